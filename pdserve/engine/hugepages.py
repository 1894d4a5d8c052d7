"""KV cache regions on transparent huge pages (THP), where the OS allows it.

Why: a NIXL (UCX over CMA, i.e. process_vm_readv) READ pins the *source* pages page by page; with 4 KB pages
that pinning was the bottleneck, and the prefill-side region on 2 MB huge pages roughly doubled CMA
throughput (docs/DESIGN.md, "KV transfer: leases, one-sided reads, staging"). The advice must come
before the pages are first touched, hence ``torch.empty`` + ``madvise(MADV_HUGEPAGE)`` + ``zero_()``.

Linux only, CPU tensors only; anywhere else (other OS, THP ``never``, a CUDA tensor, a region under 2 MB,
madvise failing) it is a no-op with a debug log, and the tensor is the same either way.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman-common.h
_THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.lru_cache(maxsize=1)
def thp_mode() -> str:
    """The bracketed THP mode ("always", "madvise", "never"), or "" where there is none (non-Linux, no sysfs)."""
    if not sys.platform.startswith("linux"):
        return ""
    try:
        with open(_THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else ""


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


def advise_hugepages(t: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) the 2 MB-aligned interior of ``t``'s memory. True when the advice was taken.

    Changes neither contents nor shape; pages already faulted in stay small until khugepaged collapses them,
    so call it before the first touch (see ``empty_kv``)."""
    if t.device.type != "cpu":
        return False
    mode = thp_mode()
    if mode not in ("always", "madvise"):
        log.debug("huge pages: transparent huge pages unavailable (mode %r); KV region stays on 4 KB pages", mode)
        return False
    nbytes = t.numel() * t.element_size()
    addr = t.data_ptr()
    start = (addr + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1)
    end = (addr + nbytes) & ~(HUGE_PAGE - 1)
    if end <= start:
        log.debug("huge pages: region of %d bytes has no aligned 2 MB interior", nbytes)
        return False
    libc = _libc()
    if libc is None:
        log.debug("huge pages: no libc madvise")
        return False
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) != 0:
        log.debug("huge pages: madvise failed (errno %d)", ctypes.get_errno())
        return False
    return True


def empty_kv(*shape: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed tensor like ``torch.zeros``; on CPU its memory is advised onto huge pages before the zeroing
    faults it in (so the pages come in as 2 MB pages where THP allows)."""
    t = torch.empty(*shape, dtype=dtype, device=device)
    advise_hugepages(t)
    return t.zero_()
