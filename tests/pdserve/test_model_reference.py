"""The engine's model against HF transformers on the same weights, for SmolLM2 and tiny random checkpoints of each
supported family: greedy generation token-identical; fp32 prefill logits bit-identical under exact_prefill (F.linear,
as transformers computes them) and within rounding (LOGIT_ATOL) on the default oneDNN-packed weights."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import hf_greedy

from pdserve.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.engine.model_runner import ModelRunner, StepInput
from pdserve.model.config import ModelConfig
from pdserve.model.parallel_state import ParallelState
from pdserve.sampling_params import SamplingParams

TINY_SHAPES = {
    "llama-gqa": ("llama", dict(num_heads=8, num_kv_heads=2)),
    "llama-mqa-tied": ("llama", dict(num_heads=4, num_kv_heads=1, tie_word_embeddings=True)),
    "llama-mha-bias": ("llama", dict(num_heads=4, num_kv_heads=4, attention_bias=True, mlp_bias=True)),
    "llama3-rope": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        ),
    ),
    "llama-linear-rope": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "llama-yarn-rope": (
        "llama",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}),
    ),
    "mistral-window": ("mistral", dict(num_heads=8, num_kv_heads=2, sliding_window=16)),
    "qwen2-bias": ("qwen2", dict(num_heads=8, num_kv_heads=2)),
}


# The packed kernel sums each dot product in another order than MKL: measured up to 1.2e-4 on SmolLM2's logits (which
# reach ~40), so twice that is rounding, while a wrong weight, mask or position moves logits by far more.
LOGIT_ATOL = 2.5e-4


def full_logits(
    model_path, prompt: list[int], exact_prefill: bool = False, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Logits for every prompt position from one prefill through the paged cache."""
    cfg = ModelConfig.from_path(model_path)
    bs = 16
    nblk = (len(prompt) + bs - 1) // bs
    runner = ModelRunner(
        str(model_path),
        cfg,
        ParallelState(),
        TorchAttentionBackend(),
        nblk + 1,
        bs,
        4096,
        dtype=dtype,
        exact_prefill=exact_prefill,
    )
    table = torch.arange(1, nblk + 1)  # skip block 0 so a wrong table would show
    slots = table.repeat_interleave(bs) * bs + torch.arange(bs).repeat(nblk)
    n = len(prompt)
    step = StepInput(
        True,
        torch.tensor(prompt),
        torch.arange(n),
        [0, n],
        [0],
        torch.arange(n),
        [0],
        [slots[:n]],
        [torch.tensor([n])],
        [table.unsqueeze(0)],
    )
    return runner.execute(step)


def hf_logits(model_path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float()


PROMPTS = [[5, 17, 33, 2 + 40, 99, 7, 8, 100, 31, 64, 12, 3, 250, 18, 19, 20, 21, 22, 1, 9], list(range(30, 67)), [11]]


@pytest.mark.parametrize("name", list(TINY_SHAPES))
def test_tiny_prefill_logits_match_transformers(tiny_factory, name):
    family, shape = TINY_SHAPES[name]
    path = tiny_factory(family, **shape)
    prompt = [(i * 37 + 11) % 256 for i in range(40)]  # longer than the mistral window
    want = hf_logits(path, prompt)
    diff = (full_logits(path, prompt) - want).abs().max().item()
    assert diff <= LOGIT_ATOL, f"{name}: max |logit diff| {diff}"
    assert torch.equal(full_logits(path, prompt, exact_prefill=True), want), f"{name}: exact_prefill not exact"


@pytest.mark.parametrize("name", list(TINY_SHAPES))
def test_tiny_greedy_batch_matches_transformers(tiny_factory, name):
    family, shape = TINY_SHAPES[name]
    path = tiny_factory(family, **shape)
    want = hf_greedy(path, PROMPTS, 32)
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=128)) as eng:
        alone = [
            eng.generate([p], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]["token_ids"]
            for p in PROMPTS
        ]
        batch = [
            r["token_ids"] for r in eng.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        ]
        assert eng.blocks.num_free() == 128
    assert alone == want
    assert batch == want


@pytest.mark.slow
def test_smollm2_prefill_logits_match_transformers(smollm2_path):
    from pdserve.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_path)
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    want = hf_logits(smollm2_path, prompt)
    got = full_logits(smollm2_path, prompt)
    assert (got - want).abs().max().item() <= LOGIT_ATOL
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    exact = full_logits(smollm2_path, prompt, exact_prefill=True)
    assert torch.equal(exact, want), (exact - want).abs().max().item()


@pytest.mark.slow
def test_smollm2_greedy_single_and_batch_match_transformers(smollm2_path):
    with LLMEngine(EngineConfig(model=str(smollm2_path))) as eng:
        tok = eng.tokenizer
        texts = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]
        want = hf_greedy(smollm2_path, prompts, 32)
        sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        single = eng.generate([prompts[0]], sp)[0]["token_ids"]
        batch = [r["token_ids"] for r in eng.generate(prompts, sp)]
    assert single == want[0]
    assert batch == want


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2_path):
    with LLMEngine(EngineConfig(model=str(smollm2_path))) as eng:
        prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=32))[0]
    assert "Paris" in out["text"]
    assert out["finish_reason"].value == "stop"
