"""pdserve's fused CPU kernels (pdserve.kernels, csrc/fused.cpp) compute what the torch ops they replace compute:
the residual add and RMSNorm, rotary embedding in place on the q/k columns of a fused qkv row, SiLU(gate) * up; in
fp32 to rounding of the sum of squares, in bf16 to one bf16 rounding. Shapes cover a single decode row and a
prefill block large enough to be split over threads. The tests fail, rather than skip, where the kernels do not
build: every CPU runner builds them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.model.rope import apply_rope

ROWS = [1, 7, 300]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module", autouse=True)
def built():
    assert kernels.available(), "the CPU kernels did not build here (see the log for the compiler's error)"


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}


def _norm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_add_rms_norm_updates_the_residual_in_place_and_returns_its_norm(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    d = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.rand(576, generator=g).to(dtype) + 0.5
    expect_x = x + d
    residual = x.clone()
    out_x, h = kernels.add_rms_norm(residual, d, w, 1e-5)
    assert out_x.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, expect_x)  # the add is one rounding, as torch's
    torch.testing.assert_close(h, _norm_ref(expect_x, w, 1e-5), **_tol(dtype))


def test_bfloat16_rounding_is_torchs_bit_for_bit_on_ties_nan_inf_and_subnormals():
    # The kernels round bf16 with bit operations of their own; the residual add shows it value by value.
    tie, big, tiny = 2.0**-8, 3.0e38, 2.0**-133
    pairs = [
        (1.0, tie),  # halfway: to even (down)
        (1.0 + 2 * tie, tie),  # halfway: to even (up)
        (1.0, tie * 1.5),
        (-1.0, -tie),
        (big, big),  # overflow to inf
        (float("inf"), float("-inf")),  # nan
        (float("nan"), 1.0),
        (float("-inf"), 1.0),
        (tiny, tiny),  # subnormal
        (-0.0, 0.0),
    ]
    x = torch.tensor([a for a, _ in pairs] * 64, dtype=torch.float32).view(-1, len(pairs) * 4)
    d = torch.tensor([b for _, b in pairs] * 64, dtype=torch.float32).view(-1, len(pairs) * 4)
    xb, db = x.to(torch.bfloat16), d.to(torch.bfloat16)
    expect = (xb.float() + db.float()).to(torch.bfloat16)
    residual = xb.clone()
    kernels.add_rms_norm(residual, db, torch.ones(x.shape[1], dtype=torch.bfloat16), 1e-6)
    nan = expect.isnan()
    assert torch.equal(residual.isnan(), nan)  # a NaN's payload is free: torch's own paths differ in it
    assert torch.equal(residual.view(torch.int16)[~nan], expect.view(torch.int16)[~nan])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_a_delta_leaves_the_input_alone(dtype):
    x = torch.randn(5, 64).to(dtype)
    w = torch.rand(64).to(dtype)
    before = x.clone()
    _, h = kernels.add_rms_norm(x, None, w, 1e-6)
    assert torch.equal(x, before)
    torch.testing.assert_close(h, _norm_ref(before, w, 1e-6), **_tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_rope_in_place_matches_apply_rope_on_query_and_key_heads_only(rows, dtype):
    nq, nkv, d = 9, 3, 64
    g = torch.Generator().manual_seed(100 + rows)
    qkv = torch.randn(rows, (nq + 2 * nkv) * d, generator=g).to(dtype)
    pos = torch.randint(0, 4096, (rows,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos().unsqueeze(1).to(dtype), emb.sin().unsqueeze(1).to(dtype)
    expect = apply_rope((cos, sin), qkv[:, : (nq + nkv) * d].view(rows, -1, d).float()).to(dtype)
    v_before = qkv[:, (nq + nkv) * d :].clone()
    kernels.rope_(qkv, cos, sin, nq + nkv, d)
    torch.testing.assert_close(qkv[:, : (nq + nkv) * d].view(rows, -1, d), expect, **_tol(dtype))
    assert torch.equal(qkv[:, (nq + nkv) * d :], v_before)  # values are not rotated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", ROWS)
def test_silu_mul_matches_torch(rows, dtype):
    g = torch.Generator().manual_seed(200 + rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([0.0, -100.0, 100.0, -1e-30])  # saturating ends, zero and a tiny value
    gate, up = gate_up.chunk(2, dim=-1)
    expect = F.silu(gate.float()).to(dtype) * up
    torch.testing.assert_close(kernels.silu_mul(gate_up), expect, **_tol(dtype))


@pytest.mark.parametrize("rows", [1, 32])
def test_greedy_pick_is_argmax_with_its_log_softmax(rows):
    g = torch.Generator().manual_seed(300 + rows)
    logits = torch.randn(rows, 49152, generator=g) * 8
    logits[0, 17] = logits[0, 4000] = logits[0].max() + 1  # a tie: the first index wins, as argmax's
    tokens, lps = kernels.greedy_pick(logits)
    assert torch.equal(tokens, logits.argmax(dim=-1)) and tokens[0] == 17
    expect = torch.log_softmax(logits, dim=-1).gather(1, tokens.unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(lps, expect, atol=1e-5, rtol=1e-5)


def test_greedy_pick_follows_argmax_on_nan_and_inf_rows():
    logits = torch.zeros(3, 1000)
    logits[0, 5], logits[0, 9] = float("nan"), float("nan")
    logits[1, 7] = float("inf")
    logits[2, 123] = 1.0
    tokens, lps = kernels.greedy_pick(logits)
    assert tokens.tolist() == logits.argmax(dim=-1).tolist() == [5, 7, 123]
    assert lps[:2].isnan().all() and torch.isfinite(lps[2])


def _causal_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Float64 causal attention of n queries placed at the end of ctx keys, with each row's LSE."""
    n, hq, _ = q.shape
    ctx, hkv, _ = k.shape
    kf, vf = (x.double().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
    s = torch.einsum("nhd,khd->hnk", q.double(), kf) * scale
    hidden = torch.arange(ctx).unsqueeze(0) > torch.arange(ctx - n, ctx).unsqueeze(1)
    s = s.masked_fill(hidden, float("-inf"))
    return torch.einsum("hnk,khd->nhd", s.softmax(-1), vf), torch.logsumexp(s, -1).transpose(0, 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "ctx", "hq", "hkv", "d"),
    [(1, 1, 9, 3, 64), (7, 7, 9, 3, 64), (300, 300, 9, 3, 64), (17, 90, 8, 2, 128), (33, 33, 4, 4, 64)],
)
def test_prefill_attention_is_causal_attention_with_its_lse(n, ctx, hq, hkv, d, dtype):
    """Queries and keys as strided views of one fused qkv projection (the model's layout): a whole prompt (n = ctx),
    a later chunk that sees every earlier key (n < ctx), GQA groups of 3, 4 and 1, head sizes 64 and 128, and more
    query rows than one task's tile (300)."""
    g = torch.Generator().manual_seed(n + ctx)
    qkv = torch.randn(ctx, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[ctx - n :, : hq * d].view(n, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].view(ctx, hkv, d)
    v = qkv[:, (hq + hkv) * d :].view(ctx, hkv, d)
    out, lse = kernels.prefill_attention(q, k, v, d**-0.5)
    want, want_lse = _causal_ref(q, k, v, d**-0.5)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == (n, hq, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output rounded, and the weights of p . v (AVX512_BF16)
    assert (out.double() - want).abs().max() <= tol
    assert (lse.double() - want_lse).abs().max() <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64])
@pytest.mark.parametrize(("n", "m"), [(1, 5), (3, 577), (9, 4099)])
def test_sum_in_order_is_bit_identical_to_the_loop_of_adds(n, m, dtype):
    """The shared-memory all-reduce's local sum: rows of a larger slot array (strided), left to right, the same bits
    as torch's copy_ + add_ loop, which every rank must reproduce exactly."""
    g = torch.Generator().manual_seed(n * m)
    slots = (torch.randn(n, m + 13, generator=g, dtype=torch.float64) * 100).to(dtype)[:, :m]
    want = slots[0].clone()
    for r in range(1, n):
        want.add_(slots[r])
    got = kernels.sum_in_order(slots, torch.empty(m, dtype=dtype))
    assert torch.equal(got, want)


def test_merge_partials_equals_merge_attn_states():
    """The DCP merge in one pass against the torch ops: three partials over a head slice of the gathered buffer
    (strided), some empty (-inf LSE), and a row where every partial is empty (0 / -inf)."""
    from pdserve.attention.merge import merge_attn_states

    g = torch.Generator().manual_seed(11)
    n, t, h, d = 3, 5, 9, 64
    outs = torch.randn(n, t, h, d, generator=g)[:, :, 3:6]
    lses = (torch.randn(n, t, h, generator=g) * 4)[:, :, 3:6].clone()
    lses[1, 2, 0] = float("-inf")
    lses[:, 4, 1] = float("-inf")
    got, got_lse = kernels.merge_partials(outs, lses)
    want, want_lse = merge_attn_states(outs, lses)
    assert torch.allclose(got, want, atol=1e-6, rtol=1e-6) and torch.allclose(got_lse, want_lse, atol=1e-6)
    assert (got[4, 1] == 0).all() and got_lse[4, 1] == float("-inf")
