"""`pdserve bench serve`'s load generator: it refuses every target but this machine's loopback, its workload and
its Poisson arrivals are the same for a seed and have the stated shape."""

from __future__ import annotations

import statistics

import pytest

from bench.serve import arrivals, check_loopback, workload


def test_only_loopback_targets():
    for url in ("http://127.0.0.1:8000", "http://localhost:8000/", "http://[::1]:8000", "http://127.3.2.1:1"):
        check_loopback(url)
    for url in ("http://10.1.2.3:8000", "http://192.168.0.1:80", "http://8.8.8.8:80"):
        with pytest.raises(ValueError, match="loopback"):
            check_loopback(url)


def test_workload_is_seeded_and_shaped_as_stated():
    a, b = workload(400, 128, 24, vocab=49152), workload(400, 128, 24, vocab=49152)
    assert a == b and workload(5, 128, 24, 49152, seed=1) != a[:5]
    plens, olens = [len(p) for p, _ in a], [o for _, o in a]
    assert 16 <= min(plens) and max(plens) <= 4 * 128 and 4 <= min(olens) and max(olens) <= 4 * 24
    assert 100 < statistics.median(plens) < 160 and 18 < statistics.median(olens) < 30  # lognormal medians
    assert all(100 <= t < 49152 - 100 for p, _ in a for t in p)


def test_poisson_arrivals_have_the_asked_rate():
    t = arrivals(4000, rate=2.0)
    gaps = [b - a for a, b in zip([0.0, *t], t)]
    assert t == sorted(t) and statistics.mean(gaps) == pytest.approx(0.5, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.5, rel=0.1)  # exponential: sd = mean


def test_fresh_prompts_keep_the_lengths_and_share_no_prefix():
    """Each rate of a sweep sends prompts of its own: a repeated prompt would be a prefix-cache hit on every server."""
    from bench.serve import fresh_prompts

    base = workload(50, 64, 12, vocab=49152)
    a, b = fresh_prompts(base, 49152, seed=1), fresh_prompts(base, 49152, seed=2)
    assert [(len(p), o) for p, o in a] == [(len(p), o) for p, o in base] == [(len(p), o) for p, o in b]
    assert a == fresh_prompts(base, 49152, seed=1)  # seeded: every side gets the same prompts at a rate
    blocks = {tuple(p[:16]) for p, _ in base + a + b}  # first blocks (16 tokens): nothing shared across the sets
    assert len(blocks) == 3 * len(base)
