"""Stand-in services for testing the supervisor's process hygiene (not pdserve services): each spawns daemon
"rank" processes the way pods spawn their TP ranks, plus a plain subprocess, and optionally ignores SIGTERM.

    python cluster_helpers.py service obedient|stubborn N     # a service with N spawned ranks
    python cluster_helpers.py supervise N_SERVICES            # a LocalCluster running stand-ins; prints pids
"""

from __future__ import annotations

import multiprocessing as mp
import signal
import subprocess
import sys
import time
from pathlib import Path


def _rank(stubborn: bool) -> None:
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)


def service(mode: str, n: int) -> None:
    stubborn = mode == "stubborn"
    if stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    ranks = [mp.get_context("spawn").Process(target=_rank, args=(stubborn,), daemon=True) for _ in range(n)]
    for r in ranks:
        r.start()
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    print("ready", flush=True)
    while True:
        time.sleep(1)


def supervise(n: int, log_dir: str) -> None:
    from pdserve.cluster.supervisor import LocalCluster, Service
    from pdserve.cluster.topology import Topology

    c = LocalCluster(Topology(), log_dir=log_dir)
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    c.services = [
        Service(
            f"svc-{i}",
            "prefill",
            [sys.executable, __file__, "service", "stubborn" if i % 2 else "obedient", "2"],
            "127.0.0.1:1",
            Path(log_dir) / f"svc-{i}.log",
        )
        for i in range(n)
    ]
    c._start_reaper()
    for s in c.services:
        c._spawn(s)
    print("pids", " ".join(str(s.pid) for s in c.services), flush=True)
    while True:
        time.sleep(1)


if __name__ == "__main__":
    if sys.argv[1] == "service":
        service(sys.argv[2], int(sys.argv[3]))
    else:
        supervise(int(sys.argv[2]), sys.argv[3])
