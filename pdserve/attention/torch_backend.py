"""CPU attention over the paged cache with torch's fused flash kernel, which also returns the LSE."""
from __future__ import annotations

import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.merge import merge_attn_states

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


class TorchAttentionBackend:
    name = "torch"

    def forward(
        self, q: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if meta.is_prefill:
            return self._prefill(q, kv_layer, meta, scale, new_kv)
        return self._decode(q, kv_layer, meta, scale)

    def _prefill(self, q, kv_layer, meta, scale, new_kv):
        # The flash kernel takes strided [1, H, L, D] views and Hkv < Hq heads natively (bit-identical to expanding
        # K/V per query head), so queries and a first chunk's K/V go in as views of the QKV projection: no copies.
        hkv, d = kv_layer.shape[-2], q.shape[-1]
        bs = kv_layer.shape[2]
        hq = q.shape[1]
        outs, lses = [], []
        for i in range(meta.num_seqs):
            a, b = meta.cu_seqlens_q[i], meta.cu_seqlens_q[i + 1]
            qi = q[a:b]
            n, ctx = qi.shape[0], int(meta.context_lens[i])
            start = meta.query_start_pos[i]
            if ctx == 0:  # a DCP rank that holds none of this sequence's tokens yet
                outs.append(torch.zeros_like(qi))
                lses.append(torch.full((n, hq), float("-inf")))  # LSE is float32 in every dtype, as the kernel's
                continue
            qb = qi.transpose(0, 1).unsqueeze(0)
            plain = meta.sliding_window is None and meta.dcp_size == 1
            whole = start == 0 and n == ctx and plain  # a whole prompt (or its first chunk)
            if whole and new_kv is not None:  # its K/V are exactly this step's rows
                kb, vb = (x[a:b].transpose(0, 1).unsqueeze(0) for x in new_kv)
            else:
                nblk = (ctx + bs - 1) // bs
                table = meta.block_tables[i, :nblk]
                # kv_layer[0][table], not kv_layer[0, table]: the mixed index is far slower (docs/performance.md)
                kb, vb = (kv_layer[j][table].reshape(-1, hkv, d)[:ctx].transpose(0, 1).unsqueeze(0).contiguous()
                          for j in (0, 1))
            o, lse = attend_prefill_seq(qb, kb, vb, meta, start, ctx, scale, whole, plain)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs), torch.cat(lses)

    def _decode(self, q, kv_layer, meta, scale):
        # One query per sequence: view its Hq heads as [Hkv, group] rows so GQA needs no KV copy per head.
        b, hq, d = q.shape
        hkv, bs = kv_layer.shape[-2], kv_layer.shape[2]
        slots, mask, empty = meta.derived.get("decode") or self._decode_plan(meta, bs, q.dtype)
        max_ctx = mask.shape[-1]
        # Contiguous [B, Hkv, L, D]: the CPU flash kernel is much slower on strided K/V (docs/performance.md).
        k = kv_layer[0].view(-1, hkv, d).index_select(0, slots).view(b, max_ctx, hkv, d).transpose(1, 2).contiguous()
        v = kv_layer[1].view(-1, hkv, d).index_select(0, slots).view(b, max_ctx, hkv, d).transpose(1, 2).contiguous()
        qg = q.view(b, hkv, hq // hkv, d)
        o, lse = _flash(qg, k, v, 0.0, False, attn_mask=mask, scale=scale)
        o, lse = o.reshape(b, hq, d), lse.reshape(b, hq)
        if empty is not None:
            o = o.masked_fill(empty.view(b, 1, 1), 0.0)
            lse = lse.masked_fill(empty.view(b, 1), float("-inf"))
        return o, lse

    @staticmethod
    def _decode_plan(meta: AttentionMetadata, bs: int, dtype: torch.dtype):
        """Flat cache slots of every sequence's keys, the padding/window mask, and which rows have no keys."""
        ctx = meta.context_lens
        b = ctx.shape[0]
        max_ctx = max(int(ctx.max()), 1)
        idx = torch.arange(max_ctx)
        table = meta.block_tables[:, : (max_ctx + bs - 1) // bs]
        slots = (table.gather(1, (idx // bs).unsqueeze(0).expand(b, -1)) * bs + idx % bs).reshape(-1)
        allowed = idx.unsqueeze(0) < ctx.unsqueeze(1)
        if meta.sliding_window is not None:
            allowed &= idx.unsqueeze(0) > (ctx.unsqueeze(1) - 1 - meta.sliding_window)
        empty = ctx == 0
        if bool(empty.any()):
            allowed[empty, 0] = True  # keep the kernel finite; these rows are zeroed after
        else:
            empty = None
        mask = torch.zeros(b, max_ctx, dtype=dtype).masked_fill_(~allowed, float("-inf")).view(b, 1, 1, max_ctx)
        meta.derived["decode"] = (slots, mask, empty)
        return slots, mask, empty


def attend_prefill_seq(qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, meta: AttentionMetadata, start: int,
                       ctx: int, scale: float, whole: bool, plain: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill attention: qb [1, Hq, n, D] over its ctx local keys kb/vb [1, Hkv, ctx, D], causal by
    absolute position (and window / DCP shard). Returns (out [n, Hq, D], lse [n, Hq]); rows with no key give 0 / -inf.

    whole: the queries are the whole prompt so far (keys = queries, aligned); plain: no window and no DCP."""
    n = qb.shape[2]
    if whole:
        o, lse = _flash(qb, kb, vb, 0.0, True, scale=scale)
        return o[0].transpose(0, 1), lse[0].transpose(0, 1)
    if start > 0 and start + n == ctx and plain:
        # A later chunk of a chunked prefill: every earlier key is visible (no mask) and the chunk's own keys
        # are causal and aligned with its queries, so two fused calls merged by LSE replace one call with an
        # [n, ctx] mask (which costs a mask build per layer and the kernel's slow masked path).
        o1, lse1 = _flash(qb, kb[:, :, :start], vb[:, :, :start], 0.0, False, scale=scale)
        o2, lse2 = _flash(qb, kb[:, :, start:], vb[:, :, start:], 0.0, True, scale=scale)
        o, lse = merge_attn_states(torch.stack([o1[0].transpose(0, 1), o2[0].transpose(0, 1)]),
                                   torch.stack([lse1[0].transpose(0, 1), lse2[0].transpose(0, 1)]))
        return o.to(qb.dtype), lse  # the merge sums in float32
    qpos = torch.arange(start, start + n).unsqueeze(1)
    kpos = meta.key_positions(ctx).unsqueeze(0)
    allowed = kpos <= qpos
    if meta.sliding_window is not None:
        allowed &= kpos > qpos - meta.sliding_window
    none = ~allowed.any(dim=1)
    allowed[none, 0] = True  # keep the kernel finite; these rows are zeroed below
    mask = torch.zeros(n, ctx, dtype=qb.dtype).masked_fill_(~allowed, float("-inf"))
    o, lse = _flash(qb, kb, vb, 0.0, False, attn_mask=mask.view(1, 1, n, ctx), scale=scale)
    o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)
    if bool(none.any()):
        o = o.masked_fill(none.view(n, 1, 1), 0.0)
        lse = lse.masked_fill(none.view(n, 1), float("-inf"))
    return o, lse
