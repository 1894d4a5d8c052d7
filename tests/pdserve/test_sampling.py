"""Sampling: seeded runs reproduce, top-k/top-p restrict the support, stops end generation, logprobs are real."""
from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling import Sampler, SamplingParams, _filtered_probs


def test_top_k_and_top_p_restrict_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])
    assert (_filtered_probs(logits, 2, 1.0) > 0).sum() == 2
    p = torch.softmax(logits, 0)
    # top_p just above the first token's mass keeps exactly two tokens
    kept = _filtered_probs(logits, 0, float(p[0]) + 1e-3)
    assert (kept > 0).sum() == 2 and math.isclose(float(kept.sum()), 1.0, rel_tol=1e-6)


def test_seeded_sampling_reproduces_and_differs_by_seed():
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(0))
    def draw(seed):
        s = Sampler()
        return [s.sample(logits, [SamplingParams(temperature=1.0, seed=seed)], ["a"])[0][0] for _ in range(20)]
    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


@pytest.fixture(scope="module")
def engine(smollm2_path):
    eng = LLMEngine(EngineConfig(model=str(smollm2_path), num_kv_blocks=256))
    yield eng
    eng.shutdown()


def _chat(engine, text):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def test_stop_string_truncates_text_and_finishes(engine):
    out = engine.generate([_chat(engine, "What is the capital of France?")],
                          SamplingParams(temperature=0, max_tokens=32, stop=[" is"]))[0]
    assert out["text"] == "The capital of France"
    assert out["finish_reason"].value == "stop"


def test_stop_token_id_and_max_tokens(engine):
    full = engine.generate([_chat(engine, "What is the capital of France?")],
                           SamplingParams(temperature=0, max_tokens=32))[0]
    stop_tok = full["token_ids"][2]
    out = engine.generate([_chat(engine, "What is the capital of France?")],
                          SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_tok]))[0]
    assert out["token_ids"] == full["token_ids"][:3] and out["finish_reason"].value == "stop"
    short = engine.generate([_chat(engine, "What is the capital of France?")],
                            SamplingParams(temperature=0, max_tokens=4))[0]
    assert len(short["token_ids"]) == 4 and short["finish_reason"].value == "length"


def test_logprobs_are_log_softmax_of_chosen_tokens(engine):
    out = engine.generate([_chat(engine, "Say hi")], SamplingParams(temperature=0, max_tokens=6))[0]
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert all(lp <= 0 and math.isfinite(lp) for lp in out["logprobs"])


def test_seeded_generation_reproduces_through_the_engine(engine):
    p = _chat(engine, "Tell me a story.")
    a = engine.generate([p], SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=123, max_tokens=12))[0]
    b = engine.generate([p], SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=123, max_tokens=12))[0]
    assert a["token_ids"] == b["token_ids"]
    assert engine.blocks.num_free() == 256


def test_prefix_cache_hit_gives_identical_output_and_skips_compute(engine):
    p = _chat(engine, "Explain what a prime number is, in one short sentence, for a child.")
    sp = SamplingParams(temperature=0, max_tokens=8)
    first = engine.generate([p], sp)[0]
    before = engine.num_prompt_tokens_computed
    second = engine.generate([p], sp)[0]
    computed = engine.num_prompt_tokens_computed - before
    assert second["token_ids"] == first["token_ids"]
    assert second["cached_tokens"] > 0
    assert computed == len(engine.tokenizer.encode(p)) - second["cached_tokens"]


def test_chunked_prefill_equals_unchunked(smollm2_path):
    text = " ".join(f"item {i}" for i in range(120))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(smollm2_path), prefill_chunk_size=64, max_num_batched_tokens=128,
                                enable_prefix_caching=False)) as eng:
        chunked = eng.generate([text], sp)[0]["token_ids"]
    with LLMEngine(EngineConfig(model=str(smollm2_path), enable_prefix_caching=False)) as eng:
        whole = eng.generate([text], sp)[0]["token_ids"]
    assert chunked == whole
