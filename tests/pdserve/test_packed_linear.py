"""The oneDNN-prepacked linear (pdserve/model/linear.py): F.linear's result up to fp32 rounding at decode and prefill
row counts, exactly F.linear without a packed weight, and engaged by the CPU model runner in both phases unless
exact_prefill keeps prefill on F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.model_runner import ModelRunner
from pdserve.model import linear as plinear
from pdserve.model.config import ModelConfig
from pdserve.model.parallel_state import ParallelState


@pytest.mark.parametrize("rows", [1, 3, 8, 32, 128, 777])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows, with_bias):
    """Packed weights give F.linear's answer (fp32 rounding only) for decode batches and prefill chunks, bias
    included, though the weight was packed for a batch of 8."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 576, generator=g)
    b = torch.randn(300, generator=g) if with_bias else None
    x = torch.randn(rows, 576, generator=g)
    packed = plinear.pack(w)
    assert packed is not None, "oneDNN packing is available in the CPU torch build this project pins"
    got = plinear.linear(x, w, packed, b)
    assert got.shape == (rows, 300)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_without_packed_weight_is_f_linear():
    """No packed weight (exact_prefill, or a runtime that cannot pack): bit-identical to F.linear."""
    w, x, b = torch.randn(64, 96), torch.randn(200, 96), torch.randn(64)
    assert torch.equal(plinear.linear(x, w, None, b), F.linear(x, w, b))


@pytest.mark.parametrize("rows", [1, 2, 9, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_weights_pack_on_every_cpu(rows, with_bias):
    """A bf16 weight is packed everywhere: in bf16 where oneDNN has bf16 kernels (AVX512_BF16, AMX), else as fp32
    that bf16 rows are upcast to (exact), one row excepted (it stays on the bf16 weight). Either way the product is
    a bf16 GEMM's: F.linear's on the same bf16 values with fp32 accumulation, rounded to bf16, and bf16 comes out."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(64, 96, generator=g).to(torch.bfloat16)
    b = torch.randn(64, generator=g).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    packed = plinear.pack(w)
    assert packed is not None
    native = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert packed.dtype == (torch.bfloat16 if native else torch.float32)
    got = plinear.linear(x, w, packed, b)
    assert got.dtype == torch.bfloat16
    exact = F.linear(x.float(), w.float(), None if b is None else b.float())
    # one bf16 rounding of the output (2^-8 relative) and of the bias-free sum's order
    torch.testing.assert_close(got.float(), exact, rtol=2**-7, atol=2e-2)
    if not native and rows > 1:  # the fp32 packed product of the upcast values, rounded once to bf16
        fp32 = plinear.linear(x.float(), w.float(), plinear.pack(w.float()), None if b is None else b.float())
        assert torch.equal(got, fp32.to(torch.bfloat16))


def test_cpu_runner_packs_every_linear(tiny_factory):
    """A CPU ModelRunner prepacks all five weight matrices of every layer and the LM head, so decode uses them."""
    path = tiny_factory("llama", num_heads=4, num_kv_heads=2)
    runner = ModelRunner(str(path), ModelConfig.from_path(path), ParallelState(), TorchAttentionBackend(), 8, 16, 256)
    m = runner.model
    assert m.lm_head_packed is not None
    for layer in m.layers:
        a, mlp = layer.self_attn, layer.mlp
        assert all(t is not None for t in (a.qkv_packed, a.o_packed, mlp.gate_up_packed, mlp.down_packed))


@pytest.mark.parametrize("exact_prefill", [False, True])
def test_prefill_takes_packed_weights_unless_exact(tiny_factory, monkeypatch, exact_prefill):
    """A prefill step multiplies by the packed weights by default, and only by the stored ones under exact_prefill."""
    from tests.pdserve.test_model_reference import full_logits

    used: list[bool] = []
    real = plinear.linear

    def spy(x, weight, packed, bias=None):
        used.append(packed is not None)
        return real(x, weight, packed, bias)

    monkeypatch.setattr(plinear, "linear", spy)
    path = tiny_factory("llama", num_heads=4, num_kv_heads=2)
    full_logits(path, list(range(3, 60)), exact_prefill=exact_prefill)
    assert used and set(used) == {not exact_prefill}
