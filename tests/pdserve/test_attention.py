"""Attention with LSE: partial attentions over disjoint key subsets merge to full attention; paged decode equals
paged prefill; a mixed step (decodes first, then prompt chunks) equals its parts run alone; a rank with no keys
contributes nothing."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention.base import AttentionMetadata, write_kv
from pdserve.attention.merge import merge_attn_states
from pdserve.attention.torch_backend import TorchAttentionBackend


def _reference(q, k, v, scale):
    s = torch.einsum("hd,nhd->hn", q, k) * scale
    return torch.einsum("hn,nhd->hd", s.softmax(-1), v), torch.logsumexp(s, -1)


def _attend_subset(q, k, v, idx, scale):
    """Decode attention of q over the keys in idx, through the paged backend (block size 4)."""
    hkv, d, bs = k.shape[1], k.shape[2], 4
    n = len(idx)
    nblk = max(1, (n + bs - 1) // bs)
    kv = torch.zeros(2, nblk, bs, hkv, d)
    if n:
        write_kv(kv, k[idx], v[idx], torch.arange(n))
    meta = AttentionMetadata(False, torch.arange(0), [0, 1], [n], torch.tensor([n]), torch.arange(nblk).unsqueeze(0))
    out, lse = TorchAttentionBackend().forward(q.unsqueeze(0), kv, meta, scale)
    return out[0], lse[0]


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_of_disjoint_subsets_equals_full_attention(parts, seed):
    g = torch.Generator().manual_seed(seed)
    n, hq, hkv, d = 37, 8, 2, 16
    q = torch.randn(hq, d, generator=g)
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    owner = torch.randint(0, parts, (n,), generator=g)  # arbitrary, non-contiguous subsets
    owner[:parts] = torch.arange(parts)  # every part non-empty
    results = [_attend_subset(q, k, v, (owner == p).nonzero().squeeze(1), 0.25) for p in range(parts)]
    out, lse = merge_attn_states(torch.stack([o for o, _ in results]), torch.stack([s for _, s in results]))
    k_full, v_full = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    ref_out, ref_lse = _reference(q, k_full, v_full, 0.25)
    assert (out - ref_out).abs().max() <= 1e-5
    assert (lse - ref_lse).abs().max() <= 1e-5


def test_empty_partial_contributes_nothing():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(4, 8, generator=g), torch.randn(5, 4, 8, generator=g), torch.randn(5, 4, 8, generator=g)
    full = _attend_subset(q, k, v, torch.arange(5), 0.3)
    empty = _attend_subset(q, k, v, torch.arange(0), 0.3)
    assert torch.isinf(empty[1]).all() and (empty[0] == 0).all()
    out, lse = merge_attn_states(torch.stack([full[0], empty[0]]), torch.stack([full[1], empty[1]]))
    assert torch.allclose(out, full[0]) and torch.allclose(lse, full[1])


def test_paged_decode_matches_prefill_last_row():
    g = torch.Generator().manual_seed(4)
    n, hq, hkv, d, bs = 13, 4, 2, 8, 4
    q = torch.randn(n, hq, d, generator=g)
    k, v = torch.randn(n, hkv, d, generator=g), torch.randn(n, hkv, d, generator=g)
    kv = torch.zeros(2, 6, bs, hkv, d)
    table = torch.tensor([[5, 2, 0, 3]])  # scattered blocks
    slots = torch.cat([table[0, i // bs : i // bs + 1] * bs + i % bs for i in range(n)])
    write_kv(kv, k, v, slots)
    be = TorchAttentionBackend()
    pre = AttentionMetadata(True, slots, [0, n], [0], torch.tensor([n]), table)
    out_p, lse_p = be.forward(q, kv, pre, 0.35)
    dec = AttentionMetadata(False, slots[-1:], [0, 1], [n - 1], torch.tensor([n]), table)
    out_d, lse_d = be.forward(q[-1:], kv, dec, 0.35)
    assert torch.allclose(out_p[-1], out_d[0], atol=1e-6) and torch.allclose(lse_p[-1], lse_d[0], atol=1e-6)


def test_mixed_step_equals_its_decodes_and_chunks_alone():
    g = torch.Generator().manual_seed(5)
    hq, hkv, d, bs = 4, 2, 8, 4
    kv = torch.randn(2, 16, bs, hkv, d, generator=g)  # every slot already holds some key
    tables = torch.tensor([[3, 7, 1, 0], [9, 2, 0, 0], [4, 5, 6, 8], [11, 12, 13, 0]])
    # two decodes (contexts 13 and 6), a later chunk (positions 8..13) and a first chunk (positions 0..9)
    starts, lens = [12, 5, 8, 0], [1, 1, 6, 10]
    ctx = torch.tensor([s + n for s, n in zip(starts, lens)])
    cu = [0, 1, 2, 8, 18]
    slots = torch.cat(
        [tables[i, (p := torch.arange(s, s + n)) // bs] * bs + p % bs for i, (s, n) in enumerate(zip(starts, lens))]
    )
    q = torch.randn(cu[-1], hq, d, generator=g)
    be = TorchAttentionBackend()
    mixed = AttentionMetadata(True, slots, cu, starts, ctx, tables, num_decodes=2)
    out, lse = be.forward(q, kv, mixed, 0.3)
    dec = AttentionMetadata(False, slots[:2], cu[:3], starts[:2], ctx[:2], tables[:2])
    pre = AttentionMetadata(True, slots[2:], [0, 6, 16], starts[2:], ctx[2:], tables[2:])
    out_d, lse_d = be.forward(q[:2], kv, dec, 0.3)
    out_p, lse_p = be.forward(q[2:], kv, pre, 0.3)
    assert torch.equal(out, torch.cat([out_d, out_p])) and torch.equal(lse, torch.cat([lse_d, lse_p]))
    # and each decode row is what a one-token prefill of it gives
    one = AttentionMetadata(True, slots[:1], [0, 1], starts[:1], ctx[:1], tables[:1])
    out_1, lse_1 = be.forward(q[:1], kv, one, 0.3)
    assert torch.allclose(out[0], out_1[0], atol=1e-6) and torch.allclose(lse[0], lse_1[0], atol=1e-6)


def test_flashinfer_mla_page_table_covers_the_torch_decode_slots():
    """The CSR page table handed to flashinfer's MLA wrapper names, token for token, the cache slots the torch MLA
    decode reads (DCP-sharded lengths, an empty shard, scattered blocks, padded tables)."""
    from pdserve.attention.flashinfer_mla import mla_paged_indices

    bs = 4
    ctx = torch.tensor([9, 0, 4, 1])
    tables = torch.tensor([[7, 2, 5, 0], [3, 0, 0, 0], [1, 0, 0, 0], [6, 0, 0, 0]])
    meta = AttentionMetadata(False, torch.zeros(4, dtype=torch.long), [0, 1, 2, 3, 4], [0, 0, 0, 0], ctx, tables)
    slots, _mask, empty = TorchAttentionBackend._decode_plan(meta, bs, torch.float32, torch.device("cpu"))
    indptr, indices, kv_len = mla_paged_indices(meta, bs)
    assert indptr.dtype == indices.dtype == kv_len.dtype == torch.int32
    max_ctx = slots.numel() // 4
    for i in range(4):
        pages = indices[indptr[i] : indptr[i + 1]].long()
        got = (pages.repeat_interleave(bs) * bs + torch.arange(bs).repeat(len(pages)))[: int(kv_len[i])]
        n = max(int(ctx[i]), 1)  # an empty shard reads one (masked-out) row on both paths
        assert got.tolist() == slots[i * max_ctx : i * max_ctx + n].tolist()
    assert empty is not None and empty.tolist() == [False, True, False, False]


def test_select_mla_backend_keeps_torch_off_cuda(caplog):
    from pdserve.attention import select_backend, select_mla_backend

    with caplog.at_level("INFO", logger="pdserve.attention"):
        mla = select_mla_backend(select_backend("cpu"))
    assert mla.name == "torch" and "MLA attention backend: torch" in caplog.text


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 5])
# heads of 64 and 128 columns take the 8-row score loop (several chunks of 64 / 32 rows, a last partial 8); other
# sizes up to 128 the one-head loop; wider rows of groups of 4k heads the register tiles (16 or 24 columns per tile)
@pytest.mark.parametrize(
    "hq,hkv,d", [(9, 3, 64), (16, 2, 64), (8, 1, 128), (8, 2, 48), (16, 1, 576), (8, 2, 256), (6, 2, 20)]
)
def test_cpu_decode_kernel_matches_the_torch_path(dtype, window, hq, hkv, d):
    """pdserve's C++ decode kernel (built on this machine) against the gather + flash path it replaces: scattered
    blocks, GQA groups, uneven contexts (several of the tiled loop's chunks), a sliding window, and a row with no
    keys (a DCP rank holding none)."""
    from pdserve import kernels

    assert kernels.available(), "the CPU kernels did not build here (see the log for the compiler's error)"
    g = torch.Generator().manual_seed(6)
    b, bs, nblk = 5, 16, 40
    kv = torch.randn(2, nblk, bs, hkv, d, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(nblk, generator=g)[:8] for _ in range(b)])
    ctx = torch.tensor([1, 17, 0, 100, 128])
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    meta = AttentionMetadata(False, torch.arange(0), list(range(b + 1)), [0] * b, ctx, tables, sliding_window=window)
    fast, slow = TorchAttentionBackend(), TorchAttentionBackend()
    fast.cpu_kernels, slow.cpu_kernels = True, False
    out, lse = fast.forward(q, kv, meta, 0.125)
    ref_out, ref_lse = slow.forward(q, kv, meta, 0.125)
    assert out.dtype == dtype and lse.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 outputs: rounding of the 8-bit mantissa
    assert (out.float() - ref_out.float()).abs().max() <= tol
    finite = ctx > 0
    assert (lse[finite] - ref_lse[finite]).abs().max() <= 1e-4
    assert torch.isinf(lse[~finite]).all() and (out[~finite] == 0).all()


def test_loading_the_cpu_kernels_keeps_subnormals():
    """The kernels' library must not switch the process to flush-to-zero (what linking with -ffast-math does): a
    subnormal float32 survives after it is loaded."""
    import numpy as np

    from pdserve import kernels

    assert kernels.available()
    assert float(np.float32(2.0**-149)) == 2.0**-149
    assert (torch.tensor([2.0**-126]) / 4).item() == 2.0**-128


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_prefill_kernel_matches_the_torch_path_and_exact_keeps_torch(dtype):
    """pdserve's C++ prefill kernel inside the backend: a whole prompt attended from the step's own K/V rows and a
    later chunk read back from scattered cache blocks give what the flash path gives; a step marked exact (the
    engine's exact_prefill) stays on torch's kernel, bit for bit."""
    from pdserve import kernels

    assert kernels.available(), "the CPU kernels did not build here (see the log for the compiler's error)"
    g = torch.Generator().manual_seed(8)
    hq, hkv, d, bs = 9, 3, 64, 16
    kv = torch.zeros(2, 20, bs, hkv, d, dtype=dtype)
    tables = torch.stack([torch.randperm(20, generator=g)[:6] for _ in range(2)])
    # sequence 0: a whole 37-token prompt; sequence 1: positions 50..69 of a prompt whose first 50 keys are cached
    starts, lens = [0, 50], [37, 20]
    ctx = torch.tensor([s + n for s, n in zip(starts, lens)])
    cu = [0, 37, 57]
    all_pos = [torch.arange(0, 37), torch.arange(0, 70)]
    k_all = [torch.randn(len(p), hkv, d, generator=g).to(dtype) for p in all_pos]
    v_all = [torch.randn(len(p), hkv, d, generator=g).to(dtype) for p in all_pos]
    for i, p in enumerate(all_pos):
        write_kv(kv, k_all[i], v_all[i], tables[i, p // bs] * bs + p % bs)
    slots = torch.cat(
        [tables[i, (p := torch.arange(s, s + n)) // bs] * bs + p % bs for i, (s, n) in enumerate(zip(starts, lens))]
    )
    new_k = torch.cat([k_all[0], k_all[1][50:]])
    new_v = torch.cat([v_all[0], v_all[1][50:]])
    q = torch.randn(cu[-1], hq, d, generator=g).to(dtype)
    fast, slow = TorchAttentionBackend(), TorchAttentionBackend()
    fast.cpu_kernels, slow.cpu_kernels = True, False
    meta = AttentionMetadata(True, slots, cu, starts, ctx, tables)
    out, lse = fast.forward(q, kv, meta, 0.125, new_kv=(new_k, new_v))
    ref_out, ref_lse = slow.forward(q, kv, meta, 0.125, new_kv=(new_k, new_v))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and (out.float() - ref_out.float()).abs().max() <= tol
    assert (lse - ref_lse).abs().max() <= 1e-4
    exact = AttentionMetadata(True, slots, cu, starts, ctx, tables, exact=True)
    out_x, lse_x = fast.forward(q, kv, exact, 0.125, new_kv=(new_k, new_v))
    assert torch.equal(out_x, ref_out) and torch.equal(lse_x, ref_lse)
