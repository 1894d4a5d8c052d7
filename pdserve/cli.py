"""The `pdserve` console script: each subcommand lives in pdserve/commands/<name>.py and registers itself."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand modules, in help order. A module that is not there yet is skipped, so the CLI always starts.
COMMANDS = ("up", "generate", "chat", "status", "validate", "bench", "offline")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"pdserve.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pdserve.commands.{name}":
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
