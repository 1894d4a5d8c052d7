"""Staged reads (kv_transfer.staging): reading the planned runs of whole source blocks into a buffer and
scattering it lands exactly the bytes plan_reshard's segments say, for same-layout and re-shard plans."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from kv_reference import empty_region, full_kv, random_tables, write_rank

from kv_transfer.layout import KVLayout
from kv_transfer.plan import apply_segments, plan_reshard
from kv_transfer.staging import plan_staging, scatter


def _layout(kvh, tp, dcp=1, bs=16, nb=40, dim=16):
    return KVLayout(
        num_layers=3,
        num_kv_heads=kvh,
        head_dim=dim,
        dtype="float32",
        block_size=bs,
        tp_size=tp,
        dcp_size=dcp,
        num_blocks=nb,
    )


CASES = [  # (kv heads, prefill tp, decode tp, decode dcp, decode block size, shuffled tables)
    (2, 1, 1, 1, 16, True),
    (2, 1, 1, 1, 16, False),
    (2, 2, 1, 1, 32, True),
    (2, 1, 2, 1, 16, True),
    (1, 1, 2, 2, 16, True),
    (2, 2, 4, 2, 16, True),
]


@pytest.mark.parametrize("kvh,src_tp,dst_tp,dcp,dbs,shuffled", CASES)
def test_staged_read_then_scatter_matches_direct_copy(kvh, src_tp, dst_tp, dcp, dbs, shuffled):
    tokens = 150
    src, dst = _layout(kvh, src_tp), _layout(kvh, dst_tp, dcp, bs=dbs)
    rng = random.Random(kvh * 100 + dst_tp * 10 + dcp)
    if shuffled:
        src_tables, dst_tables = random_tables(src, tokens, rng), random_tables(dst, tokens, rng)
    else:
        src_tables = [list(range(src.blocks_needed(tokens, r))) for r in range(src_tp)]
        dst_tables = [list(range(dst.blocks_needed(tokens, r))) for r in range(dst_tp)]
    full = full_kv(src, tokens, 3)
    src_regions = {}
    for r in range(src_tp):
        src_regions[r] = empty_region(src, 100 + r)
        write_rank(src, r, full, src_tables[r], src_regions[r])
    plan = plan_reshard(src, src_tables, dst, dst_tables, tokens)
    used = 0
    for d in range(dst_tp):
        rp = plan.ranks[d]
        want = empty_region(dst, 500 + d)
        apply_segments(
            {r: t.view(-1).view(torch.uint8).numpy() for r, t in src_regions.items()},
            want.view(-1).view(torch.uint8).numpy(),
            plan.segments(d),
        )
        staged = plan_staging(rp.base, src.block_nbytes, rp.dst_plane_nbytes)
        if staged is None:
            continue
        used += 1
        assert staged.stage_plane_nbytes >= rp.base.total_nbytes
        # the READ: every run of every plane, back to back in the buffer (what NIXL does one-sidedly)
        planes = range(0, 2 * src.num_layers)
        stage = torch.full((len(planes) * staged.stage_plane_nbytes,), 0xAB, dtype=torch.uint8)
        for i, p in enumerate(planes):
            for r, so, st, n in zip(staged.run_rank, staged.run_src_offset, staged.run_stage_offset, staged.run_nbytes):
                srcb = src_regions[int(r)].view(-1).view(torch.uint8)
                a = p * rp.src_plane_nbytes + int(so)
                b = i * staged.stage_plane_nbytes + int(st)
                stage[b : b + int(n)] = srcb[a : a + int(n)]
        got = empty_region(dst, 500 + d)
        scatter(staged, stage, got, range(0, 2), rp.dst_plane_nbytes)  # in two layer groups
        scatter(staged, stage[2 * staged.stage_plane_nbytes :], got, range(2, len(planes)), rp.dst_plane_nbytes)
        assert torch.equal(got, want), f"decode rank {d}"
    assert used, "no rank of this case was staged"


def test_contiguous_tables_stage_one_run_per_plane():
    src = dst = _layout(2, 1)
    tables = [list(range(src.blocks_needed(112, 0)))]  # 7 whole blocks: every staged row lands
    rp = plan_reshard(src, tables, dst, tables, 112).ranks[0]
    staged = plan_staging(rp.base, src.block_nbytes, rp.dst_plane_nbytes)
    assert staged is not None and len(staged) == 1 and staged.stage_rows is None
    assert np.array_equal(staged.run_nbytes, [len(tables[0]) * src.block_nbytes])
