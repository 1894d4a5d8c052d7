"""KV regions on transparent huge pages: same tensor either way, the advice reported truthfully."""

from __future__ import annotations

import sys

import pytest
import torch

from pdserve.engine import hugepages
from pdserve.engine.hugepages import HUGE_PAGE, advise_hugepages, empty_kv, thp_mode


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


def _vma_of(addr: int) -> dict[str, str]:
    """The /proc/self/smaps entry of the mapping that holds addr: its fields, VmFlags included."""
    entry: dict[str, str] | None = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                if entry is not None:
                    break
                entry = {} if lo <= addr < hi else None
            elif entry is not None:
                key, _, value = line.partition(":")
                entry[key] = value.strip()
    assert entry is not None, f"no mapping holds {addr:#x}"
    return entry


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or thp_mode() not in ("always", "madvise"),
    reason="transparent huge pages unavailable here",
)
def test_region_is_advised_for_huge_pages():
    """The region's own mapping carries the huge-page advice (VmFlags "hg"), so the kernel backs it with 2 MB pages
    whenever it has them free. Whether it does depends on physical-memory fragmentation, not on this code, so the
    AnonHugePages figure is reported, not asserted (in a long test run it can be 0)."""
    t = empty_kv(32 * HUGE_PAGE, dtype=torch.uint8)
    vma = _vma_of(t.data_ptr() + 16 * HUGE_PAGE)
    assert "hg" in vma["VmFlags"].split(), vma["VmFlags"]
    print("AnonHugePages of the region's mapping:", vma.get("AnonHugePages"))
    assert not t.any()
    del t


def test_no_op_without_thp(monkeypatch):
    monkeypatch.setattr(hugepages, "thp_mode", lambda: "never")
    t = torch.ones(4 * HUGE_PAGE // 4)
    assert advise_hugepages(t) is False
    assert torch.equal(t, torch.ones_like(t))
