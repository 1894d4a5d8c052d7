"""python -m prefill_svc --model PATH --tensor-parallel-size N --port P [--router ADDR]: run a prefill pod."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from pdserve.engine.executor import CPU_COLLECTIVES, CPU_PINNING
from pdserve.security import add_tls_arguments
from prefill_svc.config import KV_TRANSPORTS, PrefillConfig, PrefillConfigError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m prefill_svc", description=__doc__)
    d = PrefillConfig
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--served-model-name", default=None, help="model name clients use (default: directory name)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size)
    p.add_argument("--host", default=d.host, help="listen address of the gRPC server")
    p.add_argument("--port", type=int, default=d.port, help="gRPC port (0: pick a free one)")
    p.add_argument("--advertise-host", default=None, help="host the router / decode pods reach us at")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port (0: any)")
    p.add_argument("--pod-id", default=None)
    p.add_argument("--router", dest="router_address", default=None,
                   help="host:port of the router's Registry; omitted: run standalone")
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""))
    p.add_argument("--heartbeat-interval", dest="heartbeat_interval_s", type=float, default=d.heartbeat_interval_s)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks, help="KV blocks per rank")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--prefill-chunk-size", type=int, default=d.prefill_chunk_size)
    p.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false")
    p.add_argument("--device", default=d.device)
    p.add_argument("--exact-prefill", action="store_true",
                   help="CPU: compute prompts with transformers' GEMM (bit-identical logits) instead of oneDNN-packed "
                        "weights (faster, logits within ~1e-4)")
    p.add_argument("--cpu-collectives", choices=CPU_COLLECTIVES, default="auto",
                   help="how CPU ranks of this pod talk: shm (shared memory, the auto choice on Linux) or gloo")
    p.add_argument("--cpu-pinning", choices=CPU_PINNING, default="auto",
                   help="pin each rank to one core (auto: when the pod's ranks outnumber its cores)")
    p.add_argument("--kv-transport", choices=KV_TRANSPORTS, default=d.kv_transport)
    p.add_argument("--kv-host", default=None, help="listen host of the per-rank KV endpoints (default: advertise host)")
    p.add_argument("--lease-ttl", dest="lease_ttl_s", type=float, default=d.lease_ttl_s)
    p.add_argument("--max-leases", type=int, default=d.max_leases)
    p.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=d.drain_timeout_s)
    p.add_argument("--ready-file", default=None,
                   help="write {address, port, metrics_port, kv_endpoints, pod_id} as JSON here once serving")
    p.add_argument("--log-level", default="INFO")
    add_tls_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    kw = {k: v for k, v in vars(args).items() if k not in ("ready_file", "log_level")}
    try:
        config = PrefillConfig(**kw)
    except PrefillConfigError as e:
        print(f"prefill_svc: {e}", file=sys.stderr)
        return 2

    def on_ready(server) -> None:
        if args.ready_file:
            info = {"address": server.address, "port": server.port, "metrics_port": server.metrics.http_port,
                    "pod_id": server.pod_id,
                    "kv_endpoints": [str(e) for e in server.worker.kv.endpoints] if server.worker.kv else []}
            tmp = args.ready_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(info, f)
            os.replace(tmp, args.ready_file)

    from prefill_svc.server import run

    run(config, on_ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
