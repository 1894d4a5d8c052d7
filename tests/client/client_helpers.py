"""A real grpc.aio server implementing the Router service whose answers each test scripts (status codes, a hang,
a failure after one message). It does not imitate the router's generation: the live-cluster tests do that for real.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, Callable

import grpc

from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc


class Scripted(router_pb2_grpc.RouterServicer):
    """Each Generate call runs ``script(attempt_number, request, context)`` (an async generator function)."""

    def __init__(self) -> None:
        self.script: Callable[..., Any] | None = None
        self.calls: list[tuple[float, router_pb2.GenerateRequest]] = []
        self.cancel_ids: list[str] = []
        self.status_calls = 0
        self.status_code: grpc.StatusCode | None = None

    async def Generate(self, request, context):
        self.calls.append((time.monotonic(), request))
        async for m in self.script(len(self.calls), request, context):
            yield m

    async def Cancel(self, request, context):
        self.cancel_ids.append(request.request_id)
        return router_pb2.CancelResponse(found=True)

    async def ClusterStatus(self, request, context):
        self.status_calls += 1
        if self.status_code is not None and self.status_calls < 3:
            await context.abort(self.status_code, "scripted status failure")
        return router_pb2.ClusterStatusResponse(ready_models=["m"])


class ServerThread:
    """The scripted server on its own event loop in a daemon thread; ``await extra(self)`` runs in that loop after
    the server started (e.g. to start an HTTP front)."""

    def __init__(self, extra: Callable[[Any], Any] | None = None) -> None:
        self.servicer = Scripted()
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()

        async def main() -> None:
            self.server = grpc.aio.server()
            router_pb2_grpc.add_RouterServicer_to_server(self.servicer, self.server)
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()
            self.extra = await extra(self) if extra is not None else None
            ready.set()
            await self.server.wait_for_termination()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        # Best effort: grpc.aio's server.stop() can hang when its loop runs in a non-main thread after an abort();
        # the thread is a daemon, so it never outlives the test session.
        fut = asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop)
        try:
            fut.result(2)
        except Exception:
            fut.cancel()


def abort_with(code: grpc.StatusCode, message: str):
    async def script(n, request, context):
        await context.abort(code, message)
        yield  # pragma: no cover

    return script


def final_message(request_id: str, text: str = "") -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(
        request_id=request_id,
        token_ids=[5],
        text=text,
        finish_reason=common_pb2.FINISH_REASON_STOP,
        usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1),
        timing=common_pb2.Timing(ttft_s=0.01, e2e_s=0.02),
    )
