"""A bfloat16 checkpoint end to end through kv_transfer: both pods follow its dtype (EngineConfig.dtype "auto"), the
prefill pod publishes bf16 KV, a decode engine pulls those bytes into its bf16 cache over TCP and continues; the tokens
equal one bf16 engine generating alone. A pod whose KV dtype differs is refused, naming both dtypes and the flag."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from prefill_ref import greedy, random_prompt

from kv_transfer.factory import make_puller
from kv_transfer.layout import KVLayout
from pdserve.cli_config import build
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams
from prefill_svc.config import PrefillConfig
from prefill_svc.worker import PrefillWorker

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory, smollm2):
    from pdserve.testing import write_tiny_checkpoint

    path = write_tiny_checkpoint(tmp_path_factory.mktemp("prefill-tiny-bf16"), "llama", tokenizer_from=smollm2, seed=5)
    cfg_file = path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = "bfloat16"  # weights stay fp32 on disk: loading rounds them, as for any bf16 run
    cfg_file.write_text(json.dumps(cfg, indent=2))
    return path


def test_bf16_prefill_then_decode_identical_to_one_engine(tiny_bf16):
    ids = random_prompt(300, seed=17)
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(tiny_bf16), num_kv_blocks=64)) as alone:
        assert alone.dtype == "bfloat16"
        want = alone.generate([ids], sp)[0]["token_ids"]
    w = PrefillWorker(
        build(
            PrefillConfig,
            model=str(tiny_bf16),
            kv_transport="tcp",
            prefill_chunk_size=128,
            max_num_batched_tokens=512,
            num_kv_blocks=64,
        )
    )
    w.start()
    try:
        assert w.layout.dtype == "bfloat16" and w.engine.executor.kv_cache.dtype == torch.bfloat16
        params, client = greedy()
        res = asyncio.run(w.prefill("r", ids, params, client))
        h = res.handoff
        assert h is not None and h.layout.dtype == "bfloat16"
        with LLMEngine(EngineConfig(model=str(tiny_bf16), num_kv_blocks=64)) as dec:
            cache = dec.executor.kv_cache
            assert cache.dtype == torch.bfloat16
            mc = dec.model_config
            dst = KVLayout(
                num_layers=mc.num_layers,
                num_kv_heads=mc.num_kv_heads,
                head_dim=mc.head_dim,
                dtype=str(cache.dtype),
                block_size=dec.config.block_size,
                num_blocks=cache.shape[2],
            )
            assert dst.same_model(h.layout) and dst.token_nbytes == mc.num_kv_heads * mc.head_dim * 2
            seq = dec.add_awaiting_kv(ids, sp, "r")
            assert seq is not None
            with make_puller(dst, 0, cache, backend="tcp") as puller:
                puller.pull(h, seq.block_tables[0])
            got = list(dec.start_decoding(seq, res.first_token_id, res.first_token_logprob).new_token_ids)
            while dec.has_unfinished():
                for o in dec.step():
                    got += o.new_token_ids
    finally:
        w.stop()
    assert got == want
