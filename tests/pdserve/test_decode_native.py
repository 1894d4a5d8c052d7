"""A tensor-parallel decode step through pdserve's C++ kernel (kernels.decode_layers: every layer and its
shared-memory collectives in one call) gives the same bits as the op-by-op path it replaces, and the LM head split
over the TP ranks gives the logits the single-rank head gives."""

from __future__ import annotations

import pytest

from pdserve import kernels
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.model.parallel_state import ParallelState
from pdserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not kernels.available(), reason="pdserve's CPU kernels do not build here")

PROMPTS = [[1, 17, 42, 99, 7, 3, 240, 11, 64], [5, 6, 7], [200, 100, 50, 25, 12, 6, 3, 1, 2, 4, 8, 16, 32]]


def _run(path, monkeypatch, native: bool, **kw) -> dict[str, list]:
    """Greedy tokens, their logprobs and top-5 alternatives of every prompt, decoded together."""
    monkeypatch.setenv("PDSERVE_NATIVE_DECODE", "1" if native else "0")  # the rank processes inherit it
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
        ("llama", dict(num_heads=8, num_kv_heads=2, vocab_size=250), dict(tensor_parallel_size=4)),
        (
            "llama",
            dict(num_heads=8, num_kv_heads=2, vocab_size=250),
            dict(tensor_parallel_size=4, decode_context_parallel_size=2),
        ),
        ("qwen2", dict(num_heads=4, num_kv_heads=2), dict(tensor_parallel_size=2)),  # a qkv bias
        ("llama", dict(num_heads=8, num_kv_heads=2), dict(tensor_parallel_size=2, dtype="bfloat16")),
    ],
)
def test_native_decode_step_is_bit_identical_to_the_op_by_op_step(tiny_factory, monkeypatch, family, shape, parallel):
    path = tiny_factory(family, **shape)
    native = _run(path, monkeypatch, True, **parallel)
    ops = _run(path, monkeypatch, False, **parallel)
    assert native == ops
    assert all(len(v) == 10 for v in native.values())


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
