"""The engine thread: owns the DecodePod (and so the pod's rank group), steps it, fans outputs out to subscribers.

Every pod operation runs on this one thread (torch.distributed calls from rank 0 must not interleave), so the
asyncio server talks to it only through ``call(fn)`` (a concurrent.futures.Future) and per-request sinks, which are
called on the engine thread with each RequestOutput / Failure as soon as it is sampled."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import grpc

from decode_svc.config import DecodeConfig
from decode_svc.kv_loads import LoadOutcome
from decode_svc.pod import DecodePod, Failure
from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.sequence import FinishReason
from pdserve.engine.shm import RankFailure
from pdserve.errors import Unavailable
from pdserve.pod.engine_thread import EngineThread, dead_ranks

log = logging.getLogger("decode_svc.engine")

Sink = Callable[[RequestOutput | Failure], None]


class RequestObserver(Protocol):
    """Sees every subscribed request's start, events and end on the engine thread (the vLLM-named metrics)."""

    def started(self, request_id: str) -> None: ...

    def event(self, ev: RequestOutput | Failure) -> None: ...

    def dropped(self, request_id: str) -> None: ...

    def kv_transfer(self, outcome: LoadOutcome) -> None: ...


class EngineStopped(Unavailable):
    """The engine thread is gone (a rank died, or the pod is stopping): the pod cannot take this call."""


class RankDied(RuntimeError):
    """A TP rank process of the pod exited. Its collectives are broken for good, so the pod stops decoding."""


@dataclass
class PodStats:
    """A snapshot for metrics and health, replaced (never mutated) by the engine thread."""

    running: int = 0
    waiting: int = 0
    waiting_for_kv: int = 0  # of waiting: KV still arriving (the batch steps without them)
    reserved: int = 0
    blocks_used: list[int] = field(default_factory=list)  # per TP rank
    blocks_free: list[int] = field(default_factory=list)
    generated_tokens: int = 0
    kv_bytes_received: int = 0
    steps: int = 0
    preemptions: int = 0  # sequences the scheduler evicted for lack of blocks (recomputed later), since start


class EngineLoop:
    def __init__(self, config: DecodeConfig, pod_factory: Callable[[DecodeConfig], DecodePod] = DecodePod) -> None:
        self.config = config
        self._pod_factory = pod_factory
        self.pod: DecodePod | None = None
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._error: BaseException | None = None
        self._closed = False  # the loop ended: commands still queued are answered EngineStopped
        self._thread = EngineThread("decode-engine", self._run)
        self.stats = PodStats()
        self._steps = 0
        # Called once, on the engine thread, when the engine fails (e.g. RankDied); the server turns unhealthy.
        self.on_failure: Callable[[BaseException], object] | None = None
        self.observer: RequestObserver | None = None

    # --- lifecycle ---
    def start(self, timeout_s: float = 600.0) -> None:
        """Build the pod (spawns the TP ranks) on the engine thread; raises what building raised."""
        try:
            self._thread.start(timeout_s)
        except BaseException as e:
            self._error = self._error or e
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        self._thread.stop(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.alive and self._error is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped serving (None while it runs)."""
        return self._error

    # --- calls from other threads ---
    def call(self, fn: Callable[[DecodePod], Any]) -> Future:
        fut: Future = Future()
        if not self.alive:
            fut.set_exception(EngineStopped(f"the decode engine is not running: {self._error or 'stopped'}"))
            return fut
        self._thread.put(lambda: self._answer(fn, fut))
        return fut

    def _answer(self, fn: Callable[[DecodePod], Any], fut: Future) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        if self._closed:
            fut.set_exception(EngineStopped(f"the decode engine stopped: {self._error or 'shutting down'}"))
            return
        try:
            assert self.pod is not None  # commands run once the pod is up
            fut.set_result(fn(self.pod))
        except BaseException as e:
            fut.set_exception(e)

    def subscribe(self, request_id: str, sink: Sink) -> None:
        """Engine thread (inside a command): route request_id's events to sink until its final one."""
        self._sinks[request_id] = sink
        if self.observer is not None:
            self.observer.started(request_id)

    def unsubscribe(self, request_id: str) -> None:
        if self._sinks.pop(request_id, None) is not None and self.observer is not None:
            self.observer.dropped(request_id)

    def emit(self, ev: RequestOutput | Failure) -> None:
        """Engine thread: hand an event to its subscriber (dropping the subscription when it is final)."""
        sink = self._sinks.get(ev.request_id)
        if sink is None:
            return
        if ev.finished:
            del self._sinks[ev.request_id]
        if self.observer is not None:
            try:
                self.observer.event(ev)
            except Exception:  # metrics must not stop the pod
                log.exception("metrics of %s failed", ev.request_id)
        try:
            sink(ev)
        except Exception:  # a broken subscriber must not stop the pod
            log.exception("sink of %s failed", ev.request_id)

    def cancel(self, pod: DecodePod, request_id: str) -> bool:
        """Engine thread: cancel and end the request's stream with FINISH_REASON_CANCELLED."""
        found = pod.cancel(request_id)
        self.emit(RequestOutput(request_id, [], [], "", True, FinishReason.CANCELLED))
        self._sinks.pop(request_id, None)
        return found

    # --- the thread ---
    def _run(self, thread: EngineThread) -> None:
        self.pod = pod = self._pod_factory(self.config)  # raised by start()
        self._refresh_stats()
        thread.ready()
        last_stats = 0.0
        try:
            while True:
                thread.run_commands(self._wait_s(pod))
                if thread.stopping:
                    break
                _check_ranks(pod)  # also while idle: a dead rank must turn the pod unhealthy before new work
                pod.engine.executor.keepalive()  # idle ranks would otherwise hit the process group's timeout
                pod.expire_reservations()
                pod.keep_queued_alive()
                if pod.has_work():
                    events = pod.step()
                    self._steps += 1
                    for ev in events:
                        self.emit(ev)
                self._report_transfers(pod)
                now = time.monotonic()
                if now - last_stats > 0.05 or not pod.has_work():
                    self._refresh_stats()
                    last_stats = now
        except BaseException as exc:
            e = exc
            try:  # a collective that failed because a peer died says so only vaguely: name the rank
                _check_ranks(pod, grace_s=2.0)
            except RankDied as dead:
                e = dead
            log.error("decode engine failed: %s", e, exc_info=not isinstance(e, RankDied))
            self._error = e
            # UNAVAILABLE: the request may succeed on another pod; this one is not coming back.
            code = grpc.StatusCode.UNAVAILABLE if isinstance(e, (RankDied, RankFailure)) else grpc.StatusCode.INTERNAL
            for rid in list(self._sinks):
                self.emit(Failure(rid, code, f"decode engine failed: {e}"))
            if self.on_failure is not None:
                try:
                    self.on_failure(e)
                except Exception:
                    log.exception("on_failure callback failed")
        finally:
            self._closed = True
            thread.run_commands()  # answers what is still queued with EngineStopped
            try:
                pod.shutdown()
            except Exception:
                log.exception("pod shutdown failed")

    # How often an otherwise idle loop asks the ranks whether a transfer landed (a gather across the group).
    RECEIVE_POLL_S = 0.002

    def _wait_s(self, pod: DecodePod) -> float:
        """How long to wait for commands before the next pass: none while there is compute to do."""
        if pod.only_receiving():
            return self.RECEIVE_POLL_S
        return 0.0 if pod.has_work() else 0.05

    def _report_transfers(self, pod: DecodePod) -> None:
        outcomes, pod.kv_outcomes = pod.kv_outcomes, []
        if self.observer is None:
            return
        for o in outcomes:
            try:
                self.observer.kv_transfer(o)
            except Exception:  # metrics must not stop the pod
                log.exception("transfer metrics of %s failed", o.request_id)

    def _refresh_stats(self) -> None:
        pod = self.pod
        assert pod is not None
        self.stats = PodStats(
            running=pod.num_running,
            waiting=pod.num_waiting,
            waiting_for_kv=pod.num_waiting_for_kv,
            reserved=len(pod.reservations),
            blocks_used=pod.used_blocks_per_rank(),
            blocks_free=pod.free_blocks_per_rank(),
            generated_tokens=pod.num_generated_tokens,
            kv_bytes_received=pod.kv_bytes_received,
            steps=self._steps,
            preemptions=pod.engine.scheduler.num_preemptions,
        )


def _check_ranks(pod: DecodePod, grace_s: float = 0.0) -> None:
    """Raise RankDied if a spawned TP rank process has exited (cheap: a non-blocking waitpid per rank).

    grace_s: after a failed collective, wait up to this long for a dying rank to become reapable (its sockets
    close, resetting the peers, a moment before its exit can be waited for)."""
    dead = dead_ranks(pod.engine.executor, grace_s)
    if dead:
        what = ", ".join(f"rank {r} (exit code {c})" for r, c in dead)
        raise RankDied(f"TP {what} of this decode pod exited; the pod cannot decode until it is restarted")
