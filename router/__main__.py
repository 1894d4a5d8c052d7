"""``python -m router --port P [--model PATH] [...]``: run a pdserve router (every RouterConfig field is a flag,
pdserve.cli_config)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Sequence

from pdserve import cli_config
from router.config import RouterConfig


def _parser() -> argparse.ArgumentParser:
    p = cli_config.build_parser(RouterConfig, "python -m router", "pdserve router: Router + Registry gRPC API")
    cli_config.add_log_level(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = cli_config.from_args(RouterConfig, args)
    except ValueError as e:
        print(f"python -m router: error: {e}", file=sys.stderr)
        return 2
    from router.server import serve

    if config.uses_uvloop:
        import uvloop

        uvloop.run(serve(config))
    else:
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
