"""Watchdog of a local cluster: kills the cluster's process groups if the supervisor dies without stopping them.

Started by the supervisor in its own session with a pipe on stdin. The supervisor writes one process-group id per
line as it starts each service, and ``done`` once it has stopped them itself. If stdin reaches EOF without ``done``
(the supervisor was SIGKILLed, or crashed), every group gets SIGTERM, then SIGKILL after a short grace, so no
service (nor the TP-rank processes a service spawned, which share its group) outlives the supervisor.

    python -m pdserve.cluster.reaper [--grace SECONDS]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - a foreign group took the id; not ours any more
        return False


def kill_groups(pgids: list[int], grace: float) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for g in pgids:
            try:
                os.killpg(g, sig)
            except (ProcessLookupError, PermissionError):
                pass
        if sig == signal.SIGKILL:
            break
        end = time.monotonic() + grace
        while time.monotonic() < end and any(group_alive(g) for g in pgids):
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pdserve.cluster.reaper")
    ap.add_argument("--grace", type=float, default=3.0, help="seconds between SIGTERM and SIGKILL")
    args = ap.parse_args(argv)
    # Ctrl-C in the supervisor's terminal is the supervisor's business; we only act on its death.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    pgids: list[int] = []
    for line in sys.stdin:
        line = line.strip()
        if line == "done":
            return 0
        if line.lstrip("-").isdigit():
            pgids.append(int(line))
    kill_groups(pgids, args.grace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
