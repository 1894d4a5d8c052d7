"""The supervisor never leaves a process behind: stop() takes down every service's whole process group (ranks and
other grandchildren included, SIGKILL for those that ignore SIGTERM), and a supervisor that is SIGKILLed takes its
services with it (PR_SET_PDEATHSIG + the reaper watchdog). Uses stand-in services (tests/cluster/cluster_helpers.py);
the same checks against the real `pdserve up` are in tests/client/test_live_cluster.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from pdserve.cluster.supervisor import LocalCluster, Service
from pdserve.cluster.topology import Topology

HELPER = str(Path(__file__).with_name("cluster_helpers.py"))


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _wait_descendants(root: psutil.Process, at_least: int, before: set[int], timeout: float = 60) -> list[int]:
    """root's descendants that were not there ``before`` (earlier tests' helpers, such as multiprocessing's resource
    tracker, live on in this process), once there are ``at_least`` of them."""
    end = time.monotonic() + timeout
    kids: list[int] = []
    while time.monotonic() < end:
        kids = [k.pid for k in root.children(recursive=True) if k.pid not in before]
        if len(kids) >= at_least:
            return kids
        time.sleep(0.1)
    raise AssertionError(f"only {len(kids)} new descendants after {timeout}s")


def _gone(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = _alive(pids)
        if not left:
            return []
        time.sleep(0.1)
    return _alive(pids)


@pytest.mark.slow
def test_stop_kills_every_group_member_including_stubborn_ones(tmp_path):
    c = LocalCluster(Topology(), log_dir=tmp_path)
    c.services = [
        Service(
            f"svc-{i}",
            "prefill" if i else "router",
            [sys.executable, HELPER, "service", "stubborn" if i == 1 else "obedient", "2"],
            "127.0.0.1:1",
            tmp_path / f"svc-{i}.log",
        )
        for i in range(3)
    ]
    before = {k.pid for k in psutil.Process().children(recursive=True)}
    c._start_reaper()
    for s in c.services:
        c._spawn(s)
    # 3 services x (1 + 2 ranks + 1 subprocess + the spawn resource tracker) + the reaper
    pids = _wait_descendants(psutil.Process(), at_least=3 * 4 + 1, before=before)
    t = time.monotonic()
    c.stop(grace=1.0)
    assert time.monotonic() - t < 20
    assert _gone(pids, 5) == []
    c.stop()  # idempotent


@pytest.mark.slow
def test_sigkilled_supervisor_takes_its_services_with_it(tmp_path):
    sup = subprocess.Popen(
        [sys.executable, HELPER, "supervise", "2", str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = sup.stdout.readline()
        assert line.startswith("pids"), line
        pids = _wait_descendants(psutil.Process(sup.pid), at_least=2 * 4 + 1, before=set())
        sup.kill()
        sup.wait(10)
        left = _gone(pids, 15)
        assert left == [], [psutil.Process(p).cmdline() for p in _alive(left)]
    finally:
        if sup.poll() is None:
            os.killpg(sup.pid, signal.SIGKILL)


def test_interrupt_during_spawn_is_deferred_until_the_child_is_recorded(tmp_path):
    from pdserve.cluster.supervisor import Interrupted

    c = LocalCluster(Topology(), log_dir=tmp_path)
    s = Service(
        "svc", "prefill", [sys.executable, "-c", "import time; time.sleep(60)"], "127.0.0.1:1", tmp_path / "svc.log"
    )
    c.services = [s]
    c._signalled = signal.SIGINT  # as if Ctrl-C arrived while Popen was running
    with pytest.raises(Interrupted):
        c._spawn(s)  # spawned, recorded, then the pending signal is raised
    assert s.proc is not None and s.proc.poll() is None
    c.stop(grace=2)
    assert s.proc.poll() is not None
