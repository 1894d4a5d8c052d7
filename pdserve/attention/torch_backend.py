"""Attention over the paged cache with torch's fused kernels, which also return the LSE: the CPU flash kernel on CPU,
the memory-efficient (CUTLASS) kernel elsewhere, i.e. on CUDA when flashinfer is absent."""

from __future__ import annotations

import torch

from pdserve import kernels
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.merge import merge_attn_states
from pdserve.engine.kv_quant import gather_gqa

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_efficient = torch.ops.aten._scaled_dot_product_efficient_attention
_BIAS_ALIGN = 16  # elements; the efficient kernel reads bias rows at an aligned stride (torch SDPA's preprocess_mask)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused attention with LSE: q [B, H, L, D] over k, v [B, Hkv, S, D] (H a multiple of Hkv), optional additive mask
    broadcastable to [B, H, L, S] in q's dtype; causal aligns query i with key i. Returns (out [B, H, L, Dv], lse
    [B, H, L] float32, natural log)."""
    if q.device.type == "cpu":
        return _flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
    h, s, dv = q.shape[1], k.shape[2], v.shape[-1]
    if k.shape[1] != h:  # the efficient kernel needs one head count: each KV head serves h // hkv query heads
        k, v = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (k, v))
    q, k, v = (_aligned(x) for x in (q, k, v))
    bias = None
    if mask is not None:
        shape = (q.shape[0], h, q.shape[2], s)
        bias = mask.expand(shape)
        if bias.stride(-1) != 1 or any(st % _BIAS_ALIGN for st in bias.stride()[:-1]):
            bias = torch.nn.functional.pad(mask, (0, -s % _BIAS_ALIGN))[..., :s].expand(shape)
    out, lse = _efficient(q, k, v, bias, True, 0.0, causal, scale=scale)[:2]
    return out[..., :dv], lse[..., : q.shape[2]]  # the kernel pads LSE rows to a multiple of 32


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x with 16-byte aligned head size and strides, as the efficient kernel needs (bf16 has no unaligned variant):
    zero columns change neither scores nor outputs (those of V are sliced off)."""
    align = 16 // x.element_size()
    if x.shape[-1] % align:
        return torch.nn.functional.pad(x, (0, -x.shape[-1] % align))
    if x.stride(-1) != 1 or any(st % align for n, st in zip(x.shape[:-1], x.stride()[:-1]) if n > 1):
        return x.contiguous()
    return x


class TorchAttentionBackend:
    name = "torch"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        # CPU decode reads the paged cache in place and CPU prefill attends GQA groups at once with pdserve's kernels
        # where they build (pdserve.kernels); a CUDA fallback never calls them, so it builds nothing there
        self.cpu_kernels = torch.device(device).type == "cpu" and kernels.available()

    def forward(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        kv_scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not meta.is_prefill:
            return self._decode(q, kv_layer, meta, scale, kv_scales)
        d = meta.num_decodes
        if d == 0:
            return self._prefill(q, kv_layer, meta, scale, new_kv, kv_scales)
        dec, pre = meta.split_decodes()
        o1, lse1 = self._decode(q[:d], kv_layer, dec, scale, kv_scales)
        new = new_kv and (new_kv[0][d:], new_kv[1][d:])
        o2, lse2 = self._prefill(q[d:], kv_layer, pre, scale, new, kv_scales)
        return torch.cat([o1, o2]), torch.cat([lse1, lse2])

    def prefill_kernel_applies(self, meta: AttentionMetadata, head_dim: int) -> bool:
        """Whether this step's prefill sequences that see every earlier key go through kernels.prefill_attention
        (the model's native prefill asks the same question)."""
        plain = meta.sliding_window is None and meta.dcp_size == 1
        return self.cpu_kernels and plain and not meta.exact and head_dim in (64, 128)

    def _prefill(self, q, kv_layer, meta, scale, new_kv, kv_scales=None):
        # The flash kernel takes strided [1, H, L, D] views and Hkv < Hq heads natively (bit-identical to expanding
        # K/V per query head), so queries and a first chunk's K/V go in as views of the QKV projection: no copies.
        hkv, d = kv_layer.shape[-2], q.shape[-1]
        bs = kv_layer.shape[2]
        hq = q.shape[1]
        kernel = self.prefill_kernel_applies(meta, d)
        outs, lses = [], []
        for i in range(meta.num_seqs):
            a, b = meta.cu_seqlens_q[i], meta.cu_seqlens_q[i + 1]
            qi = q[a:b]
            n, ctx = qi.shape[0], int(meta.context_lens[i])
            start = meta.query_start_pos[i]
            if ctx == 0:  # a DCP rank that holds none of this sequence's tokens yet
                outs.append(torch.zeros_like(qi))
                # LSE is float32 in every dtype, as the kernel's
                lses.append(torch.full((n, hq), float("-inf"), device=q.device))
                continue
            plain = meta.sliding_window is None and meta.dcp_size == 1
            whole = start == 0 and n == ctx and plain  # a whole prompt (or its first chunk)
            own = whole and new_kv is not None  # its K/V are exactly this step's rows
            if own:
                kc, vc = new_kv[0][a:b], new_kv[1][a:b]
            else:
                table = meta.block_tables[i, : (ctx + bs - 1) // bs]
                if kv_scales is not None:  # fp8: this sequence's rows dequantised (the cache stays 8-bit)
                    slots = (table.unsqueeze(1) * bs + torch.arange(bs, device=table.device)).reshape(-1)[:ctx]
                    kc, vc = (gather_gqa(kv_layer[j], kv_scales[j], slots, q.dtype) for j in (0, 1))
                else:
                    # kv_layer[0][table], not kv_layer[0, table]: the mixed index is far slower (docs/performance.md)
                    kc, vc = (kv_layer[j][table].reshape(-1, hkv, d)[:ctx] for j in (0, 1))
            if kernel and start + n == ctx:
                # a whole prompt, or a later chunk that sees every earlier key: causal with its queries at the end
                o, lse = kernels.prefill_attention(qi, kc, vc, scale)
                outs.append(o)
                lses.append(lse)
                continue
            qb = qi.transpose(0, 1).unsqueeze(0)
            kb, vb = (x.transpose(0, 1).unsqueeze(0) for x in (kc, vc))
            if not own:  # gathered rows: contiguous [1, Hkv, ctx, D], as the flash kernel is far slower on strided K/V
                kb, vb = kb.contiguous(), vb.contiguous()
            o, lse = attend_prefill_seq(qb, kb, vb, meta, start, ctx, scale, whole, plain)
            outs.append(o)
            lses.append(lse)
        if len(outs) == 1:
            return outs[0], lses[0]
        return torch.cat(outs), torch.cat(lses)

    def _decode(self, q, kv_layer, meta, scale, kv_scales=None):
        # One query per sequence: view its Hq heads as [Hkv, group] rows so GQA needs no KV copy per head.
        if self.cpu_kernels and q.device.type == "cpu" and kv_scales is not None:  # fp8, dequantised in registers
            return kernels.paged_decode_attention_fp8(
                q,
                kv_layer[0],
                kv_layer[1],
                kv_scales[0],
                kv_scales[1],
                meta.block_tables,
                meta.context_lens,
                meta.sliding_window,
                scale,
            )
        if self.cpu_kernels and q.device.type == "cpu":
            return kernels.paged_decode_attention(
                q, kv_layer[0], kv_layer[1], meta.block_tables, meta.context_lens, meta.sliding_window, scale
            )
        b, hq, d = q.shape
        hkv, bs = kv_layer.shape[-2], kv_layer.shape[2]
        slots, mask, empty = meta.derived.get("decode") or self._decode_plan(meta, bs, q.dtype, q.device)
        max_ctx = mask.shape[-1]
        # Contiguous [B, Hkv, L, D]: the CPU flash kernel is much slower on strided K/V (docs/performance.md).
        if kv_scales is not None:  # fp8 (CUDA, or no C++ kernels): the batch's rows dequantised
            k, v = (gather_gqa(kv_layer[j], kv_scales[j], slots, q.dtype) for j in (0, 1))
        else:
            k, v = (kv_layer[j].view(-1, hkv, d).index_select(0, slots) for j in (0, 1))
        k = k.view(b, max_ctx, hkv, d).transpose(1, 2).contiguous()
        v = v.view(b, max_ctx, hkv, d).transpose(1, 2).contiguous()
        qg = q.view(b, hkv, hq // hkv, d)
        o, lse = attend(qg, k, v, False, scale, mask)
        o, lse = o.reshape(b, hq, d), lse.reshape(b, hq)
        if empty is not None:
            o = o.masked_fill(empty.view(b, 1, 1), 0.0)
            lse = lse.masked_fill(empty.view(b, 1), float("-inf"))
        return o, lse

    @staticmethod
    def _decode_plan(meta: AttentionMetadata, bs: int, dtype: torch.dtype, device: torch.device):
        """Flat cache slots of every sequence's keys, the padding/window mask, and which rows have no keys, all on
        the queries' device (context_lens lives on the host)."""
        ctx = meta.context_lens
        b = ctx.shape[0]
        max_ctx = max(int(ctx.max()), 1)
        ctx = ctx.to(device)
        idx = torch.arange(max_ctx, device=device)
        table = meta.block_tables[:, : (max_ctx + bs - 1) // bs].to(device)
        slots = (table.gather(1, (idx // bs).unsqueeze(0).expand(b, -1)) * bs + idx % bs).reshape(-1)
        allowed = idx.unsqueeze(0) < ctx.unsqueeze(1)
        if meta.sliding_window is not None:
            allowed &= idx.unsqueeze(0) > (ctx.unsqueeze(1) - 1 - meta.sliding_window)
        empty: torch.Tensor | None
        empty = ctx == 0
        if bool(empty.any()):
            allowed[empty, 0] = True  # keep the kernel finite; these rows are zeroed after
        else:
            empty = None
        # off CPU, rows at an aligned stride so attend() uses the mask of every layer as it is
        width = max_ctx if device.type == "cpu" else -(-max_ctx // _BIAS_ALIGN) * _BIAS_ALIGN
        mask = torch.zeros(b, width, dtype=dtype, device=device)[:, :max_ctx].masked_fill_(~allowed, float("-inf"))
        mask = mask.view(b, 1, 1, max_ctx)
        meta.derived["decode"] = (slots, mask, empty)
        return slots, mask, empty


def attend_prefill_seq(
    qb: torch.Tensor,
    kb: torch.Tensor,
    vb: torch.Tensor,
    meta: AttentionMetadata,
    start: int,
    ctx: int,
    scale: float,
    whole: bool,
    plain: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill attention: qb [1, Hq, n, D] over its ctx local keys kb/vb [1, Hkv, ctx, D], causal by
    absolute position (and window / DCP shard). Returns (out [n, Hq, D], lse [n, Hq]); rows with no key give 0 / -inf.

    whole: the queries are the whole prompt so far (keys = queries, aligned); plain: no window and no DCP."""
    n = qb.shape[2]
    if whole:
        o, lse = attend(qb, kb, vb, True, scale)
        return o[0].transpose(0, 1), lse[0].transpose(0, 1)
    if start > 0 and start + n == ctx and plain:
        # A later chunk of a chunked prefill: every earlier key is visible (no mask) and the chunk's own keys
        # are causal and aligned with its queries, so two fused calls merged by LSE replace one call with an
        # [n, ctx] mask (which costs a mask build per layer and the kernel's slow masked path).
        o1, lse1 = attend(qb, kb[:, :, :start], vb[:, :, :start], False, scale)
        o2, lse2 = attend(qb, kb[:, :, start:], vb[:, :, start:], True, scale)
        o, lse = merge_attn_states(
            torch.stack([o1[0].transpose(0, 1), o2[0].transpose(0, 1)]),
            torch.stack([lse1[0].transpose(0, 1), lse2[0].transpose(0, 1)]),
        )
        return o.to(qb.dtype), lse  # the merge sums in float32
    qpos = torch.arange(start, start + n).unsqueeze(1)
    kpos = meta.key_positions(ctx).unsqueeze(0)
    allowed = kpos <= qpos
    if meta.sliding_window is not None:
        allowed &= kpos > qpos - meta.sliding_window
    allowed = allowed.to(qb.device)  # positions are host-side (query_start_pos, key_positions)
    none = ~allowed.any(dim=1)
    allowed[none, 0] = True  # keep the kernel finite; these rows are zeroed below
    mask = torch.zeros(n, ctx, dtype=qb.dtype, device=qb.device).masked_fill_(~allowed, float("-inf"))
    o, lse = attend(qb, kb, vb, False, scale, mask.view(1, 1, n, ctx))
    o, lse = o[0].transpose(0, 1), lse[0].transpose(0, 1)
    if bool(none.any()):
        o = o.masked_fill(none.view(n, 1, 1), 0.0)
        lse = lse.masked_fill(none.view(n, 1), float("-inf"))
    return o, lse
