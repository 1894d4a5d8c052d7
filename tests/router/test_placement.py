"""Placement policies (pure): decode fit across ranks under DCP, decode choice, prefill load + prefix affinity."""

from __future__ import annotations

import pytest

from pdserve.parallel_config import dcp_local_count
from router.placement import (
    DecodeView,
    PrefillView,
    PrefixIndex,
    block_hashes,
    blocks_needed,
    fits,
    never_fits,
    pick_decode,
    pick_prefill,
    prefill_locally,
    prefix_key,
    rendezvous,
)


def dv(pod, free, total=None, tp=None, dcp=1, inter=1, bs=16, running=0, max_seqs=0, inflight=0, max_len=0):
    tp = tp or len(free)
    total = total if total is not None else tuple(100 for _ in free)
    return DecodeView(pod, tp, dcp, inter, bs, tuple(free), tuple(total), running, max_seqs, inflight, max_len)


def test_blocks_needed_without_dcp_is_ceil_on_every_rank():
    assert blocks_needed(0, 2, 1, 1, 16) == [0, 0]
    assert blocks_needed(1, 2, 1, 1, 16) == [1, 1]
    assert blocks_needed(16, 1, 1, 1, 16) == [1]
    assert blocks_needed(17, 4, 1, 1, 16) == [2, 2, 2, 2]


@pytest.mark.parametrize("n", [0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 64, 100, 1000])
@pytest.mark.parametrize(
    "tp,dcp,inter,bs", [(2, 2, 1, 16), (4, 2, 1, 16), (4, 4, 4, 16), (8, 2, 8, 16), (2, 2, 16, 16), (4, 4, 1, 4)]
)
def test_blocks_needed_matches_the_dcp_token_placement(n, tp, dcp, inter, bs):
    need = blocks_needed(n, tp, dcp, inter, bs)
    for r in range(tp):
        local = dcp_local_count(n, dcp, inter, r % dcp)
        assert need[r] == -(-local // bs)
    # DCP groups are consecutive TP ranks; ranks with the same dcp rank need the same blocks.
    assert all(need[r] == need[r % dcp] for r in range(tp))
    # The group as a whole holds every token once.
    assert sum(dcp_local_count(n, dcp, inter, d) for d in range(dcp)) == n


def test_dcp_halves_the_per_rank_need():
    assert blocks_needed(64, 2, 1, 1, 16) == [4, 4]
    assert blocks_needed(64, 2, 2, 1, 16) == [2, 2]


def test_fits_checks_every_rank():
    v = dv("d", free=(2, 1), dcp=2, tp=2)
    assert fits(v, 32)  # 16 tokens per rank -> 1 block each
    assert fits(v, 33)  # rank 0 holds 17 tokens (2 blocks, ok), rank 1 holds 16 (1 block)
    assert fits(v, 34) is False  # rank 1 now holds 17: 2 blocks > 1 free
    assert fits(dv("d", free=(10,), max_len=100), 101) is False
    # Unknown KV (no stats yet): let AllocateKV decide.
    assert fits(DecodeView("d", 2, 1, 1, 16, (), ()), 10_000)


def test_never_fits_uses_total_capacity():
    v = dv("d", free=(0, 0), total=(4, 4), dcp=2, tp=2)
    assert not never_fits(v, 128)  # 64 per rank = 4 blocks: fits an empty pod
    assert never_fits(v, 129)
    assert never_fits(dv("d", free=(10,), max_len=50), 51)


def test_pick_decode_prefers_most_free_kv_after_placement():
    a = dv("a", free=(50, 50))
    b = dv("b", free=(80, 30))  # tightest rank is what counts
    c = dv("c", free=(60, 60))
    assert pick_decode([a, b, c], 16) == "c"


def test_pick_decode_skips_pods_that_do_not_fit_and_excluded():
    a = dv("a", free=(0,))
    b = dv("b", free=(5,))
    assert pick_decode([a, b], 16) == "b"
    assert pick_decode([a, b], 16, exclude={"b"}) is None
    assert pick_decode([a], 16) is None
    assert pick_decode([], 16) is None


def test_pick_decode_running_sequences_break_near_ties():
    a = dv("a", free=(50,), running=30, max_seqs=32)
    b = dv("b", free=(49,), running=0, max_seqs=32)
    assert pick_decode([a, b], 16) == "b"
    # Equal everything: fewer router in-flight requests, then the pod id.
    x = dv("x", free=(50,), inflight=3)
    y = dv("y", free=(50,), inflight=1)
    assert pick_decode([x, y], 16) == "y"
    assert pick_decode([dv("q", free=(50,)), dv("p", free=(50,))], 16) == "p"


def test_pick_decode_spreads_as_bookings_accumulate():
    """Simulates the registry's bookkeeping: each placement books blocks, so consecutive requests alternate."""
    free = {"a": 100, "b": 100}
    chosen = []
    for _ in range(20):
        pod = pick_decode([dv(p, free=(f,)) for p, f in free.items()], 64)
        free[pod] -= 4
        chosen.append(pod)
    assert chosen.count("a") == chosen.count("b") == 10


def test_pick_prefill_least_queued_tokens():
    views = [PrefillView("a", 500), PrefillView("b", 100), PrefillView("c", 300)]
    assert pick_prefill(views, 10) == "b"
    assert pick_prefill(views, 10, exclude={"b"}) == "c"
    assert pick_prefill([PrefillView("a", 0, inflight=2), PrefillView("b", 0, inflight=1)], 10) == "b"
    assert pick_prefill([], 10) is None
    # A prompt too long for a pod's context is not sent there.
    assert pick_prefill([PrefillView("a", 0, max_model_len=8), PrefillView("b", 900)], 10) == "b"


def test_pick_prefill_affinity_unless_overloaded():
    views = [PrefillView("a", 1000), PrefillView("b", 0)]
    assert pick_prefill(views, 10, affinity_pod="a", max_imbalance=2000) == "a"
    assert pick_prefill(views, 10, affinity_pod="a", max_imbalance=999) == "b"  # overloaded: least loaded wins
    assert pick_prefill(views, 10, affinity_pod="gone", max_imbalance=2000) == "b"
    assert pick_prefill(views, 10, affinity_pod="a", exclude={"a"}, max_imbalance=2000) == "b"


def test_block_hashes_cover_full_blocks_and_chain():
    ids = list(range(40))
    h = block_hashes(ids, 16)
    assert len(h) == 2
    assert block_hashes(ids[:32], 16) == h
    # Same second block after a different first block: different hash (chained).
    other = [999] + ids[1:]
    assert block_hashes(other, 16)[1] != h[1]
    assert block_hashes(ids[:15], 16) == []


def test_prefix_index_longest_prefix_and_lru():
    idx = PrefixIndex(block_size=4, capacity=5)
    p1 = list(range(12))
    idx.record(block_hashes(p1, 4), "a")
    assert idx.lookup(block_hashes(p1, 4)) == ("a", 3)
    # Shares the first two blocks only.
    p2 = p1[:8] + [77, 78, 79, 80]
    assert idx.lookup(block_hashes(p2, 4)) == ("a", 2)
    idx.record(block_hashes(p2, 4), "b")
    assert idx.lookup(block_hashes(p2, 4)) == ("b", 3)
    assert idx.lookup(block_hashes([5, 5, 5, 5], 4)) == (None, 0)
    assert len(idx) <= 5
    idx.forget_pod("b")
    assert idx.lookup(block_hashes(p2, 4))[0] is None or idx.lookup(block_hashes(p2, 4))[0] == "a"


def test_ties_alternate_by_requests_routed_so_far():
    """An idle cluster fed one request at a time (each finished before the next) still alternates pods."""
    routed = {"a": 0, "b": 0}
    for _ in range(10):
        pod = pick_prefill([PrefillView(p, 0, routed=n) for p, n in routed.items()], 10)
        routed[pod] += 1
    assert routed == {"a": 5, "b": 5}
    routed = {"a": 0, "b": 0}
    for _ in range(10):
        pod = pick_decode([DecodeView(p, 1, 1, 1, 16, (50,), (100,), routed=n) for p, n in routed.items()], 16)
        routed[pod] += 1
    assert routed == {"a": 5, "b": 5}


def test_prefix_key_covers_the_first_full_blocks_only():
    assert prefix_key([1, 2, 3], 4, 4) is None  # no full block
    assert prefix_key(list(range(8)), 4, 0) is None
    k = prefix_key(list(range(8)), 4, 1)
    assert k == prefix_key(list(range(4)) + [99, 98, 97, 96, 95], 4, 1)  # only the first block counts
    assert k != prefix_key(list(range(8)), 4, 2)
    assert prefix_key([5] * 8, 4, 2) == prefix_key([5] * 9, 4, 2)  # a partial last block is ignored


def test_rendezvous_is_stable_and_moves_only_what_it_must():
    pods = [f"p{i}" for i in range(4)]
    keys = [prefix_key([i, i + 1, i + 2, i + 3], 4, 1) for i in range(400)]
    assert all(k is not None for k in keys)
    first = {k: rendezvous(k, pods) for k in keys if k}
    # the same answer whatever order the pods are listed in (each replica's registry orders them its own way)
    assert first == {k: rendezvous(k, list(reversed(pods))) for k in keys if k}
    counts = {p: list(first.values()).count(p) for p in pods}
    assert min(counts.values()) > 50, counts  # spread over the pods
    gone = {k: rendezvous(k, pods[:-1]) for k in keys if k}  # p3 left: only its prefixes move
    assert all(gone[k] == first[k] for k in first if first[k] != "p3")
    assert rendezvous(b"x", []) is None


def test_rendezvous_pod_is_the_affinity_of_an_unseen_prefix():
    views = [PrefillView("p0", 0), PrefillView("p1", 0), PrefillView("p2", 0)]
    key = prefix_key(list(range(32)), 16, 4)
    assert key is not None
    want = rendezvous(key, [v.pod_id for v in views])
    assert pick_prefill(views, 32, affinity_pod=want) == want
    # excluded (a failed try): the next-highest pod, the same on every replica
    nxt = rendezvous(key, [v.pod_id for v in views if v.pod_id != want])
    assert nxt != want and pick_prefill(views, 32, affinity_pod=nxt, exclude={want}) == nxt


@pytest.mark.parametrize(
    "uncached,max_local,queued,max_queue,local",
    [
        (100, 0, 10**6, 1, False),  # off: never local, however busy the prefill pods
        (64, 64, 0, 0, True),  # short enough
        (65, 64, 0, 0, False),
        (65, 64, 5000, 4096, True),  # prefill pods busy: local anyway (Dynamo's queue clause)
        (65, 64, 4095, 4096, False),
        (65, 64, 10**6, 0, False),  # queue clause off
        (65, 64, None, 4096, False),  # no prefill pod ready: the remote path reports that
    ],
)
def test_prefill_locally_follows_the_conditional_disaggregation_rule(uncached, max_local, queued, max_queue, local):
    assert prefill_locally(uncached, max_local, queued, max_queue) is local
