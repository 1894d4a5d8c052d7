"""The transport protocol between a prefill pod (publisher) and a decode pod (pullers).

Flow for one request (each side only calls the methods on its own object):

  prefill: lease = publisher.publish(request_id, block_tables, num_tokens)    # before/while computing
           publisher.set_layers_ready(lease, n)                                # after each layer (group)
           handoff = publisher.handoff(lease)   -> sent to decode (router/gRPC), JSON-able
           ... publisher frees the blocks itself via on_free(lease, reason) when every decode rank
               reported done, when the lease times out, or when a decode rank aborted.
  decode:  puller.renew(handoff)               # while the request waits in the decode queue
           puller.pull(handoff, block_table)   # one puller per decode rank; returns once the last layer landed
           (on an exception the decode service frees its blocks; the puller already told prefill.)

Errors are ServiceErrors: each carries the gRPC status a service answers with.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kv_transfer.layout import KVLayout
from pdserve.errors import ServiceError

PROTOCOL_VERSION = 1


# ---- errors ---------------------------------------------------------------------------------------
class KVTransferError(ServiceError):
    """Base class: a ServiceError whose subclass fixes the status a service answers with."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "") -> None:
        super().__init__(None, message)


class TransferUnavailable(KVTransferError):
    """The peer is gone or the data path broke (process died, connection reset, NIXL error, I/O timeout)."""

    code = grpc.StatusCode.UNAVAILABLE


class LeaseExpired(KVTransferError):
    """The lease is unknown, timed out, aborted or already completed: its KV may be reused, so no read."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class HandshakeTimeout(KVTransferError):
    """No answer to the handshake within its bound (nobody listening, or a peer that never replies)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TransferCancelled(KVTransferError):
    """The decode side gave the pull up (its request was cancelled or another rank's share failed)."""

    code = grpc.StatusCode.CANCELLED


class BadTransferRequest(KVTransferError, ValueError):
    """Malformed or inconsistent request (layouts that do not match, bad ranks); a bug, not a fault."""

    code = grpc.StatusCode.INVALID_ARGUMENT


# ---- handoff --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, s: str) -> "Endpoint":
        host, _, port = s.rpartition(":")
        return cls(host.strip("[]"), int(port))


@dataclass(frozen=True)
class KVHandoff:
    """What prefill tells decode about one request's KV. Travels as JSON (``to_json``/``from_json``)."""

    lease_id: str
    request_id: str
    num_tokens: int
    layout: KVLayout  # the prefill side's layout (with num_blocks)
    block_tables: list[list[int]]  # per prefill tp rank
    # per prefill tp rank: the control endpoint serving that rank's region (None in a partial handoff of a
    # publisher that does not host that rank; KVHandoff.merge joins the partial ones)
    endpoints: list[Endpoint | None]
    transport: str = "tcp"  # best data path the publisher offers: "nixl" or "tcp"

    def to_dict(self) -> dict[str, Any]:
        return {
            "lease_id": self.lease_id,
            "request_id": self.request_id,
            "num_tokens": self.num_tokens,
            "layout": self.layout.to_dict(),
            "block_tables": [list(map(int, t)) for t in self.block_tables],
            "endpoints": [str(e) if e is not None else "" for e in self.endpoints],
            "transport": self.transport,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "KVHandoff":
        return cls(
            lease_id=d["lease_id"],
            request_id=d["request_id"],
            num_tokens=int(d["num_tokens"]),
            layout=KVLayout.from_dict(d["layout"]),
            block_tables=[list(t) for t in d["block_tables"]],
            endpoints=[Endpoint.parse(e) if e else None for e in d["endpoints"]],
            transport=d.get("transport", "tcp"),
        )

    @property
    def complete(self) -> bool:
        return all(e is not None for e in self.endpoints)

    def to_json(self) -> str:
        import json

        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str | bytes) -> "KVHandoff":
        import json

        return cls.from_dict(json.loads(s))

    @staticmethod
    def merge(parts: Sequence["KVHandoff"]) -> "KVHandoff":
        """Join the handoffs of publishers that each serve some prefill ranks (one process per rank)."""
        first = parts[0]
        tables: list[list[int] | None] = [None] * first.layout.tp_size
        eps: list[Endpoint | None] = [None] * first.layout.tp_size
        for p in parts:
            if (p.lease_id, p.num_tokens, p.layout) != (first.lease_id, first.num_tokens, first.layout):
                raise BadTransferRequest("handoffs of different requests/layouts cannot be merged")
            for r, (t, e) in enumerate(zip(p.block_tables, p.endpoints)):
                if e is not None:
                    tables[r], eps[r] = t, e
        if any(e is None for e in eps):
            raise BadTransferRequest("some prefill ranks have no publisher in these handoffs")
        transport = "nixl" if all(p.transport == "nixl" for p in parts) else "tcp"
        return KVHandoff(first.lease_id, first.request_id, first.num_tokens, first.layout, tables, eps, transport)  # type: ignore[arg-type]


@dataclass
class PullResult:
    lease_id: str
    nbytes: int  # bytes written into this rank's region
    seconds: float
    layer_landed_at: list[float] = field(default_factory=list)  # time.monotonic() when each layer landed
    transport: str = ""


# ---- the two sides --------------------------------------------------------------------------------
FreeCallback = Callable[[str, str, str], None]  # (lease_id, request_id, reason) -> free the blocks


class KVPublisher(ABC):
    """Prefill side: one per process, serving the KV regions of the prefill tp ranks it hosts."""

    name: str  # "nixl" or "tcp"

    @property
    @abstractmethod
    def endpoint(self) -> Endpoint: ...

    @abstractmethod
    def publish(
        self,
        request_id: str,
        block_tables: Mapping[int, Sequence[int]],
        num_tokens: int,
        *,
        lease_id: str | None = None,
        layers_ready: int = 0,
    ) -> str:
        """Start a lease for a request's KV (``block_tables``: tp rank -> table, for the ranks hosted here).

        ``lease_id``: pass the same id to every publisher of the request (see ``new_lease_id``).
        Returns the lease id."""

    @abstractmethod
    def set_layers_ready(self, lease_id: str, num_layers_ready: int) -> None:
        """Layers [0, n) are final in the regions; pullers waiting on them start reading now."""

    @abstractmethod
    def handoff(self, lease_id: str) -> KVHandoff: ...

    @abstractmethod
    def abort(self, lease_id: str, reason: str = "aborted") -> None:
        """Prefill gives up on the request (e.g. it was cancelled); blocks are freed once no read is in flight."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving; every live lease is freed (reason "shutdown")."""

    def __enter__(self) -> "KVPublisher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class KVPuller(ABC):
    """Decode side: one per decode tp rank, owning that rank's registered region."""

    name: str

    @abstractmethod
    def pull(
        self,
        handoff: KVHandoff,
        block_table: Sequence[int],
        *,
        on_layers_landed: Callable[[int], None] | None = None,
        timeout_s: float | None = None,
        cancelled: threading.Event | None = None,
    ) -> PullResult:
        """Copy this rank's share of the request's KV into ``block_table`` of the local region, layer by
        layer as prefill finishes them; return once the last layer landed; then report done to prefill.

        ``on_layers_landed(n)``: layers [0, n) are in place (for layer-wise decode start / metrics).
        ``cancelled``: once set, the pull stops at its next layer group or poll and raises TransferCancelled
        (a pull run off the caller's thread is given up this way; no write starts after that).
        Raises TransferUnavailable, LeaseExpired, HandshakeTimeout, BadTransferRequest; on any failure
        prefill is told (best effort) so it can free its blocks, and the caller frees its own."""

    @abstractmethod
    def renew(self, handoff: KVHandoff) -> None:
        """Keep the lease alive while the request still waits for decode blocks."""

    @abstractmethod
    def abort(self, handoff: KVHandoff, reason: str = "aborted") -> None:
        """Tell prefill this decode rank gives up (best effort, never raises)."""

    @abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> "KVPuller":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
