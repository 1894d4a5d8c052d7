"""KV block checksums (pdserve/pod/kv_checksum.py): the sum a prefill pod computes over its ranks' regions equals
the sum a decode pod computes over what it read, whatever the two layouts (TP heads, DCP tokens, replicated heads);
one damaged byte, or another request's block read in its place, changes the checksum of exactly that block. The copy
between the layouts is kv_transfer's reference data path (plan_reshard + apply_segments)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_transfer.layout import KVLayout
from kv_transfer.plan import apply_segments, plan_reshard
from pdserve.pod.kv_checksum import combine, first_mismatch, partial_checksums

NUM_BLOCKS = 24


def _layout(tp: int, dcp: int = 1, heads: int = 2, interleave: int = 1) -> KVLayout:
    return KVLayout(
        num_layers=3,
        num_kv_heads=heads,
        head_dim=8,
        dtype="float32",
        block_size=4,
        tp_size=tp,
        dcp_size=dcp,
        interleave=interleave,
        num_blocks=NUM_BLOCKS,
    )


def _regions(layout: KVLayout, seed: int) -> list[torch.Tensor]:
    """Random KV per rank; ranks holding the same heads hold the same bytes (as a pod's replicas compute them)."""
    g = torch.Generator().manual_seed(seed)
    by_heads: dict[range, torch.Tensor] = {}
    out = []
    for r in range(layout.tp_size):
        heads = layout.kv_heads_of_rank(r)
        if heads not in by_heads:
            by_heads[heads] = torch.randn(layout.region_shape(), generator=g)
        out.append(by_heads[heads].clone())
    return out


def _src_tables(layout: KVLayout, num_tokens: int, seed: int) -> list[list[int]]:
    """A prefill pod uses one block table on every rank."""
    return _tables(layout, num_tokens, seed)[:1] * layout.tp_size


def _tables(layout: KVLayout, num_tokens: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.permutation(NUM_BLOCKS)[: layout.blocks_needed(num_tokens, r)].tolist() for r in range(layout.tp_size)]


def _pod_sums(layout: KVLayout, regions: list[torch.Tensor], tables: list[list[int]], n: int, b: int) -> list[int]:
    return combine([partial_checksums(layout, r, regions[r], tables[r], n, b) for r in range(layout.tp_size)])


def _copy(src: KVLayout, src_regions, src_tables, dst: KVLayout, dst_tables, n: int) -> list[torch.Tensor]:
    plan = plan_reshard(src, src_tables, dst, dst_tables, n)
    dst_regions = [torch.zeros(dst.region_shape()) for _ in range(dst.tp_size)]
    src_bytes = {r: t.view(torch.uint8).reshape(-1).numpy() for r, t in enumerate(src_regions)}
    for d in range(dst.tp_size):
        apply_segments(src_bytes, dst_regions[d].view(torch.uint8).reshape(-1).numpy(), plan.segments(d))
    return dst_regions


CASES = [  # (prefill layout, decode layout)
    (_layout(1), _layout(1)),
    (_layout(2), _layout(4, 2)),  # decode TP 4 x DCP 2: each decode rank holds half the tokens of one head
    (_layout(1, heads=1), _layout(4, 2, heads=1, interleave=2)),  # one head on 4 decode ranks, tokens by 2
    (_layout(2, heads=1), _layout(2, 2, heads=1)),  # one head replicated on both prefill ranks
]


@pytest.mark.parametrize("src,dst", CASES)
def test_prefill_and_decode_sums_agree_across_layouts(src, dst):
    n = 37  # a partial last block
    src_regions, src_tables = _regions(src, 1), _src_tables(src, n, 2)
    dst_tables = _tables(dst, n, 3)
    dst_regions = _copy(src, src_regions, src_tables, dst, dst_tables, n)
    want = _pod_sums(src, src_regions, src_tables, n, src.block_size)
    assert len(want) == 10 and len(set(want)) == 10
    assert _pod_sums(dst, dst_regions, dst_tables, n, src.block_size) == want


@pytest.mark.parametrize("src,dst", CASES)
def test_one_damaged_byte_is_named_by_its_block(src, dst):
    n = 37
    src_regions, src_tables = _regions(src, 4), _src_tables(src, n, 5)
    dst_tables = _tables(dst, n, 6)
    want = _pod_sums(src, src_regions, src_tables, n, src.block_size)
    dst_regions = _copy(src, src_regions, src_tables, dst, dst_tables, n)
    # flip one byte of token 21 (logical block 5), layer 2's V, on whichever decode rank holds it first
    token = 21
    d = next(r for r in range(dst.tp_size) if dst.token_dcp_rank(token) == dst.dcp_rank(r))
    li = int(dst.token_local_index(token))
    slot = dst_tables[d][li // dst.block_size], li % dst.block_size
    dst_regions[d].view(torch.uint8)[2, 1, slot[0], slot[1], 0, 3] ^= 0x40
    got = _pod_sums(dst, dst_regions, dst_tables, n, src.block_size)
    assert first_mismatch(want, got) == token // src.block_size
    assert sum(a != b for a, b in zip(want, got)) == 1


def test_another_requests_blocks_read_in_place_are_refused():
    """Decode reads the right number of blocks, but another request's (a stale block table): every block differs."""
    src, dst, n = _layout(1, heads=1), _layout(2, 2, heads=1), 16
    regions = _regions(src, 7)
    mine, other = [[0, 1, 2, 3]], [[4, 5, 6, 7]]
    want = _pod_sums(src, regions, mine, n, src.block_size)
    dst_tables = _tables(dst, n, 8)
    read = _copy(src, regions, other, dst, dst_tables, n)
    got = _pod_sums(dst, read, dst_tables, n, src.block_size)
    assert first_mismatch(want, got) == 0 and all(a != b for a, b in zip(want, got))


def test_same_bytes_at_another_position_do_not_pass():
    """The row seed is the (token, head) position: two tokens' KV swapped keeps the bytes but not the sum."""
    lay, n = _layout(1, heads=1), 8
    region = _regions(lay, 9)[0]
    table = [0, 1]
    want = partial_checksums(lay, 0, region, table, n, 8)
    swapped = region.clone()
    swapped[:, :, 0, [0, 1]] = region[:, :, 0, [1, 0]]
    assert partial_checksums(lay, 0, swapped, table, n, 8) != want
