"""Keep a service's helper threads from preempting its event loop (Linux scheduling policy).

grpc.aio hands every RPC event through helper threads: grpc core's event-engine threads do the socket I/O and a
poller thread passes each completion to the asyncio loop. Each wakes for microseconds per event and, under the normal
policy, may preempt whatever runs on its core, the loop thread included, which then waits in the run queue behind
the other processes of a busy machine. ``batch_helper_threads`` puts every other thread of the process under
SCHED_BATCH, which the kernel never lets preempt on wakeup: a helper runs when a core frees up (the loop only waits
for its events anyway) and the loop finishes its burst. Threads the helpers start inherit the policy; threads the
loop thread starts later (asyncio.to_thread) keep the normal one. Unprivileged; a no-op where the policy is missing.

``background_thread`` does the same for the calling thread, and lowers its nice: a pod's KV transfer threads run
beside its engine thread on the same cores and must not take the cycles of its decode steps.

``may_set_nice`` tells whether this process may start a service at a given nice value: what the local cluster
asks before it gives the routers their CPU priority over the pods (pdserve/cluster/exec_child.py applies it).
"""

from __future__ import annotations

import logging
import os
import resource
import threading

log = logging.getLogger("pdserve.sched")

_TASKS = "/proc/self/task"
CAP_SYS_NICE = 23  # linux/capability.h
NICE_RANGE = range(-20, 20)


def batch_helper_threads(who: str) -> int:
    """SCHED_BATCH for every thread of this process but the calling one; returns how many were switched."""
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is None or not os.path.isdir(_TASKS):
        return 0
    me = threading.get_native_id()
    switched = 0
    for name in os.listdir(_TASKS):
        tid = int(name)
        if tid == me:
            continue
        try:
            if os.sched_getscheduler(tid) == os.SCHED_OTHER:
                os.sched_setscheduler(tid, batch, os.sched_param(0))
                switched += 1
        except OSError:  # exited since the listing
            continue
    log.info("%s: %d helper threads under SCHED_BATCH", who, switched)
    return switched


def background_thread(nice: int) -> None:
    """Put the calling thread behind the computing threads of its core: SCHED_BATCH (it never preempts them on
    wakeup) and ``nice`` above its current nice (at most 19), so a busy core gives it a small share. For threads that
    move bytes beside a pod's engine thread (a decode rank's KV transfer threads). Unprivileged: lowering a priority
    needs no capability; a no-op where the calls are missing."""
    tid = threading.get_native_id()
    batch = getattr(os, "SCHED_BATCH", None)
    try:
        if batch is not None:
            os.sched_setscheduler(tid, batch, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except (OSError, AttributeError) as e:  # not Linux, or a sandbox that refuses: the thread keeps its priority
        log.debug("background thread %d keeps its priority: %s", tid, e)


def may_set_nice(nice: int, status: str | None = None, rlimit_nice: int | None = None) -> bool:
    """Whether a child of this process may run at ``nice``, as the kernel's can_nice decides: any value >= 0; a
    negative one with CAP_SYS_NICE, or where RLIMIT_NICE allows 20 - nice. ``status`` (/proc/self/status's text)
    and ``rlimit_nice`` (the soft limit) default to this process's own."""
    if nice >= 0:
        return True
    if rlimit_nice is None:  # RLIMIT_NICE is Linux's: elsewhere only the capability check below can say yes
        which = getattr(resource, "RLIMIT_NICE", None)
        rlimit_nice = 0 if which is None else resource.getrlimit(which)[0]
    if rlimit_nice == resource.RLIM_INFINITY or 20 - nice <= rlimit_nice:
        return True
    if status is None:
        try:
            with open("/proc/self/status") as f:
                status = f.read()
        except OSError:
            return False
    for line in status.splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) >> CAP_SYS_NICE & 1)
    return False
