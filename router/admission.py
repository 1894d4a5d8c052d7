"""Admission: a request gets a decode pod with room for its KV, or waits in a bounded FIFO queue for one.

``admit`` returns at once when the queue is empty and a decode pod fits; otherwise the request joins the queue
(RESOURCE_EXHAUSTED when ``max_queue_len`` are already waiting) and is woken, strictly first come first served,
when capacity may have grown (a heartbeat, a finished request, a new pod). A request that waits longer than
``max_queue_wait_s`` gets RESOURCE_EXHAUSTED; one that could not fit even an empty decode pod gets it at once.
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Callable

import grpc

from pdserve.errors import ServiceError
from router.config import RouterConfig
from router.placement import never_fits, pick_decode
from router.registry import Registry


@dataclass
class Admitted:
    pod_id: str
    need: list[int]  # blocks per rank the router booked on the pod
    queue_s: float


@dataclass
class _Waiter:
    num_tokens: int
    exclude: frozenset[str]
    fut: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Admission:
    def __init__(self, registry: Registry, config: RouterConfig) -> None:
        self.registry = registry
        self.config = config
        self._queue: collections.deque[_Waiter] = collections.deque()
        self.inflight = 0  # admitted and not released
        registry.on_change(self.pump)

    @property
    def depth(self) -> int:
        return sum(1 for w in self._queue if not w.fut.done())

    def _try_place(self, num_tokens: int, exclude: frozenset[str]) -> Admitted | None:
        if self.inflight >= self.config.max_inflight_requests:
            return None
        pod = pick_decode(self.registry.decode_views(), num_tokens, exclude)
        if pod is None:
            return None
        need = self.registry.reserve_decode(pod, num_tokens)
        self.inflight += 1
        return Admitted(pod, need, 0.0)

    def pump(self) -> None:
        """Hand capacity to waiters in arrival order; stop at the first that still does not fit."""
        while self._queue:
            w = self._queue[0]
            if w.fut.done():
                self._queue.popleft()
                continue
            got = self._try_place(w.num_tokens, w.exclude)
            if got is None:
                return
            self._queue.popleft()
            w.fut.set_result(got)

    def release(self, admitted: Admitted) -> None:
        """The request is over on its decode pod (or never reached it): give back what admit booked."""
        self.inflight = max(0, self.inflight - 1)
        self.registry.release_decode(admitted.pod_id, admitted.need)  # -> changed() -> pump()

    def check_possible(self, num_tokens: int, exclude: frozenset[str] = frozenset()) -> None:
        views = [v for v in self.registry.decode_views() if v.pod_id not in exclude]
        if not views:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                "no READY decode pod: start decode pods (python -m decode_svc ... --router ...) "
                "or wait until they register",
            )
        if all(never_fits(v, num_tokens) for v in views):
            v = max(views, key=lambda v: min(v.total_blocks) if v.total_blocks else 0)
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the request needs KV for {num_tokens} tokens, more than any decode pod can hold even when empty "
                f"(largest: {v.pod_id!r}, {list(v.total_blocks)} blocks of {v.block_size} tokens per rank, "
                f"max_model_len {v.max_model_len or 'unknown'}): shorten the prompt or max_tokens, or add decode pods "
                "with more KV blocks / decode context parallelism",
            )

    async def admit(
        self,
        num_tokens: int,
        timeout: float | None,
        exclude: frozenset[str] = frozenset(),
        on_wait: Callable[[asyncio.Future], None] | None = None,
    ) -> Admitted:
        """A decode pod for ``num_tokens`` tokens of KV. Raises ServiceError; asyncio.CancelledError when the
        waiting future is cancelled (Cancel RPC) or the caller is."""
        self.check_possible(num_tokens, exclude)
        if not self._queue or self.depth == 0:
            got = self._try_place(num_tokens, exclude)
            if got is not None:
                return got
        if self.depth >= self.config.max_queue_len:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"router queue is full ({self.depth} requests waiting for decode KV, bound "
                f"{self.config.max_queue_len}): retry with backoff, or add decode pods",
            )
        t0 = time.monotonic()
        w = _Waiter(num_tokens, exclude)
        self._queue.append(w)
        if on_wait is not None:
            on_wait(w.fut)
        limit = self.config.max_queue_wait_s if timeout is None else min(timeout, self.config.max_queue_wait_s)
        try:
            await asyncio.wait({w.fut}, timeout=limit)
        except BaseException:  # the caller went away while waiting
            if w.fut.done() and not w.fut.cancelled():
                self.release(w.fut.result())  # placed just as it left: give the booking back
            else:
                w.fut.cancel()
            raise
        if w.fut.cancelled():  # Cancel RPC
            raise asyncio.CancelledError()
        if not w.fut.done():
            w.fut.cancel()  # pump() skips it from now on
            waited = time.monotonic() - t0
            if timeout is not None and limit >= timeout:
                raise ServiceError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"deadline passed after {waited:.2f}s waiting in the router queue for decode KV",
                )
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"no decode pod had room for {num_tokens} tokens of KV within {waited:.1f}s "
                f"(max_queue_wait_s {self.config.max_queue_wait_s}): retry later or add decode pods",
            )
        got = w.fut.result()
        got.queue_s = time.monotonic() - t0
        return got
