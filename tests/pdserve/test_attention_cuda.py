"""The torch attention backend off CPU, the engine's attention on CUDA when flashinfer is absent: select_backend falls
back to it on CUDA; its non-CPU path returns the interface's shapes (LSE unpadded, GQA heads expanded); and, on a
CUDA machine, it matches its CPU path (GQA and MLA, masks, empty shards) and the engine matches transformers there."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import pytest
import torch

from pdserve.attention import select_backend
from pdserve.attention.torch_backend import attend
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams

REPO = Path(__file__).resolve().parents[2]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _flashinfer_importable() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def _gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(_flashinfer_importable(), reason="flashinfer is installed here")
def test_cuda_without_flashinfer_selects_the_torch_backend_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="pdserve.attention"):
        backend = select_backend("cuda")
    assert backend.name == "torch"
    text = caplog.text
    assert "flashinfer requested but not usable" in text and "attention backend: torch on cuda" in text


@pytest.mark.parametrize("keys", [40, 48])
@pytest.mark.parametrize("masked", [False, True])
def test_non_cpu_path_returns_unpadded_lse_for_every_query_head(keys, masked):
    """On the meta device (shapes only): the efficient kernel pads LSE rows to 32, wants equal head counts and a
    bias at an aligned row stride (40 keys need padding, 48 do not)."""
    q = torch.empty(2, 9, 5, 64, device="meta")
    k = torch.empty(2, 3, keys, 64, device="meta")
    mask = torch.empty(2, 1, 5, keys, device="meta") if masked else None
    out, lse = attend(q, k, k, not masked, 0.125, mask)
    assert out.shape == (2, 9, 5, 64) and lse.shape == (2, 9, 5) and lse.dtype == torch.float32


@cuda
def test_torch_backend_on_cuda_matches_its_cpu_path(tmp_path):
    mod = _gpu_check()
    figures = mod.check_attention_torch_cuda(mod.Ctx(tmp_path, False, tmp_path))
    assert figures["worst"]["float32"] <= 1e-3


@cuda
@pytest.mark.parametrize(
    "family,shape", [("llama", dict(num_heads=8, num_kv_heads=2)), ("deepseek_v3", dict(num_heads=4))]
)
def test_engine_on_cuda_with_torch_attention_matches_transformers(tiny_factory, family, shape):
    from transformers import AutoModelForCausalLM

    path = tiny_factory(family, **shape)
    prompts = [[(i * 37 + 11) % 256 for i in range(40)], [(i * 11 + 3) % 256 for i in range(23)]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cfg = EngineConfig(model=str(path), device="cuda", block_size=4, num_kv_blocks=128, attention_backend="torch")
    with LLMEngine(cfg) as eng:
        got = [r["token_ids"] for r in eng.generate(prompts, sp)]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to("cuda")
    want = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        g = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=24,
            min_new_tokens=24,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        want.append(g[0, len(p) :].tolist())
    assert got == want


def test_non_cpu_path_keeps_the_value_width_when_it_pads_unaligned_heads():
    """bf16 K as a strided view (MLA's expansion) and a 12-wide V: aligned for the kernel, V's padding sliced off."""
    q = torch.empty(1, 4, 5, 24, device="meta", dtype=torch.bfloat16)
    kv = torch.empty(40, 4, 36, device="meta", dtype=torch.bfloat16)
    k, v = (x.transpose(0, 1).unsqueeze(0) for x in (kv[..., :24], kv[..., 24:]))
    out, lse = attend(q, k, v, True, 0.125)
    assert out.shape == (1, 4, 5, 12) and out.dtype == torch.bfloat16 and lse.shape == (1, 4, 5)
