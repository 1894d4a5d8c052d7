"""A TP=2 prefill pod: both ranks publish their half of the kv heads layer by layer; a decode rank (TP 1) pulls from
both endpoints and gets transformers' KV; the blocks go back only once both ranks' publishers let go."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from prefill_ref import cached_kv, greedy, hf_prefill, random_prompt

from kv_transfer.factory import make_puller
from kv_transfer.layout import KVLayout
from pdserve.cli_config import build
from prefill_svc.config import PrefillConfig
from prefill_svc.worker import PrefillWorker

pytestmark = pytest.mark.slow  # spawns a rank process


def _wait(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_tp2_prefill_publishes_both_ranks_and_frees_after_both(tiny_model):
    ids = random_prompt(700, seed=41)
    w = PrefillWorker(
        build(
            PrefillConfig,
            model=str(tiny_model),
            tensor_parallel_size=2,
            kv_transport="tcp",
            prefill_chunk_size=256,
            max_num_batched_tokens=512,
            num_kv_blocks=128,
        )
    )
    w.start()
    try:
        params, client = greedy()
        res = asyncio.run(w.prefill("tp", ids, params, client))
        h = res.handoff
        assert len(h.endpoints) == 2 and h.endpoints[0] != h.endpoints[1] and h.layout.tp_size == 2
        assert h.block_tables[0] == h.block_tables[1] == res.block_table
        hf_tok, hk, hv = hf_prefill(tiny_model, ids)
        assert res.first_token_id == hf_tok

        dst = KVLayout(
            num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", block_size=16, tp_size=1, num_blocks=60
        )
        region = torch.full(dst.region_shape(), float("nan"))
        table = list(range(10, 10 + 44))
        with make_puller(dst, 0, region, backend="tcp") as puller:
            puller.pull(h, table)
        k, v = cached_kv(region, table, len(ids))
        torch.testing.assert_close(k, hk, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v, hv, atol=2e-4, rtol=1e-4)
        _wait(lambda: w.stats.num_leases == 0)  # both ranks freed (rank 1 seen by polling)
        assert w.stats.free_blocks == 128 and w.stats.leases_freed == {"done": 1}

        # ReleaseKV path: abort on both ranks, blocks back once both let go
        res2 = asyncio.run(w.prefill("tp2", ids[:300], params, client))
        assert res2.num_cached_tokens == 288  # prefix cache works under TP too
        assert asyncio.run(w.release(res2.lease_id))
        _wait(lambda: w.stats.num_leases == 0 and w.stats.free_blocks == 128)
    finally:
        w.stop()
