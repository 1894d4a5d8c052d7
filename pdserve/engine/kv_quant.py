"""fp8 KV cache: 8-bit K/V (or MLA latent) with float32 scales per (layer, plane, block, group) beside the cache.

A group is one local KV head (GQA) or one part of an MLA latent row (0: the compressed latent, 1: its rope part).
Scales come from the data (docs/DESIGN.md, "fp8 KV cache"): when a sequence's first block on a rank is opened, each
group's scale is ``HEADROOM * amax / fp8_max`` over that step's rows of the sequence (the prompt, or its first
chunk); every later block the sequence opens on that rank copies the scale of its first block, so all of a
sequence's blocks on a rank share one scale per (layer, plane, group), and a block's scale never changes while it
holds data. Values beyond the scale's range (a later token larger than ``HEADROOM`` times the prompt's largest)
saturate at +-fp8_max instead of becoming inf/NaN."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# vLLM's names; "fp8" means fp8_e4m3 there too
FP8_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# The prompt's amax maps to fp8_max / HEADROOM, so decode tokens up to 2x larger still fit; fp8 is floating point,
# so the headroom costs one exponent step of the 15 (e4m3) below the largest value, not mantissa bits.
HEADROOM = 2.0
# A group whose rows are all zero still gets a finite, positive scale (dequantising gives back zeros).
MIN_AMAX = 1e-6
# MLA scales: the latent and its rope part are scaled apart (their magnitudes differ by an order).
MLA_GROUPS = 2


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's torch dtype for EngineConfig.kv_cache_dtype ("auto": the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    try:
        return FP8_DTYPES[kv_cache_dtype]
    except KeyError:
        raise ValueError(f"kv_cache_dtype must be auto, fp8, fp8_e4m3 or fp8_e5m2, got {kv_cache_dtype!r}") from None


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_MAX


@dataclass
class KVQuant:
    """One step's fp8 bookkeeping on one rank, built once per step (model runner) and used by every layer."""

    scales: torch.Tensor  # [layers, planes, num_blocks, groups] float32, the rank's scale region
    dtype: torch.dtype  # the cache's fp8 dtype
    block_size: int
    row_block: torch.Tensor  # [R] int64: per locally stored row (slot >= 0), the block whose scale it uses
    local_rows: torch.Tensor | None  # [R] rows of the step stored here; None: every row
    written: torch.Tensor  # [W] blocks written this step
    written_src: torch.Tensor  # [W] the block each takes its scale from (the sequence's first block here)
    fresh: list[tuple[int, int, int]]  # (first row, end row, block): sequences whose first block here opens now

    @property
    def fp8_max(self) -> float:
        return FP8_MAX[self.dtype]

    @staticmethod
    def for_step(
        scales: torch.Tensor,
        dtype: torch.dtype,
        block_size: int,
        slot_mapping: torch.Tensor,
        cu_seqlens_q: list[int],
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> "KVQuant":
        dev = scales.device
        slots = slot_mapping.cpu()
        local = slots >= 0
        first_block = block_tables[:, 0].cpu()
        seq_of_row = torch.repeat_interleave(
            torch.arange(len(cu_seqlens_q) - 1), torch.tensor([b - a for a, b in zip(cu_seqlens_q, cu_seqlens_q[1:])])
        )
        fresh = []
        ctx = context_lens.tolist()
        for i, (a, b) in enumerate(zip(cu_seqlens_q, cu_seqlens_q[1:])):
            n_local = int(local[a:b].sum())
            # ctx counts this step's rows: all of them here means nothing of this sequence was stored here before
            if n_local and ctx[i] == n_local:
                fresh.append((a, b, int(first_block[i])))
        all_local = bool(local.all())
        rows = None if all_local else local.nonzero().squeeze(1)
        row_block = first_block[seq_of_row] if all_local else first_block[seq_of_row[rows]]
        blocks = (slots if all_local else slots[rows]) // block_size
        pairs = torch.unique(torch.stack([blocks, row_block], dim=1), dim=0)
        return KVQuant(
            scales=scales,
            dtype=dtype,
            block_size=block_size,
            row_block=row_block.to(dev),
            local_rows=None if rows is None else rows.to(dev),
            written=pairs[:, 0].to(dev),
            written_src=pairs[:, 1].to(dev),
            fresh=fresh,
        )

    def set_scales(self, layer: int, planes: list[torch.Tensor], groups: list[torch.Tensor] | None = None) -> None:
        """Scales of layer ``layer`` for this step's writes: fresh sequences' first blocks from their rows' amax
        (planes: this step's rows per plane, [T, G, W] per group; MLA passes [T, C] with ``groups`` = the column
        ranges of each group), then every written block from its sequence's first block."""
        sc = self.scales[layer]
        for a, b, blk in self.fresh:
            amax = torch.stack([_group_amax(p[a:b], groups) for p in planes])  # [planes, G]
            sc[:, blk] = amax.clamp_min(MIN_AMAX) * (HEADROOM / self.fp8_max)
        if self.written.numel():
            sc[:, self.written] = sc[:, self.written_src]

    def local(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.local_rows is None else x[self.local_rows]


def _group_amax(x: torch.Tensor, groups: list[torch.Tensor] | None) -> torch.Tensor:
    """[G] float32 largest |value| per group: x [n, G, W] (GQA heads) or x [n, C] split by ``groups``' columns."""
    if groups is None:
        return x.abs().amax(dim=(0, 2)).float()
    return torch.stack([x[:, g].abs().amax() for g in groups]).float()


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / scale rounded to fp8, saturating at +-fp8_max (no inf / NaN): x [..., W], scale broadcastable to it."""
    m = FP8_MAX[dtype]
    return (x.float() / scale).clamp_(-m, m).to(dtype)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q * scale in ``dtype``: q fp8 [..., W], scale float32 broadcastable to it."""
    return (q.float() * scale).to(dtype)


def mla_groups(kv_lora_rank: int, latent_dim: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """Column indices of an MLA latent row's two scale groups: the compressed latent, then its rope part."""
    return [torch.arange(0, kv_lora_rank, device=device), torch.arange(kv_lora_rank, latent_dim, device=device)]


def mla_column_group(kv_lora_rank: int, latent_dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[C] int64: the scale group of each latent column (0 for the latent, 1 for the rope part)."""
    return (torch.arange(latent_dim, device=device) >= kv_lora_rank).long()


def write_kv_fp8(
    kv_layer: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, q: KVQuant
) -> None:
    """write_kv for an fp8 cache: k, v [T, Hkv, D] quantised per (block, head) into their slots (-1: not here)."""
    q.set_scales(layer, [k, v])
    sc = q.scales[layer]  # [2, blocks, Hkv]
    slots = q.local(slot_mapping)
    if slots.numel() == 0:
        return
    kvh, d = kv_layer.shape[-2], kv_layer.shape[-1]
    for plane, x in enumerate((k, v)):
        rows = quantize(q.local(x), sc[plane, q.row_block].unsqueeze(-1), q.dtype)
        # index_copy_ has no fp8 kernel on CPU: the same bytes go in through uint8 views
        kv_layer[plane].view(torch.uint8).view(-1, kvh, d).index_copy_(0, slots, rows.view(torch.uint8))


def write_latent_fp8(
    latent_layer: torch.Tensor,
    layer: int,
    rows: torch.Tensor,
    slot_mapping: torch.Tensor,
    q: KVQuant,
    kv_lora_rank: int,
) -> None:
    """write_latent for an fp8 cache: latent rows [T, C] quantised per (block, part) into their slots."""
    c = rows.shape[-1]
    q.set_scales(layer, [rows], mla_groups(kv_lora_rank, c, rows.device))
    slots = q.local(slot_mapping)
    if slots.numel() == 0:
        return
    s = q.scales[layer][0, q.row_block][:, mla_column_group(kv_lora_rank, c, rows.device)]  # [R, C]
    out = quantize(q.local(rows), s, q.dtype)
    latent_layer.view(torch.uint8).view(-1, c).index_copy_(0, slots, out.view(torch.uint8))


def gather_gqa(plane: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``slots`` of one fp8 plane [blocks, bs, Hkv, D] dequantised to ``dtype``: [N, Hkv, D]. scales: the
    plane's [blocks, Hkv]."""
    kvh, d = plane.shape[-2], plane.shape[-1]
    rows = plane.view(-1, kvh, d).index_select(0, slots)
    return dequantize(rows, scales[slots // plane.shape[1]].unsqueeze(-1), dtype)


def gather_latent(
    latent_layer: torch.Tensor, scales: torch.Tensor, slots: torch.Tensor, kv_lora_rank: int, dtype: torch.dtype
) -> torch.Tensor:
    """Latent rows ``slots`` of an fp8 latent layer [blocks, bs, C] dequantised: [N, C]. scales: [1, blocks, 2]."""
    c = latent_layer.shape[-1]
    rows = latent_layer.view(-1, c).index_select(0, slots)
    s = scales[0, slots // latent_layer.shape[1]][:, mla_column_group(kv_lora_rank, c, rows.device)]
    return dequantize(rows, s, dtype)
