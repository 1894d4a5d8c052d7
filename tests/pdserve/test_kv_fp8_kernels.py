"""The C++ decode kernel over an fp8 cache (csrc/paged_decode.cpp, dequantised in registers) against a float64
reference of the same dequantised attention: GQA groups, a sliding window, a sequence with no keys here, both fp8
kinds, float32 and bfloat16 queries; and the torch backend's decode through it equal to its gather path."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.engine import kv_quant

pytestmark = pytest.mark.skipif(not kernels.available(), reason="pdserve's CPU kernels could not be built")


def _reference(q, k8, v8, ks, vs, tables, ctx, window, scale):
    """float64 attention over the dequantised keys/values of each sequence; LSE natural log."""
    b, hq, d = q.shape
    bs, hkv = k8.shape[1], k8.shape[2]
    g = hq // hkv
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float64)
    for i in range(b):
        n = int(ctx[i])
        start = max(0, n - window) if window else 0
        if n - start <= 0:
            continue
        pos = torch.arange(start, n)
        blocks = tables[i, pos // bs]
        k = k8[blocks, pos % bs].double() * ks[blocks].double().unsqueeze(-1)  # [n, Hkv, D]
        v = v8[blocks, pos % bs].double() * vs[blocks].double().unsqueeze(-1)
        for h in range(hq):
            s = (k[:, h // g] @ q[i, h].double()) * scale
            lse[i, h] = torch.logsumexp(s, 0)
            out[i, h] = torch.softmax(s, 0) @ v[:, h // g]
    return out, lse


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,window", [(64, None), (128, 5), (24, None), (192, None)])
@pytest.mark.parametrize("g", [3, 4])  # 4 heads of 192: the register-tiled loop
def test_fp8_decode_kernel_matches_float64_reference(fp8, qdtype, head_dim, window, g):
    torch.manual_seed(1)
    nb, bs, hkv, b = 12, 4, 2, 4
    m = kv_quant.FP8_MAX[fp8]
    k8 = (torch.randn(nb, bs, hkv, head_dim) * m / 8).clamp(-m, m).to(fp8)
    v8 = (torch.randn(nb, bs, hkv, head_dim) * m / 8).clamp(-m, m).to(fp8)
    # scales differ per block and head, as blocks of different sequences do
    ks = torch.rand(nb, hkv) * 0.01 + 1e-3
    vs = torch.rand(nb, hkv) * 0.05 + 1e-3
    tables = torch.tensor([[3, 7, 1, 0], [5, 2, 9, 11], [4, 0, 0, 0], [6, 8, 10, 0]])
    ctx = torch.tensor([13, 16, 0, 9])
    q = torch.randn(b, hkv * g, head_dim).to(qdtype)
    scale = head_dim**-0.5
    out, lse = kernels.paged_decode_attention_fp8(q, k8, v8, ks, vs, tables, ctx, window, scale)
    want_o, want_lse = _reference(q, k8, v8, ks, vs, tables, ctx, window, scale)
    # float32 sums against float64: a few ulps of the largest value; bf16 output: its 8-bit mantissa
    tol = (1e-5 if qdtype == torch.float32 else 1e-2) * want_o.abs().max().item()
    assert (out.double() - want_o).abs().max() <= tol, (out.double() - want_o).abs().max()
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse))
    fin = torch.isfinite(want_lse)
    assert torch.allclose(lse.double()[fin], want_lse[fin], atol=1e-4, rtol=1e-5)
    assert (out[2] == 0).all(), "a sequence with no keys here contributes nothing"


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kernel_decodes_every_finite_byte_as_torch_does(fp8):
    """Each finite byte (subnormals and the largest values included) as one key whose score is its value: the LSE
    and the value-weighted output equal float64 sums over torch's own conversion of the same bytes."""
    raw = torch.arange(256, dtype=torch.uint8)
    raw = raw[torch.isfinite(raw.view(fp8).float())]  # NaN / inf bytes are never written (quantize clamps)
    n, d, bs = raw.numel(), 64, 4
    nb = -(-n // bs)
    k8 = torch.zeros(nb * bs, 1, d, dtype=torch.uint8)
    k8[:n, 0, 0] = raw
    k8 = k8.view(nb, bs, 1, d).view(fp8)
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    ones = torch.ones(nb, 1)
    scale = 1.0 / kv_quant.FP8_MAX[fp8]  # scores within [-1, 1]: every key weighs in
    out, lse = kernels.paged_decode_attention_fp8(
        q, k8, k8, ones, ones, torch.arange(nb).unsqueeze(0), torch.tensor([n]), None, scale
    )
    vals = raw.view(fp8).double()
    s = vals * scale
    assert abs(lse.item() - torch.logsumexp(s, 0).item()) < 1e-5
    assert abs(out[0, 0, 0].item() - (torch.softmax(s, 0) @ vals).item()) <= 1e-5 * vals.abs().max().item()


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_torch_gather_path_equals_the_kernel_on_fp8(fp8):
    """The torch backend's device-agnostic fp8 decode (gather a step's rows, scale them: the CUDA path) and its C++
    kernel give the same attention and LSE."""
    from pdserve.attention.base import AttentionMetadata
    from pdserve.attention.torch_backend import TorchAttentionBackend

    torch.manual_seed(3)
    nb, bs, hkv, d = 10, 4, 2, 64
    m = kv_quant.FP8_MAX[fp8]
    kv = (torch.randn(2, nb, bs, hkv, d) * m / 8).clamp(-m, m).to(fp8)
    scales = torch.rand(2, nb, hkv) * 0.01 + 1e-3
    tables = torch.tensor([[3, 7, 1], [5, 2, 9], [0, 0, 0]])
    ctx = torch.tensor([10, 12, 0])
    meta = AttentionMetadata(
        is_prefill=False,
        slot_mapping=torch.tensor([21, 39, -1]),
        cu_seqlens_q=[0, 1, 2, 3],
        query_start_pos=[9, 11, 0],
        context_lens=ctx,
        block_tables=tables,
    )
    q = torch.randn(3, 6, d)
    kernel = TorchAttentionBackend()
    gather = TorchAttentionBackend()
    gather.cpu_kernels = False
    o1, l1 = kernel.forward(q, kv, meta, 0.125, kv_scales=scales)
    o2, l2 = gather.forward(q, kv, meta, 0.125, kv_scales=scales)
    assert torch.allclose(o1, o2, atol=1e-5 * o2.abs().max().item(), rtol=0)
    assert torch.equal(torch.isinf(l1), torch.isinf(l2)) and torch.allclose(l1[:2], l2[:2], atol=1e-4)
