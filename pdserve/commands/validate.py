"""`pdserve validate`: check a parallel config against vLLM's rules before any GPU is touched.

    pdserve validate --model PATH --tensor-parallel-size 8 --decode-context-parallel-size 2
    pdserve validate --num-attention-heads 32 --num-kv-heads 8 -tp 16 -dcp 2

Exit status: 0 valid (one-line verdict on stdout); 2 refused (vLLM's message and the fix on stderr);
1 the model could not be read. ``--json`` prints the verdict as one JSON object on stdout instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from pdserve.parallel_config import (
    ModelParallelInfo,
    ParallelConfig,
    check_parallel_config,
)

EXIT_VALID = 0
EXIT_BAD_INPUT = 1
EXIT_REFUSED = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_argument_group("model (either --model, or the head counts)")
    src.add_argument("--model", metavar="PATH", help="model directory (or its config.json)")
    src.add_argument("--num-attention-heads", type=int, metavar="N", help="total query heads, instead of --model")
    src.add_argument(
        "--num-kv-heads",
        type=int,
        metavar="N",
        help="total KV heads (default: same as --num-attention-heads, i.e. MHA)",
    )
    src.add_argument("--use-mla", action="store_true", help="the model uses MLA (only with the head counts)")
    src.add_argument(
        "--sliding-window",
        type=int,
        metavar="N",
        help="the model has sliding-window attention of N tokens (only with the head counts)",
    )
    par = p.add_argument_group("parallel config (vLLM's flags)")
    par.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N")
    par.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1, metavar="N")
    par.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="N")
    par.add_argument("--dcp-kv-cache-interleave-size", type=int, default=1, metavar="N")
    par.add_argument("--block-size", type=int, default=16, metavar="N")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON on stdout")


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``validate`` subcommand; its handler is ``args.func(args) -> exit code``."""
    p = subparsers.add_parser(
        "validate",
        help="check a TP/DCP/PP config against vLLM's parallel-config rules",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    p.set_defaults(func=run_validate)
    return p


def _model_from_args(args: argparse.Namespace) -> ModelParallelInfo:
    if args.model is not None:
        if (
            args.num_attention_heads is not None
            or args.num_kv_heads is not None
            or args.use_mla
            or args.sliding_window is not None
        ):
            raise ValueError("give either --model or the head counts, not both")
        return ModelParallelInfo.from_model_path(args.model)
    if args.num_attention_heads is None:
        raise ValueError("one of --model or --num-attention-heads is required")
    kv = args.num_kv_heads if args.num_kv_heads is not None else args.num_attention_heads
    return ModelParallelInfo(
        num_attention_heads=args.num_attention_heads,
        num_kv_heads=kv,
        use_mla=args.use_mla,
        sliding_window=args.sliding_window,
    )


def run_validate(args: argparse.Namespace) -> int:
    try:
        model = _model_from_args(args)
    except (OSError, ValueError, TypeError) as e:  # unreadable path, bad JSON, impossible head counts
        print(f"pdserve validate: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    cfg = ParallelConfig(
        tensor_parallel_size=args.tensor_parallel_size,
        decode_context_parallel_size=args.decode_context_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        dcp_kv_cache_interleave_size=args.dcp_kv_cache_interleave_size,
        block_size=args.block_size,
    )
    verdict = check_parallel_config(model, cfg)
    if args.json:
        out = {
            "valid": verdict.valid,
            "rule": verdict.rule,
            "message": verdict.message,
            "fix": None
            if verdict.fix is None
            else {
                "flag": verdict.fix.flag,
                "value": verdict.fix.value,
                "text": verdict.fix.text,
                "changes": verdict.fix.changes,
            },
        }
        print(json.dumps(out))
        return EXIT_VALID if verdict.valid else EXIT_REFUSED
    if verdict.valid:
        print(verdict.message)
        return EXIT_VALID
    assert verdict.fix is not None
    print(f"invalid parallel config: {verdict.message}", file=sys.stderr)
    print(f"fix: {verdict.fix.text} ({' '.join(verdict.fix.cli_args)})", file=sys.stderr)
    return EXIT_REFUSED


def main_validate(argv: Sequence[str] | None = None) -> int:
    """Standalone entry (tests, ``python -m pdserve.commands.validate``); returns the exit code."""
    p = argparse.ArgumentParser(
        prog="pdserve validate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(p)
    return run_validate(p.parse_args(list(argv) if argv is not None else None))


if __name__ == "__main__":
    sys.exit(main_validate())
