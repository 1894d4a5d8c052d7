"""`pdserve status`: the pods of a running cluster, their state, load and free KV blocks per rank.

    pdserve status
    pdserve status --json
    pdserve status --watch 2
    pdserve status --router h1:50051,h2:50051     # each router, what it sees, and the pods some router lacks

Exit status: 0 every router answered; 1 one did not (its error on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pdserve.commands.generate import add_connection_arguments, connection_kwargs


def register(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "status",
        help="show the pods of a running cluster",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_connection_arguments(p)
    p.add_argument("--role", choices=["prefill", "decode"], default=None, help="only pods of this role")
    p.add_argument("--model", default="", help="only pods serving this model")
    p.add_argument("--json", action="store_true", help="print the ClusterStatus response as JSON")
    p.add_argument("--watch", type=float, default=None, metavar="S", help="refresh every S seconds until Ctrl-C")
    p.set_defaults(func=run_status)
    return p


def _short(enum_name: str, prefix: str) -> str:
    return enum_name.removeprefix(prefix).lower()


def format_status(st: Any) -> str:
    from pdserve_api.v1 import common_pb2

    rows = [
        (
            "POD",
            "ROLE",
            "STATE",
            "ADDRESS",
            "MODEL",
            "TP",
            "DCP",
            "KV FREE/TOTAL (per rank)",
            "RUN",
            "WAIT",
            "INFLIGHT",
            "LOCAL PREFILL<=",
            "HB AGE",
        )
    ]
    for p in st.pods:
        kv = " ".join(f"{r.free_blocks}/{r.total_blocks}" for r in p.kv) or "-"
        rows.append(
            (
                p.pod_id,
                _short(common_pb2.Role.Name(p.role), "ROLE_"),
                _short(common_pb2.PodState.Name(p.state), "POD_STATE_"),
                p.address,
                p.model,
                str(p.parallel.tensor_parallel_size or 1),
                str(p.parallel.decode_context_parallel_size or 1),
                kv,
                str(p.load.num_running_seqs),
                str(p.load.num_waiting_seqs),
                str(p.num_inflight_requests),
                # the router's conditional-disaggregation threshold; only decode pods have one
                str(p.local_prefill_max_tokens) if p.role == common_pb2.ROLE_DECODE else "-",
                f"{p.last_heartbeat_age_s:.1f}s",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if not st.pods:
        lines.append("(no pods registered)")
    lines.append(
        f"ready models: {', '.join(st.ready_models) or 'none'}; router queue: {st.router_queue_depth}; "
        f"in flight: {st.num_inflight_requests}"
    )
    return "\n".join(lines)


def format_routers(seen: dict[str, Any]) -> str:
    """One line per router (how many pods it lists, READY ones, or its error) and the pods some router lacks: with
    several routers every pod should be in each (it registers with all)."""
    from pdserve_api.v1 import common_pb2

    everyone = set().union(*({p.pod_id for p in st.pods} for st in seen.values() if not isinstance(st, str)))
    lines = []
    for addr, st in seen.items():
        if isinstance(st, str):
            lines.append(f"router {addr}: {st}")
            continue
        pods = {p.pod_id for p in st.pods}
        ready = sum(p.state == common_pb2.POD_STATE_READY for p in st.pods)
        missing = sorted(everyone - pods)
        lines.append(
            f"router {addr}: {len(pods)} pods ({ready} ready), in flight {st.num_inflight_requests}, queue "
            f"{st.router_queue_depth}" + (f"; does not list {', '.join(missing)}" if missing else "")
        )
    return "\n".join(lines)


def run_status(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from pdserve.client import NO_RETRY, Client, PdserveError
    from pdserve.client._common import router_addresses

    addresses = router_addresses(args.router)
    clients = [Client(a, timeout=args.timeout or 10.0, retry=NO_RETRY, **connection_kwargs(args)) for a in addresses]
    try:
        while True:
            seen: dict[str, Any] = {}
            failed = False
            for a, client in zip(addresses, clients):
                try:
                    seen[a] = client.cluster_status(role=args.role, model=args.model)
                except PdserveError as e:
                    print(f"pdserve status: error: router {a}: {e.status_name}: {e.message}", file=sys.stderr)
                    seen[a] = f"error: {e.status_name}: {e.message}"
                    failed = True
            if args.json:
                dicts = {
                    a: st if isinstance(st, str) else MessageToDict(st, preserving_proto_field_name=True)
                    for a, st in seen.items()
                }
                if len(addresses) == 1:
                    if not failed:
                        print(json.dumps(dicts[addresses[0]], indent=1))
                else:
                    print(
                        json.dumps(
                            {
                                "routers": [
                                    {"address": a, **({"error": d} if isinstance(d, str) else d)}
                                    for a, d in dicts.items()
                                ]
                            },
                            indent=1,
                        )
                    )
            else:
                if args.watch:
                    print("\x1b[2J\x1b[H", end="")
                if len(addresses) > 1:
                    print(format_routers(seen))
                for a, st in seen.items():
                    if not isinstance(st, str):
                        print(f"router {a}")
                        print(format_status(st), flush=True)
            if not args.watch:
                return 1 if failed else 0
            try:
                time.sleep(args.watch)
            except KeyboardInterrupt:
                return 1 if failed else 0
    finally:
        for c in clients:
            c.close()
