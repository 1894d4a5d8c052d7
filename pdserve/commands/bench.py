"""`pdserve bench NAME [--quick] --out FILE.json`: run one benchmark, print its table, write its JSON."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys

from pdserve.cli_config import argparse_type

BENCHMARKS = (
    "engine",
    "decode",
    "cluster",
    "kv_transfer",
    "prefill",
    "router",
    "soak",
    "peer",
    "serve",
    "interference",
    "dcp",
    "quant",
    "llamacpp",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("bench", help="run a benchmark (table to stdout, JSON to --out)")
    p.add_argument("name", choices=BENCHMARKS)
    p.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    p.add_argument("--out", help="write the JSON result here")
    p.add_argument("--device", default="cpu", help="torch device of the benchmarks that take one (engine, dcp)")
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="KEY:MS",
        default=[],
        help="serve: SLOs as vLLM's bench serve takes them, e.g. ttft:2000 tpot:150 (milliseconds)",
    )
    p.add_argument(
        "--endpoint",
        metavar="URL",
        help="serve: load an OpenAI-compatible server already running on loopback instead of the sides",
    )
    p.add_argument("--rates", type=float, nargs="+", metavar="RPS", help="serve: request rates to sweep")
    p.add_argument(
        "--local-prefill-max-tokens",
        type=_local_prefill,
        metavar="N|auto",
        help="serve, interference: the conditional side's router threshold (default: auto, from the decode pod's "
        "measured step times; the JSON records what the router chose)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        metavar="DTYPE",
        help="engine, peer: only these model dtypes (float32, bfloat16; peer also int8), default all of them",
    )
    p.add_argument("--chaos", action="store_true", help="soak: inject faults (kills, freezes, KV path drops) in load")
    p.add_argument(
        "--int8-from-gguf",
        action="store_true",
        default=None,  # None when absent: only llamacpp takes it (run_bench refuses it elsewhere)
        help="llamacpp: serve pdserve's int8 side from the Q8_0 GGUF that llama-server loads, so both hold the same "
        "int8 values and scales (default: --quantization int8 over the fp32 checkpoint)",
    )
    p.set_defaults(func=run_bench)


def _local_prefill(raw: str) -> int | str:
    from router.local_prefill import parse_max_tokens

    return argparse_type(parse_max_tokens)(raw)


def run_bench(args: argparse.Namespace) -> int:
    from bench.common import BenchUnavailable, format_table, write_result

    name = args.name
    if getattr(args, "chaos", False):  # only the soak takes it
        if name != "soak":
            print(f"benchmark {name!r} takes no --chaos")
            return 2
        name = "chaos"  # the soak while a seeded nemesis kills and freezes processes (bench/chaos.py)
    try:
        module = importlib.import_module(f"bench.{name}")
    except ModuleNotFoundError as e:
        print(f"benchmark {args.name!r} is not available yet ({e})")
        return 2
    kw = {}
    if args.device != "cpu":
        if "device" not in inspect.signature(module.run).parameters:
            print(f"benchmark {args.name!r} runs on cpu only (no --device)")
            return 2
        kw["device"] = args.device
    params = inspect.signature(module.run).parameters
    # only some benchmarks take these
    for opt in ("out", "goodput", "endpoint", "rates", "local_prefill_max_tokens", "int8_from_gguf", "dtypes"):
        value = getattr(args, opt, None)
        if opt == "dtypes" and value:
            value = tuple(value)
        given = value is not None and value != []  # a threshold of 0 is given too
        if given and opt != "out" and opt not in params:
            print(f"benchmark {args.name!r} takes no --{opt.replace('_', '-')}")
            return 2
        if given and opt in params:
            kw[opt] = value
    try:
        result = module.run(quick=args.quick, **kw)
    except ValueError as e:
        print(f"error: benchmark {args.name!r}: {e}", file=sys.stderr)
        return 2
    except BenchUnavailable as e:
        print(f"error: benchmark {args.name!r} cannot run here: {e}", file=sys.stderr)
        return 2
    print(format_table(result.get("table", [])))
    print("ratios:", json.dumps(result["ratios"], indent=None))
    write_result(result, args.out)
    return 0
