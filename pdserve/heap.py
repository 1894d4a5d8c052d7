"""Keep Python's cyclic garbage collector off a serving process's hot path.

A router or pod imports torch, grpc and protobuf at start: ~10^5 long-lived objects that every older-generation
collection walks again, a pause of up to tens of milliseconds on whichever request is running. Once a service is
up, ``freeze_startup_heap`` moves everything alive into the permanent generation (``gc.freeze``), so collections
walk only what requests allocate. vLLM (``freeze_gc_heap`` after warm-up) and SGLang (``freeze_gc``) do the same.
Objects frozen here are never collected; they are the ones a service keeps for its whole life anyway.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger("pdserve.heap")


def freeze_startup_heap(who: str) -> int:
    """Collect once, then freeze every object alive now; returns how many were frozen (and logs it)."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d startup objects frozen out of garbage collection", who, frozen)
    return frozen
