"""The engine in bfloat16 against HF transformers in bfloat16 on the same weights (SmolLM2, rounded to bf16 alike).

Logit tolerance. bf16 keeps 8 significant bits: unit roundoff u = 2^-8. Each of the 2L residual sub-blocks (attention
and MLP of L layers) adds its bf16-rounded output to the residual stream, so the final hidden state carries a relative
error of about sqrt(2L) * u as a random walk; the LM head turns that into a logit error of about sqrt(2L) * u * sigma,
sigma the spread (std) of the logits. Over N = positions * vocab logits the largest of those Gaussian-like errors is
sqrt(2 ln N) of them. One bf16 computation therefore sits within e1 = sqrt(2 ln N) * sqrt(2L) * u * sigma of the exact
logits, and two independent ones within sqrt(2) * e1 of each other: the tolerance. Empirical check (also asserted):
transformers bf16 vs transformers fp32 is one bf16 computation against (nearly) exact, and lands at ~1.0 e1 (SmolLM2:
max 1.3 on logits of std 8 and magnitude ~38, e1 ~1.3). Under exact_prefill the engine's bf16 prefill logits are
bit-identical to transformers' (the same GEMMs); by default its linears run on packed weights (on a CPU without bf16
kernels, fp32 copies that bf16 rows are upcast to), which round differently but stay inside the bound, and a
position's argmax may then differ only where transformers' own top two are within it (a near tie).

Greedy tokens. bf16 logits near 16-32 are spaced 0.125 apart, so the top two candidates of a step often tie or sit
one or two quanta apart; any reordering of the sums (a decode step over the cache vs one whole forward, as transformers
itself shows: its own cached decode differs from its full forward by up to 0.3) then picks the other one and the
sequences part. So the test asserts, per prompt: identical tokens up to the first divergence, and at that step the two
choices are a near-tie under transformers' own logits (within the tolerance above); and identical first 16 tokens on
the prompts measured to have no near-tie that early. Measured agreement over 64 tokens (engine vs transformers bf16,
tokens before the first divergence): 19, 50, 1, 6 for the four prompts below (printed by the test with -s)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams
from tests.pdserve.test_model_reference import full_logits

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # slow: SmolLM2 in bf16 against transformers, minutes

U = 2.0**-8  # bf16 unit roundoff (8 significant bits)
TEXTS = [
    "What is the capital of France?",
    "Explain gravity to a child.",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
]
FIRST16 = TEXTS[:2]  # no near-tie in their first 16 steps (measured)
NEW_TOKENS = 64


def one_side_bound(logits_fp32: torch.Tensor, num_layers: int) -> float:
    """e1 of the module docstring: the largest logit error of one bf16 forward."""
    n = logits_fp32.numel()
    return math.sqrt(2 * math.log(n)) * math.sqrt(2 * num_layers) * U * logits_fp32.std().item()


def _hf(path, dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def _prompts(path) -> list[list[int]]:
    from pdserve.tokenizer import Tokenizer

    tok = Tokenizer(path)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in TEXTS]


@pytest.fixture(scope="module")
def hf_bf16(smollm2_path):
    return _hf(smollm2_path, torch.bfloat16)


def test_bf16_prefill_logits_within_rounding_of_transformers(smollm2_path, hf_bf16):
    hf32 = _hf(smollm2_path, torch.float32)
    layers = hf32.config.num_hidden_layers
    for prompt in _prompts(smollm2_path):
        with torch.no_grad():
            want = hf_bf16(torch.tensor([prompt])).logits[0].float()
            exact = hf32(torch.tensor([prompt])).logits[0].float()
        e1 = one_side_bound(exact, layers)
        # The error model predicts real bf16 rounding: transformers' own bf16 vs fp32 gap is of the order of e1.
        assert (want - exact).abs().max().item() <= 2 * e1
        assert torch.equal(full_logits(smollm2_path, prompt, dtype=torch.bfloat16, exact_prefill=True), want)
        got = full_logits(smollm2_path, prompt, dtype=torch.bfloat16)
        diff = (got - want).abs().max().item()
        assert diff <= math.sqrt(2) * e1, f"max |logit diff| {diff} > {math.sqrt(2) * e1}"
        ours, theirs = got.argmax(-1), want.argmax(-1)
        rows = torch.arange(len(ours))
        gap = want[rows, theirs] - want[rows, ours]  # 0 where the choices agree
        assert gap.max().item() <= math.sqrt(2) * e1, f"argmax differs beyond a near tie: gap {gap.max().item()}"


def _hf_generate(model, prompt: list[int], n: int) -> list[int]:
    g = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return g[0, len(prompt) :].tolist()


def test_bf16_greedy_agrees_with_transformers_up_to_near_ties(smollm2_path, hf_bf16):
    hf32 = _hf(smollm2_path, torch.float32)
    prompts = _prompts(smollm2_path)
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(smollm2_path), dtype="bfloat16")) as eng:
        assert eng.executor.kv_cache.dtype == torch.bfloat16
        ours = [eng.generate([p], sp)[0]["token_ids"] for p in prompts]
    agreement = {}
    for text, prompt, got in zip(TEXTS, prompts, ours):
        want = _hf_generate(hf_bf16, prompt, NEW_TOKENS)
        same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), NEW_TOKENS)
        agreement[text] = same
        if text in FIRST16:
            assert same >= 16, f"{text!r}: tokens differ at {same}"
        if same < NEW_TOKENS:  # the step where they part must be a near-tie for transformers itself
            ctx = prompt + want[:same]
            with torch.no_grad():
                logits = hf_bf16(torch.tensor([ctx])).logits[0, -1].float()
                exact = hf32(torch.tensor([ctx])).logits[0].float()
            tol = math.sqrt(2) * one_side_bound(exact, hf32.config.num_hidden_layers)
            gap = (logits[want[same]] - logits[got[same]]).abs().item()
            assert gap <= tol, f"{text!r}: parted at {same} on a logit gap of {gap} (> {tol}): not a near-tie"
    print(f"bf16 greedy agreement over {NEW_TOKENS} tokens (tokens before the first divergence): {agreement}")


def test_dtype_auto_follows_the_checkpoint_and_bad_names_are_refused(smollm2_path):
    from pdserve.engine.llm_engine import resolve_dtype
    from pdserve.model.config import ModelConfig

    mc = ModelConfig.from_path(smollm2_path)
    raw = dict(mc.raw)
    for key, name, want in (
        ("dtype", "bfloat16", "bfloat16"),
        ("torch_dtype", "float16", "float16"),
        ("dtype", None, "float32"),
    ):
        raw.pop("dtype", None)
        raw.pop("torch_dtype", None)
        if name is not None:
            raw[key] = name
        assert resolve_dtype("auto", ModelConfig.from_dict(raw)) == want
        assert resolve_dtype("float32", ModelConfig.from_dict(raw)) == "float32"
    with pytest.raises(ValueError, match="EngineConfig.dtype must be one of auto, float32, bfloat16, float16"):
        EngineConfig(dtype="bf16")
