"""Lifecycle pieces every pod server shares: version, health, id checks, signals and the event loop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from grpc_health.v1 import health, health_pb2

MAX_ID_LEN = 256  # request / lease ids travel to other pods, logs and metric labels


def version() -> str:
    """The installed pdserve version, as pods report it when they register."""
    try:
        from importlib.metadata import version as dist_version

        return dist_version("pdserve")
    except Exception:
        return "unknown"


def id_problem(name: str, value: str) -> str | None:
    """Why an id field is refused (too long, or unprintable), or None."""
    if len(value) > MAX_ID_LEN or not value.isprintable():
        return f"{name} must be at most {MAX_ID_LEN} printable characters, got {value[:40]!r}"
    return None


async def set_health(servicer: health.aio.HealthServicer, service: str, serving: bool) -> None:
    """The overall health ("") and the pod's own service, both SERVING or both NOT_SERVING."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", service):
        await servicer.set(name, status)


def on_stop_signals(fn: Callable[[str], Awaitable[Any] | None]) -> None:
    """Call fn(signal name) on SIGTERM / SIGINT in the running loop (a coroutine result is scheduled)."""
    loop = asyncio.get_running_loop()

    def handle(name: str) -> None:
        res = fn(name)
        if asyncio.iscoroutine(res):
            asyncio.ensure_future(res)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle, sig.name)


def run_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run a pod's main coroutine, on uvloop when it is installed."""
    try:
        try:
            import uvloop
        except ImportError:
            asyncio.run(main)
        else:
            uvloop.run(main)
    finally:
        _reap_resource_tracker()


def _reap_resource_tracker() -> None:
    """Stop and reap the multiprocessing resource tracker the rank processes started, so that the pod's process
    group is empty when it exits (an orphaned tracker lingers until init reaps it)."""
    from multiprocessing import resource_tracker

    tracker = getattr(resource_tracker, "_resource_tracker", None)
    stop = getattr(tracker, "_stop", None)  # CPython's own shutdown hook for it; absent elsewhere
    if stop is not None:
        try:
            stop()
        except Exception:  # best effort: exiting anyway
            pass
