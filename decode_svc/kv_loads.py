"""Requests whose prompt KV is still arriving on a decode pod (vLLM's WAITING_FOR_REMOTE_KVS, SGLang's transfer
queue), tracked by the engine thread while the running batch keeps stepping.

A load starts with the request's blocks allocated on every rank (the engine holds the request in ``awaiting_kv``)
and every rank's ``receive`` started on its transfer threads (decode_svc/kv_source.py). Once per step ``poll``
gathers what finished on every rank: one gather across the group, so the driver sees every rank's outcome and no
rank ever runs a request whose KV landed on only some of them. A load is

  landed   when every rank wrote its share and the checksums (when on) match: the request joins the batch;
  failed   as soon as one rank could not: the request fails at once with that rank's status, and the other ranks
           are told to stop (a rank that found the lease freed waits for the others: it may only echo their cause).

A load given up (failed, or cancelled) leaves the engine at once (``LLMEngine.detach``: the request id is free
again) but keeps its blocks until the transfer thread of every rank stopped writing into them ("draining"); only
then do they go back, so a late write can never land in another request's KV.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from decode_svc.kv_source import (
    KVDeliveryError,
    KVSource,
    RankShare,
    check_checksums,
    decode_connector,
    rank_failure,
)

if TYPE_CHECKING:  # pragma: no cover
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sequence import Sequence

log = logging.getLogger("decode_svc.kv_loads")

# The statuses a rank's pull ends with when another rank's failure ended the lease or the load (see _error_of).
_ECHOES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED)


@dataclass
class Load:
    """One request's KV on its way into the pod's blocks."""

    load_id: str  # unique per load: a request id may come back (a retry) while an old load still drains
    request_id: str
    seq: "Sequence"  # holds the blocks on every rank
    source: KVSource
    first_tokens: list[int]
    first_logprobs: list[float]
    started: float  # time.monotonic() when the ranks were asked to receive
    shares: dict[int, RankShare] = field(default_factory=dict)  # tp rank -> its outcome, as it comes in
    error: KVDeliveryError | None = None  # why the load failed (set once)

    @property
    def nbytes(self) -> int:
        total = 0
        for s in self.shares.values():
            if isinstance(s, tuple):
                total += int(s[0])
            elif isinstance(s, int):
                total += s
        return total

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started


@dataclass(frozen=True)
class LoadOutcome:
    """A load's end, for metrics: how long it took, what it moved, and why it failed (None: it landed)."""

    request_id: str
    seconds: float
    nbytes: int
    cause: str | None = None  # the failing status' name, e.g. "UNAVAILABLE", "DATA_LOSS", "CANCELLED"


class KVLoads:
    """The engine thread's table of loads: ``start`` / ``poll`` / ``give_up``."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self.tp_size = engine.config.tensor_parallel_size
        self.active: dict[str, Load] = {}  # request id -> its load
        self.draining: dict[str, Load] = {}  # load id -> a given-up load whose ranks may still write
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self.active) + len(self.draining)

    def start(self, seq: "Sequence", source: KVSource, first_tokens: list[int], first_logprobs: list[float]) -> None:
        """Have every rank start receiving seq's prompt KV into seq's blocks; returns at once."""
        load = Load(
            f"{seq.request_id}#{next(self._ids)}",
            seq.request_id,
            seq,
            source,
            list(first_tokens),
            list(first_logprobs),
            time.monotonic(),
        )
        decode_connector(self.engine.executor)
        self.active[seq.request_id] = load
        started = self.engine.executor.connector_call("receive", load.load_id, source, seq.block_tables)
        for rank, r in enumerate(started):
            if isinstance(r, BaseException):  # this rank runs no transfer thread: its outcome is known now
                load.shares[rank] = r

    def poll(self) -> tuple[list[Load], list[Load]]:
        """Collect every rank's finished shares. Returns (landed, failed): landed loads are done and should join
        the batch (their request still awaits its KV in the engine); failed ones carry ``error`` and have left the
        engine (their blocks come back once every rank stopped)."""
        if not (self.active or self.draining):
            return [], []
        by_id = {ld.load_id: ld for ld in self.active.values()} | self.draining
        for rank, done in enumerate(self.engine.executor.connector_call("take_finished")):
            if isinstance(done, BaseException):
                raise done  # the connector itself broke on that rank: the pod cannot account for its blocks
            for load_id, share in done.items():
                ld = by_id.get(load_id)
                if ld is not None:
                    ld.shares[rank] = share
        landed: list[Load] = []
        failed: list[Load] = []
        for rid, ld in list(self.active.items()):
            ld.error = self._error_of(ld)
            if ld.error is None and len(ld.shares) < self.tp_size:
                continue  # some rank is still receiving
            del self.active[rid]
            if ld.error is None:
                landed.append(ld)
            else:
                failed.append(ld)
                self._drain(ld, f"{ld.error.code.name}: {ld.error.message}")
        for load_id, ld in list(self.draining.items()):
            if len(ld.shares) == self.tp_size:
                del self.draining[load_id]
                self.engine.free_reserved(ld.seq)
        return landed, failed

    def _error_of(self, ld: Load) -> KVDeliveryError | None:
        """Why ld failed, as far as the shares in so far say (a rank that could not, or, once every rank is in,
        checksums that differ); None when nothing failed yet.

        A rank that found the lease freed or was told to stop (FAILED_PRECONDITION, CANCELLED) may only echo
        another rank's failure: when one rank gives up, the prefill pod frees the lease under the others. So such a
        failure decides only once every rank is in, and any other rank's failure is the request's status."""
        failures = [rank_failure(r, s) for r, s in sorted(ld.shares.items()) if isinstance(s, BaseException)]
        first_cause = next((e for e in failures if e.code not in _ECHOES), None)
        if first_cause is not None:
            return first_cause
        if failures:
            return failures[0] if len(ld.shares) == self.tp_size else None
        if len(ld.shares) == self.tp_size and getattr(ld.source, "checksums", None):
            try:
                check_checksums(ld.source, [s[1] for s in ld.shares.values() if isinstance(s, tuple)])
            except KVDeliveryError as e:
                return e
        return None

    def give_up(self, request_id: str, reason: str) -> Load | None:
        """Stop request_id's load (cancelled): every rank stops at its next layer group and its blocks come back
        once they all did. None when the request has no load here."""
        ld = self.active.pop(request_id, None)
        if ld is not None:
            self._drain(ld, reason)
        return ld

    def _drain(self, ld: Load, reason: str) -> None:
        self.engine.detach(ld.request_id)
        if len(ld.shares) == self.tp_size:
            self.engine.free_reserved(ld.seq)
            return
        self.draining[ld.load_id] = ld
        for rank, r in enumerate(self.engine.executor.connector_call("abort", [ld.load_id], reason)):
            if isinstance(r, BaseException):
                log.warning("rank %d could not stop the KV load of %s: %r", rank, ld.request_id, r)
