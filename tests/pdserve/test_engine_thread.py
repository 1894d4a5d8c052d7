"""EngineThread: the thread both pods run their engine on (start-up errors, commands in order, wake, stop)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from pdserve.pod.engine_thread import EngineThread, dead_ranks


def test_start_raises_what_building_raised():
    def run(t: EngineThread) -> None:
        raise ValueError("no model")

    t = EngineThread("t", run)
    with pytest.raises(ValueError, match="no model"):
        t.start(timeout_s=10)
    t.stop(timeout_s=10)
    assert not t.alive


def test_commands_run_in_order_on_the_thread_until_stop():
    seen: list = []
    idle = threading.Event()

    def run(t: EngineThread) -> None:
        t.ready()
        while not t.stopping:
            t.run_commands(0.05)
            idle.set()
        t.run_commands()  # what was queued behind the stop
        seen.append("stopped")

    t = EngineThread("t", run)
    t.start(timeout_s=10)
    for i in range(3):
        t.put(lambda i=i: seen.append((i, threading.current_thread().name)))
    t.put(lambda: 1 / 0)  # logged; the next command still runs
    t.put(lambda: seen.append("after"))
    t.wake()
    t.stop(timeout_s=10)
    assert not t.alive
    assert seen == [(0, "t"), (1, "t"), (2, "t"), "after", "stopped"]


def test_dead_ranks_names_exited_processes():
    alive = SimpleNamespace(is_alive=lambda: True, exitcode=None)
    gone = SimpleNamespace(is_alive=lambda: False, exitcode=-9)
    assert dead_ranks(SimpleNamespace(procs=[alive, gone])) == [(2, -9)]
    assert dead_ranks(SimpleNamespace(procs=[alive])) == []
    assert dead_ranks(SimpleNamespace()) == []
