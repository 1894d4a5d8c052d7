"""pdserve's W8A8 kernels (csrc/int8_gemm.cpp), per row and per 32-column block (Q8_0), against int64 / float64
references of the same quantised operands: integer sums are exact, so the accumulator must match to the bit and the
scaled output to fp32 rounding."""

from __future__ import annotations

import pytest
import torch

from pdserve import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="pdserve's CPU kernels are unavailable")

# M rows of x, N weight rows, K: tails past the 32- and 64-byte vectors and past the 4-row blocks included
SHAPES = [(1, 1, 1), (1, 4, 32), (1, 7, 100), (1, 13, 576), (3, 9, 64), (5, 17, 1537), (33, 6, 200)]


def _ref_acc(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    return xq.long() @ wq.long().T


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_matmul_sums_exactly_as_int64(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    wq = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    assert torch.equal(kernels.int8_matmul(xq, wq).long(), _ref_acc(xq, wq))


def test_int8_matmul_is_exact_at_the_extremes_where_int16_pair_sums_would_saturate():
    # every pair |w| * |x| at its largest: 2 * 128 * 127 per pair, K * 128 * 127 in all
    k = 4096
    for wv in (-128, 127):
        for xv in (-127, 127):
            xq = torch.full((2, k), xv, dtype=torch.int8)
            wq = torch.full((5, k), wv, dtype=torch.int8)
            assert torch.equal(kernels.int8_matmul(xq, wq).long(), _ref_acc(xq, wq))
    xq = torch.tensor([[127, -127] * 64], dtype=torch.int8)
    wq = torch.tensor([[-128, 127] * 64, [127, -128] * 64], dtype=torch.int8)
    assert torch.equal(kernels.int8_matmul(xq, wq).long(), _ref_acc(xq, wq))


def test_int8_matmul_rejects_minus_128_activations():
    with pytest.raises(RuntimeError, match=r"\[-127, 127\]"):
        kernels.int8_matmul(torch.full((1, 8), -128, dtype=torch.int8), torch.ones(2, 8, dtype=torch.int8))


def test_quantize_per_token_is_symmetric_per_row_with_a_unit_scale_for_zero_rows():
    x = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * torch.tensor([1, 10, 0.01, 3, 1, 0])[:, None]
    q, s = kernels.quantize_per_token(x)
    amax = x.abs().amax(dim=1)
    want_s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    torch.testing.assert_close(s, want_s, rtol=2e-7, atol=0)
    want_q = torch.round(x / want_s[:, None]).clamp(-127, 127)
    # the kernel multiplies by 127 / amax: a value at a rounding midpoint may land one step away
    assert (q.float() - want_q).abs().max().item() <= 1
    assert (q.float() != want_q).float().mean().item() < 1e-2
    assert q.abs().amax(dim=1)[:5].eq(127).all() and q[5].eq(0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_is_acc_times_both_scales_plus_bias(m, n, k, dtype, with_bias):
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    wq = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    ws = torch.rand(n, generator=g) * 0.02 + 1e-3
    bias = torch.randn(n, generator=g).to(dtype) if with_bias else None
    y = kernels.int8_linear(x, wq, ws, bias)
    assert y.dtype == dtype and y.shape == (m, n)
    xq, xs = kernels.quantize_per_token(x)
    ref = kernels.int8_matmul(xq, wq).double() * xs.double()[:, None] * ws.double()[None, :]
    if bias is not None:
        ref = ref + bias.double()
    # three fp32 roundings (the product, each scale, the bias), then the output dtype's
    tol = 4 * torch.finfo(torch.float32).eps if dtype == torch.float32 else torch.finfo(dtype).eps
    torch.testing.assert_close(y.double(), ref.to(dtype).double(), rtol=tol, atol=1e-6)


def test_int8_linear_approximates_the_float_layer_it_quantises():
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(4, 512, generator=g), torch.randn(64, 512, generator=g) * 0.05
    from pdserve.model.quant import quantize_per_channel

    wq, ws = quantize_per_channel(w)
    y, ref = kernels.int8_linear(x, wq, ws, None), torch.nn.functional.linear(x, w)
    assert ((y - ref).norm() / ref.norm()).item() < 0.02


def _ref_grouped(xq, xs, wq, ws, group: int) -> torch.Tensor:
    """float64 sum over blocks of the exact int64 block dot times x_scale * w_scale, and the sum of |terms|."""
    k = xq.shape[1]
    groups = xs.shape[1]
    pad = groups * group - k
    xb = torch.nn.functional.pad(xq.long(), (0, pad)).view(xq.shape[0], groups, group)
    wb = torch.nn.functional.pad(wq.long(), (0, pad)).view(wq.shape[0], groups, group)
    terms = torch.einsum("mgc,ngc->mng", xb, wb).double() * xs.double()[:, None, :] * ws.double()[None]
    return terms.sum(-1), terms.abs().sum(-1)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_int8_linear_grouped_is_the_sum_of_exact_block_dots_to_fp32_rounding(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g) * torch.rand(1, k, generator=g) * 4
    wq = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    groups = -(-k // 32)
    ws = torch.rand(n, groups, generator=g) / 100
    bias = torch.randn(n, generator=g)
    xq, xs = kernels.quantize_per_group(x, 32)
    assert xs.shape == (m, groups)
    ref, mag = _ref_grouped(xq, xs, wq, ws, 32)
    got = kernels.int8_linear_grouped(x, wq, ws, 32, bias).double()
    # fp32: each block's scale product, its product with the exact sum, and the running sum round (< 2^-24 each)
    assert ((got - bias.double() - ref).abs() <= mag * 3 * (k / 8 + 4) * 2.0**-24 + 1e-6).all()


def test_quantize_per_group_gives_each_block_its_own_scale_and_a_short_last_block_its_own():
    x = torch.randn(3, 80, generator=torch.Generator().manual_seed(2))
    x[1, 32:64] *= 1000
    x[2, 64:] = 0
    q, s = kernels.quantize_per_group(x, 32)
    for gi, (c0, c1) in enumerate([(0, 32), (32, 64), (64, 80)]):
        qb, sb = kernels.quantize_per_token(x[:, c0:c1])
        assert torch.equal(q[:, c0:c1], qb) and torch.equal(s[:, gi], sb), gi


def test_int8_linear_grouped_at_the_extremes_and_in_bf16():
    k = 4096
    x = torch.full((2, k), 3.0)
    wq = torch.full((5, k), -128, dtype=torch.int8)
    ws = torch.ones(5, k // 32)
    assert torch.equal(kernels.int8_linear_grouped(x, wq, ws, 32), torch.full((2, 5), -128.0 * 3 / 127 * 127 * k))
    xb = torch.randn(4, 96, generator=torch.Generator().manual_seed(3)).bfloat16()
    wq2 = torch.randint(-127, 128, (6, 96), dtype=torch.int8, generator=torch.Generator().manual_seed(4))
    ws2 = torch.rand(6, 3, generator=torch.Generator().manual_seed(5))
    got = kernels.int8_linear_grouped(xb, wq2, ws2, 32)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), kernels.int8_linear_grouped(xb.float(), wq2, ws2, 32), rtol=1e-2, atol=1e-2)


def test_int8_linear_grouped_checks_its_scales_shape():
    with pytest.raises(RuntimeError, match=r"\[N, ceil\(K / group\)\]"):
        kernels.int8_linear_grouped(torch.ones(1, 64), torch.ones(2, 64, dtype=torch.int8), torch.ones(2, 3), 32)
