"""A decode step through pdserve's C++ kernel (kernels.decode_layers: every layer, and on a tensor-parallel pod its
shared-memory collectives, in one call) and a single rank's prefill of whole prompts (kernels.prefill_layers) give
the same bits as the op-by-op path they replace, on one rank and on several, and the LM head split over the TP
ranks gives the logits the single-rank head gives."""

from __future__ import annotations

import pytest
from barrier_helpers import dead_pid, two_rank_barrier

from pdserve import kernels
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.shm import Barrier, RankFailure, shm_supported
from pdserve.model.parallel_state import ParallelState
from pdserve.sampling_params import SamplingParams

# slow: multi-rank decode steps per shape
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not kernels.available(), reason="pdserve's CPU kernels do not build here"),
]

PROMPTS = [[1, 17, 42, 99, 7, 3, 240, 11, 64], [5, 6, 7], [200, 100, 50, 25, 12, 6, 3, 1, 2, 4, 8, 16, 32]]


def _run(path, monkeypatch, native: bool, **kw) -> dict[str, list]:
    """Greedy tokens, their logprobs and top-5 alternatives of every prompt, decoded together."""
    monkeypatch.setenv("PDSERVE_NATIVE_LAYERS", "1" if native else "0")  # the rank processes inherit it
    eng = LLMEngine(EngineConfig(model=str(path), num_kv_blocks=64, block_size=4, max_model_len=128, **kw))
    try:
        sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, top_logprobs=5)
        ids = [eng.add_request(p, sp) for p in PROMPTS]
        got: dict[str, list] = {i: [] for i in ids}
        while eng.has_unfinished():
            for o in eng.step():
                got[o.request_id] += list(zip(o.new_token_ids, o.new_logprobs, o.new_top_logprobs))
        return {str(k): v for k, v in zip(range(len(ids)), got.values())}
    finally:
        eng.shutdown()


@pytest.mark.parametrize(
    "family,shape,parallel",
    [
        # one rank: the layers without collectives, and (head size 64: pdserve's prefill attention) the prefill
        ("llama", dict(num_heads=8, num_kv_heads=2), {}),
        ("llama", dict(num_heads=4, num_kv_heads=2, head_dim=64), {}),
        ("llama", dict(num_heads=4, num_kv_heads=2, head_dim=64), dict(dtype="bfloat16")),
        ("qwen2", dict(num_heads=4, num_kv_heads=2, head_dim=64), {}),
        # chunked prompts: a first chunk goes native with no logits rows, the later ones op by op
        ("llama", dict(num_heads=4, num_kv_heads=2, head_dim=64), dict(prefill_chunk_size=4)),
        ("llama", dict(num_heads=8, num_kv_heads=2, vocab_size=250), dict(tensor_parallel_size=4)),
        (
            "llama",
            dict(num_heads=8, num_kv_heads=2, vocab_size=250),
            dict(tensor_parallel_size=4, decode_context_parallel_size=2),
        ),
        ("qwen2", dict(num_heads=4, num_kv_heads=2), dict(tensor_parallel_size=2)),  # a qkv bias
        ("llama", dict(num_heads=8, num_kv_heads=2), dict(tensor_parallel_size=2, dtype="bfloat16")),
        # int8 linears: their scales ride where a float layer's packed copy does
        ("llama", dict(num_heads=4, num_kv_heads=2, head_dim=64), dict(quantization="int8")),
        ("qwen2", dict(num_heads=4, num_kv_heads=2, head_dim=64), dict(quantization="int8", dtype="bfloat16")),
        ("llama", dict(num_heads=8, num_kv_heads=2), dict(tensor_parallel_size=2, quantization="int8")),
    ],
)
def test_native_steps_are_bit_identical_to_the_op_by_op_steps(tiny_factory, monkeypatch, family, shape, parallel):
    path = tiny_factory(family, **shape)
    native = _run(path, monkeypatch, True, **parallel)
    ops = _run(path, monkeypatch, False, **parallel)
    assert native == ops
    assert all(len(v) == 10 for v in native.values())


def test_int8_layers_take_the_one_call_step(tiny_factory, monkeypatch):
    """--quantization int8 decodes and prefills through the one-call layers, not op by op."""
    calls = {"decode_layers": 0, "prefill_layers": 0}
    for name in calls:
        real = getattr(kernels, name)

        def counted(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(kernels, name, counted)
    path = tiny_factory("llama", num_heads=4, num_kv_heads=2, head_dim=64)
    _run(path, monkeypatch, True, quantization="int8")
    assert calls["prefill_layers"] >= 1 and calls["decode_layers"] >= 9


def test_vocab_shards_cover_the_vocab_in_rank_order():
    for vocab, tp in [(250, 4), (49152, 9), (7, 3), (5, 8)]:
        shards = [ParallelState(tp_size=tp, tp_rank=r).vocab_shard(vocab) for r in range(tp)]
        assert [first for first, _ in shards] == [sum(n for _, n in shards[:r]) for r in range(tp)]
        assert sum(n for _, n in shards) == vocab
        assert max(n for _, n in shards) - min(n for _, n in shards) <= 1


def test_tp_greedy_tokens_match_one_rank(tiny_factory, monkeypatch):
    """The vocab-parallel head (odd vocab: uneven shards) and the native step pick what a single rank picks."""
    path = tiny_factory("llama", num_heads=8, num_kv_heads=2, vocab_size=250)
    one = _run(path, monkeypatch, True)
    tp = _run(path, monkeypatch, True, tensor_parallel_size=4, decode_context_parallel_size=2)
    for k in one:
        assert [t for t, _, _ in tp[k]] == [t for t, _, _ in one[k]]
        assert [lp for _, lp, _ in tp[k]] == pytest.approx([lp for _, lp, _ in one[k]], abs=1e-4)


def _native(b: Barrier, timeout_s: float = 10.0) -> list[int]:
    """b's handle as kernels.barrier_wait takes it (no slots), its members' TP ranks appended."""
    handle = b.native()
    handle[7] = int(timeout_s * 1000)
    return handle + list(b.ranks)


@pytest.mark.skipif(shm_supported() is not None, reason=f"shared memory: {shm_supported()}")
def test_the_native_barrier_keeps_step_with_shm_py_s():
    """The C++ step's barrier is a copy of pdserve/engine/shm.py's over the same words: one side waiting natively
    and the other through Python (and both switching between the two) pass the same phases, none early."""
    import threading

    b0, b1 = two_rank_barrier()
    phases = 300
    seen: list[int] = []
    shared = [0]

    def wait(b: Barrier, native: bool) -> None:
        if native:
            b.seq = kernels.barrier_wait(_native(b), "a test")
        else:
            b.wait(10.0, "a test")

    def other() -> None:
        for i in range(phases):
            wait(b1, i % 3 == 0)
            seen.append(shared[0])  # what rank 0 wrote before the first wait of this round
            wait(b1, i % 5 == 0)

    t = threading.Thread(target=other)
    t.start()
    for i in range(phases):
        shared[0] = i
        wait(b0, i % 2 == 0)
        wait(b0, i % 7 == 0)  # the next round's write waits until rank 1 has read this one's
    t.join(timeout=30)
    assert not t.is_alive()
    assert seen == list(range(phases))
    assert b0.seq == b1.seq == 2 * phases


@pytest.mark.skipif(shm_supported() is not None, reason=f"shared memory: {shm_supported()}")
def test_the_native_barrier_names_a_dead_rank_and_an_abort():
    b0, _ = two_rank_barrier((0, 7))
    gone = dead_pid()
    b0.expect(1, gone)
    with pytest.raises(RuntimeError) as ei:
        kernels.barrier_wait(_native(b0), "an all-reduce")
    e = ParallelState.native_failure(ei.value)
    assert isinstance(e, RankFailure) and e.rank == 7
    assert str(e) == f"TP rank 7 (pid {gone}) exited during an all-reduce"

    b0.expect(1, 0)  # no pid to watch: only the abort word ends the wait
    b0.abort()
    with pytest.raises(RuntimeError) as ei:
        kernels.barrier_wait(_native(b0), "an all-gather")
    e = ParallelState.native_failure(ei.value)
    assert isinstance(e, RankFailure) and e.rank is None
    assert str(e) == "an all-gather was aborted: the pod is stopping its ranks"
