"""``python -m router --port P [--model PATH] [...]``: run a pdserve router (every RouterConfig field is a flag)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import sys
from typing import Sequence

from router.config import RouterConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description="pdserve router: Router + Registry gRPC API")
    for f in dataclasses.fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.name in ("model", "served_model_name"):
            p.add_argument(flag, default=None, metavar="NAME" if f.name != "model" else "PATH")
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, (int, float, str)):
            p.add_argument(flag, type=type(default), default=default, metavar=type(default).__name__.upper(),
                           help=f"default: {default!r}")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(RouterConfig)}
    try:
        config = RouterConfig(**kwargs)
    except ValueError as e:
        print(f"python -m router: error: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop  # type: ignore[import-not-found]

        uvloop.install()
    except ImportError:
        pass
    from router.server import serve

    asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
