"""Placement policies: pure functions over snapshots of the pods (no I/O, no clocks), unit-tested on their own.

- Decode: a request needs, on every TP rank of the pod, the KV blocks its tokens occupy under the pod's DCP token
  placement (docs/DESIGN.md). A pod *fits* when every rank has that many free blocks. Among the pods that fit, the
  one left with the most free KV (as a fraction, on its tightest rank) wins, minus a penalty for the sequences it is
  already running; ties go to the pod with fewer requests in flight, then to the one that got fewer requests so far
  (so back-to-back requests on an idle cluster alternate), then to the lowest pod id.
- Prefill: least queued prompt tokens, with prefix affinity: a request whose first blocks were already sent to a
  pod goes back to that pod (its prefix cache holds them), unless that pod has more than ``max_imbalance`` queued
  tokens above the least loaded one.
- Conditional disaggregation (NVIDIA Dynamo's rule): a request is prefilled on its decode pod, with no KV transfer,
  when the part of its prompt that pod must compute is short, or when the prefill pods' queues are long; otherwise
  on a prefill pod. Decode pods keep no prefix cache, so that part is the whole prompt.
- PrefixIndex: the router's memory of which pod saw which prompt-prefix block (chained block hashes, LRU).
- Rendezvous: a prompt no index knows goes to the pod with the highest hash of (its first blocks, pod id) among the
  READY prefill pods: every router replica computes the same pod from the same pod list, with no state shared, and
  a pod joining or leaving moves only the prefixes it wins or held.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from pdserve.parallel_config import dcp_local_num_blocks

__all__ = [
    "DecodeView",
    "PrefillView",
    "PrefixIndex",
    "blocks_needed",
    "fits",
    "never_fits",
    "pick_decode",
    "pick_prefill",
    "prefill_locally",
    "block_hashes",
    "prefix_key",
    "rendezvous",
]


# ----------------------------------------------------------------------------------------------------------------
# Decode
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeView:
    """What placement knows about one READY decode pod."""

    pod_id: str
    tp: int
    dcp: int
    interleave: int
    block_size: int
    free_blocks: tuple[int, ...]  # per TP rank, as the router best knows it now (reports minus its own reservations)
    total_blocks: tuple[int, ...]  # per TP rank; empty tuples: the pod has not reported KV stats (unknown)
    running_seqs: int = 0  # sequences the pod runs or holds (reported, or the router's own count if larger)
    max_num_seqs: int = 0  # 0: unknown
    inflight: int = 0  # requests the router has in flight on it
    max_model_len: int = 0  # 0: unknown
    routed: int = 0  # requests the router ever placed on it (last tie-break: spreads sequential traffic)

    @property
    def kv_known(self) -> bool:
        return len(self.free_blocks) == self.tp and len(self.total_blocks) == self.tp


def blocks_needed(num_tokens: int, tp: int, dcp: int, interleave: int, block_size: int) -> list[int]:
    """KV blocks a sequence of ``num_tokens`` tokens occupies on each TP rank (DCP rank = tp_rank % dcp)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return [dcp_local_num_blocks(num_tokens, dcp, interleave, r % dcp, block_size) for r in range(tp)]


def fits(view: DecodeView, num_tokens: int) -> bool:
    """Whether ``num_tokens`` tokens of KV fit in the pod's free blocks on every rank now. Unknown KV: assume yes
    (the pod's AllocateKV is the final word)."""
    if view.max_model_len and num_tokens > view.max_model_len:
        return False
    if not view.kv_known:
        return True
    need = blocks_needed(num_tokens, view.tp, view.dcp, view.interleave, view.block_size)
    return all(n <= f for n, f in zip(need, view.free_blocks))


def never_fits(view: DecodeView, num_tokens: int) -> bool:
    """Whether the request could not fit this pod even with its whole KV cache free (or past its context)."""
    if view.max_model_len and num_tokens > view.max_model_len:
        return True
    if not view.kv_known:
        return False
    need = blocks_needed(num_tokens, view.tp, view.dcp, view.interleave, view.block_size)
    return any(n > t for n, t in zip(need, view.total_blocks))


def _decode_score(view: DecodeView, num_tokens: int) -> float:
    busy = view.running_seqs / view.max_num_seqs if view.max_num_seqs else 0.0
    if not view.kv_known:
        return 0.5 - busy  # unknown capacity ranks in the middle
    need = blocks_needed(num_tokens, view.tp, view.dcp, view.interleave, view.block_size)
    left = min((f - n) / t if t else 0.0 for f, n, t in zip(view.free_blocks, need, view.total_blocks))
    return left - 0.5 * busy


def pick_decode(views: Iterable[DecodeView], num_tokens: int, exclude: Iterable[str] = ()) -> str | None:
    """The decode pod for a request of ``num_tokens`` KV tokens, or None when none fits now."""
    ex = set(exclude)
    best: tuple[float, int, int, str] | None = None
    for v in views:
        if v.pod_id in ex or not fits(v, num_tokens):
            continue
        key = (-_decode_score(v, num_tokens), v.inflight, v.routed, v.pod_id)
        if best is None or key < best:
            best = key
    return None if best is None else best[3]


# ----------------------------------------------------------------------------------------------------------------
# Prefill
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PrefillView:
    """What placement knows about one READY prefill pod."""

    pod_id: str
    queued_tokens: int  # prompt tokens queued on it: max(reported, the router's own in-flight prompt tokens)
    inflight: int = 0  # prefill calls the router has in flight on it
    max_model_len: int = 0  # 0: unknown
    routed: int = 0  # requests the router ever placed on it (last tie-break)


def prefill_locally(
    uncached_tokens: int, max_local_tokens: int, prefill_queued_tokens: int | None, max_queue_tokens: int = 0
) -> bool:
    """Whether to prefill on the decode pod: never when ``max_local_tokens`` is 0; else when the tokens it would
    compute are at most ``max_local_tokens``, or when the least loaded prefill pod already has ``max_queue_tokens``
    (> 0) queued. ``prefill_queued_tokens`` None: no prefill pod is ready (the remote path then fails as it does
    without this rule)."""
    if max_local_tokens <= 0:
        return False
    if uncached_tokens <= max_local_tokens:
        return True
    return max_queue_tokens > 0 and prefill_queued_tokens is not None and prefill_queued_tokens >= max_queue_tokens


def pick_prefill(
    views: Iterable[PrefillView],
    prompt_len: int,
    affinity_pod: str | None = None,
    exclude: Iterable[str] = (),
    max_imbalance: int = 4096,
) -> str | None:
    """Least queued prompt tokens; the affinity pod instead when it is within ``max_imbalance`` tokens of that."""
    ex = set(exclude)
    cands = [v for v in views if v.pod_id not in ex and not (v.max_model_len and prompt_len >= v.max_model_len)]
    if not cands:
        return None
    least = min(cands, key=lambda v: (v.queued_tokens, v.inflight, v.routed, v.pod_id))
    if affinity_pod is not None:
        aff = next((v for v in cands if v.pod_id == affinity_pod), None)
        if aff is not None and aff.queued_tokens - least.queued_tokens <= max_imbalance:
            return aff.pod_id
    return least.pod_id


# ----------------------------------------------------------------------------------------------------------------
# Prefix affinity
# ----------------------------------------------------------------------------------------------------------------


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the prompt's full blocks: hash i covers tokens [0, (i+1)*block_size)."""
    out: list[int] = []
    h = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hash((h, tuple(token_ids[start : start + block_size])))
        out.append(h)
    return out


def prefix_key(token_ids: Sequence[int], block_size: int, max_blocks: int) -> bytes | None:
    """A process-independent key of the prompt's first full blocks (at most ``max_blocks``); None: no full block."""
    n = min(len(token_ids) // block_size, max_blocks) * block_size if block_size > 0 else 0
    if n <= 0:
        return None
    return hashlib.blake2b(struct.pack(f"<{n}q", *token_ids[:n]), digest_size=16).digest()


def rendezvous(key: bytes, pod_ids: Iterable[str]) -> str | None:
    """The pod with the highest hash of (key, pod id): the same on every router that sees the same pods."""
    best: tuple[bytes, str] | None = None
    for p in pod_ids:
        w = hashlib.blake2b(key + b"\0" + p.encode(), digest_size=8).digest()
        if best is None or (w, p) > best:
            best = (w, p)
    return None if best is None else best[1]


class PrefixIndex:
    """Which prefill pod last received each prompt-prefix block. Bounded LRU over block hashes."""

    def __init__(self, block_size: int = 16, capacity: int = 200_000) -> None:
        if block_size < 1 or capacity < 1:
            raise ValueError("block_size and capacity must be positive")
        self.block_size = block_size
        self.capacity = capacity
        self._pod_of: OrderedDict[int, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pod_of)

    def lookup(self, hashes: Sequence[int]) -> tuple[str | None, int]:
        """(pod holding the longest known prefix, number of leading blocks matched)."""
        pod: str | None = None
        n = 0
        for h in hashes:
            p = self._pod_of.get(h)
            if p is None:
                break
            pod, n = p, n + 1
        return pod, n

    def record(self, hashes: Sequence[int], pod_id: str) -> None:
        for h in hashes:
            self._pod_of[h] = pod_id
            self._pod_of.move_to_end(h)
        while len(self._pod_of) > self.capacity:
            self._pod_of.popitem(last=False)

    def forget_pod(self, pod_id: str) -> None:
        for h in [h for h, p in self._pod_of.items() if p == pod_id]:
            del self._pod_of[h]
