"""Prefill-side lease table: who may still read a request's KV, and when its blocks go back.

A lease lives from publish until one of:
  * every decode rank reported done        -> freed, reason "done"
  * nobody renewed it for ``timeout_s``    -> freed, reason "expired" (logged, counted)
  * a decode rank or prefill aborted        -> freed, reason "aborted"
  * the publisher shut down                 -> freed, reason "shutdown"

Reads are only served under a *pin*: a pin is granted only on a live lease, and a lease being retired
waits for its pins to drain (or for their TTL to pass) before its blocks are handed back. That is the
guarantee that no decode rank reads KV that was freed or reused: a read either got a pin first, or is
refused with LeaseExpired. A one-sided (NIXL) read cannot be stopped while it runs, so it is confirmed
afterwards instead: ``release_pin`` says whether its pin was still live (blocks held throughout); if not,
the reader discards what it read. Any decode contact (wait, pin, renew) renews the lease; so does prefill's
progress (set_layers_ready), so a long prefill does not time its own lease out.

Thread-safe: one lock + condition; the free callback runs outside the lock.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Counter, Gauge

from kv_transfer.transport import BadTransferRequest, LeaseExpired

log = logging.getLogger(__name__)

LEASES_ACTIVE = Gauge("pdserve_kv_leases_active", "KV leases held by prefill (blocks not yet freed)")
LEASES_FREED = Counter("pdserve_kv_leases_freed", "KV leases freed on the prefill side, by reason", ["reason"])
LEASE_RENEWALS = Counter("pdserve_kv_lease_renewals", "KV lease renewals (decode contact or prefill progress)")

FREE_REASONS = ("done", "expired", "aborted", "shutdown")
_TOMBSTONES = 10_000  # remember this many freed ids, to tell "expired" from "never existed" in errors


def new_lease_id() -> str:
    """Random, unguessable (128 bits); also the handle a decode rank presents on every read."""
    return secrets.token_urlsafe(16)


@dataclass
class Lease:
    lease_id: str
    request_id: str
    num_layers: int
    data: Any  # publisher's own record (block tables, ...)
    expires_at: float
    layers_ready: int = 0
    expected_ranks: int | None = None  # decode world size, learned from the first decode contact
    done_ranks: set[int] = field(default_factory=set)
    pins: dict[int, tuple[int, float]] = field(default_factory=dict)  # pin id -> (decode rank, deadline)
    retiring: str | None = None  # free reason once retired; no new pins from then on


class LeaseTable:
    def __init__(
        self,
        timeout_s: float = 30.0,
        pin_ttl_s: float = 10.0,
        on_free: Callable[[Lease, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.timeout_s = timeout_s
        self.pin_ttl_s = pin_ttl_s
        self._on_free = on_free
        self._clock = clock
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        self._freed: OrderedDict[str, str] = OrderedDict()  # lease id -> reason
        self._pin_ids = itertools.count(1)
        self.freed_counts = {r: 0 for r in FREE_REASONS}  # per-table view of LEASES_FREED, for tests/logs

    # ---- prefill side ---------------------------------------------------------------------------
    def create(
        self, request_id: str, num_layers: int, data: Any = None, lease_id: str | None = None, layers_ready: int = 0
    ) -> Lease:
        lease_id = lease_id or new_lease_id()
        with self._cond:
            if lease_id in self._leases or lease_id in self._freed:
                raise BadTransferRequest(f"lease id {lease_id} already used")
            lease = Lease(lease_id, request_id, num_layers, data, self._clock() + self.timeout_s, layers_ready)
            self._leases[lease_id] = lease
            LEASES_ACTIVE.inc()
            return lease

    def set_layers_ready(self, lease_id: str, n: int) -> None:
        with self._cond:
            lease = self._live(lease_id)
            if not 0 <= n <= lease.num_layers:
                raise BadTransferRequest(f"layers_ready {n} out of [0, {lease.num_layers}]")
            lease.layers_ready = max(lease.layers_ready, n)
            self._renew(lease)
            self._cond.notify_all()

    def abort(self, lease_id: str, reason: str = "aborted") -> None:
        """Retire now (prefill cancelled, or a decode rank gave up). ``reason`` outside FREE_REASONS is only
        logged; the lease is then freed as "aborted" (keeps the metric's label set closed)."""
        if reason not in FREE_REASONS:
            log.info("KV lease %s aborted: %s", lease_id, reason)
            reason = "aborted"
        self._retire_and_free(lease_id, reason)

    def close(self) -> None:
        """Free every lease now (publisher shutdown: nobody can read any more anyway)."""
        with self._cond:
            ids = list(self._leases)
            for lease in self._leases.values():
                lease.pins.clear()
        for lease_id in ids:
            self._retire_and_free(lease_id, "shutdown")

    # ---- decode contact -------------------------------------------------------------------------
    def check(self, lease_id: str, dst_rank: int | None = None, dst_world: int | None = None) -> Lease:
        """Validate a decode contact and renew the lease. Raises LeaseExpired."""
        with self._cond:
            lease = self._live(lease_id)
            self._note_rank(lease, dst_rank, dst_world)
            self._renew(lease)
            return lease

    def renew(self, lease_id: str) -> float:
        """Extend the lease; returns the seconds it now has left."""
        with self._cond:
            lease = self._live(lease_id)
            self._renew(lease)
            return lease.expires_at - self._clock()

    def wait_layers(
        self, lease_id: str, after: int, timeout_s: float, dst_rank: int | None = None, dst_world: int | None = None
    ) -> int:
        """Block until more than ``after`` layers are ready (or timeout); returns layers ready.

        Raises LeaseExpired if the lease is (or becomes) retired while waiting."""
        deadline = self._clock() + timeout_s
        with self._cond:
            lease = self._live(lease_id)
            self._note_rank(lease, dst_rank, dst_world)
            while True:
                lease = self._live(lease_id)
                self._renew(lease)
                left = deadline - self._clock()
                if lease.layers_ready > after or left <= 0:
                    return lease.layers_ready
                self._cond.wait(min(left, 0.5))

    def pin(self, lease_id: str, dst_rank: int, layers_needed: int, ttl_s: float | None = None) -> int:
        """Grant a read of layers [0, layers_needed): the blocks stay put until unpin or the TTL passes."""
        with self._cond:
            lease = self._live(lease_id)
            if layers_needed > lease.layers_ready:
                raise BadTransferRequest(f"layers [0, {layers_needed}) not ready ({lease.layers_ready} are)")
            self._renew(lease)
            pin_id = next(self._pin_ids)
            lease.pins[pin_id] = (dst_rank, self._clock() + (ttl_s or self.pin_ttl_s))
            return pin_id

    def touch_pin(self, lease_id: str, pin_id: int, ttl_s: float | None = None) -> bool:
        """Extend a pin (a long streamed read); False if it is gone, i.e. the read must stop now."""
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None or pin_id not in lease.pins:
                return False
            rank, deadline = lease.pins[pin_id]
            now = self._clock()
            if deadline <= now:
                return False
            lease.pins[pin_id] = (rank, now + (ttl_s or self.pin_ttl_s))
            return True

    def unpin(self, lease_id: str, pin_id: int) -> None:
        freed = None
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None:
                return
            lease.pins.pop(pin_id, None)
            if lease.retiring and not self._live_pins(lease):
                freed = self._pop(lease)
        self._call_free(freed)

    def release_pin(self, lease_id: str, pin_id: int) -> bool:
        """End a one-sided (NIXL) read: True iff the pin was still live, i.e. the blocks were held from the
        grant until now, so whatever the read fetched in between is the lease's KV. False: the pin timed out
        (the blocks may have been freed and reused meanwhile), the reader must discard what it read."""
        freed = None
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            held = lease.pins.pop(pin_id, None)
            live = held is not None and held[1] > self._clock()
            if lease.retiring and not self._live_pins(lease):
                freed = self._pop(lease)
        self._call_free(freed)
        return live

    def complete(self, lease_id: str, dst_rank: int, dst_world: int) -> bool:
        """Decode rank ``dst_rank`` has all its KV. Returns True when this freed the lease."""
        freed = None
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None or lease.retiring:
                return False
            self._note_rank(lease, dst_rank, dst_world)
            lease.done_ranks.add(dst_rank)
            for pid, (rank, _) in list(lease.pins.items()):
                if rank == dst_rank:  # its reads landed before it said done
                    del lease.pins[pid]
            if len(lease.done_ranks) >= (lease.expected_ranks or 0):
                lease.retiring = "done"
                if not self._live_pins(lease):
                    freed = self._pop(lease)
        self._call_free(freed)
        return freed is not None

    # ---- housekeeping ---------------------------------------------------------------------------
    def sweep(self) -> int:
        """Expire timed-out leases and free retired ones whose pins drained. Returns how many were freed."""
        now = self._clock()
        freed = []
        with self._cond:
            for lease in list(self._leases.values()):
                if lease.retiring is None and now >= lease.expires_at:
                    log.warning(
                        "KV lease %s (request %s) expired after %.1fs without decode completing "
                        "(%d/%s ranks done); freeing its blocks",
                        lease.lease_id,
                        lease.request_id,
                        self.timeout_s,
                        len(lease.done_ranks),
                        lease.expected_ranks if lease.expected_ranks is not None else "?",
                    )
                    lease.retiring = "expired"
                    self._cond.notify_all()
                if lease.retiring and not self._live_pins(lease, now):
                    freed.append(self._pop(lease))
        for f in freed:
            self._call_free(f)
        return len(freed)

    def has_pins(self) -> bool:
        """Some read may be in flight right now."""
        with self._cond:
            return any(lease.pins for lease in self._leases.values())

    def __len__(self) -> int:
        with self._cond:
            return len(self._leases)

    def get(self, lease_id: str) -> Lease | None:
        with self._cond:
            return self._leases.get(lease_id)

    def freed_reason(self, lease_id: str) -> str | None:
        with self._cond:
            return self._freed.get(lease_id)

    # ---- internals (lock held) ------------------------------------------------------------------
    def _live(self, lease_id: str) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            reason = self._freed.get(lease_id)
            raise LeaseExpired(f"lease {lease_id}: " + (f"freed ({reason})" if reason else "unknown"))
        if lease.retiring:
            raise LeaseExpired(f"lease {lease_id}: being freed ({lease.retiring})")
        return lease

    def _renew(self, lease: Lease) -> None:
        lease.expires_at = self._clock() + self.timeout_s
        LEASE_RENEWALS.inc()

    def _note_rank(self, lease: Lease, dst_rank: int | None, dst_world: int | None) -> None:
        if dst_world is None:
            return
        if lease.expected_ranks is None:
            lease.expected_ranks = int(dst_world)
        elif lease.expected_ranks != dst_world:
            raise BadTransferRequest(f"decode world size {dst_world} != {lease.expected_ranks} seen before")
        if dst_rank is not None and not 0 <= dst_rank < dst_world:
            raise BadTransferRequest(f"decode rank {dst_rank} out of range for world {dst_world}")

    def _live_pins(self, lease: Lease, now: float | None = None) -> bool:
        now = self._clock() if now is None else now
        for pid, (rank, deadline) in list(lease.pins.items()):
            if deadline <= now:
                log.warning("KV lease %s: read pin %d of decode rank %d timed out", lease.lease_id, pid, rank)
                del lease.pins[pid]
        return bool(lease.pins)

    def _pop(self, lease: Lease) -> tuple[Lease, str]:
        reason = lease.retiring or "aborted"
        del self._leases[lease.lease_id]
        self._freed[lease.lease_id] = reason
        while len(self._freed) > _TOMBSTONES:
            self._freed.popitem(last=False)
        self.freed_counts[reason] = self.freed_counts.get(reason, 0) + 1
        LEASES_ACTIVE.dec()
        LEASES_FREED.labels(reason=reason).inc()
        self._cond.notify_all()
        return lease, reason

    # ---- internals (lock not held) --------------------------------------------------------------
    def _retire_and_free(self, lease_id: str, reason: str) -> None:
        freed = None
        with self._cond:
            lease = self._leases.get(lease_id)
            if lease is None or lease.retiring:
                return
            lease.retiring = reason
            self._cond.notify_all()
            if not self._live_pins(lease):
                freed = self._pop(lease)
        self._call_free(freed)

    def _call_free(self, freed: tuple[Lease, str] | None) -> None:
        if freed is None or self._on_free is None:
            return
        lease, reason = freed
        try:
            self._on_free(lease, reason)
        except Exception:  # a failing callback must not wedge the table
            log.exception("KV lease %s: free callback failed", lease.lease_id)
