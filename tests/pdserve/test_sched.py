"""pdserve/sched.py: every thread but the caller goes under SCHED_BATCH, threads they start inherit it, and threads
the caller starts afterwards keep the normal policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from e2e_helpers import REPO, service_env

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux scheduling policies")

# In a process of its own: the policy is per thread and sticks for the thread's life.
_SCRIPT = r"""
import json, os, threading
from pdserve.sched import batch_helper_threads

stop = threading.Event()
ids = {}

def helper(name, child):
    ids[name] = threading.get_native_id()
    if child:
        ready.wait()
        t = threading.Thread(target=helper, args=("grandchild", False))
        t.start()
    stop.wait()

ready = threading.Event()
threads = [threading.Thread(target=helper, args=(n, n == "a")) for n in ("a", "b")]
for t in threads:
    t.start()
while len(ids) < 2:
    pass
switched = batch_helper_threads("test")
ready.set()  # "a" starts a thread of its own now, under SCHED_BATCH
later = threading.Thread(target=helper, args=("later", False))
later.start()
while len(ids) < 4:
    pass
policy = {name: os.sched_getscheduler(tid) for name, tid in ids.items()}
policy["main"] = os.sched_getscheduler(threading.get_native_id())
stop.set()
print(json.dumps({"switched": switched, "policy": policy, "batch": os.SCHED_BATCH, "other": os.SCHED_OTHER}))
"""


def test_helper_threads_go_under_sched_batch_and_the_caller_does_not():
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    p, batch, other = r["policy"], r["batch"], r["other"]
    assert r["switched"] >= 2  # a and b (and whatever the interpreter started)
    assert p["a"] == p["b"] == p["grandchild"] == batch
    assert p["main"] == p["later"] == other


@pytest.mark.parametrize(
    "nice,cap_eff,rlimit,allowed",
    [
        (0, "0000000000000000", 0, True),  # the default and lower priorities need nothing
        (10, "0000000000000000", 0, True),
        (-10, "0000000000000000", 0, False),
        (-10, "0000000000800000", 0, True),  # CAP_SYS_NICE (bit 23)
        (-10, "000001ffffffffff", 0, True),  # root's full set
        (-10, "0000000000000000", 30, True),  # RLIMIT_NICE admits 20 - (-10)
        (-11, "0000000000000000", 30, False),
    ],
)
def test_may_set_nice_decides_as_the_kernel_does(nice, cap_eff, rlimit, allowed):
    from pdserve.sched import may_set_nice

    status = f"Name:\tpython3\nCapInh:\t0000000000000000\nCapEff:\t{cap_eff}\n"
    assert may_set_nice(nice, status=status, rlimit_nice=rlimit) is allowed


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs Linux scheduling policies")
def test_a_background_thread_runs_batch_and_nicer_while_its_process_does_not():
    """What a decode rank's KV transfer threads get: SCHED_BATCH and 10 nice levels below the thread that started
    them; the starting thread keeps its own policy and nice."""
    import threading

    from pdserve.sched import background_thread

    me = threading.get_native_id()
    before = (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me))
    seen: dict[str, int] = {}

    def run() -> None:
        background_thread(10)
        tid = threading.get_native_id()
        seen["policy"], seen["nice"] = os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert seen == {"policy": os.SCHED_BATCH, "nice": min(19, before[1] + 10)}
    assert (os.sched_getscheduler(me), os.getpriority(os.PRIO_PROCESS, me)) == before
