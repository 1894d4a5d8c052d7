"""`pdserve generate PROMPT`: stream a completion from a running cluster to the terminal.

    pdserve generate "The capital of France is" --max-tokens 16 --temperature 0
    echo "Once upon a time" | pdserve generate - --json

The text goes to stdout as it arrives; token counts and timing (TTFT) go to stderr at the end (--quiet: none).
Ctrl-C cancels the request (the cluster frees its KV) and exits with 130.

Exit status: 0 done; 1 the request failed (the error's gRPC status and the server's message on stderr); 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

DEFAULT_ROUTER = "127.0.0.1:50051"


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--router",
        default=os.environ.get("PDSERVE_ROUTER", DEFAULT_ROUTER),
        metavar="HOST:PORT",
        help=f"router gRPC address, or several comma-separated (default $PDSERVE_ROUTER or {DEFAULT_ROUTER})",
    )
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="deadline of the request in seconds")
    from pdserve.security import API_KEY_ENV, add_tls_arguments

    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"the router's API key (default ${API_KEY_ENV})",
    )
    add_tls_arguments(p, client_only=True)


def connection_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Client(...) keyword arguments for --api-key and the --tls-* flags; a bad certificate file exits 2, named."""
    from pdserve.security import TLSConfigError, tls_from_args

    try:
        return {"api_key": args.api_key, "tls": tls_from_args(args)}
    except TLSConfigError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--model", default="", help="model name (default: the cluster's only model)")
    g.add_argument("--max-tokens", type=int, default=None, metavar="N")
    g.add_argument("--temperature", type=float, default=None, metavar="T", help="0: greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=None, metavar="P")
    g.add_argument("--top-k", type=int, default=None, metavar="K")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument("--request-id", default=None, help="request id (default: a random one)")


def sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = dict(
        model=args.model or None,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        request_id=args.request_id,
    )
    if args.ignore_eos:
        kw["ignore_eos"] = True
    return kw


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate",
        help="stream a completion from a running cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("prompt", nargs="?", default="-", help="the prompt ('-' or omitted: read stdin)")
    p.add_argument("--token-ids", metavar="IDS", help="send these comma-separated token ids instead of text")
    add_sampling_arguments(p)
    add_connection_arguments(p)
    p.add_argument("--no-stream", action="store_true", help="print the text once it is complete")
    p.add_argument("--json", action="store_true", help="print the whole completion as one JSON object")
    p.add_argument("--quiet", "-q", action="store_true", help="no statistics on stderr")
    p.set_defaults(func=run_generate)
    return p


def completion_json(c: Any) -> dict[str, Any]:
    d = dataclasses.asdict(c)
    d["usage"]["total_tokens"] = c.usage.total_tokens
    return d


def print_stats(c: Any) -> None:
    t = c.timing
    ttft = t.ttft_s if t.ttft_s else (t.client_ttft_s or 0.0)
    tpot = f", {t.mean_tpot_s * 1000:.1f} ms/token" if t.mean_tpot_s else ""
    print(
        f"[{c.usage.prompt_tokens} prompt + {c.usage.completion_tokens} completion tokens, "
        f"TTFT {ttft:.3f}s{tpot}, {t.e2e_s or (t.client_e2e_s or 0.0):.2f}s total, finish: {c.finish_reason}"
        f"{' (' + repr(c.stop_reason) + ')' if c.stop_reason else ''}]",
        file=sys.stderr,
        flush=True,
    )


def fail(cmd: str, e: Exception) -> int:
    from pdserve.client import PdserveError

    if isinstance(e, PdserveError):
        print(f"pdserve {cmd}: error: {e.status_name}: {e.message}", file=sys.stderr, flush=True)
    else:
        print(f"pdserve {cmd}: error: {e}", file=sys.stderr, flush=True)
    return 1


def stream_to_terminal(stream: Any, *, echo: bool = True) -> Any:
    """Print the stream's text as it arrives; Ctrl-C cancels it (re-raised after the cancel). Returns the
    Completion."""
    try:
        for chunk in stream:
            if echo and chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        stream.cancel()
        raise
    return stream.completion


def run_generate(args: argparse.Namespace) -> int:
    from pdserve.client import Client, PdserveError

    if args.token_ids:
        try:
            prompt: Any = [int(t) for t in args.token_ids.replace(" ", "").split(",") if t]
        except ValueError:
            print("pdserve generate: error: --token-ids must be comma-separated integers", file=sys.stderr)
            return 2
    elif args.prompt == "-":
        prompt = sys.stdin.read()
    else:
        prompt = args.prompt
    try:
        with Client(args.router, timeout=args.timeout, **connection_kwargs(args)) as client:
            stream = client.generate_stream(prompt, **sampling_kwargs(args))
            live = not (args.no_stream or args.json)
            c = stream_to_terminal(stream, echo=live)
    except KeyboardInterrupt:
        print("\npdserve generate: cancelled", file=sys.stderr)
        return 130
    except (PdserveError, TypeError, ValueError) as e:
        return fail("generate", e)
    if args.json:
        print(json.dumps(completion_json(c), indent=1))
        return 0
    if not live:
        sys.stdout.write(c.text)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not args.quiet:
        print_stats(c)
    return 0
