"""LLMEngine's API for pods that receive a prompt's KV from elsewhere (reserve, adopt, add_awaiting_kv,
start_decoding, knows, block_tables_of), and the model-less bookkeeping engine."""

from __future__ import annotations

import pytest

from pdserve.engine.llm_engine import EngineConfig, LLMEngine, RequestError
from pdserve.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 9, 100, 3, 77, 8, 61, 12]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def _prefill(eng: LLMEngine, rid: str) -> tuple[int, float, list[int]]:
    """Run the prompt on eng (holding its KV); first token, its logprob and the prompt's block table."""
    eng.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), rid, hold_kv=True)
    outs = [o for _ in range(10) for o in eng.step()]
    (out,) = [o for o in outs if o.request_id == rid]
    return out.new_token_ids[0], out.new_logprobs[0], list(eng.held[rid].block_tables[0])


def _copy_kv(src: LLMEngine, src_table: list[int], dst: LLMEngine, dst_table: list[int]) -> None:
    for a, b in zip(src_table, dst_table):
        dst.executor.kv_cache[:, :, b] = src.executor.kv_cache[:, :, a]


def _decode_all(eng: LLMEngine, rid: str, first) -> list[int]:
    toks = list(first.new_token_ids)
    while eng.has_unfinished():
        toks += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return toks


@pytest.fixture(scope="module")
def engines(tiny_factory):
    path = tiny_factory("llama", num_heads=8, num_kv_heads=2)
    cfg = EngineConfig(model=str(path), block_size=4, num_kv_blocks=32, enable_prefix_caching=False)
    with LLMEngine(cfg) as prefill, LLMEngine(cfg) as decode:
        yield prefill, decode


def test_reserved_then_adopted_request_decodes_like_a_local_one(engines):
    prefill, decode = engines
    solo = prefill.generate([PROMPT], GREEDY)[0]["token_ids"]
    first, lp, src_table = _prefill(prefill, "r1")
    free_before = decode.blocks.num_free()
    res = decode.reserve("r1", len(PROMPT), len(PROMPT) + 4)
    assert res is not None and not decode.knows("r1")  # a reservation is not a request yet
    assert decode.blocks.num_free() == free_before - 4  # ceil(14 / 4) blocks
    seq = decode.adopt(res, PROMPT, GREEDY)
    assert decode.knows("r1") and decode.block_tables_of("r1") == [seq.block_tables[0]]
    _copy_kv(prefill, src_table, decode, seq.block_tables[0])
    generated = decode.num_generated_tokens
    out = decode.start_decoding(seq, first, lp)
    assert out.new_token_ids == [first] and out.completion_tokens == 1 and not out.finished
    assert decode.num_generated_tokens == generated  # prefill sampled the first token
    assert _decode_all(decode, "r1", out) == solo
    assert decode.num_generated_tokens == generated + len(solo) - 1
    assert not decode.knows("r1") and decode.blocks.num_free() == free_before
    assert prefill.release("r1")


def test_add_awaiting_kv_then_start_decoding(engines):
    prefill, decode = engines
    solo = prefill.generate([PROMPT], GREEDY)[0]["token_ids"]
    first, lp, src_table = _prefill(prefill, "r2")
    seq = decode.add_awaiting_kv(PROMPT, GREEDY, "r2")
    assert seq is not None and len(seq.block_tables[0]) == len(src_table)
    _copy_kv(prefill, src_table, decode, seq.block_tables[0])
    assert _decode_all(decode, "r2", decode.start_decoding(seq, first, lp)) == solo
    assert prefill.release("r2")


def test_no_room_keeps_nothing_and_a_used_id_is_refused(engines):
    _, decode = engines
    free = decode.blocks.num_free()
    assert decode.reserve("big", 4 * free + 1, 4 * free + 1) is None
    assert decode.add_awaiting_kv(PROMPT, GREEDY, "r3", headroom=free) is None
    assert not decode.knows("r3") and decode.blocks.num_free() == free
    seq = decode.add_awaiting_kv(PROMPT, GREEDY, "r4")
    with pytest.raises(RequestError, match="already in use"):
        decode.add_awaiting_kv(PROMPT, GREEDY, "r4")
    res = decode.reserve("r4", len(PROMPT), len(PROMPT))
    with pytest.raises(RequestError, match="already in use"):
        decode.adopt(res, PROMPT, GREEDY)
    assert res.block_tables  # a refused adoption leaves the reservation whole
    decode.free_reserved(res)
    assert decode.abort(seq.request_id) and decode.blocks.num_free() == free


def test_bookkeeping_engine_reserves_without_a_model():
    cfg = EngineConfig(
        model="unused", block_size=16, num_kv_blocks=12, decode_context_parallel_size=2, enable_prefix_caching=False
    )
    eng = LLMEngine.bookkeeping(cfg, max_model_len=1024)
    seqs = []
    while (s := eng.reserve(f"c{len(seqs)}", 100, 100)) is not None:
        seqs.append(s)
    assert len(seqs) == 3  # 50 tokens per DCP rank: 4 blocks of 16 of the 12 per rank
    assert [len(t) for t in seqs[0].block_tables] == [4, 4]
    for s in seqs:
        eng.free_reserved(s)
    assert eng.blocks.free_per_rank() == [12, 12]
