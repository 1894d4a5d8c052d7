"""One in-flight request's cancellation and clean-up state (Flight), shared by the journey that owns it and by the
core (Cancel RPC, pod eviction) that reaches it through RouterCore.flights."""

from __future__ import annotations

import asyncio
from typing import Any

from router.admission import Admitted


class Cancelled(Exception):
    """The Cancel RPC ended this request."""


class PodLost(Exception):
    """The registry dropped a pod this request was waiting on."""


class Flight:
    """One in-flight request: what to cancel and what to clean up. Owned by its journey; Cancel and pod eviction
    reach it through RouterCore.flights."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.cancelled = False
        self.lost: set[str] = set()
        self._pending: Any = None  # the grpc call or queue future being awaited
        self._pending_pod: str | None = None
        # clean-up state
        self.admitted: Admitted | None = None  # decode KV booked by admission
        self.decode_pod: str | None = None  # holds a reservation or a decoding request
        self.decode_done = False  # the decode pod has finished the request on its own
        self.prefill_pod: str | None = None  # a Prefill call is in flight there
        self.lease: tuple[str, str] | None = None  # (prefill pod, lease id) until decode has the KV
        self.kv_consumed = False
        self.recomputed = False  # the prompt's KV was computed again after a failed load (at most once)
        self.allocate_s = 0.0  # duration of the AllocateKV call that succeeded

    def cancel(self) -> None:
        self.cancelled = True
        if self._pending is not None:
            self._pending.cancel()

    def pod_lost(self, pod_id: str) -> None:
        if pod_id in (self.decode_pod, self.prefill_pod, self._pending_pod):
            self.lost.add(pod_id)
            if self._pending is not None and self._pending_pod == pod_id:
                self._pending.cancel()

    def set_pending(self, fut: Any, pod_id: str | None = None) -> None:
        self._pending, self._pending_pod = fut, pod_id
        if self.cancelled and fut is not None:
            fut.cancel()

    async def call(self, pod_id: str, call: Any) -> Any:
        """Await a pod call (or a stream read) so that Cancel and pod eviction can interrupt it."""
        return await self._interruptible(pod_id, call, call)

    async def read(self, pod_id: str, stream: Any) -> Any:
        """Read one message of a server stream, interruptible like ``call``."""
        return await self._interruptible(pod_id, stream, stream.read())

    async def _interruptible(self, pod_id: str, pending: Any, awaitable: Any) -> Any:
        """Await ``awaitable`` with ``pending`` (the call or the stream) as what Cancel and eviction cancel."""
        self.set_pending(pending, pod_id)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if self.cancelled:
                raise Cancelled() from None
            if pod_id in self.lost:
                raise PodLost(f"pod {pod_id!r} was dropped from the registry (missed heartbeats)") from None
            raise
        finally:
            self._pending = self._pending_pod = None
