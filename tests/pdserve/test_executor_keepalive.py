"""TP rank processes stay up while their driver lives. Over gloo, ranks 1..N-1 wait for the driver's next step
inside a collective, which the process group aborts after its timeout (so the driver sends keepalives); over shared
memory they sleep as long as the driver lives. Ctrl-C reaches the whole process group. These tests use real 2-rank
groups with a short collective timeout (4 s)."""

from __future__ import annotations

import operator
import os
import signal
import time

import pytest

from pdserve.engine.executor import Executor

pytestmark = pytest.mark.slow

TIMEOUT_S = 4.0  # of each collective (the rendezvous has its own, long timeout)


@pytest.fixture(params=["gloo", "shm"])
def executor(request, tiny_factory):
    model = tiny_factory("llama", num_kv_heads=2)
    ex = Executor.create(
        str(model),
        tp_size=2,
        dcp_size=1,
        interleave=1,
        num_blocks=8,
        block_size=16,
        max_model_len=256,
        timeout_s=TIMEOUT_S,
        cpu_collectives=request.param,
    )
    assert ex.collectives == request.param
    try:
        yield ex
    finally:
        ex.shutdown()


def _idle(ex: Executor, seconds: float, keepalive: bool) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if keepalive:
            ex.keepalive()
        time.sleep(0.05)


def test_idle_driver_keepalive_keeps_ranks_alive(executor):
    """Idle for twice the group's timeout while the driver's loop calls keepalive(): the rank is still alive and the
    next call on every rank works (each rank answers its own tp_rank)."""
    _idle(executor, 2 * TIMEOUT_S, keepalive=True)
    assert executor.workers_alive()
    assert executor.call_all_ranks(operator.attrgetter("ps.tp_rank")) == [0, 1]


def test_idle_driver_without_keepalive_loses_its_gloo_ranks_not_its_shm_ranks(executor):
    """The fault keepalive() prevents, shown on the same real group: with no broadcast for longer than the timeout
    the waiting rank's collective times out and the rank process exits (a decode / prefill pod with TP > 1 that
    sat idle for the timeout would be broken). Over shared memory the same idle period costs nothing: the ranks
    sleep until the next step and answer it."""
    _idle(executor, 2 * TIMEOUT_S, keepalive=False)
    if executor.collectives == "shm":
        assert executor.workers_alive()
        assert executor.call_all_ranks(operator.attrgetter("ps.tp_rank")) == [0, 1]
        return
    deadline = time.monotonic() + 60
    while executor.workers_alive() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not executor.workers_alive()
    assert executor.procs[0].exitcode not in (None, 0)


def test_ctrl_c_to_the_process_group_leaves_ranks_to_the_driver(executor):
    """SIGINT (what Ctrl-C sends to every process of the foreground group) does not kill a rank: the driver handles
    it (a pod drains with its ranks still computing) and stops the ranks itself."""
    os.kill(executor.procs[0].pid, signal.SIGINT)
    time.sleep(0.5)  # give a (wrongly) dying rank the chance to die before we look
    assert executor.workers_alive()
    assert executor.call_all_ranks(operator.attrgetter("ps.tp_rank")) == [0, 1]
