"""python -m decode_svc --model PATH --tensor-parallel-size N --decode-context-parallel-size M
   --dcp-kv-cache-interleave-size I --port P

Starts the decode pod (all TP ranks, spawned from this process) and serves DecodeWorker + grpc.health.v1 until
SIGTERM, then drains. An invalid parallel config is refused before anything starts, with the rule's message."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from pdserve.security import add_tls_arguments
from decode_svc.config import DecodeConfig, DecodeConfigError
from pdserve.parallel_config import ParallelConfigError
from pdserve.engine.executor import CPU_COLLECTIVES, CPU_PINNING


def build_parser() -> argparse.ArgumentParser:
    d = DecodeConfig.__dataclass_fields__
    p = argparse.ArgumentParser(prog="python -m decode_svc", description="pdserve decode pod (DecodeWorker gRPC)")
    p.add_argument("--model", default=None, help="HF checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--decode-context-parallel-size", "-dcp", type=int, default=1)
    p.add_argument("--dcp-kv-cache-interleave-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=d["block_size"].default)
    p.add_argument("--num-kv-blocks", type=int, default=d["num_kv_blocks"].default, help="KV blocks per rank")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--exact-prefill", action="store_true",
                   help="CPU: recompute preempted prompts with transformers' GEMM (bit-identical logits) instead of "
                        "oneDNN-packed weights")
    p.add_argument("--cpu-collectives", choices=CPU_COLLECTIVES, default="auto",
                   help="how CPU ranks of this pod talk: shm (shared memory, the auto choice on Linux) or gloo")
    p.add_argument("--cpu-pinning", choices=CPU_PINNING, default="auto",
                   help="pin each rank to one core (auto: when the pod's ranks outnumber its cores)")
    p.add_argument("--host", default=d["host"].default)
    p.add_argument("--port", type=int, default=d["port"].default, help="gRPC port (0: pick a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: no metrics endpoint)")
    p.add_argument("--reservation-ttl-s", type=float, default=d["reservation_ttl_s"].default)
    p.add_argument("--admission-timeout-s", type=float, default=d["admission_timeout_s"].default)
    p.add_argument("--drain-timeout-s", type=float, default=d["drain_timeout_s"].default)
    p.add_argument("--allow-file-kv", action="store_true",
                   help="accept file:// KV handles (tests / offline use; reads local files named by requests)")
    p.add_argument("--kv-transfer-backend", choices=("auto", "nixl", "tcp"), default="auto",
                   help="KV data path for pulls from prefill pods (auto: NIXL when usable, else TCP)")
    p.add_argument("--kv-transfer-timeout-s", type=float, default=d["kv_transfer_timeout_s"].default)
    p.add_argument("--pod-id", default=d["pod_id"].default)
    p.add_argument("--served-model-name", default=None, help="model name (default: the checkpoint directory's name)")
    p.add_argument("--advertise-host", default=None, help="host the router reaches this pod at (default: --host)")
    p.add_argument("--router", dest="router_address", default=None,
                   help="host:port of the router's Registry: register, heartbeat load and free KV per rank")
    p.add_argument("--cluster-token", default=os.environ.get("PDSERVE_CLUSTER_TOKEN", ""))
    p.add_argument("--heartbeat-interval-s", type=float, default=d["heartbeat_interval_s"].default)
    p.add_argument("--log-level", default=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"))
    add_tls_arguments(p)
    return p


def config_from_args(a: argparse.Namespace) -> DecodeConfig:
    return DecodeConfig(
        model=a.model, tensor_parallel_size=a.tensor_parallel_size,
        decode_context_parallel_size=a.decode_context_parallel_size,
        dcp_kv_cache_interleave_size=a.dcp_kv_cache_interleave_size, block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks, max_num_seqs=a.max_num_seqs, max_model_len=a.max_model_len, device=a.device,
        exact_prefill=a.exact_prefill, cpu_collectives=a.cpu_collectives, cpu_pinning=a.cpu_pinning,
        host=a.host, port=a.port, metrics_port=a.metrics_port, reservation_ttl_s=a.reservation_ttl_s,
        admission_timeout_s=a.admission_timeout_s, drain_timeout_s=a.drain_timeout_s, allow_file_kv=a.allow_file_kv,
        kv_transfer_backend=a.kv_transfer_backend, kv_transfer_timeout_s=a.kv_transfer_timeout_s, pod_id=a.pod_id,
        served_model_name=a.served_model_name, advertise_host=a.advertise_host, router_address=a.router_address,
        cluster_token=a.cluster_token, heartbeat_interval_s=a.heartbeat_interval_s,
        tls_cert_file=a.tls_cert_file, tls_key_file=a.tls_key_file, tls_ca_file=a.tls_ca_file,
        tls_require_client_cert=a.tls_require_client_cert, tls_server_name=a.tls_server_name)


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
    except (DecodeConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    from decode_svc.server import serve
    from pdserve.pod.lifecycle import run_loop

    def ready(server) -> None:
        metrics = f", metrics on {cfg.host}:{server.metrics_port}" if server.metrics_port else ""
        print(f"decode_svc ready: DecodeWorker on {cfg.host}:{server.port}{metrics} "
              f"(tp={cfg.tensor_parallel_size} dcp={cfg.decode_context_parallel_size} "
              f"interleave={cfg.dcp_kv_cache_interleave_size})", flush=True)

    run_loop(serve(cfg, ready))
    print("decode_svc stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
