"""Block accounting is exact: every block comes back, DCP ranks hold their ceil-share, the prefix cache reuses
full blocks and never hands out a block still in use."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_manager import BlockManager, dcp_local_count, dcp_slot
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams


def _seq(i: int, n: int) -> Sequence:
    return Sequence(f"r{i}", list(range(100 + i, 100 + i + n)), SamplingParams(), i)


def test_random_allocate_free_returns_every_block():
    rng = random.Random(0)
    bm = BlockManager(64, 4)
    live: list[Sequence] = []
    for i in range(500):
        if live and rng.random() < 0.4:
            bm.free(live.pop(rng.randrange(len(live))))
        else:
            s = _seq(i, rng.randint(1, 40))
            if bm.can_allocate(s, s.num_tokens):
                bm.allocate(s, s.num_tokens)
                live.append(s)
        used = sum(len(t) for s in live for t in s.block_tables)
        assert bm.num_free() == 64 - used
    for s in live:
        bm.free(s)
    assert bm.num_free() == 64


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_blocks_freed_together_come_back_as_one_ascending_run(prefix_caching):
    """free() releases a table tail first (so a prompt's leading blocks stay cached longest); whoever takes those
    blocks next gets them in ascending order: one consecutive range, which a KV transfer moves as one segment."""
    bm = BlockManager(20, 4, enable_prefix_caching=prefix_caching)
    a, b = _seq(0, 40), _seq(1, 40)
    for s in (a, b):
        bm.allocate(s, s.num_tokens)
    assert a.block_tables == [list(range(10))] and b.block_tables == [list(range(10, 20))]
    bm.free(a)
    c = _seq(2, 40)  # other tokens than a's: no prefix hits
    bm.allocate(c, c.num_tokens)
    assert c.block_tables == [list(range(10))]
    bm.free(b)
    bm.free(c)
    d = _seq(3, 80)
    bm.allocate(d, d.num_tokens)
    assert d.block_tables == [list(range(20))]


@pytest.mark.parametrize("dcp,interleave", [(2, 1), (3, 1), (2, 4), (4, 2)])
def test_dcp_ranks_hold_ceil_share_of_tokens(dcp, interleave):
    bs = 4
    bm = BlockManager(256, bs, dcp, interleave)
    for n in [1, 2, 5, 16, 17, 33, 100]:
        s = _seq(n, n)
        bm.allocate(s, n)
        counts = [dcp_local_count(n, dcp, interleave, r) for r in range(dcp)]
        assert sum(counts) == n
        # the sharding is balanced to within one interleave unit
        assert max(counts) - min(counts) <= interleave
        for r in range(dcp):
            owned = sum(1 for t in range(n) if dcp_slot(t, dcp, interleave)[0] == r)
            assert counts[r] == owned
            assert len(s.block_tables[r]) == -(-owned // bs)
        bm.free(s)
    assert bm.free_per_rank() == [256] * dcp


def test_double_free_is_an_error():
    bm = BlockManager(4, 4)
    s = _seq(0, 5)
    bm.allocate(s, 5)
    tables = [list(t) for t in s.block_tables]
    bm.free(s)
    with pytest.raises(RuntimeError, match="double free"):
        bm.ranks[0].release(tables[0][0])


def test_prefix_cache_shares_full_blocks_and_counts_hits():
    bm = BlockManager(16, 4, enable_prefix_caching=True)
    a = _seq(0, 10)
    bm.allocate(a, 10)
    a.num_computed = 10
    bm.register_computed(a)
    b = Sequence("b", a.prompt_ids[:8] + [7, 7, 7], SamplingParams(), 1)
    assert bm.match_prefix(b) == 8
    assert b.block_tables[0][:2] == a.block_tables[0][:2]
    bm.allocate(b, b.num_tokens)
    assert bm.num_free() == 16 - 3 - 1  # a: 3 blocks, b: 2 shared + 1 new
    bm.free(a)
    bm.free(b)
    assert bm.num_free() == 16
    # freed but still cached: a new request with the same prefix finds them
    c = Sequence("c", a.prompt_ids[:9], SamplingParams(), 2)
    assert bm.match_prefix(c) == 8
    bm.free(c)
    assert bm.num_free() == 16
