"""KV regions on transparent huge pages: same tensor either way, the advice reported truthfully."""

from __future__ import annotations

import sys

import pytest
import torch

from pdserve.engine import hugepages
from pdserve.engine.hugepages import HUGE_PAGE, advise_hugepages, empty_kv, thp_mode


def _anon_huge_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages"):
                return int(line.split()[1])
    return -1


def test_advice_keeps_contents_and_shape():
    t = torch.arange(6 * HUGE_PAGE // 4, dtype=torch.int32).view(6, -1)
    before = t.clone()
    taken = advise_hugepages(t)
    assert taken == (thp_mode() in ("always", "madvise"))
    assert t.shape == before.shape and torch.equal(t, before)


def test_empty_kv_is_zeros_of_the_shape():
    shape = (3, 2, 40, 16, 3, 64)  # a small KV region (~2.9 MB)
    t = empty_kv(*shape, dtype=torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    small = empty_kv(2, 5, dtype=torch.bfloat16)  # no aligned 2 MB interior: still just zeros
    assert small.shape == (2, 5) and not small.any()
    assert advise_hugepages(small) is False


@pytest.mark.skipif(not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages unavailable here")
def test_region_lands_on_huge_pages():
    before = _anon_huge_kb()
    t = empty_kv(32 * HUGE_PAGE, dtype=torch.uint8)
    grown = _anon_huge_kb() - before
    assert grown >= 16 * HUGE_PAGE // 1024, f"only {grown} kB on huge pages"  # allow for fragmentation
    del t


def test_no_op_without_thp(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    t = torch.ones(4 * HUGE_PAGE // 4)
    assert advise_hugepages(t) is False
    assert torch.equal(t, torch.ones_like(t))
