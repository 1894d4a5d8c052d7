"""Driving the router's streams for one HTTP request: all of them to the end (a whole answer), or as Server-Sent
Events, with several streams (a batch of prompts) merged as their chunks come."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from pdserve.client import PdserveError
from pdserve.client.aio import AsyncGenerateStream
from pdserve.client.types import GenerateChunk
from router.openai.errors import ApiError
from router.openai.logprobs import add_usage, usage, zero_usage

Frames = Callable[[int, GenerateChunk], list[dict[str, Any]]]


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def gather(streams: list[AsyncGenerateStream]) -> list[Any]:
    """Every stream's Completion; a failure (or this request's cancellation) cancels the others."""
    tasks = [asyncio.ensure_future(s.until_done()) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for s, t in zip(streams, tasks):
            t.cancel()
            s.cancel()
        raise


async def stream_sse(
    request: web.Request,
    streams: list[AsyncGenerateStream],
    frames: Frames,
    head: list[dict[str, Any]],
    usage_frame: Callable[[dict[str, int]], dict[str, Any]] | None,
) -> web.StreamResponse:
    """SSE: the first chunk of every stream is awaited before the headers go out, so an error before the first
    token is still an ordinary HTTP error; a failure after it is sent as an ``error`` event. ``frames(i, chunk)``:
    the events of stream i's chunk; ``usage_frame``: the last event, with the summed usage (include_usage)."""
    try:
        firsts = await asyncio.gather(*(s.__anext__() for s in streams))
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    resp = web.StreamResponse(
        status=200,
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
    try:
        await resp.prepare(request)
        for obj in head:
            await resp.write(sse(obj))
        await _events(resp, streams, firsts, frames, usage_frame)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
    finally:
        for s in streams:
            s.cancel()  # no-op for finished streams; a gone client frees the request's KV
    return resp


async def _events(
    resp: web.StreamResponse,
    streams: list[AsyncGenerateStream],
    firsts: list[GenerateChunk],
    frames: Frames,
    usage_frame: Callable[[dict[str, int]], dict[str, Any]] | None,
) -> None:
    """Write every chunk's events, then the usage event; a stream that failed ends them with an error event."""
    total = zero_usage()
    async for i, chunk in _merge(streams, firsts):
        if isinstance(chunk, PdserveError):
            await resp.write(sse(ApiError.from_sdk(chunk).body()))
            return
        for obj in frames(i, chunk):
            await resp.write(sse(obj))
        if chunk.finished and chunk.usage is not None:
            add_usage(total, usage(chunk.usage))
    if usage_frame is not None:
        await resp.write(sse(usage_frame(total)))


async def _merge(streams: list[AsyncGenerateStream], firsts: list[GenerateChunk]) -> AsyncIterator[tuple[int, Any]]:
    """(stream index, chunk or the PdserveError that ended it), in arrival order."""
    if len(streams) == 1:
        yield 0, firsts[0]
        try:  # a finished stream stops at once (a finished chunk may end only one of n sequences)
            async for c in streams[0]:
                yield 0, c
        except PdserveError as e:
            yield 0, e
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: AsyncGenerateStream, first: GenerateChunk) -> None:
        await queue.put((i, first))
        try:
            async for c in s:
                await queue.put((i, c))
        except PdserveError as e:
            await queue.put((i, e))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    live = len(tasks)
    try:
        while live:
            i, item = await queue.get()
            if item is None:
                live -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
