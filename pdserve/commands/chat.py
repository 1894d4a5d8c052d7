"""`pdserve chat`: talk to the model of a running cluster (its chat template is applied by the router).

    pdserve chat "What is the capital of France?"      # one question, the answer streamed
    pdserve chat --system "You are terse."             # interactive: one line per turn, history kept

In the interactive mode, Ctrl-C during an answer cancels it (the cluster frees its KV); Ctrl-C or Ctrl-D at the
prompt, or /exit, quits. /reset forgets the conversation.

Exit status: 0 done; 1 a request failed (its gRPC status and the server's message on stderr); 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdserve.commands.generate import (
    add_connection_arguments,
    add_sampling_arguments,
    completion_json,
    connection_kwargs,
    fail,
    print_stats,
    sampling_kwargs,
    stream_to_terminal,
)


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "chat",
        help="chat with the model of a running cluster (streams the reply)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("message", nargs="?", default=None, help="one user message (omitted: interactive)")
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(p)
    add_connection_arguments(p)
    p.add_argument("--json", action="store_true", help="(one message) print the whole reply as JSON")
    p.add_argument("--quiet", "-q", action="store_true", help="no statistics on stderr")
    p.set_defaults(func=run_chat)
    return p


def run_chat(args: argparse.Namespace) -> int:
    from pdserve.client import Client, PdserveError

    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    kw = sampling_kwargs(args)
    with Client(args.router, timeout=args.timeout, **connection_kwargs(args)) as client:
        if args.message is not None:
            msgs = history + [{"role": "user", "content": args.message}]
            try:
                c = stream_to_terminal(client.chat_stream(msgs, **kw), echo=not args.json)
            except KeyboardInterrupt:
                print("\npdserve chat: cancelled", file=sys.stderr)
                return 130
            except (PdserveError, TypeError, ValueError) as e:
                return fail("chat", e)
            if args.json:
                print(json.dumps(completion_json(c), indent=1))
            else:
                print(flush=True)
                if not args.quiet:
                    print_stats(c)
            return 0

        interactive = sys.stdin.isatty()
        if interactive:
            print("pdserve chat: one message per line; /reset forgets, /exit or Ctrl-D quits.", file=sys.stderr)
        while True:
            try:
                line = input("> " if interactive else "")
            except (EOFError, KeyboardInterrupt):
                print(file=sys.stderr)
                return 0
            line = line.strip()
            if not line:
                continue
            if line in ("/exit", "/quit"):
                return 0
            if line == "/reset":
                del history[1 if args.system else 0 :]
                continue
            history.append({"role": "user", "content": line})
            kw["request_id"] = None  # a fresh id per turn
            try:
                c = stream_to_terminal(client.chat_stream(history, **kw))
            except KeyboardInterrupt:
                print("\n[cancelled]", file=sys.stderr, flush=True)
                history.pop()
                continue
            except PdserveError as e:
                fail("chat", e)
                history.pop()
                continue
            print(flush=True)
            history.append({"role": "assistant", "content": c.text})
            if not args.quiet:
                print_stats(c)
