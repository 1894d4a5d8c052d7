"""Generate's refusals and queueing through real gRPC, before any pod is contacted (or with pods registered at
addresses where nothing listens, which is a real connection failure, not a fake pod)."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from router_helpers import register_request, run, running_router, stubs

from pdserve.net import free_port
from pdserve_api.v1 import common_pb2, router_pb2

PREFILL, DECODE = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE


def gen(ids=(1, 2, 3), **sp):
    return router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=list(ids)), sampling_params=common_pb2.SamplingParams(**sp)
    )


async def status_of(router, req, timeout=None):
    call = router.Generate(req, timeout=timeout)
    msgs = []
    try:
        async for m in call:
            msgs.append(m)
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), msgs
    return grpc.StatusCode.OK, "", msgs


def dead_address():
    return f"127.0.0.1:{free_port()}"  # nothing listens there


def test_no_pods_is_unavailable():
    async def body():
        async with running_router() as (server, ch):
            router, _ = stubs(ch)
            return await status_of(router, gen())

    code, details, msgs = run(body())
    assert code == grpc.StatusCode.UNAVAILABLE and "no READY prefill pod" in details and not msgs


@pytest.mark.parametrize(
    "req,code,needle",
    [
        (router_pb2.GenerateRequest(), grpc.StatusCode.INVALID_ARGUMENT, "set exactly one prompt"),
        (gen(ids=()), grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty"),
        (router_pb2.GenerateRequest(text=""), grpc.StatusCode.INVALID_ARGUMENT, "prompt text is empty"),
        (gen(ids=(1, 300)), grpc.StatusCode.INVALID_ARGUMENT, "out of range for the model's vocabulary [0, 256)"),
        (gen(ids=range(1, 200)), grpc.StatusCode.INVALID_ARGUMENT, "max_model_len is 128"),
        (gen(temperature=-1), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be a finite number >= 0"),
        (gen(top_p=0), grpc.StatusCode.INVALID_ARGUMENT, "top_p must be in (0, 1]"),
        (gen(max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be an integer >= 1, got 0"),
        (gen(stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop strings must be non-empty"),
        (
            gen(max_tokens=2, min_tokens=3),
            grpc.StatusCode.INVALID_ARGUMENT,
            "min_tokens must be less than or equal to max_tokens=2, got 3.",
        ),
        (
            gen(top_logprobs=21),
            grpc.StatusCode.INVALID_ARGUMENT,
            "Requested sample logprobs of 21, which is greater than max allowed: 20",
        ),
        (gen(presence_penalty=3), grpc.StatusCode.INVALID_ARGUMENT, "presence_penalty must be in [-2, 2], got 3.0."),
        (gen(repetition_penalty=0), grpc.StatusCode.INVALID_ARGUMENT, "repetition_penalty must be greater than zero"),
        (gen(min_p=2), grpc.StatusCode.INVALID_ARGUMENT, "min_p must be in [0, 1], got 2.0."),
        (gen(top_k=-2), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (
            router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1]), model="nope"),
            grpc.StatusCode.NOT_FOUND,
            "is not served here",
        ),
        (router_pb2.GenerateRequest(chat=router_pb2.ChatPrompt()), grpc.StatusCode.INVALID_ARGUMENT, "no messages"),
        (
            router_pb2.GenerateRequest(chat=router_pb2.ChatPrompt(messages=[router_pb2.ChatMessage(role="x")])),
            grpc.StatusCode.INVALID_ARGUMENT,
            "role 'x'",
        ),
        # Text is tokenized with the real tokenizer: its ids exceed the tiny registered vocabulary.
        (router_pb2.GenerateRequest(text="hello world"), grpc.StatusCode.INVALID_ARGUMENT, "vocabulary"),
    ],
)
def test_bad_requests_are_invalid_argument(req, code, needle):
    async def body():
        async with running_router() as (server, ch):
            router, registry = stubs(ch)
            await registry.RegisterWorker(register_request("p0", PREFILL, max_model_len=128))
            await registry.RegisterWorker(register_request("d0", DECODE, max_model_len=128))
            return await status_of(router, req)

    got, details, msgs = run(body())
    assert got == code and needle in details, details
    assert not msgs


def test_dead_decode_pods_give_unavailable_naming_them():
    async def body():
        async with running_router() as (server, ch):
            router, registry = stubs(ch)
            await registry.RegisterWorker(register_request("p0", PREFILL, address=dead_address()))
            for i in range(2):
                await registry.RegisterWorker(register_request(f"d{i}", DECODE, address=dead_address()))
            res = await status_of(router, gen(max_tokens=4))
            core = server.core
            await asyncio.sleep(0.1)  # background clean-up of the refused reservations
            return res, core.admission.inflight, [e.effective_free() for e in core.registry.pods.values()]

    (code, details, msgs), inflight, free = run(body())
    assert code == grpc.StatusCode.UNAVAILABLE
    assert "d0" in details and "d1" in details, details
    assert inflight == 0 and free == [[100], [100], [100]]  # every booking given back


def _full_cluster():
    return [
        register_request("p0", PREFILL, address=dead_address()),
        register_request("d0", DECODE, address=dead_address(), num_blocks=10, free=[0]),
    ]


def test_queue_bound_deadline_cancel_and_duplicate_ids():
    async def body():
        async with running_router(max_queue_len=2, max_queue_wait_s=20) as (server, ch):
            router, registry = stubs(ch)
            for r in _full_cluster():
                assert (await registry.RegisterWorker(r)).accepted
            # Two requests wait (the decode pod has no free block).
            a = router.Generate(router_pb2.GenerateRequest(request_id="a", token_ids=common_pb2.TokenIds(ids=[1])))
            b = router.Generate(router_pb2.GenerateRequest(request_id="b", token_ids=common_pb2.TokenIds(ids=[1])))
            # (no wait_for_connection: a streaming call's headers come with its first message)
            for _ in range(100):
                if server.core.admission.depth == 2:
                    break
                await asyncio.sleep(0.01)
            assert server.core.admission.depth == 2
            st = await router.ClusterStatus(router_pb2.ClusterStatusRequest())
            assert st.router_queue_depth == 2 and st.num_inflight_requests == 0
            # Same id again: ALREADY_EXISTS. Third distinct request: the queue is full.
            dup = await status_of(
                router, router_pb2.GenerateRequest(request_id="a", token_ids=common_pb2.TokenIds(ids=[1]))
            )
            full = await status_of(router, gen())
            # Cancel RPC: the waiting stream ends with a CANCELLED final message.
            assert (await router.Cancel(router_pb2.CancelRequest(request_id="a"))).found
            msgs_a = [m async for m in a]
            assert not (await router.Cancel(router_pb2.CancelRequest(request_id="a"))).found
            # Client-side cancel: the router forgets the waiting request.
            b.cancel()
            for _ in range(100):
                if server.core.admission.depth == 0 and not server.core.flights:
                    break
                await asyncio.sleep(0.01)
            depth_after = server.core.admission.depth
            # A deadline while queued.
            dl = await status_of(router, gen(), timeout=0.3)
            return dup, full, msgs_a, depth_after, dl, server.core.flights

    dup, full, msgs_a, depth_after, dl, flights = run(body())
    assert dup[0] == grpc.StatusCode.ALREADY_EXISTS
    assert full[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in full[1]
    assert len(msgs_a) == 1 and msgs_a[0].finish_reason == common_pb2.FINISH_REASON_CANCELLED
    assert msgs_a[0].request_id == "a" and not msgs_a[0].token_ids
    assert depth_after == 0
    assert dl[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert not flights


def test_draining_router_refuses_new_requests():
    async def body():
        async with running_router(drain_timeout_s=0.2) as (server, ch):
            router, _ = stubs(ch)
            server.core.draining = True
            return await status_of(router, gen())

    code, details, _ = run(body())
    assert code == grpc.StatusCode.UNAVAILABLE and "shutting down" in details
