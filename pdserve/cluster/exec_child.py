"""Run by path (``python exec_child.py [--parent PID] [--deathsig NAME] [--cpus 0,1] -- CMD...``) as the first thing in
a child the supervisor starts: it applies what the service must inherit (CPU placement, death with its parent) and
then execs CMD in the same process. No Python runs between fork and exec in the parent, whose gRPC threads make a
``preexec_fn`` unsafe (the child ran gRPC's fork handlers and could crash before exec). Imports nothing of pdserve."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int, sig: signal.Signals) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)  # survives the exec below
    if os.getppid() != parent:  # the parent died before the prctl: nobody would signal us
        os._exit(1)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.exit("usage: exec_child.py [--parent PID] [--deathsig NAME] [--cpus 0,1] -- CMD...")
    split = argv.index("--")
    opts = dict(zip(argv[:split:2], argv[1:split:2]))
    cmd = argv[split + 1 :]
    if "--cpus" in opts:
        os.sched_setaffinity(0, {int(c) for c in opts["--cpus"].split(",")})
    if "--parent" in opts:
        _die_with_parent(int(opts["--parent"]), signal.Signals["SIG" + opts.get("--deathsig", "KILL")])
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
