"""Admission queue (pure asyncio over a real Registry): fit, FIFO wake-up, bound, timeouts, cancellation."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from router_helpers import register_request

from pdserve.errors import ServiceError
from pdserve_api.v1 import common_pb2, registry_pb2
from router.admission import Admission
from router.config import RouterConfig
from router.registry import Registry

DECODE = common_pb2.ROLE_DECODE


def make(free=(10,), total=10, tp=1, dcp=1, kv_heads=1, **cfg):
    config = RouterConfig(**cfg)
    reg = Registry(config, "SmolLM2-135M-Instruct")
    r = reg.register(
        register_request("d0", DECODE, tp=tp, dcp=dcp, kv_heads=kv_heads, num_blocks=total, free=list(free))
    )
    assert r.accepted, r.message
    return reg, Admission(reg, config)


def heartbeat(reg, free, total=10):
    reg.heartbeat(
        registry_pb2.HeartbeatRequest(
            pod_id="d0",
            kv=[common_pb2.RankKVStats(rank=r, free_blocks=f, total_blocks=total) for r, f in enumerate(free)],
        )
    )


def test_admits_at_once_and_books_blocks():
    async def body():
        reg, adm = make(free=(10, 10), tp=2, dcp=2)
        a = await adm.admit(64, None)  # 32 tokens per DCP rank = 2 blocks each
        assert a.pod_id == "d0" and a.need == [2, 2]
        assert reg.pods["d0"].effective_free() == [8, 8]
        adm.release(a)
        assert reg.pods["d0"].effective_free() == [10, 10]

    asyncio.run(body())


def test_waits_then_wakes_in_fifo_order_on_heartbeat():
    async def body():
        reg, adm = make(free=(1,))
        order = []

        async def one(i):
            a = await adm.admit(16, None)
            order.append(i)
            return a

        tasks = [asyncio.create_task(one(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        assert order == [0] and adm.depth == 2  # one block: first admitted, two queued
        heartbeat(reg, [2])  # the pod reports 2 free blocks (the first request's block is in its report)
        await asyncio.sleep(0.01)
        assert order == [0, 1, 2]
        assert adm.depth == 0
        for t in tasks:
            adm.release(t.result())

    asyncio.run(body())


def test_release_wakes_the_queue_without_a_heartbeat():
    async def body():
        reg, adm = make(free=(1,))
        a = await adm.admit(16, None)
        t = asyncio.create_task(adm.admit(16, None))
        await asyncio.sleep(0.01)
        assert not t.done()
        adm.release(a)
        await asyncio.sleep(0.01)
        assert t.done() and t.result().pod_id == "d0"

    asyncio.run(body())


def test_queue_bound_gives_resource_exhausted():
    async def body():
        reg, adm = make(free=(0,), max_queue_len=1)
        t = asyncio.create_task(adm.admit(16, None))
        await asyncio.sleep(0.01)
        with pytest.raises(ServiceError) as e:
            await adm.admit(16, None)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in e.value.message
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        assert adm.depth == 0

    asyncio.run(body())


def test_wait_bound_and_deadline():
    async def body():
        reg, adm = make(free=(0,), max_queue_wait_s=0.05)
        with pytest.raises(ServiceError) as e:
            await adm.admit(16, None)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "within" in e.value.message
        with pytest.raises(ServiceError) as e:
            await adm.admit(16, 0.02)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert adm.depth == 0

    asyncio.run(body())


def test_never_fits_and_no_pods():
    async def body():
        reg, adm = make(free=(10,), total=10)
        with pytest.raises(ServiceError) as e:
            await adm.admit(16 * 10 + 1, None)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "even when empty" in e.value.message
        reg.pods["d0"].state = common_pb2.POD_STATE_UNHEALTHY
        with pytest.raises(ServiceError) as e:
            await adm.admit(16, None)
        assert e.value.code == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


def test_cancelling_the_waiter_future_leaves_the_queue():
    async def body():
        reg, adm = make(free=(0,))
        futs = []
        t = asyncio.create_task(adm.admit(16, None, on_wait=futs.append))
        await asyncio.sleep(0.01)
        futs[0].cancel()  # what the Cancel RPC does
        with pytest.raises(asyncio.CancelledError):
            await t
        assert adm.depth == 0
        heartbeat(reg, [5])
        assert reg.pods["d0"].effective_free() == [5]  # nothing booked for the cancelled request

    asyncio.run(body())


def test_max_inflight_requests_queues():
    async def body():
        reg, adm = make(free=(100,), total=100, max_inflight_requests=1)
        a = await adm.admit(16, None)
        t = asyncio.create_task(adm.admit(16, None))
        await asyncio.sleep(0.01)
        assert not t.done()
        adm.release(a)
        await asyncio.sleep(0.01)
        assert t.done()

    asyncio.run(body())
