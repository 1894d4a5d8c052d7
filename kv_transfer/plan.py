"""Re-shard plan: which bytes of which prefill rank land where in each decode rank's region.

A pure function of the two layouts and the block tables. The plan is computed once for the
(layer 0, K) plane and shifted per plane (a layer's K or V; an MLA layer's latent), because every
plane of a region has the same block/slot/head geometry: only the plane's base offset changes. That keeps an 8k-token,
30-layer plan in the low milliseconds and lets a transport move any layer (group) on its own.

Segments are byte copies ``(src_rank, src_offset, dst_offset, nbytes)``; adjacent rows that are
contiguous on both sides (consecutive heads of a slot, consecutive slots of a block, and even
consecutive blocks when both block tables happen to be consecutive) are merged into one.

MLA caches are one replicated latent "head" with one plane per layer (see layout.py), so the same
planner gives each decode rank exactly the tokens of its DCP shard, spread over the prefill ranks
that all hold the whole latent.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class Segments:
    """A batch of byte copies, sorted by destination offset. Offsets are region-relative."""

    src_rank: np.ndarray  # int32, prefill tp rank to read from
    src_offset: np.ndarray  # int64
    dst_offset: np.ndarray  # int64
    nbytes: np.ndarray  # int64

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    def __iter__(self) -> Iterator[tuple[int, int, int, int]]:
        return zip(self.src_rank.tolist(), self.src_offset.tolist(), self.dst_offset.tolist(), self.nbytes.tolist())

    @property
    def total_nbytes(self) -> int:
        return int(self.nbytes.sum())

    def src_ranks(self) -> list[int]:
        return np.unique(self.src_rank).tolist()

    def from_src_rank(self, rank: int) -> "Segments":
        m = self.src_rank == rank
        return Segments(self.src_rank[m], self.src_offset[m], self.dst_offset[m], self.nbytes[m])

    def shifted(self, src_delta: int, dst_delta: int) -> "Segments":
        return Segments(self.src_rank, self.src_offset + src_delta, self.dst_offset + dst_delta, self.nbytes)

    @staticmethod
    def concat(parts: Sequence["Segments"]) -> "Segments":
        if not parts:
            return _empty_segments()
        return Segments(
            np.concatenate([p.src_rank for p in parts]),
            np.concatenate([p.src_offset for p in parts]),
            np.concatenate([p.dst_offset for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
        )


@dataclass(frozen=True)
class RankPlan:
    """Everything one decode rank reads. ``base`` is the (layer 0, K) plane."""

    dst_rank: int
    base: Segments
    src_plane_nbytes: int
    dst_plane_nbytes: int
    planes_per_layer: int = 2  # K and V; 1 for an MLA latent cache

    def plane_index(self, layer: int, kv: int) -> int:
        return self.planes_per_layer * layer + kv

    def plane_segments(self, layer: int, kv: int) -> Segments:
        plane = self.plane_index(layer, kv)
        return self.base.shifted(plane * self.src_plane_nbytes, plane * self.dst_plane_nbytes)

    def layer_segments(self, layer: int) -> Segments:
        """Every plane of one layer (K then V, or the latent)."""
        return Segments.concat([self.plane_segments(layer, kv) for kv in range(self.planes_per_layer)])

    def segments(self, layers: range) -> Segments:
        return Segments.concat([self.layer_segments(layer) for layer in layers])

    def src_ranks(self) -> list[int]:
        return self.base.src_ranks()

    @property
    def nbytes_per_layer(self) -> int:
        return self.planes_per_layer * self.base.total_nbytes


@dataclass(frozen=True)
class ReshardPlan:
    src: KVLayout
    dst: KVLayout
    num_tokens: int
    layers: range
    ranks: dict[int, RankPlan]  # decode tp rank -> its reads

    def segments(self, dst_rank: int, layers: range | None = None) -> Segments:
        return self.ranks[dst_rank].segments(self.layers if layers is None else layers)

    def layer_segments(self, dst_rank: int, layer: int) -> Segments:
        return self.ranks[dst_rank].layer_segments(layer)

    @property
    def total_nbytes(self) -> int:
        return sum(rp.nbytes_per_layer for rp in self.ranks.values()) * len(self.layers)


def plan_reshard(
    src: KVLayout,
    src_block_tables: Sequence[Sequence[int]],
    dst: KVLayout,
    dst_block_tables: Sequence[Sequence[int]] | Mapping[int, Sequence[int]],
    num_tokens: int,
    layers: range | None = None,
    dst_ranks: Sequence[int] | None = None,
) -> ReshardPlan:
    """Plan the copy of the first ``num_tokens`` tokens of a request from ``src`` to ``dst``.

    ``src_block_tables[r]`` / ``dst_block_tables[r]``: the request's block table on tp rank r.
    ``dst_ranks`` restricts the plan to some decode ranks (a decode rank plans only its own
    reads; the other ranks' tables may then be missing). Layouts need ``num_blocks`` set.
    """
    if not src.same_model(dst):
        raise ValueError(f"layouts describe different KV tensors: {src} vs {dst}")
    if src.num_blocks <= 0 or dst.num_blocks <= 0:
        raise ValueError("plan_reshard needs num_blocks on both layouts")
    if num_tokens < 0:
        raise ValueError("num_tokens must be >= 0")
    if len(src_block_tables) != src.tp_size:
        raise ValueError(f"need {src.tp_size} prefill block tables, got {len(src_block_tables)}")
    layers = range(src.num_layers) if layers is None else layers
    if layers and (layers.start < 0 or layers[-1] >= src.num_layers or layers.step != 1):
        raise ValueError(f"bad layer range {layers} for {src.num_layers} layers")
    if dst_ranks is None:
        dst_ranks = range(dst.tp_size)

    src_tables = [checked_block_table(src, r, src_block_tables[r], num_tokens, "prefill") for r in range(src.tp_size)]
    tokens = np.arange(num_tokens, dtype=np.int64)
    ranks = {}
    for d in dst_ranks:
        dst_table = checked_block_table(dst, d, dst_block_tables[d], num_tokens, "decode")
        ranks[d] = RankPlan(
            dst_rank=d,
            base=_plan_rank_plane0(src, src_tables, dst, d, dst_table, tokens),
            src_plane_nbytes=src.plane_nbytes(),
            dst_plane_nbytes=dst.plane_nbytes(),
            planes_per_layer=dst.kv_planes,
        )
    return ReshardPlan(src=src, dst=dst, num_tokens=num_tokens, layers=layers, ranks=ranks)


def _plan_rank_plane0(
    src: KVLayout,
    src_tables: list[np.ndarray],
    dst: KVLayout,
    d: int,
    dst_table: np.ndarray,
    tokens: np.ndarray,
) -> Segments:
    """One row per (token held by decode rank d, kv head), then coalesced."""
    toks = tokens[dst.token_dcp_rank(tokens) == dst.dcp_rank(d)]
    li = dst.token_local_index(toks)
    dst_slot_off = (dst_table[li // dst.block_size] * dst.block_size + li % dst.block_size) * dst.token_nbytes

    src_dcp = src.token_dcp_rank(toks)
    src_li = src.token_local_index(toks)
    src_slot_off = np.empty_like(toks)
    parts = []
    dst_heads = dst.kv_heads_of_rank(d)
    for h in dst_heads:
        # Spread replicas: the i-th decode rank reading these tokens of head h reads from the i-th replica
        # (with MLA every rank holds the one latent head, and ranks of the same dcp_rank read the same tokens).
        spread = [r for r in dst.ranks_holding_head(h) if dst.dcp_rank(r) == dst.dcp_rank(d)].index(d)
        src_rank = np.empty_like(toks, dtype=np.int32)
        head_off = np.empty_like(toks)
        for sd in range(src.dcp_size):
            holders = [r for r in src.ranks_holding_head(h) if src.dcp_rank(r) == sd]
            r = holders[spread % len(holders)]
            m = src_dcp == sd
            sli = src_li[m]
            src_rank[m] = r
            src_slot = src_tables[r][sli // src.block_size] * src.block_size + sli % src.block_size
            src_slot_off[m] = src_slot * src.token_nbytes
            head_off[m] = (h - src.kv_heads_of_rank(r).start) * src.head_nbytes
        parts.append(
            Segments(
                src_rank,
                src_slot_off + head_off,
                dst_slot_off + (h - dst_heads.start) * dst.head_nbytes,
                np.full(toks.shape, dst.head_nbytes, dtype=np.int64),
            )
        )
    return coalesce(Segments.concat(parts))


def plan_scales(src: KVLayout, dst: KVLayout, d: int) -> list[list[tuple[int, int]]]:
    """Where decode rank ``d`` can take each of its fp8 scale groups (a KV head, or the MLA latent's two parts)
    from: per local group, every ``(prefill rank, its local group)`` holding it (replicas hold the same values).

    A sequence's blocks on one rank share one scale per (layer, plane, group) (pdserve/engine/kv_quant.py), so a
    group's scales are one value per (layer, plane), read from any prefill rank holding that head; the decode rank
    writes it into every block of the request, whichever prefill blocks the tokens came from. A DCP > 1 source
    would give each of its DCP ranks a scale of its own for one head, which one decode block could not hold, so it
    is refused."""
    if not src.same_model(dst):
        raise ValueError(f"layouts describe different KV tensors: {src} vs {dst}")
    if not dst.has_scales:
        return []
    if src.dcp_size != 1:
        raise ValueError(f"fp8 KV moves from a prefill side without DCP only (its dcp_size is {src.dcp_size})")
    if dst.use_mla:  # the latent is replicated on every rank, with the same scales
        return [[(r, g) for r in range(src.tp_size)] for g in range(dst.scale_groups)]
    return [
        [(r, h - src.kv_heads_of_rank(r).start) for r in src.ranks_holding_head(h)] for h in dst.kv_heads_of_rank(d)
    ]


def coalesce(segs: Segments) -> Segments:
    """Sort by destination and merge rows contiguous on both sides (same source rank)."""
    if len(segs) == 0:
        return segs
    order = np.argsort(segs.dst_offset, kind="stable")
    rank, so, do, nb = (a[order] for a in (segs.src_rank, segs.src_offset, segs.dst_offset, segs.nbytes))
    brk = np.ones(len(nb), dtype=bool)
    brk[1:] = (rank[1:] != rank[:-1]) | (so[1:] != so[:-1] + nb[:-1]) | (do[1:] != do[:-1] + nb[:-1])
    starts = np.flatnonzero(brk)
    return Segments(rank[starts], so[starts], do[starts], np.add.reduceat(nb, starts))


def checked_block_table(layout: KVLayout, rank: int, table: Sequence[int], num_tokens: int, side: str) -> np.ndarray:
    t = np.asarray(table, dtype=np.int64).reshape(-1)
    need = layout.blocks_needed(num_tokens, rank)
    if len(t) < need:
        raise ValueError(f"{side} rank {rank}: block table has {len(t)} blocks, {num_tokens} tokens need {need}")
    if len(t) and (t.min() < 0 or t.max() >= layout.num_blocks):
        raise ValueError(f"{side} rank {rank}: block id out of range [0, {layout.num_blocks})")
    return t


def _empty_segments() -> Segments:
    return Segments(np.empty(0, np.int32), np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.int64))


def apply_segments(
    src_regions: Mapping[int, np.ndarray],
    dst_region: np.ndarray,
    segs: Segments,
) -> None:
    """Apply copies with plain byte slicing (uint8 views). The reference data path and a CPU fallback."""
    for r, so, do, n in segs:
        dst_region[do : do + n] = src_regions[r][so : so + n]
