"""The oneDNN-prepacked decode linear (pdserve/model/linear.py): same result as F.linear at decode batch sizes,
exactly F.linear above PACKED_MAX_ROWS, and actually engaged by the CPU model runner."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.attention.torch_backend import TorchAttentionBackend
from pdserve.engine.model_runner import ModelRunner
from pdserve.model import linear as plinear
from pdserve.model.config import ModelConfig
from pdserve.model.parallel_state import ParallelState


@pytest.mark.parametrize("rows", [1, 3, 8, plinear.PACKED_MAX_ROWS])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear_at_decode_sizes(rows, with_bias):
    """Packed weights give F.linear's answer (fp32 rounding only) for every decode-sized batch, bias included."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 576, generator=g)
    b = torch.randn(300, generator=g) if with_bias else None
    x = torch.randn(rows, 576, generator=g)
    packed = plinear.pack(w)
    assert packed is not None, "oneDNN packing is available in the CPU torch build this project pins"
    got = plinear.linear(x, w, packed, b)
    assert got.shape == (rows, 300)
    torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


def test_prefill_sized_inputs_take_f_linear():
    """Above PACKED_MAX_ROWS the result is bit-identical to F.linear (prefill keeps MKL's compute-bound path)."""
    w, x = torch.randn(64, 96), torch.randn(plinear.PACKED_MAX_ROWS + 1, 96)
    assert torch.equal(plinear.linear(x, w, plinear.pack(w)), F.linear(x, w))


def test_cpu_runner_packs_every_linear(tiny_factory):
    """A CPU ModelRunner prepacks all five weight matrices of every layer and the LM head, so decode uses them."""
    path = tiny_factory("llama", num_heads=4, num_kv_heads=2)
    runner = ModelRunner(str(path), ModelConfig.from_path(path), ParallelState(), TorchAttentionBackend(), 8, 16, 256)
    m = runner.model
    assert m.lm_head_packed is not None
    for layer in m.layers:
        a, mlp = layer.self_attn, layer.mlp
        assert all(t is not None for t in (a.qkv_packed, a.o_packed, mlp.gate_up_packed, mlp.down_packed))
