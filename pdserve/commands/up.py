"""`pdserve up`: start the embedded local cluster (router, a prefill pod and a decode pod) on loopback.

    pdserve up                                  # default model, 1 prefill pod, 1 decode pod (DCP where it fits)
    pdserve up --model ./ckpt --decode-tp 2 --decode-dcp 2
    pdserve up --config cluster.yaml --http-port 8080

Waits until every process is healthy and every pod is READY in the router, prints the endpoints, then supervises.
Ctrl-C (or SIGTERM) stops everything: HTTP front and pods first, then the router; whatever does not stop within
--stop-timeout is killed (a second Ctrl-C kills at once). No process is ever left behind, even if `pdserve up` itself
is killed: every service dies with it.

--restart on-failure (or always) heals the cluster as Kubernetes would: a service that crashes, or that stops
passing its health check (a pod whose TP rank died, a frozen process), is started again on the same port after an
exponential back-off (--restart-backoff, doubling up to --restart-backoff-max); a restarted pod registers with the
routers again by itself. Each restart is logged.

Exit status: 0 after a clean stop; 1 if the cluster could not start or a service died; 2 on a bad topology.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from typing import Any

from pdserve.cluster.topology import AUTO, Topology, TopologyError
from pdserve.engine.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS


def _size(v: str) -> int | str:
    if v == AUTO:
        return AUTO
    try:
        n = int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {v!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or 'auto', got {v!r}")
    return n


def add_topology_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE.yaml", help="topology file (flags below override it)")
    p.add_argument("--model", metavar="PATH", help="checkpoint directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", help="address every service listens on (default 127.0.0.1)")
    p.add_argument(
        "--port", dest="router_port", type=int, metavar="N", help="router gRPC port (default 50051; 0: any free port)"
    )
    p.add_argument(
        "--routers",
        dest="num_routers",
        type=int,
        metavar="N",
        help="number of routers (default 1); every pod registers with all, the first takes --port, the "
        "others free ports",
    )
    p.add_argument(
        "--router-nice",
        type=int,
        metavar="N",
        help="CPU priority (nice, -20..19) of the routers and the HTTP front, for their sessions and processes; "
        "default -10 where raising it is allowed (CAP_SYS_NICE), else 0",
    )
    p.add_argument(
        "--http-port",
        type=int,
        metavar="N",
        help="OpenAI-compatible HTTP port (default 8000; 0: any free port; -1: none)",
    )
    p.add_argument("--prefill-pods", type=int, metavar="N", help="number of prefill pods (default 1)")
    p.add_argument("--prefill-tp", type=int, metavar="N", help="tensor-parallel size of each prefill pod")
    p.add_argument("--decode-pods", type=int, metavar="N", help="number of decode pods (default 1)")
    p.add_argument(
        "--decode-tp",
        type=_size,
        metavar="N|auto",
        help="tensor-parallel size of each decode pod (default auto: the smallest that allows DCP, or 1 "
        "on CPU when that needs more ranks than cores)",
    )
    p.add_argument(
        "--decode-dcp",
        type=_size,
        metavar="N|auto",
        help="decode context-parallel size (default auto: the smallest > 1 the model allows)",
    )
    p.add_argument("--dcp-interleave", type=int, metavar="N", help="DCP KV interleave size in tokens (default 1)")
    p.add_argument("--block-size", type=int, metavar="N", help="KV block size in tokens (default 16)")
    p.add_argument("--num-kv-blocks", type=int, metavar="N", help="KV blocks per rank on every pod")
    p.add_argument("--max-model-len", type=int, metavar="N", help="context length served")
    p.add_argument("--device", metavar="DEV", help="device of every pod: cpu, cuda (default: the pods' default)")
    p.add_argument(
        "--unified",
        action="store_true",
        default=None,
        help="colocated serving: one unified pod (prefill and decode in one engine, chunked prefill "
        "between decode steps, no KV transfer) instead of the prefill/decode pair",
    )
    p.add_argument("--unified-cpus", metavar="CORES", help="cores of every unified pod and its ranks")
    p.add_argument(
        "--prefill-cpus",
        metavar="CORES",
        help="cores of every prefill pod and its ranks, e.g. 0 or "
        "0-3,8 (sched_setaffinity; threads per rank = cores / TP); default: every core",
    )
    p.add_argument("--decode-cpus", metavar="CORES", help="cores of every decode pod and its ranks (as --prefill-cpus)")
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        help="weights, activations and KV cache of every pod (default: auto, the checkpoint's dtype)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        help="KV cache storage of every pod: auto (--dtype) or fp8 (= fp8_e4m3) / fp8_e5m2, half the bytes of "
        "bf16 to hold, move and read (default: auto)",
    )
    p.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="CPU: int8 quantises every pod's decoder linear weights at load (W8A8, per output channel), a "
        "quarter of fp32's bytes to stream per token (default: none)",
    )


def topology_from_args(args: argparse.Namespace) -> Topology:
    topo = Topology.from_yaml(args.config) if args.config else Topology()
    return topo.with_overrides(
        model=args.model,
        host=args.host,
        router_port=args.router_port,
        http_port=args.http_port,
        num_routers=getattr(args, "num_routers", None),
        router_nice=getattr(args, "router_nice", None),
        prefill_pods=args.prefill_pods,
        prefill_tp=args.prefill_tp,
        decode_pods=args.decode_pods,
        decode_tp=args.decode_tp,
        decode_dcp=args.decode_dcp,
        dcp_interleave=args.dcp_interleave,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        device=args.device,
        dtype=args.dtype,
        kv_cache_dtype=getattr(args, "kv_cache_dtype", None),
        quantization=getattr(args, "quantization", None),
        prefill_cpus=getattr(args, "prefill_cpus", None),
        decode_cpus=getattr(args, "decode_cpus", None),
        unified=getattr(args, "unified", None),
        unified_cpus=getattr(args, "unified_cpus", None),
    )


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "up",
        help="start a local cluster (router + prefill + decode with DCP)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_topology_arguments(p)
    p.add_argument("--log-dir", metavar="DIR", help="service logs (default ~/.cache/pdserve/logs/up-<time>-<pid>)")
    p.add_argument("--ready-file", metavar="PATH", help="write the endpoints and pids as JSON here once ready")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=900.0,
        metavar="S",
        help="give up if the cluster is not ready after this long (default 900)",
    )
    p.add_argument(
        "--stop-timeout",
        type=float,
        default=15.0,
        metavar="S",
        help="on Ctrl-C, seconds each service gets to stop before it is killed (default 15)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the checked topology and the commands, start nothing")
    p.add_argument("--quiet", "-q", action="store_true", help="print only the endpoints")
    p.add_argument(
        "--ask",
        metavar="PROMPT",
        help="once ready, send PROMPT as a chat message (greedy), stream the answer, then stop everything",
    )
    p.add_argument("--ask-max-tokens", type=int, default=128, metavar="N", help="answer length limit for --ask")
    from pdserve.cluster.restart import RESTART_MODES, RestartPolicy

    d = RestartPolicy()
    p.add_argument(
        "--restart",
        choices=RESTART_MODES,
        default="never",
        help="restart policy of every service (default never: a service that dies stops the cluster)",
    )
    p.add_argument(
        "--restart-backoff",
        type=float,
        default=d.backoff_s,
        metavar="S",
        help=f"delay before the first restart, doubled for each crash in a row (default {d.backoff_s:g})",
    )
    p.add_argument(
        "--restart-backoff-max",
        type=float,
        default=d.backoff_max_s,
        metavar="S",
        help=f"longest delay between restarts (default {d.backoff_max_s:g})",
    )
    p.add_argument(
        "--restart-startup-timeout",
        type=float,
        default=d.startup_timeout_s,
        metavar="S",
        help=f"a restarted service not serving within S seconds is killed (default {d.startup_timeout_s:g})",
    )
    add_security_arguments(p)
    p.set_defaults(func=run_up)
    return p


def add_security_arguments(p: argparse.ArgumentParser) -> None:
    from pdserve.security import API_KEY_ENV, add_tls_arguments

    g = p.add_argument_group("security")
    g.add_argument(
        "--cluster-token",
        default=os.environ.get("PDSERVE_CLUSTER_TOKEN") or None,
        metavar="TOKEN",
        help="secret pods present to register and to pull KV from each other (default "
        "$PDSERVE_CLUSTER_TOKEN, else a random one per run)",
    )
    g.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        metavar="KEY",
        help=f"clients must send this key, over gRPC and HTTP (default ${API_KEY_ENV}; none: open)",
    )
    add_tls_arguments(p)


def _err(msg: str) -> None:
    print(f"pdserve up: error: {msg}", file=sys.stderr, flush=True)


def _ask(router: str, prompt: str, max_tokens: int, **security: Any) -> int:
    from pdserve.client import Client, PdserveError
    from pdserve.commands.generate import print_stats, stream_to_terminal

    print(f"\n> {prompt}", flush=True)
    try:
        with Client(router, timeout=600, **security) as client:
            c = stream_to_terminal(
                client.chat_stream([{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
            )
    except PdserveError as e:
        _err(f"the cluster could not answer: {e.status_name}: {e.message}")
        return 1
    print(flush=True)
    print_stats(c)
    return 0


def run_up(args: argparse.Namespace) -> int:
    from pdserve.cluster.supervisor import ClusterError, Interrupted, LocalCluster

    try:
        topo = topology_from_args(args).resolve()
    except TopologyError as e:
        _err(str(e))
        return 2
    for w in topo.warnings:
        print(f"pdserve up: warning: {w}", file=sys.stderr, flush=True)
    if not args.quiet and not args.dry_run:
        for n in topo.notes:
            print(f"pdserve up: {n}", flush=True)

    def echo(line: str) -> None:
        if not args.quiet:
            print(f"pdserve up: {line}", flush=True)

    from pdserve.security import TLSConfigError, tls_from_args

    try:
        tls = tls_from_args(args)
    except TLSConfigError as e:
        _err(str(e))
        return 2
    if tls is not None and not tls.serves_tls:
        _err("TLS for the local cluster needs --tls-cert-file and --tls-key-file (every service serves them)")
        return 2
    # Why random by default: a local cluster's pods still authenticate each other, and nobody has to pick a secret.
    token = args.cluster_token or secrets.token_urlsafe(24)
    from pdserve.cluster.restart import RestartPolicy

    try:
        policy = RestartPolicy(
            args.restart,
            backoff_s=args.restart_backoff,
            backoff_max_s=args.restart_backoff_max,
            startup_timeout_s=args.restart_startup_timeout,
        )
    except ValueError as e:
        _err(str(e))
        return 2
    cluster = LocalCluster(
        topo,
        log_dir=args.log_dir,
        echo=echo,
        cluster_token=token,
        api_key=args.api_key or "",
        tls=tls,
        restart_policy=policy,
    )
    if args.dry_run:
        topo.assign_ports()
        plan = cluster._plan()
        print(
            json.dumps(
                {
                    "model": str(topo.model_path()),
                    "router": f"{topo.host}:{topo.router_port}",
                    "routers": cluster.router_addresses,
                    "http_port": topo.http_port,
                    "router_nice": topo.router_nice,
                    "notes": topo.notes,
                    "pods": [
                        {
                            "name": p.name,
                            "role": p.role,
                            "port": p.port,
                            "tp": p.tensor_parallel_size,
                            "dcp": p.decode_context_parallel_size,
                            "interleave": p.dcp_kv_cache_interleave_size,
                            "cpus": None if p.cpus is None else list(p.cpus),
                            "nice": p.nice,
                        }
                        for p in topo.pods
                    ],
                    "commands": {s.name: s.argv for s in plan},
                },
                indent=1,
            )
        )
        return 0

    cluster.install_signal_handlers()
    t0 = time.monotonic()
    try:
        try:
            endpoints = cluster.start(timeout=args.startup_timeout)
        except ClusterError as e:
            _err(str(e))
            return 1
        if args.ready_file:
            cluster.write_ready_file(args.ready_file)
        print(
            f"pdserve up: cluster ready in {time.monotonic() - t0:.1f}s, serving "
            f"{endpoints.model}\n{cluster.describe()}",
            flush=True,
        )
        if args.ask is not None:
            return _ask(endpoints.router, args.ask, args.ask_max_tokens, api_key=args.api_key, tls=tls)
        print("Press Ctrl-C to stop.", flush=True)
        while True:
            cluster.heal()
            dead = cluster.dead_services()
            if dead:
                for s in dead:
                    _err(f"{s.name} exited with status {s.exited()}; last lines of {s.log_path}:\n{s.log_tail()}")
                return 1
            time.sleep(0.5)
    except Interrupted as e:
        print(f"pdserve up: {e}: stopping the cluster", flush=True)
        return 0
    finally:
        cluster.stop(grace=args.stop_timeout)
        print("pdserve up: all processes stopped", flush=True)
