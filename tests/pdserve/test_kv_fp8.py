"""fp8 KV cache (pdserve/engine/kv_quant.py): scales from the data, saturation, the per-block scale invariant, and
accuracy against the model-dtype cache on the same prompts (SmolLM2 and a tiny DeepSeek-V3): greedy tokens, the
chosen tokens' logprobs and the perplexity of a fixed text read back through the fp8 cache."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine import kv_quant
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams

FIXED_TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined movable "
    "metal type, oil-based ink and a wooden screw press into a system that could produce books far faster than "
    "scribes. Within fifty years presses operated in more than two hundred cities across Europe, and the number of "
    "books in circulation grew from thousands to millions. Scholars could compare identical copies of a text, errors "
    "were corrected in later editions, and ideas travelled between universities in weeks rather than years. The "
    "press also changed languages: printers standardised spelling so that one edition could sell in many regions."
)


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_saturates_and_round_trips(dtype):
    m = kv_quant.FP8_MAX[dtype]
    scale = torch.tensor(0.5)
    x = torch.tensor([0.0, 1.0, -3.0, m * 0.5, m * 0.5 * 4, -m * 100, float("inf")])
    q = kv_quant.quantize(x, scale, dtype)
    back = kv_quant.dequantize(q, scale, torch.float32)
    assert torch.isfinite(back).all(), "saturation must clamp, never produce inf / NaN"
    assert back[4].item() == m * 0.5 and back[5].item() == -m * 0.5 and back[6].item() == m * 0.5
    rel = 2.0**-3 if dtype == torch.float8_e4m3fn else 2.0**-2  # half an ulp of the mantissa
    assert torch.allclose(back[:4], x[:4], rtol=rel / 2 + 1e-6, atol=0)


def _quant_step(scales, slots, cu, ctx, tables, bs=4):
    return kv_quant.KVQuant.for_step(
        scales, torch.float8_e4m3fn, bs, torch.tensor(slots), cu, torch.tensor(ctx), torch.tensor(tables)
    )


def test_scales_come_from_the_data_and_later_blocks_inherit_them():
    """A fresh sequence's first block takes HEADROOM * amax / 448 per (plane, head); blocks it opens later copy it,
    and a row larger than the range saturates instead of overflowing."""
    torch.manual_seed(0)
    bs, blocks, heads, d = 4, 8, 2, 8
    kv = torch.zeros(2, blocks, bs, heads, d, dtype=torch.float8_e4m3fn)
    scales = torch.ones(1, 2, blocks, heads)
    k = torch.randn(6, heads, d)
    v = torch.randn(6, heads, d) * 10
    k[:, 1] *= 100  # heads of different magnitude get different scales
    # one 6-token prompt in blocks 5 and 2 (slots 20..23, 8..9)
    q = _quant_step(scales, [20, 21, 22, 23, 8, 9], [0, 6], [6], [[5, 2]])
    kv_quant.write_kv_fp8(kv, 0, k, v, torch.tensor([20, 21, 22, 23, 8, 9]), q)
    want_k = k.abs().amax(dim=(0, 2)) * kv_quant.HEADROOM / 448.0
    want_v = v.abs().amax(dim=(0, 2)) * kv_quant.HEADROOM / 448.0
    assert torch.allclose(scales[0, 0, 5], want_k) and torch.allclose(scales[0, 1, 5], want_v)
    assert torch.equal(scales[0, :, 2], scales[0, :, 5]), "a sequence's later block copies its first block's scale"
    back = kv_quant.gather_gqa(kv[0], scales[0, 0], torch.tensor([20, 21, 22, 23, 8, 9]), torch.float32)
    assert (back - k).abs().max() <= (k.abs().amax() * 2.0**-4).item()
    # a decode token 10x the prompt's largest K of head 0 opens block 7: same scale, saturated value
    big = torch.full((1, heads, d), 10.0) * k[:, 0].abs().max()
    q2 = _quant_step(scales, [28], [0, 1], [7], [[5, 2, 7]])
    assert q2.fresh == [], "a sequence with KV here already is not fresh"
    kv_quant.write_kv_fp8(kv, 0, big, big, torch.tensor([28]), q2)
    assert torch.equal(scales[0, :, 7], scales[0, :, 5])
    got = kv_quant.gather_gqa(kv[0], scales[0, 0], torch.tensor([28]), torch.float32)
    assert torch.isfinite(got).all()
    assert torch.allclose(got[0, 0], torch.full((d,), 448.0) * scales[0, 0, 5, 0])


def test_mla_latent_and_rope_part_are_scaled_apart():
    bs, blocks, rank, rope = 4, 4, 12, 4
    lat = torch.zeros(blocks, bs, rank + rope, dtype=torch.float8_e5m2)
    scales = torch.ones(1, 1, blocks, 2)
    rows = torch.randn(3, rank + rope)
    rows[:, rank:] *= 50
    q = kv_quant.KVQuant.for_step(
        scales, torch.float8_e5m2, bs, torch.tensor([4, 5, 6]), [0, 3], torch.tensor([3]), torch.tensor([[1]])
    )
    kv_quant.write_latent_fp8(lat, 0, rows, torch.tensor([4, 5, 6]), q, rank)
    s = scales[0, 0, 1]
    assert math.isclose(s[0].item(), rows[:, :rank].abs().max().item() * 2 / 57344.0, rel_tol=1e-6)
    assert math.isclose(s[1].item(), rows[:, rank:].abs().max().item() * 2 / 57344.0, rel_tol=1e-6)
    back = kv_quant.gather_latent(lat, scales[0], torch.tensor([4, 5, 6]), rank, torch.float32)
    assert torch.allclose(back, rows, rtol=2.0**-3, atol=0)


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def kv_dtype_accuracy(
    model: str, prompts: list[list[int]], max_tokens: int, kv_cache_dtype: str, text: list[int], **cfg
) -> dict[str, float]:
    """The fp8 cache against the model-dtype cache on the same prompts, one engine each: the share of prompts whose
    first 32 greedy tokens agree, the mean |logprob difference| of the chosen tokens up to the first divergence,
    and the perplexity of ``text`` read back in 16-token chunks (each chunk attends the earlier ones from the
    cache)."""
    runs = {}
    for kv in ("auto", kv_cache_dtype):
        conf = EngineConfig(model=model, kv_cache_dtype=kv, max_model_len=1024, **cfg)
        with LLMEngine(conf) as eng:
            gen = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        # a separate engine with 16-token chunks for the text, so its later chunks read the cache
        chunked = EngineConfig(
            model=model, kv_cache_dtype=kv, max_model_len=1024, prefill_chunk_size=16, max_num_batched_tokens=16
        )
        with LLMEngine(chunked) as eng:
            plp = eng.generate([text], SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=0)
        lps = [p[0] for p in plp[0]["prompt_logprobs"] if p is not None]
        runs[kv] = (gen, math.exp(-sum(lps) / len(lps)))
    (base, ppl_base), (test, ppl_test) = runs["auto"], runs[kv_cache_dtype]
    same32, deltas = 0, []
    for a, b in zip(base, test):
        ta, tb = a["token_ids"], b["token_ids"]
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        same32 += n >= min(32, len(ta))
        # a token's logprob counts until the first divergence (it is the chosen token on both sides)
        deltas += [abs(x - y) for x, y in zip(a["logprobs"][: n + 1], b["logprobs"][: n + 1])]
    return {
        "same_first32": same32 / len(prompts),
        "mean_abs_logprob_delta": sum(deltas) / len(deltas),
        "ppl_base": ppl_base,
        "ppl_fp8": ppl_test,
    }


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(100, vocab, (int(torch.randint(8, 48, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


TOPICS = ["the ocean", "a city at night", "bread", "volcanoes", "chess", "the moon", "honeybees", "winter"]
TEMPLATES = [
    "Write a short paragraph about {}.",
    "Explain to a child how {} works.",
    "List three facts about {}:",
    "Here is a poem about {}:",
    "What is the most surprising thing about {}?",
    "Describe {} in the style of a news report.",
    "Give a step-by-step guide related to {}.",
    "Summarize the history of {} in a few sentences.",
]


def english_prompts(tokenizer, n: int) -> list[list[int]]:
    """n natural-language prompts (a greedy continuation of random ids is mostly near-ties, English is not)."""
    texts = [t.format(topic) for t in TEMPLATES for topic in TOPICS]
    return [tokenizer.encode(x) for x in texts[:n]]


@pytest.mark.slow
def test_smollm2_fp8_matches_the_model_dtype_cache(smollm2_path):
    from pdserve.tokenizer import Tokenizer

    tok = Tokenizer(str(smollm2_path))
    text = tok.encode(FIXED_TEXT)
    # 16 prompts x 40 tokens keeps the suite's time; the 64 x 64 figures are in docs/DESIGN.md
    got = kv_dtype_accuracy(str(smollm2_path), english_prompts(tok, 16), 40, "fp8", text, num_kv_blocks=256)
    # greedy agreement is reported, not held: e4m3's 3 mantissa bits move SmolLM2's chosen-token logprobs by ~0.045
    # on average, enough to flip near ties within 32 tokens (docs/DESIGN.md, "fp8 KV cache": measured figures)
    print("smollm2 fp8_e4m3:", got)
    assert got["mean_abs_logprob_delta"] <= 0.05, got
    assert abs(got["ppl_fp8"] / got["ppl_base"] - 1) <= 0.02, got


def test_tiny_deepseek_v3_fp8_latent_matches_the_model_dtype_cache(tiny_factory):
    """A random-weight model's greedy choices are near ties (top-2 gaps of ~0.02 nats, below fp8's rounding of the
    latent), so its tokens diverge early by chance; what is held here is what the latent's fp8 rounding does to
    the distribution: the chosen tokens' logprobs and the perplexity of a fixed sequence."""
    path = tiny_factory("deepseek_v3", num_heads=4)
    text = [(i * 37 + 11) % 250 + 3 for i in range(160)]
    got = kv_dtype_accuracy(str(path), _prompts(32, 256), 32, "fp8", text, num_kv_blocks=256)
    print("tiny deepseek-v3 fp8_e4m3:", got)
    assert got["mean_abs_logprob_delta"] <= 0.1, got
    assert abs(got["ppl_fp8"] / got["ppl_base"] - 1) <= 0.02, got
