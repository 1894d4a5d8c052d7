"""Sampling: seeded runs reproduce, top-k/top-p restrict the support, stops end generation, logprobs are real."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling import Sampler, _filtered_probs
from pdserve.sampling_params import SamplingParams


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
    out = engine.generate(
        [_chat(engine, "What is the capital of France?")], SamplingParams(temperature=0, max_tokens=32, stop=[" is"])
    )[0]
    assert out["text"] == "The capital of France"
    assert out["finish_reason"].value == "stop"


def test_stop_token_id_and_max_tokens(engine):
    full = engine.generate(
        [_chat(engine, "What is the capital of France?")], SamplingParams(temperature=0, max_tokens=32)
    )[0]
    stop_tok = full["token_ids"][2]
    out = engine.generate(
        [_chat(engine, "What is the capital of France?")],
        SamplingParams(temperature=0, max_tokens=32, stop_token_ids=[stop_tok]),
    )[0]
    assert out["token_ids"] == full["token_ids"][:3] and out["finish_reason"].value == "stop"
    short = engine.generate(
        [_chat(engine, "What is the capital of France?")], SamplingParams(temperature=0, max_tokens=4)
    )[0]
    assert len(short["token_ids"]) == 4 and short["finish_reason"].value == "length"


def test_logprobs_are_log_softmax_of_chosen_tokens(engine):
    out = engine.generate([_chat(engine, "Say hi")], SamplingParams(temperature=0, max_tokens=6))[0]
    assert len(out["logprobs"]) == len(out["token_ids"])
    assert all(lp <= 0 and math.isfinite(lp) for lp in out["logprobs"])


@pytest.mark.slow
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


@pytest.mark.slow
def test_chunked_prefill_equals_unchunked(smollm2_path):
    text = " ".join(f"item {i}" for i in range(120))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLMEngine(
        EngineConfig(
            model=str(smollm2_path), prefill_chunk_size=64, max_num_batched_tokens=128, enable_prefix_caching=False
        )
    ) as eng:
        chunked = eng.generate([text], sp)[0]["token_ids"]
    with LLMEngine(EngineConfig(model=str(smollm2_path), enable_prefix_caching=False)) as eng:
        whole = eng.generate([text], sp)[0]["token_ids"]
    assert chunked == whole


# --- penalties, min_tokens, min_p, logit_bias, top logprobs (vLLM's definitions) --------------------------------


def vllm_penalties(logits, prompts, outputs, presence, frequency, repetition):
    """vLLM's apply_penalties (model_executor/layers/utils.py), written out on its own as the reference."""
    logits = logits.clone()
    n, vocab = logits.shape
    for i in range(n):
        prompt_mask = torch.zeros(vocab, dtype=torch.bool)
        prompt_mask[list(prompts[i])] = True
        counts = torch.zeros(vocab)
        for t in outputs[i]:
            counts[t] += 1
        out_mask = counts > 0
        rep = torch.where(prompt_mask | out_mask, torch.tensor(repetition[i]), torch.tensor(1.0))
        row = logits[i]
        row[row > 0] /= rep[row > 0]
        row[row <= 0] *= rep[row <= 0]
        row -= frequency[i] * counts + presence[i] * out_mask
    return logits


def test_penalties_match_vllms_definition_on_a_mixed_batch():
    g = torch.Generator().manual_seed(0)
    vocab, n = 64, 5
    logits = torch.randn(n, vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (7,), generator=g).tolist() for _ in range(n)]
    outputs = [torch.randint(0, vocab, (k,), generator=g).tolist() for k in (0, 3, 9, 1, 4)]
    pres, freq, rep = [0.5, 0.0, -1.0, 0.0, 2.0], [0.0, 1.5, 0.3, 0.0, -2.0], [1.0, 1.3, 0.7, 1.0, 2.0]
    params = [
        SamplingParams(temperature=0, presence_penalty=p, frequency_penalty=f, repetition_penalty=r)
        for p, f, r in zip(pres, freq, rep)
    ]
    rids = [f"r{i}" for i in range(n)]
    got = Sampler()._process(logits.clone(), params, rids, prompts, outputs)
    want = vllm_penalties(logits, prompts, outputs, pres, freq, rep)
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.equal(got[3], logits[3])  # the row without penalties is untouched
    toks, lps, _ = Sampler().sample(logits, params, rids, prompts, outputs)
    assert toks == want.argmax(-1).tolist()
    # logprobs stay those of the raw logits (vLLM's default logprobs mode)
    raw = torch.log_softmax(logits, -1)
    assert lps == pytest.approx([float(raw[i, t]) for i, t in enumerate(toks)], abs=1e-6)


def test_plain_batches_skip_the_logits_processing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("processed a batch that needs no processing")

    s = Sampler()
    monkeypatch.setattr(s, "_process", boom)
    logits = torch.randn(4, 32)
    toks, _, tops = s.sample(logits, [SamplingParams(temperature=0)] * 4, list("abcd"))
    assert toks == logits.argmax(-1).tolist() and tops == [None] * 4


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(3, 16)
    logits[:, 2] = 10.0  # EOS is by far the most likely
    logits[:, 5] = 9.0  # then a stop token
    s = Sampler(eos_token_ids=[2])
    params = [
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0, min_tokens=3, ignore_eos=True),
    ]
    toks, _, _ = s.sample(logits, params, ["a", "b", "c"], [[1]] * 3, [[7, 7], [7, 7, 7], [7]])
    assert toks[0] not in (2, 5)  # 2 outputs < 3: both masked
    assert toks[1] == 2  # min_tokens reached: EOS allowed again
    assert toks[2] == 2  # ignore_eos: EOS is no stop token for this row, so it is not masked
    with pytest.raises(Exception, match="min_tokens must be less than or equal to max_tokens=2, got 3."):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_logit_bias_is_added_and_clamped_like_openai():
    p = SamplingParams(temperature=0, logit_bias={3: 500.0, 4: -1.5})
    assert p.logit_bias == {3: 100.0, 4: -1.5}
    logits = torch.zeros(1, 8)
    out = Sampler()._process(logits.clone(), [p], ["a"], [[0]], [[]])
    assert out[0, 3] == 100.0 and out[0, 4] == -1.5 and out[0, 0] == 0.0
    assert Sampler().sample(logits, [p], ["a"], [[0]], [[]])[0] == [3]


def test_min_p_drops_unlikely_tokens():
    logits = torch.tensor([[2.0, 1.9, 0.0, -1.0]])
    for seed in range(30):  # min_p=1 keeps only the most likely token, whatever the draw
        p = SamplingParams(temperature=1.0, min_p=1.0, seed=seed)
        assert Sampler().sample(logits, [p], ["a"])[0] == [0]
    probs = _filtered_probs(logits[0], 0, 1.0, min_p=0.5)
    assert (probs > 0).tolist() == [True, True, False, False]


def test_top_logprobs_are_the_k_most_likely_of_the_raw_logits():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0, top_logprobs=k) for k in (0, 1, 5)]
    _, _, tops = Sampler().sample(logits, params, ["a", "b", "c"])
    raw = torch.log_softmax(logits, -1)
    assert tops[0] is None
    for row, k in ((1, 1), (2, 5)):
        ids, lps = tops[row]
        want = raw[row].topk(k)
        assert ids == want.indices.tolist() and lps == pytest.approx(want.values.tolist(), abs=1e-6)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2], got nan."),
        (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
        (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1."),
        (dict(top_logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
        (dict(logit_bias={-1: 1.0}), "logit_bias keys must be non-negative token ids"),
    ],
)
def test_out_of_range_params_are_refused_with_vllms_message(kw, msg):
    from pdserve.sampling_params import SamplingParamsError

    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kw)
    assert str(e.value) == msg


def test_extreme_penalties_keep_sampling_finite():
    logits = torch.randn(2, 32)
    params = [
        SamplingParams(temperature=0.7, repetition_penalty=1e-30, seed=1),
        SamplingParams(temperature=1.0, repetition_penalty=3e38, frequency_penalty=2.0, seed=2),
    ]
    toks, lps, _ = Sampler().sample(logits, params, ["a", "b"], [list(range(16))] * 2, [[1, 2, 3]] * 2)
    assert all(0 <= t < 32 for t in toks) and all(math.isfinite(lp) for lp in lps)


def test_engine_min_tokens_holds_stops_back(engine):
    p = _chat(engine, "What is the capital of France?")
    free = engine.generate([p], SamplingParams(temperature=0, max_tokens=40))[0]
    assert free["finish_reason"].value == "stop"
    n = len(free["token_ids"])
    out = engine.generate([p], SamplingParams(temperature=0, max_tokens=n + 5, min_tokens=n + 3))[0]
    assert len(out["token_ids"]) >= n + 3
    assert not set(out["token_ids"][: n + 2]) & engine.eos_ids  # EOS masked until min_tokens
    assert out["token_ids"][: n - 1] == free["token_ids"][: n - 1]
