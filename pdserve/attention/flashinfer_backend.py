"""GPU attention through flashinfer's paged-KV wrappers (chosen when CUDA and flashinfer are present).

The cache layout [2, num_blocks, block_size, Hkv, D] per layer is flashinfer's "NHD" paged layout with K and V as
separate tensors. flashinfer reports LSE in base 2; it is converted to natural log so merge.py applies unchanged.
Not exercised by CI (no GPU there); the GPU check script runs it against the torch backend."""

from __future__ import annotations

import math

import flashinfer  # ImportError here makes select_backend fall back to torch
import torch

from pdserve.attention.base import AttentionMetadata

_LN2 = math.log(2.0)


class FlashInferAttentionBackend:
    name = "flashinfer"

    def __init__(self, device: torch.device, workspace_bytes: int = 128 * 1024 * 1024) -> None:
        self.device = device
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._planned_for: int | None = None  # id of the metadata the wrappers were planned for (once per step)

    def _paged_indices(self, meta: AttentionMetadata, block_size: int):
        ctx = meta.context_lens.clamp(min=1)  # an empty DCP shard still gets one (masked-out) page
        nblk = (ctx + block_size - 1) // block_size
        indptr = torch.zeros(len(ctx) + 1, dtype=torch.int32)
        indptr[1:] = torch.cumsum(nblk, 0)
        indices = torch.cat([meta.block_tables[i, : int(nblk[i])] for i in range(len(ctx))]).to(torch.int32)
        last = (ctx - (nblk - 1) * block_size).to(torch.int32)
        dev = self.device
        return indptr.to(dev), indices.to(dev), last.to(dev)

    def forward(self, q, kv_layer, meta: AttentionMetadata, scale: float, new_kv=None, kv_scales=None):
        if kv_scales is not None:  # the executor picks the torch backend for fp8 caches
            raise ValueError("the flashinfer backend reads model-dtype KV caches only; fp8 runs on the torch backend")
        hq, d = q.shape[1], q.shape[2]
        hkv, bs = kv_layer.shape[-2], kv_layer.shape[2]
        if self._planned_for != id(meta):
            indptr, indices, last = self._paged_indices(meta, bs)
            window = -1 if meta.sliding_window is None else meta.sliding_window - 1
            if meta.is_prefill:
                qo = torch.tensor(meta.cu_seqlens_q, dtype=torch.int32, device=self.device)
                self._prefill.plan(
                    qo,
                    indptr,
                    indices,
                    last,
                    hq,
                    hkv,
                    d,
                    bs,
                    causal=True,
                    sm_scale=scale,
                    window_left=window,
                    q_data_type=q.dtype,
                    kv_data_type=kv_layer.dtype,
                )
            else:
                self._decode.plan(
                    indptr,
                    indices,
                    last,
                    hq,
                    hkv,
                    d,
                    bs,
                    sm_scale=scale,
                    window_left=window,
                    q_data_type=q.dtype,
                    kv_data_type=kv_layer.dtype,
                )
            self._planned_for = id(meta)
        wrapper = self._prefill if meta.is_prefill else self._decode
        out, lse2 = wrapper.run(q.contiguous(), (kv_layer[0], kv_layer[1]), return_lse=True)
        lse = lse2.float() * _LN2
        empty = meta.context_lens.to(q.device) == 0
        if not meta.is_prefill and bool(empty.any()):
            out = out.masked_fill(empty.view(-1, 1, 1), 0.0)
            lse = lse.masked_fill(empty.view(-1, 1), float("-inf"))
        return out, lse.to(q.dtype)
