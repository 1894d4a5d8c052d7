"""python -m prefill_svc --model PATH --tensor-parallel-size N --port P [--router ADDR]: run a prefill pod.

Every PrefillConfig field (engine and serving parts included) is a flag (pdserve.cli_config)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pdserve import cli_config
from prefill_svc.config import PrefillConfig


def build_parser() -> argparse.ArgumentParser:
    p = cli_config.build_parser(PrefillConfig, "python -m prefill_svc", __doc__)
    p.add_argument(
        "--ready-file",
        default=None,
        help="write {address, port, metrics_port, kv_endpoints, pod_id} as JSON here once serving",
    )
    cli_config.add_log_level(p)
    return p


def config_from_args(args: argparse.Namespace) -> PrefillConfig:
    return cli_config.from_args(PrefillConfig, args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"prefill_svc: {e}", file=sys.stderr)
        return 2

    def on_ready(server) -> None:
        if args.ready_file:
            info = {
                "address": server.address,
                "port": server.port,
                "metrics_port": server.metrics.http_port,
                "pod_id": server.pod_id,
                "kv_endpoints": [str(e) for e in server.worker.kv.endpoints] if server.worker.kv else [],
            }
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, args.ready_file)

    from prefill_svc.server import run

    run(config, on_ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
