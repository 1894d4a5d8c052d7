"""Multi-head latent attention over the paged latent cache with torch's fused kernels (which return LSE; see
torch_backend.attend: the flash kernel on CPU, the memory-efficient one on CUDA).

Prefill expands the latent into per-head K/V (cheaper when queries are many); decode keeps the latent and attends
with the absorbed query as one head shared by all query heads, reading each cached row once."""

from __future__ import annotations

from typing import Callable

import torch

from pdserve import kernels
from pdserve.attention.base import AttentionMetadata
from pdserve.attention.torch_backend import TorchAttentionBackend, attend, attend_prefill_seq
from pdserve.engine.kv_quant import gather_latent


class TorchMLABackend:
    name = "torch"

    def __init__(self) -> None:
        self.cpu_kernels: bool | None = None  # decided on the first CPU decode (building the kernels needs a compiler)

    def forward_prefill(
        self,
        q: torch.Tensor,
        latent_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
        new_latent: torch.Tensor | None = None,
        kv_scales: torch.Tensor | None = None,
        kv_lora_rank: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bs, c = latent_layer.shape[1], latent_layer.shape[2]
        outs: list[torch.Tensor | None] = []
        lses: list[torch.Tensor] = []
        for i in range(meta.num_seqs):
            a, b = meta.cu_seqlens_q[i], meta.cu_seqlens_q[i + 1]
            qi = q[a:b]
            n, ctx = qi.shape[0], int(meta.context_lens[i])
            start = meta.query_start_pos[i]
            plain = meta.sliding_window is None and meta.dcp_size == 1
            whole = start == 0 and n == ctx and plain
            if ctx == 0:  # a DCP rank that holds none of this sequence's tokens yet
                outs.append(None)
                lses.append(torch.full((n, q.shape[1]), float("-inf"), device=q.device))
                continue
            if whole and new_latent is not None:  # its latent rows are exactly this step's
                rows = new_latent[a:b]
            else:
                table = meta.block_tables[i, : (ctx + bs - 1) // bs]
                if kv_scales is not None:  # fp8: this sequence's rows dequantised (the cache stays 8-bit)
                    slots = (table.unsqueeze(1) * bs + torch.arange(bs, device=table.device)).reshape(-1)[:ctx]
                    rows = gather_latent(latent_layer, kv_scales, slots, kv_lora_rank, q.dtype)
                else:
                    rows = latent_layer[table].reshape(-1, c)[:ctx]
            k, v = expand(rows)
            d = max(q.shape[-1], k.shape[-1], v.shape[-1])
            # The kernel wants one head size for Q, K and V: zero columns change neither scores nor outputs.
            qb, kb, vb = (_pad(x, d).transpose(0, 1).unsqueeze(0) for x in (qi, k, v))
            o, lse = attend_prefill_seq(qb, kb, vb, meta, start, ctx, scale, whole, plain)
            outs.append(o[..., : v.shape[-1]])
            lses.append(lse)
        dv = next((o.shape[-1] for o in outs if o is not None), None)
        if dv is None:  # no local keys for any sequence: the width comes from one (empty) expansion
            dv = expand(latent_layer.view(-1, c)[:0])[1].shape[-1]
        filled = [
            torch.zeros(lse.shape[0], q.shape[1], dv, dtype=q.dtype, device=q.device) if o is None else o
            for o, lse in zip(outs, lses)
        ]
        if len(filled) == 1:
            return filled[0], lses[0]
        return torch.cat(filled), torch.cat(lses)

    def forward_decode(
        self,
        q: torch.Tensor,
        latent_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        kv_scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, h, c = q.shape
        bs = latent_layer.shape[1]
        # fp8 latents carry two scales per row (latent, rope part): they take the gather path below
        if q.device.type == "cpu" and meta.sliding_window is None and kv_scales is None:
            if self.cpu_kernels is None:
                self.cpu_kernels = kernels.available()
            if self.cpu_kernels:
                # The latent rows in place as one shared K = V head: no gathered, padded copy of every row per
                # layer, which took most of a large batch's step (docs/performance.md, "bench dcp").
                cache = latent_layer.view(latent_layer.shape[0], bs, 1, c)
                o, lse = kernels.paged_decode_attention(
                    q, cache, cache, meta.block_tables, meta.context_lens, None, scale
                )
                return o[..., :v_dim], lse
        plan = meta.derived.get("decode") or TorchAttentionBackend._decode_plan(meta, bs, q.dtype, q.device)
        slots, mask, empty = plan
        max_ctx = mask.shape[-1]
        # One shared head: K and V are the same latent rows (V reads their first v_dim values), gathered once.
        if kv_scales is not None:  # fp8: the batch's rows dequantised; v_dim is the latent part's width
            kv = gather_latent(latent_layer, kv_scales, slots, v_dim, q.dtype).view(b, 1, max_ctx, c)
        else:
            kv = latent_layer.view(-1, c).index_select(0, slots).view(b, 1, max_ctx, c)
        o, lse = attend(q.view(b, 1, h, c), kv, kv, False, scale, mask)
        o, lse = o.reshape(b, h, c)[..., :v_dim], lse.reshape(b, h)
        if empty is not None:
            o = o.masked_fill(empty.view(b, 1, 1), 0.0)
            lse = lse.masked_fill(empty.view(b, 1), float("-inf"))
        return o, lse


def _pad(x: torch.Tensor, d: int) -> torch.Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))
