"""Chunked prefill and the prefix cache, through the prefill engine loop: first token and KV equal to transformers."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager

import pytest
import torch
from prefill_ref import cached_kv, greedy, hf_prefill, random_prompt

from pdserve.cli_config import build
from prefill_svc.config import PrefillConfig
from prefill_svc.worker import PrefillWorker

ATOL = 2e-4


@contextmanager
def worker(model, **kw):
    kw.setdefault("kv_transport", "none")
    w = PrefillWorker(build(PrefillConfig, model=str(model), **kw))
    w.start()
    try:
        yield w
    finally:
        w.stop()


def prefill_and_read(w: PrefillWorker, ids: list[int], rid: str):
    """Prefill ids; returns (result, K, V) read from the pod's cache while the lease holds the blocks."""
    params, client = greedy()
    res = asyncio.run(w.prefill(rid, ids, params, client))
    k, v = cached_kv(w.engine.executor.kv_cache, res.block_table, len(ids))
    return res, k, v


def test_4096_prompt_in_chunks_of_512_equals_unchunked_and_transformers(tiny_model):
    ids = random_prompt(4096, seed=1)
    blocks = 4096 // 16 + 8
    with worker(
        tiny_model,
        prefill_chunk_size=512,
        max_num_batched_tokens=4096,
        num_kv_blocks=blocks,
        enable_prefix_caching=False,
    ) as w:
        chunked, kc, vc = prefill_and_read(w, ids, "chunked")
        assert w.stats.num_steps == 8  # 4096 / 512: really chunked
        assert w.stats.kv_held_blocks == 256 and w.stats.num_leases == 1  # KV held after the first token
        assert w.engine.num_prompt_tokens_computed == 4096
    with worker(
        tiny_model,
        prefill_chunk_size=4096,
        max_num_batched_tokens=4096,
        num_kv_blocks=blocks,
        enable_prefix_caching=False,
    ) as w:
        whole, ku, vu = prefill_and_read(w, ids, "whole")
        assert w.stats.num_steps == 1
    hf_tok, hk, hv = hf_prefill(tiny_model, ids)
    assert chunked.first_token_id == whole.first_token_id == hf_tok
    assert chunked.first_token_logprob == pytest.approx(whole.first_token_logprob, abs=1e-4)
    torch.testing.assert_close(kc, ku, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(vc, vu, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(kc, hk, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(vc, hv, atol=ATOL, rtol=1e-4)
    assert not chunked.finished and chunked.lease_id


def test_prefix_cache_hit_same_output_and_fewer_tokens_computed(tiny_model):
    shared = random_prompt(1024, seed=2)  # 64 full blocks
    a = shared + random_prompt(100, seed=3)
    b = shared + random_prompt(77, seed=4)
    with worker(tiny_model, prefill_chunk_size=256, max_num_batched_tokens=1024, num_kv_blocks=256) as w:
        ra, _, _ = prefill_and_read(w, a, "a")
        assert ra.num_cached_tokens == 0
        before = w.engine.num_prompt_tokens_computed
        rb, kb, vb = prefill_and_read(w, b, "b")
        computed_b = w.engine.num_prompt_tokens_computed - before
        hits = w.stats.prefix_hit_tokens
    assert rb.num_cached_tokens == len(shared) == hits
    assert computed_b == len(b) - len(shared)  # the shared prefix was not recomputed
    # The same prompt on a pod without the cache: same first token, same KV; and both equal transformers.
    with worker(
        tiny_model, prefill_chunk_size=256, max_num_batched_tokens=1024, num_kv_blocks=256, enable_prefix_caching=False
    ) as w:
        cold, kcold, vcold = prefill_and_read(w, b, "b")
        assert cold.num_cached_tokens == 0 and w.engine.num_prompt_tokens_computed == len(b)
    hf_tok, hk, hv = hf_prefill(tiny_model, b)
    assert rb.first_token_id == cold.first_token_id == hf_tok
    torch.testing.assert_close(kb, kcold, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(vb, vcold, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(kb, hk, atol=ATOL, rtol=1e-4)


def test_prefix_blocks_shared_while_leases_hold_them(tiny_model):
    """A held lease keeps its blocks; a second request sharing the prefix reuses them, and releasing either lease
    never frees the other's blocks."""
    shared = random_prompt(64, seed=5)
    with worker(tiny_model, prefill_chunk_size=64, max_num_batched_tokens=256, num_kv_blocks=64) as w:
        params, client = greedy()
        r1 = asyncio.run(w.prefill("1", shared + [7, 8, 9], params, client))
        r2 = asyncio.run(w.prefill("2", shared + [10, 11], params, client))
        assert r2.num_cached_tokens == 64 and r2.block_table[:4] == r1.block_table[:4]
        k_before, _ = cached_kv(w.engine.executor.kv_cache, r2.block_table, 66)
        assert asyncio.run(w.release(r1.lease_id))
        assert not asyncio.run(w.release(r1.lease_id))  # once only
        used = 64 - w.stats.free_blocks
        assert used == 5  # r2's 4 shared + 1 own block remain held
        k_after, _ = cached_kv(w.engine.executor.kv_cache, r2.block_table, 66)
        assert torch.equal(k_before, k_after)
        assert asyncio.run(w.release(r2.lease_id))
        assert w.stats.free_blocks == 64 and w.stats.num_leases == 0
