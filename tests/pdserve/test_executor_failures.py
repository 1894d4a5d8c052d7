"""A pod's ranks over shared memory when one of them fails: a killed or stopped rank is named within seconds (not
after the 120 s collective timeout), a rank stuck while running writes its stacks into the log once the timeout names
it, and a SIGKILLed driver takes its ranks and their shared memory with it."""

from __future__ import annotations

import dataclasses
import operator
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.shm import RankFailure, proc_state, shm_supported
from pdserve.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shm_supported() is not None, reason=f"shared memory: {shm_supported()}"),
]

NOTICE_S = 30.0  # far below the collective timeout (120 s): only the liveness checks can explain an answer this fast


@pytest.fixture
def engine(tiny_factory):
    model = tiny_factory("llama", num_heads=6, num_kv_heads=3, hidden_size=96)
    eng = LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=3, num_kv_blocks=32, max_model_len=128))
    assert eng.executor.collectives == "shm"
    try:
        yield eng
    finally:
        for p in eng.executor.procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
        eng.shutdown()


def _generate(eng: LLMEngine) -> list:
    return eng.generate([[1, 5, 9, 13]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))


def test_ranks_answer_steps_over_shared_memory(engine):
    """The healthy case the failure tests start from: generation works and every rank answers a call."""
    assert len(_generate(engine)[0]["token_ids"]) == 4
    assert engine.executor.call_all_ranks(operator.attrgetter("ps.tp_rank")) == [0, 1, 2]


def _failure_after(engine: LLMEngine, rank: int, sig: int) -> RankFailure:
    """Send sig to TP rank `rank`, then generate: the RankFailure it raises, which came within NOTICE_S."""
    os.kill(engine.executor.procs[rank - 1].pid, sig)
    t0 = time.monotonic()
    with pytest.raises(RankFailure) as ei:
        _generate(engine)
    assert time.monotonic() - t0 < NOTICE_S
    return ei.value


def test_a_killed_rank_is_named(engine):
    e = _failure_after(engine, 2, signal.SIGKILL)
    assert e.rank == 2 and "TP rank 2" in str(e) and "exited" in str(e)


def test_a_stopped_rank_is_named(engine):
    """A frozen rank (SIGSTOP, a debugger) would hang every collective: it is reported once stopped a few seconds."""
    _generate(engine)
    e = _failure_after(engine, 1, signal.SIGSTOP)
    assert e.rank == 1 and "stopped" in str(e)


def test_shutdown_after_a_failure_stops_every_rank(engine):
    os.kill(engine.executor.procs[0].pid, signal.SIGKILL)
    with pytest.raises(RankFailure):
        _generate(engine)
    procs = list(engine.executor.procs)
    engine.shutdown()
    assert all(not p.is_alive() for p in procs)


DRIVER = textwrap.dedent("""
    import sys, time
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    if __name__ == "__main__":
        eng = LLMEngine(EngineConfig(model=sys.argv[1], tensor_parallel_size=3, num_kv_blocks=16, max_model_len=64))
        print(" ".join(str(p.pid) for p in eng.executor.procs), flush=True)
        time.sleep(600)
""")


def _shm_names() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_sigkilled_driver_leaves_no_rank_and_no_shared_segment(tiny_factory, tmp_path):
    model = tiny_factory("llama", num_heads=6, num_kv_heads=3, hidden_size=96)
    before = _shm_names()
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    driver = subprocess.Popen(
        [sys.executable, str(script), str(model)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    try:
        pids = [int(p) for p in driver.stdout.readline().split()]
        assert len(pids) == 2
        mapped = [open(f"/proc/{pid}/maps").read() for pid in pids]
        assert all("memfd:pdserve-ranks" in m for m in mapped), "the ranks do not share the pod's memfd region"
        driver.kill()
        driver.wait(timeout=30)
        deadline = time.monotonic() + NOTICE_S
        while any(proc_state(p) not in (None, "Z") for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(proc_state(p) in (None, "Z") for p in pids), "a rank outlived its SIGKILLed driver"
    finally:
        if driver.poll() is None:
            driver.kill()
    assert _shm_names() - before == set(), "shared memory left behind in /dev/shm"


def test_shutdown_gives_the_driver_thread_back_its_cores_and_threads(tiny_factory):
    """A pod pins its driver thread and sets torch's thread count for its rank; after shutdown this process's next
    engine (a benchmark's next side) sees every core and thread again."""
    import torch

    model = tiny_factory("llama", num_heads=6, num_kv_heads=3, hidden_size=96)
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    eng = LLMEngine(
        EngineConfig(model=str(model), tensor_parallel_size=3, num_kv_blocks=16, max_model_len=64, cpu_pinning="on")
    )
    assert os.sched_getaffinity(0) != cpus or len(cpus) == 1
    eng.shutdown()
    assert os.sched_getaffinity(0) == cpus and torch.get_num_threads() == threads


def test_a_rank_that_dies_while_starting_is_named_at_once(tiny_factory, monkeypatch):
    """A rank process that fails before it joins the shared-memory group (here: it cannot be pinned to its core)
    ends the pod's start with a RankFailure naming it within seconds, not after the rendezvous timeout (600 s)."""
    from pdserve.engine.executor import Executor

    model = tiny_factory("llama", num_heads=6, num_kv_heads=3, hidden_size=96)
    start = Executor.__init__

    def rank_1_unpinnable(self, spec):
        start(self, dataclasses.replace(spec, cpus=(min(os.sched_getaffinity(0)), 1 << 20)))

    monkeypatch.setattr(Executor, "__init__", rank_1_unpinnable)
    driver_cpus = os.sched_getaffinity(0)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"TP rank 1 \(pid \d+\) exited during the ranks' start-up"):
        LLMEngine(EngineConfig(model=str(model), tensor_parallel_size=3, num_kv_blocks=32, max_model_len=128))
    assert time.monotonic() - t0 < NOTICE_S
    assert os.sched_getaffinity(0) == driver_cpus  # the failed start gave the driver its cores back


STUCK = textwrap.dedent("""
    import sys, time
    from pdserve.engine.executor import Executor
    from pdserve.engine.shm import RankFailure

    def stuck_on_rank_1(runner):
        if runner.ps.tp_rank == 1:
            time.sleep(60)  # running, not stopped: only the collective's timeout notices it

    if __name__ == "__main__":
        ex = Executor.create(sys.argv[1], 3, 1, 1, 16, 16, 64, timeout_s=3.0)
        try:
            ex.call_all_ranks(stuck_on_rank_1)
        except RankFailure as e:
            print("failure:", e, flush=True)
        time.sleep(2)  # the rank writes its stacks
        ex.shutdown()
""")


def test_a_rank_stuck_while_running_dumps_its_stacks_into_the_log(tiny_factory, tmp_path):
    """A rank that misses a collective while running (stuck in a call, not stopped and not dead) is only noticed at
    the collective's timeout; then the driver asks it for its threads' stacks, which show where it was stuck."""
    model = tiny_factory("llama", num_heads=6, num_kv_heads=3, hidden_size=96)
    script = tmp_path / "stuck_rank.py"
    script.write_text(STUCK)
    out = subprocess.run(
        [sys.executable, str(script), str(model)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "failure:" in out.stdout and "TP rank(s) [1]" in out.stdout, out.stdout
    assert "TP rank 1 (pid " in out.stderr and "missed the collective while running" in out.stderr
    # faulthandler's dump of rank 1: the frame it was stuck in
    assert "(most recent call first)" in out.stderr and "in stuck_on_rank_1" in out.stderr, out.stderr[-3000:]
