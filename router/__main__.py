"""``python -m router --port P [--model PATH] [...]``: run a pdserve router (every RouterConfig field is a flag)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from typing import Sequence

from router.config import RouterConfig

_ENV_DEFAULTS = {"cluster_token": "PDSERVE_CLUSTER_TOKEN", "api_key": "PDSERVE_API_KEY",
                 "tls_cert_file": "PDSERVE_TLS_CERT_FILE", "tls_key_file": "PDSERVE_TLS_KEY_FILE",
                 "tls_ca_file": "PDSERVE_TLS_CA_FILE", "tls_require_client_cert": "PDSERVE_TLS_REQUIRE_CLIENT_CERT",
                 "tls_server_name": "PDSERVE_TLS_SERVER_NAME"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m router", description="pdserve router: Router + Registry gRPC API")
    for f in dataclasses.fields(RouterConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if f.name in _ENV_DEFAULTS:  # secrets and certificate paths may come from the environment (containers)
            env = os.environ.get(_ENV_DEFAULTS[f.name], "")
            default = env.strip().lower() in ("1", "true", "yes", "on") if isinstance(default, bool) else env
        if f.name in ("model", "served_model_name"):
            p.add_argument(flag, default=None, metavar="NAME" if f.name != "model" else "PATH")
        elif isinstance(default, bool):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif isinstance(default, (int, float, str)):
            shown = f"env {_ENV_DEFAULTS[f.name]}" if f.name in _ENV_DEFAULTS else f"default: {default!r}"
            p.add_argument(flag, type=type(default), default=default, metavar=type(default).__name__.upper(),
                           help=shown)  # never echo a secret in --help
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
    from router.server import serve

    if config.uses_uvloop:
        import uvloop

        uvloop.run(serve(config))
    else:
        asyncio.run(serve(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
