"""A single CPU rank pins its compute threads one per core around each step (thread t on core t, as vLLM's CPU worker
binds them), and leaves the stepping thread and the machine as it found them."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from pdserve import kernels
from pdserve.engine.executor import resolve_pinning
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def _masks() -> dict[int, set[int]]:
    """Every thread of this process and the cores it may run on."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:  # the thread ended meanwhile
            pass
    return out


@pytest.mark.parametrize(
    ("requested", "threads", "cores", "pinned"),
    [
        ("auto", 2, 2, True),
        ("auto", 1, 2, False),  # one thread: nothing to keep apart
        ("auto", 4, 2, False),  # more threads than cores: pinning would stack them
        ("on", 4, 2, True),
        ("off", 2, 2, False),
    ],
)
def test_a_single_cpu_rank_pins_its_threads_when_each_gets_a_core(requested, threads, cores, pinned):
    assert resolve_pinning(requested, "cpu", 1, cores, threads)[0] is pinned
    assert resolve_pinning(requested, "cuda:0", 1, cores, threads)[0] is False


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores")
def test_pin_threads_puts_thread_t_on_core_t_and_undoes_it():
    assert kernels.available()
    cores = sorted(os.sched_getaffinity(0))[:2]
    was_threads, was_mask = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(2)
    try:
        assert kernels.pin_threads(cores) == 2
        assert os.sched_getaffinity(0) == {cores[0]}  # the calling thread is thread 0 of its team
        assert {cores[1]} in _masks().values()  # and the team's other thread sits on the next core
        kernels.pin_threads(cores, one_each=False)
        assert all(mask >= set(cores) for mask in _masks().values())
    finally:
        kernels.pin_threads(sorted(was_mask), one_each=False)
        os.sched_setaffinity(0, was_mask)
        torch.set_num_threads(was_threads)


@pytest.mark.skipif(not TWO_CORES, reason="needs two cores")
def test_the_engine_pins_only_during_a_step_and_unpins_at_shutdown(tiny_factory):
    model = tiny_factory("llama", num_kv_heads=2)
    was_threads, was_mask = torch.get_num_threads(), os.sched_getaffinity(0)
    torch.set_num_threads(2)
    seen: list[set[int]] = []
    try:
        engine = LLMEngine(EngineConfig(model=str(model), num_kv_blocks=16, max_model_len=64))
        runner_execute = engine.executor.runner.execute

        def spy(step):
            seen.append(os.sched_getaffinity(0))
            return runner_execute(step)

        engine.executor.runner.execute = spy
        # Stepped from another thread, as a pod's engine thread does: that thread's team is the one pinned.
        out: list = []
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        t = threading.Thread(target=lambda: out.append(engine.generate([[5, 6, 7]], params)))
        t.start()
        t.join()
        assert out and len(out[0][0]["token_ids"]) == 3
        assert seen and all(len(mask) == 1 for mask in seen)  # each step ran on one core
        assert os.sched_getaffinity(0) == was_mask  # the builder's thread was never pinned
        engine.shutdown()
    finally:
        kernels.pin_threads(sorted(was_mask), one_each=False)
        os.sched_setaffinity(0, was_mask)
        torch.set_num_threads(was_threads)
