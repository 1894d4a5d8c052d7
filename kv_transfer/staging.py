"""Staged reads: fetch whole source blocks in a few big runs, then scatter them locally.

A re-shard plan over block tables that are not consecutive (any cache after some churn) has one segment per
block and plane, and one-sided transports pay a fixed cost per segment (UCX over CMA: one syscall each, so 12 KB
segments move at a fraction of memcpy speed; figures in docs/performance.md, "NIXL reads"). Sorted by source,
the blocks a decode rank needs are nearly consecutive, so reading them into a staging buffer takes a few large
segments per plane, and one torch ``index_copy_`` per layer group puts every row where the plan says. Only blocks
the plan touches are read (all of them belong to the lease). A plan is a pure function of the rank's base segments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from kv_transfer.plan import Segments

MAX_ROWS = 1 << 22  # per plane: beyond this the scatter index itself gets large; read directly instead


@dataclass(frozen=True)
class StagedPlan:
    """Runs of whole source blocks per (layer 0, K) plane, and where each staged row goes."""

    run_rank: np.ndarray  # prefill tp rank of each run
    run_src_offset: np.ndarray  # plane-relative byte offset of the run in the source region
    run_stage_offset: np.ndarray  # byte offset of the run in a staged plane
    run_nbytes: np.ndarray
    stage_plane_nbytes: int  # bytes one plane takes in the staging buffer
    unit: int  # row size in bytes: every segment is a whole number of rows on both sides
    stage_rows: torch.Tensor | None  # staged rows that land somewhere (None: all of them, in order)
    dst_rows: torch.Tensor  # destination row (within a decode plane) of each such staged row

    def __len__(self) -> int:
        return int(self.run_nbytes.shape[0])


def plan_staging(base: Segments, src_block_nbytes: int, dst_plane_nbytes: int) -> StagedPlan | None:
    """The staged form of ``base``, or None when rows would be too many/small to be worth it."""
    if len(base) == 0:
        return None
    bn = int(src_block_nbytes)
    unit = math.gcd(
        bn,
        int(dst_plane_nbytes),
        int(np.gcd.reduce(base.nbytes)),
        int(np.gcd.reduce(base.src_offset)),
        int(np.gcd.reduce(base.dst_offset)),
    )
    if unit < 64 or dst_plane_nbytes // unit > MAX_ROWS:
        return None
    rank, off, n = base.src_rank.astype(np.int64), base.src_offset, base.nbytes
    first, last = off // bn, (off + n - 1) // bn
    span = last - first + 1
    # every (rank, block) the segments touch, sorted: the staging order
    touched_rank = np.repeat(rank, span)
    touched_block = np.repeat(first, span) + _ranges(span)
    keys = np.unique(touched_rank << 40 | touched_block)
    k_rank, k_block = keys >> 40, keys & ((1 << 40) - 1)
    brk = np.ones(len(keys), dtype=bool)
    brk[1:] = (k_rank[1:] != k_rank[:-1]) | (k_block[1:] != k_block[:-1] + 1)
    starts = np.flatnonzero(brk)
    lengths = np.diff(np.append(starts, len(keys)))
    stage_plane = len(keys) * bn
    if stage_plane // unit > MAX_ROWS:
        return None
    # each segment's first byte in a staged plane, then its rows
    seg_stage = np.searchsorted(keys, rank << 40 | first) * bn + off % bn
    rows_per_seg = n // unit
    stage_rows = np.repeat(seg_stage // unit, rows_per_seg) + _ranges(rows_per_seg)
    dst_rows = np.repeat(base.dst_offset // unit, rows_per_seg) + _ranges(rows_per_seg)
    all_rows = stage_plane // unit
    if len(stage_rows) == all_rows:  # every staged row is used once: scatter straight from the buffer
        by_row = np.empty(all_rows, np.int64)
        by_row[stage_rows] = dst_rows
        rows_t, dst_t = None, torch.from_numpy(by_row)
    else:
        rows_t, dst_t = torch.from_numpy(stage_rows), torch.from_numpy(dst_rows)
    return StagedPlan(
        k_rank[starts].astype(np.int32),
        k_block[starts] * bn,
        starts * bn,
        lengths * bn,
        stage_plane,
        unit,
        rows_t,
        dst_t,
    )


def scatter(
    plan: StagedPlan, staging: torch.Tensor, region: torch.Tensor, planes: range, dst_plane_nbytes: int
) -> None:
    """Copy staged planes ``planes`` (staged back to back from the buffer's start) into the region."""
    unit, n = plan.unit, len(planes)
    stg = staging[: n * plan.stage_plane_nbytes].view(n, plan.stage_plane_nbytes // unit, unit)
    dst = region.view(-1).view(torch.uint8).view(-1, dst_plane_nbytes // unit, unit)[planes.start : planes.stop]
    rows = plan.dst_rows.to(region.device)
    if plan.stage_rows is None:
        dst.index_copy_(1, rows, stg)
    else:
        dst.index_copy_(1, rows, stg.index_select(1, plan.stage_rows.to(region.device)))


def _ranges(counts: np.ndarray) -> np.ndarray:
    """concat(arange(c) for c in counts), vectorised."""
    total = int(counts.sum())
    ends = np.cumsum(counts)
    return np.arange(total, dtype=np.int64) - np.repeat(ends - counts, counts)
