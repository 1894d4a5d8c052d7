"""python -m decode_svc --model PATH --tensor-parallel-size N --decode-context-parallel-size M
   --dcp-kv-cache-interleave-size I --port P

Starts the decode pod (all TP ranks, spawned from this process) and serves DecodeWorker + grpc.health.v1 until
SIGTERM, then drains. An invalid parallel config is refused before anything starts, with the rule's message.
Every DecodeConfig field (engine and serving parts included) is a flag (pdserve.cli_config)."""

from __future__ import annotations

import argparse
import logging
import sys

from decode_svc.config import DecodeConfig
from pdserve import cli_config
from pdserve.parallel_config import ParallelConfigError


def build_parser() -> argparse.ArgumentParser:
    p = cli_config.build_parser(DecodeConfig, "python -m decode_svc", "pdserve decode pod (DecodeWorker gRPC)")
    cli_config.add_log_level(p)
    return p


def config_from_args(a: argparse.Namespace) -> DecodeConfig:
    return cli_config.from_args(DecodeConfig, a)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = config_from_args(a)
    except ParallelConfigError as e:
        print(f"error: invalid parallel config: {e.message}", file=sys.stderr)
        if e.fix is not None:
            print(f"suggested fix: {e.fix.text}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from decode_svc.server import serve
    from pdserve.pod.lifecycle import run_loop

    def ready(server) -> None:
        host, e = cfg.serving.host, cfg.engine
        metrics = f", metrics on {host}:{server.metrics_port}" if server.metrics_port else ""
        print(
            f"decode_svc ready: DecodeWorker on {host}:{server.port}{metrics} "
            f"(tp={e.tensor_parallel_size} dcp={e.decode_context_parallel_size} "
            f"interleave={e.dcp_kv_cache_interleave_size})",
            flush=True,
        )

    run_loop(serve(cfg, ready))
    print("decode_svc stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
