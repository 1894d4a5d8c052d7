"""GPU multi-head latent attention: decode through flashinfer's BatchMLAPagedAttentionWrapper, prefill as torch's.

Decode is the absorbed form: every query head attends over the shared latent rows of the paged cache
[num_blocks, block_size, kv_lora_rank + rope_dim]. flashinfer takes the latent ("ckv", the first kv_lora_rank values
of a row) and its RoPE part ("kpe", the rest) as two paged tensors; both are views of the one cache, so nothing is
copied. It reports LSE in base 2: converted to natural log so DCP's merge applies unchanged. Prefill (expanded form,
many queries) stays on the torch kernels, which run on CUDA as well.

Chosen on CUDA by select_mla_backend when flashinfer imports; flashinfer's MLA kernels take fp16 / bf16 only, so an
fp32 model decodes with the torch kernels (logged once)."""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from pdserve.attention.base import AttentionMetadata
from pdserve.attention.torch_mla import TorchMLABackend

log = logging.getLogger("pdserve.attention")

_LN2 = math.log(2.0)
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def mla_paged_indices(meta: AttentionMetadata, block_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flashinfer's CSR page table for this rank's share of every sequence: (kv_indptr, kv_indices, kv_len), int32.
    A sequence with no local tokens (an empty DCP shard) gets one token of its first page, masked out afterwards."""
    ctx = meta.context_lens.clamp(min=1)
    pages = (ctx + block_size - 1) // block_size
    indptr = torch.zeros(len(ctx) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(pages, 0)
    width = meta.block_tables.shape[1]
    keep = torch.arange(width).unsqueeze(0) < pages.unsqueeze(1)
    indices = meta.block_tables[keep].to(torch.int32)  # row-major: each sequence's pages in order
    return indptr, indices, ctx.to(torch.int32)


class FlashInferMLABackend:
    name = "flashinfer"

    def __init__(self, device: torch.device, workspace_bytes: int = 128 * 1024 * 1024) -> None:
        import flashinfer  # ImportError: select_mla_backend keeps the torch kernels

        self.device = device
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(self._workspace, backend="auto")
        self._torch = TorchMLABackend()
        self._planned_for: tuple | None = None  # (id of the step's metadata, dtypes): planned once per step
        self._warned_dtype = False

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
        return self._torch.forward_prefill(q, latent_layer, meta, scale, expand, new_latent, kv_scales, kv_lora_rank)

    def forward_decode(
        self,
        q: torch.Tensor,
        latent_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,
        kv_scales: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_scales is not None:  # fp8 latent: the torch kernels dequantise per block
            return self._torch.forward_decode(q, latent_layer, meta, scale, v_dim, kv_scales)
        if q.dtype not in _KERNEL_DTYPES or latent_layer.dtype not in _KERNEL_DTYPES or meta.sliding_window:
            if not self._warned_dtype:
                log.warning(
                    "flashinfer MLA decode needs fp16/bf16 and full attention (got %s, window %s); "
                    "using the torch MLA kernels",
                    q.dtype,
                    meta.sliding_window,
                )
                self._warned_dtype = True
            return self._torch.forward_decode(q, latent_layer, meta, scale, v_dim)
        b, h, c = q.shape
        bs = latent_layer.shape[1]
        key = (id(meta), q.dtype, latent_layer.dtype, h, c)
        if self._planned_for != key:
            indptr, indices, kv_len = mla_paged_indices(meta, bs)
            qo = torch.arange(b + 1, dtype=torch.int32)  # one query token per sequence
            self._wrapper.plan(
                qo.to(self.device),
                indptr.to(self.device),
                indices.to(self.device),
                kv_len.to(self.device),
                h,
                v_dim,
                c - v_dim,
                bs,
                False,
                scale,
                q.dtype,
                latent_layer.dtype,
            )
            self._planned_for = key
        out, lse2 = self._wrapper.run(
            q[..., :v_dim].contiguous(),
            q[..., v_dim:].contiguous(),
            latent_layer[..., :v_dim],
            latent_layer[..., v_dim:],
            return_lse=True,
        )
        lse = lse2.float() * _LN2
        empty = meta.context_lens.to(q.device) == 0
        if bool(empty.any()):
            out = out.masked_fill(empty.view(b, 1, 1), 0.0)
            lse = lse.masked_fill(empty.view(b, 1), float("-inf"))
        return out, lse.to(q.dtype)
