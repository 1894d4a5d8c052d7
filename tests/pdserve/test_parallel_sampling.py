"""Parallel sampling (n > 1) in the engine: the prompt is computed once and its KV shared by the n sequences through
a forked block table (full blocks reference-counted, the partly filled last block copied); each sequence equals the
single request with its child seed; cancelling frees every block. Prompt logprobs equal transformers' log-softmax."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.block_manager import BlockManager, dcp_local_count
from pdserve.engine.llm_engine import EngineConfig, LLMEngine, RequestError, child_params
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams


def _seq(rid: str, n: int) -> Sequence:
    return Sequence(rid, list(range(10, 10 + n)), SamplingParams(), 0)


@pytest.mark.parametrize("num_tokens", [8, 10])
def test_fork_shares_full_blocks_and_copies_the_partial_one(num_tokens):
    bm = BlockManager(32, 4)
    parent = _seq("p", num_tokens)
    bm.allocate(parent, num_tokens)
    tables, copies = bm.fork(parent, num_tokens)
    full = num_tokens // 4
    assert tables[0][:full] == parent.block_tables[0][:full]
    assert all(bm.ranks[0].ref[b] == 2 for b in parent.block_tables[0][:full])
    if num_tokens % 4:
        assert copies == [(0, parent.block_tables[0][full], tables[0][full])]
        assert tables[0][full] not in parent.block_tables[0]
    else:
        assert copies == [] and len(tables[0]) == full
    child = _seq("c", num_tokens)
    child.block_tables = tables
    bm.allocate(child, num_tokens + 5)  # the child grows on its own blocks
    assert not set(child.block_tables[0][full:]) & set(parent.block_tables[0])
    bm.free(parent)
    assert all(bm.ranks[0].ref[b] == 1 for b in child.block_tables[0])  # shared blocks live on with the child
    bm.free(child)
    assert bm.num_free() == 32 and not any(bm.ranks[0].ref)


def test_fork_under_dcp_copies_each_ranks_partial_block():
    bm = BlockManager(16, 4, dcp_size=2, interleave=1)
    parent = _seq("p", 11)  # rank 0 holds 6 tokens (1 full + 2), rank 1 holds 5 (1 full + 1)
    bm.allocate(parent, 11)
    tables, copies = bm.fork(parent, 11)
    assert [len(t) for t in tables] == [2, 2]
    assert sorted(r for r, _, _ in copies) == [0, 1]
    for r in range(2):
        assert dcp_local_count(11, 2, 1, r) % 4
        assert tables[r][0] == parent.block_tables[r][0]
    child = _seq("c", 11)
    child.block_tables = tables
    bm.free(child)
    bm.free(parent)
    assert bm.free_per_rank() == [16, 16]


def test_fork_without_a_free_block_takes_nothing():
    bm = BlockManager(3, 4)
    parent = _seq("p", 10)
    bm.allocate(parent, 10)  # all 3 blocks
    assert bm.fork(parent, 10) is None
    assert [bm.ranks[0].ref[b] for b in parent.block_tables[0]] == [1, 1, 1]
    bm.free(parent)
    with pytest.raises(RuntimeError, match="not allocated"):
        bm.ranks[0].share(0)  # a freed block cannot gain a holder


def test_child_params_follow_vllms_seed_rule():
    p = SamplingParams(seed=7, temperature=0.8)
    assert [child_params(p, i).seed for i in range(3)] == [7, 8, 9]
    assert child_params(p, 2).temperature == 0.8
    assert child_params(SamplingParams(), 3).seed is None


@pytest.fixture(scope="module")
def path(tiny_factory):
    return tiny_factory("llama", num_heads=8, num_kv_heads=2)


PROMPT = [5, 17, 99, 3, 42, 8, 61, 200, 13, 77]  # 10 tokens: two full blocks of 4 and a partial one


def test_n_seeded_equals_single_requests_with_child_seeds_and_prefills_once(path):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64, enable_prefix_caching=False)) as eng:
        singles = [eng.generate([PROMPT], child_params(sp, i))[0]["token_ids"] for i in range(4)]
        before = eng.num_prompt_tokens_computed
        (res,) = eng.generate([PROMPT], sp, n=4)
        assert eng.num_prompt_tokens_computed - before == len(PROMPT)  # the prompt ran once for all four
        assert [c["token_ids"] for c in res["choices"]] == singles
        assert len({tuple(s) for s in singles}) > 1  # the seeds do differ
        assert all(c["finish_reason"] == "length" for c in res["choices"])
        assert eng.blocks.num_free() == 64 and not eng.has_unfinished()


def test_greedy_n_gives_identical_sequences(path):
    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64)) as eng:
        single = eng.generate([PROMPT], sp)[0]["token_ids"]
        (res,) = eng.generate([PROMPT], sp, n=3)
        assert [c["token_ids"] for c in res["choices"]] == [single] * 3


def test_cancel_frees_all_n_and_every_block(path):
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64)) as eng:
        rid = eng.add_request(PROMPT, SamplingParams(seed=3, max_tokens=40, ignore_eos=True), n=4)
        for _ in range(4):
            eng.step()
        assert eng.num_running == 4
        # 4 sequences of 13 tokens with private blocks would take 16; sharing the two full prompt blocks saves 6
        assert 64 - eng.blocks.num_free() == 16 - 6
        assert eng.knows(rid) and eng.abort(rid)
        assert eng.blocks.num_free() == 64 and not eng.has_unfinished() and not eng.knows(rid)


def test_fork_without_room_recomputes_the_child(path):
    sp = SamplingParams(seed=11, max_tokens=6, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64)) as eng:
        singles = [eng.generate([PROMPT], child_params(sp, i))[0]["token_ids"] for i in range(2)]
    # 3 blocks hold the prompt; the child's copy of the last block does not fit, so it waits and is recomputed
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=5, enable_prefix_caching=False)) as eng:
        (res,) = eng.generate([PROMPT], sp, n=2)
        assert [c["token_ids"] for c in res["choices"]] == singles
        assert eng.blocks.num_free() == 5


def test_bad_n_is_refused(path):
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=16)) as eng:
        with pytest.raises(RequestError, match="n must be"):
            eng.add_request(PROMPT, SamplingParams(), n=0)
        with pytest.raises(RequestError, match="hold_kv"):
            eng.add_request(PROMPT, SamplingParams(max_tokens=5), n=2, hold_kv=True)


def test_prompt_logprobs_equal_transformers_log_softmax(path):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0].float(), dim=-1)
    # chunks of 3 and prefix caching on: prompt logprobs still cover every position, computed in full
    with LLMEngine(
        EngineConfig(model=str(path), block_size=4, num_kv_blocks=64, prefill_chunk_size=3, max_num_batched_tokens=3)
    ) as eng:
        eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))  # warms the prefix cache
        res = eng.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2), prompt_logprobs=3)[0]
    got = res["prompt_logprobs"]
    assert len(got) == len(PROMPT) - 1
    for p, (lp, top_ids, top_lps) in enumerate(got):
        assert abs(lp - ref[p, PROMPT[p + 1]].item()) < 1e-4
        vals, idx = ref[p].topk(3)
        assert top_ids == idx.tolist()
        assert torch.allclose(torch.tensor(top_lps), vals, atol=1e-4)


def test_prompt_logprobs_at_tp2_equal_one_ranks(path):
    # The step a TP 2 driver broadcasts then carries more logits rows (prompt positions) than rows to sample.
    sp = SamplingParams(temperature=0, max_tokens=3)
    got = {}
    for tp in (1, 2):
        with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64, tensor_parallel_size=tp)) as eng:
            got[tp] = eng.generate([PROMPT], sp, prompt_logprobs=0)[0]
    assert got[2]["token_ids"] == got[1]["token_ids"]
    assert len(got[2]["prompt_logprobs"]) == len(PROMPT) - 1
    for (lp1, ids1, _), (lp2, ids2, _) in zip(got[1]["prompt_logprobs"], got[2]["prompt_logprobs"]):
        assert abs(lp1 - lp2) < 1e-4 and ids1 == ids2


def test_fork_copies_each_dcp_ranks_partial_block_on_a_real_cache(tiny_factory):
    path = tiny_factory("llama", num_heads=8, num_kv_heads=1)
    sp = SamplingParams(temperature=1.0, seed=99, max_tokens=8, ignore_eos=True)
    # TP 2 with DCP 2: each rank holds 5 of the 10 prompt tokens, so each rank's last block is copied at the fork
    with LLMEngine(
        EngineConfig(
            model=str(path),
            block_size=4,
            num_kv_blocks=64,
            tensor_parallel_size=2,
            decode_context_parallel_size=2,
            enable_prefix_caching=False,
        )
    ) as eng:
        singles = [eng.generate([PROMPT], child_params(sp, i))[0]["token_ids"] for i in range(3)]
        (res,) = eng.generate([PROMPT], sp, n=3)
        assert [c["token_ids"] for c in res["choices"]] == singles
        assert eng.blocks.free_per_rank() == [64, 64]
