"""Flight: the Cancel RPC and pod eviction interrupt whatever pod call a journey is awaiting (unary or stream)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.flight import Cancelled, Flight, PodLost


async def _slow_server():
    async def sleep_unary(request, context):
        await asyncio.sleep(30)
        return b""

    async def sleep_stream(request, context):
        yield b"x"
        await asyncio.sleep(30)

    handler = grpc.method_handlers_generic_handler(
        "test.Slow",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(sleep_unary),
            "Stream": grpc.unary_stream_rpc_method_handler(sleep_stream),
        },
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


@pytest.mark.parametrize("how", ["cancel", "lost", "other_pod"])
def test_unary_call_is_interrupted(how):
    async def body():
        server, port = await _slow_server()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            unary = ch.unary_unary("/test.Slow/Unary")
            f = Flight("r1")
            f.prefill_pod = "p0"
            task = asyncio.create_task(f.call("p0", unary(b"")))
            await asyncio.sleep(0.1)
            if how == "cancel":
                f.cancel()
            elif how == "lost":
                f.pod_lost("p0")
            else:
                f.pod_lost("p9")  # not this request's pod: nothing happens
                await asyncio.sleep(0.1)
                assert not task.done()
                task.cancel()
            try:
                await task
                return None
            except BaseException as e:
                return type(e)
            finally:
                await server.stop(0)

    got = asyncio.run(body())
    assert got is {"cancel": Cancelled, "lost": PodLost, "other_pod": asyncio.CancelledError}[how]


def test_stream_read_is_interrupted_and_cancel_before_the_call_applies_at_once():
    async def body():
        server, port = await _slow_server()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stream = ch.unary_stream("/test.Slow/Stream")(b"")
            f = Flight("r1")
            assert await f.read("d0", stream) == b"x"
            task = asyncio.create_task(f.read("d0", stream))
            await asyncio.sleep(0.1)
            f.cancel()
            with pytest.raises(Cancelled):
                await task
            # Cancel arrived between steps: the next call is cancelled as soon as it is awaited.
            g = Flight("r2")
            g.cancel()
            with pytest.raises(Cancelled):
                await g.call("p0", ch.unary_unary("/test.Slow/Unary")(b""))
        await server.stop(0)

    asyncio.run(body())
