"""Keep a service's helper threads from preempting its event loop (Linux scheduling policy).

grpc.aio hands every RPC event through helper threads: grpc core's event-engine threads do the socket I/O and a
poller thread passes each completion to the asyncio loop. Each wakes for microseconds per event and, under the normal
policy, may preempt whatever runs on its core, the loop thread included, which then waits in the run queue behind
the other processes of a busy machine. ``batch_helper_threads`` puts every other thread of the process under
SCHED_BATCH, which the kernel never lets preempt on wakeup: a helper runs when a core frees up (the loop only waits
for its events anyway) and the loop finishes its burst. Threads the helpers start inherit the policy; threads the
loop thread starts later (asyncio.to_thread) keep the normal one. Unprivileged; a no-op where the policy is missing.
"""

from __future__ import annotations

import logging
import os
import threading

log = logging.getLogger("pdserve.sched")

_TASKS = "/proc/self/task"


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
