"""Run by path (``python exec_child.py [--parent PID] [--deathsig NAME] [--cpus 0,1] [--nice N] -- CMD...``) as the
first thing in a child the supervisor starts: it applies what the service must inherit (CPU placement, CPU priority,
death with its parent) and then execs CMD in the same process. No Python runs between fork and exec in the parent,
whose gRPC threads make a ``preexec_fn`` unsafe (the child ran gRPC's fork handlers and could crash before exec).
Imports nothing of pdserve."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int, sig: signal.Signals) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)  # survives the exec below
    if os.getppid() != parent:  # the parent died before the prctl: nobody would signal us
        os._exit(1)


def _set_nice(nice: int) -> None:
    """The service's CPU priority, for the process and for its session. The child runs in a session of its own, and
    where the kernel groups sessions (autogroup) it shares the CPU between the groups by the group's nice value: a
    thread's own nice then weighs only against the threads of its session. Failures are reported, not fatal."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # the exec'd process and every thread and rank it starts
    except OSError as e:
        print(f"exec_child: cannot set nice {nice}: {e.strerror}", file=sys.stderr, flush=True)
    for _ in range(8):  # without CAP_SYS_ADMIN the kernel takes one autogroup change per 100 ms, machine-wide
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(nice))
            return
        except FileNotFoundError:  # a kernel without autogroups: the process's nice is what counts
            return
        except BlockingIOError:
            time.sleep(0.025)
        except OSError as e:
            print(f"exec_child: cannot set the session's nice {nice}: {e.strerror}", file=sys.stderr, flush=True)
            return
    print(f"exec_child: the session's nice {nice} was refused for 200 ms; left at 0", file=sys.stderr, flush=True)


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        sys.exit("usage: exec_child.py [--parent PID] [--deathsig NAME] [--cpus 0,1] [--nice N] -- CMD...")
    split = argv.index("--")
    opts = dict(zip(argv[:split:2], argv[1:split:2]))
    cmd = argv[split + 1 :]
    if "--cpus" in opts:
        os.sched_setaffinity(0, {int(c) for c in opts["--cpus"].split(",")})
    if "--nice" in opts:
        _set_nice(int(opts["--nice"]))
    if "--parent" in opts:
        _die_with_parent(int(opts["--parent"]), signal.Signals["SIG" + opts.get("--deathsig", "KILL")])
    os.execv(cmd[0], cmd)


if __name__ == "__main__":
    main(sys.argv[1:])
