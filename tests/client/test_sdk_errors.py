"""SDK behaviour that needs no cluster: status -> typed exception mapping (with the server's message), retries with
backoff on UNAVAILABLE only and never after a message arrived, deadlines, cancel of a waiting call.

The server here is a real grpc.aio server implementing the Router service, scripted per test to answer with given
status codes; it does not imitate the router's generation (the live tests in test_live_cluster.py do that for real).
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
from client_helpers import ServerThread, abort_with, final_message

from pdserve.client import (
    AsyncClient,
    Client,
    DeadlineExceededError,
    GenerationFailedError,
    InvalidArgumentError,
    NotFoundError,
    PdserveError,
    ResourceExhaustedError,
    RetryPolicy,
    UnavailableError,
    errors,
)
from pdserve_api.v1 import router_pb2

FAST_RETRY = RetryPolicy(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=0.2, multiplier=2.0, jitter=0.0)


@pytest.fixture(scope="module")
def srv():
    s = ServerThread()
    yield s
    s.stop()


@pytest.fixture()
def servicer(srv):
    srv.servicer.calls.clear()
    srv.servicer.cancel_ids.clear()
    srv.servicer.status_calls = 0
    srv.servicer.status_code = None
    return srv.servicer


CASES = [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError),
    (grpc.StatusCode.NOT_FOUND, errors.NotFoundError),
    (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExistsError),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
    (grpc.StatusCode.PERMISSION_DENIED, errors.PermissionDeniedError),
    (grpc.StatusCode.UNAUTHENTICATED, errors.UnauthenticatedError),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPreconditionError),
    (grpc.StatusCode.OUT_OF_RANGE, errors.OutOfRangeError),
    (grpc.StatusCode.UNIMPLEMENTED, errors.UnimplementedError),
    (grpc.StatusCode.INTERNAL, errors.InternalError),
    (grpc.StatusCode.DATA_LOSS, errors.DataLossError),
    (grpc.StatusCode.ABORTED, errors.AbortedError),
    (grpc.StatusCode.UNKNOWN, errors.UnknownError),
]


@pytest.mark.parametrize("code,cls", CASES, ids=[c.name for c, _ in CASES])
def test_sync_status_maps_to_typed_exception_with_message(srv, servicer, code, cls):
    servicer.script = abort_with(code, f"the server says {code.name.lower()}")
    with Client(srv.address, retry=FAST_RETRY) as c:
        with pytest.raises(cls) as ei:
            c.generate("hello", max_tokens=3, request_id="rid-1")
    e = ei.value
    assert isinstance(e, PdserveError)
    assert str(e) == e.message == f"the server says {code.name.lower()}"
    assert e.code == code and e.request_id == "rid-1"
    assert len(servicer.calls) == 1  # only UNAVAILABLE is retried


@pytest.mark.parametrize("code,cls", CASES[:4], ids=[c.name for c, _ in CASES[:4]])
def test_async_status_maps_to_typed_exception_with_message(srv, servicer, code, cls):
    servicer.script = abort_with(code, "bad thing: details")

    async def run():
        async with AsyncClient(srv.address, retry=FAST_RETRY) as c:
            with pytest.raises(cls, match="^bad thing: details$"):
                await c.generate("hello")
            with pytest.raises(cls):
                async for _ in c.chat_stream([{"role": "user", "content": "x"}]):
                    pass

    asyncio.run(run())
    assert len(servicer.calls) == 2


def test_invalid_argument_is_also_a_value_error_and_deadline_a_timeout_error():
    assert issubclass(InvalidArgumentError, ValueError)
    assert issubclass(DeadlineExceededError, TimeoutError)
    assert issubclass(GenerationFailedError, UnavailableError)


def test_unavailable_is_retried_with_exponential_backoff_then_raised(srv, servicer):
    servicer.script = abort_with(grpc.StatusCode.UNAVAILABLE, "no READY prefill pod can take the prompt")
    with Client(srv.address, retry=FAST_RETRY) as c:
        with pytest.raises(UnavailableError, match="no READY prefill pod"):
            c.generate("hi")
    times = [t for t, _ in servicer.calls]
    assert len(times) == 4
    gaps = [b - a for a, b in zip(times, times[1:])]
    # 0.05, 0.1, 0.2 (no jitter): each gap at least the backoff, and growing
    for gap, want in zip(gaps, (0.05, 0.1, 0.2)):
        assert gap >= want * 0.9
    # every attempt re-sends the same request id
    assert len({r.request_id for _, r in servicer.calls}) == 1


def test_unavailable_then_success_returns_the_result(srv, servicer):
    async def script(n, request, context):
        if n < 3:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        yield final_message(request.request_id, "ok")

    servicer.script = script
    with Client(srv.address, retry=FAST_RETRY) as c:
        out = c.generate("hi", max_tokens=1)
    assert out.text == "ok" and out.finish_reason == "stop"
    assert out.usage.prompt_tokens == 3 and out.usage.completion_tokens == 1 and out.usage.total_tokens == 4
    assert out.timing.ttft_s == pytest.approx(0.01)
    assert out.timing.client_ttft_s is not None and out.timing.client_ttft_s > 0.1  # two backoffs included
    assert len(servicer.calls) == 3


def test_async_unavailable_then_success(srv, servicer):
    async def script(n, request, context):
        if n < 2:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "starting")
        yield final_message(request.request_id, "ok")

    servicer.script = script

    async def run():
        async with AsyncClient(srv.address, retry=FAST_RETRY) as c:
            return await c.generate([1, 2, 3], max_tokens=1)

    out = asyncio.run(run())
    assert out.text == "ok" and len(servicer.calls) == 2
    assert servicer.calls[0][1].token_ids.ids == [1, 2, 3]


def test_other_codes_are_not_retried(srv, servicer):
    servicer.script = abort_with(grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue full")
    with Client(srv.address, retry=FAST_RETRY) as c:
        with pytest.raises(ResourceExhaustedError, match="router queue full"):
            c.generate("hi")
    assert len(servicer.calls) == 1


def _fails_after_tokens(n, request, context):
    async def gen():
        yield router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7], text="a")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "decode failed after 1 tokens were sent: worker died")

    return gen()


def test_never_resent_after_a_message_arrived(srv, servicer):
    servicer.script = _fails_after_tokens
    with Client(srv.address, retry=FAST_RETRY) as c:
        stream = c.generate_stream("hi")
        first = next(stream)
        assert first.text == "a" and not first.finished
        with pytest.raises(GenerationFailedError, match="worker died") as ei:
            next(stream)
    assert len(servicer.calls) == 1
    assert ei.value.partial.text == "a" and ei.value.partial.finish_reason == "error"


def test_async_never_resent_after_a_message_arrived(srv, servicer):
    servicer.script = _fails_after_tokens

    async def run():
        async with AsyncClient(srv.address, retry=FAST_RETRY) as c:
            with pytest.raises(GenerationFailedError, match="worker died"):
                await c.generate("hi")

    asyncio.run(run())
    assert len(servicer.calls) == 1


def _hang(n, request, context):
    async def gen():
        await asyncio.sleep(30)
        yield final_message(request.request_id)

    return gen()


def test_deadline_exceeded(srv, servicer):
    servicer.script = _hang
    with Client(srv.address, retry=FAST_RETRY) as c:
        t = time.monotonic()
        with pytest.raises(DeadlineExceededError) as ei:
            c.generate("hi", timeout=0.3)
        assert time.monotonic() - t < 5
    assert ei.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(servicer.calls) == 1


def test_async_deadline_exceeded_and_client_default_timeout(srv, servicer):
    servicer.script = _hang

    async def run():
        async with AsyncClient(srv.address, timeout=0.3) as c:
            with pytest.raises(DeadlineExceededError):
                await c.generate("hi")

    t = time.monotonic()
    asyncio.run(run())
    assert time.monotonic() - t < 5


def test_retries_stop_at_the_deadline(srv, servicer):
    servicer.script = abort_with(grpc.StatusCode.UNAVAILABLE, "down")
    slow = RetryPolicy(max_attempts=50, initial_backoff_s=0.2, max_backoff_s=0.2, jitter=0.0)
    with Client(srv.address, retry=slow) as c:
        t = time.monotonic()
        with pytest.raises(DeadlineExceededError, match="last error: UNAVAILABLE: down"):
            c.generate("hi", timeout=0.7)
        assert time.monotonic() - t < 1.5
    assert 2 <= len(servicer.calls) <= 4


def test_unreachable_router_is_unavailable():
    with Client("127.0.0.1:1", retry=RetryPolicy(max_attempts=2, initial_backoff_s=0.01, jitter=0)) as c:
        with pytest.raises(UnavailableError):
            c.generate("hi", timeout=5)


def test_local_cancel_from_another_thread_ends_the_stream(srv, servicer):
    servicer.script = _hang
    with Client(srv.address) as c:
        stream = c.generate_stream("hi")
        threading.Timer(0.3, stream.cancel).start()
        t = time.monotonic()
        assert list(stream) == []
        assert time.monotonic() - t < 5
        assert stream.completion.finish_reason == "cancelled"


def test_async_local_cancel(srv, servicer):
    servicer.script = _hang

    async def run():
        async with AsyncClient(srv.address) as c:
            stream = c.generate_stream("hi")
            asyncio.get_running_loop().call_later(0.3, stream.cancel)
            got = [ch async for ch in stream]
            return got, stream.completion

    got, comp = asyncio.run(run())
    assert got == [] and comp.finish_reason == "cancelled"


def test_cancel_rpc_and_unary_retry(srv, servicer):
    servicer.status_code = grpc.StatusCode.UNAVAILABLE
    with Client(srv.address, retry=FAST_RETRY) as c:
        assert c.cancel("abc") is True
        assert list(c.cluster_status().ready_models) == ["m"]  # two UNAVAILABLE, then served
        assert c.wait_ready(5) == ["m"]
    assert servicer.cancel_ids == ["abc"]
    servicer.status_calls = 0
    servicer.status_code = grpc.StatusCode.NOT_FOUND
    with Client(srv.address, retry=FAST_RETRY) as c:
        with pytest.raises(NotFoundError, match="scripted status failure"):
            c.cluster_status()


def test_request_building(srv, servicer):
    seen = {}

    async def script(n, request, context):
        seen["req"] = request
        yield final_message(request.request_id)

    servicer.script = script
    with Client(srv.address, model="m1") as c:
        c.chat(
            [{"role": "system", "content": "s"}, ("user", "u")],
            max_tokens=4,
            temperature=0.0,
            stop="\n",
            seed=3,
            stop_token_ids=[9],
            add_generation_prompt=True,
            request_id="r-x",
        )
    req = seen["req"]
    assert req.request_id == "r-x" and req.model == "m1"
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "s"), ("user", "u")]
    assert req.chat.add_generation_prompt is True
    sp = req.sampling_params
    assert sp.max_tokens == 4 and sp.HasField("temperature") and sp.temperature == 0.0
    assert list(sp.stop) == ["\n"] and sp.seed == 3 and list(sp.stop_token_ids) == [9]
    assert not sp.HasField("top_p")
    with pytest.raises(TypeError, match="unknown sampling parameter"):
        Client(srv.address).generate("x", bogus=1)


# --- several routers ---
DEAD = "127.0.0.1:1"  # nothing listens: UNAVAILABLE before any token


def _answers(n, request, context):
    async def gen():
        yield final_message(request.request_id, "ok")

    return gen()


def test_failover_to_the_next_router_before_the_first_token(srv, servicer):
    servicer.script = _answers
    with Client([DEAD, srv.address], retry=FAST_RETRY) as c:
        assert c.address == DEAD and c.addresses == [DEAD, srv.address]
        for _ in range(4):  # whichever router round robin starts with, every call completes
            assert c.generate("hi").text == "ok"
            stream = c.generate_stream("hi")
            assert "".join(stream.text_chunks()) == "ok" and stream.router == srv.address  # where it was answered
        assert c.cluster_status() is not None
    assert len(servicer.calls) == 8

    async def run():
        async with AsyncClient(f"{DEAD},{srv.address}", retry=FAST_RETRY) as ac:
            for _ in range(4):
                assert (await ac.generate("hi")).text == "ok"
                stream = ac.generate_stream("hi")
                assert (await stream.until_done()).text == "ok" and stream.router == srv.address
            await ac.cluster_status()

    asyncio.run(run())
    assert len(servicer.calls) == 16


def test_calls_spread_over_the_routers(srv):
    other = ServerThread()
    try:
        srv.servicer.calls.clear()
        srv.servicer.script = other.servicer.script = _answers
        with Client(f"{srv.address},{other.address}") as c:
            for _ in range(6):
                c.generate("hi")
        assert len(srv.servicer.calls) == 3 and len(other.servicer.calls) == 3
    finally:
        other.stop()


def test_failure_after_a_token_is_not_retried_and_names_the_router(srv, servicer):
    servicer.script = _fails_after_tokens
    with Client([srv.address, DEAD], retry=FAST_RETRY) as c:
        for _ in range(2):  # starting on either router: the dead one fails over, the live one fails mid-stream
            with pytest.raises(GenerationFailedError, match=f"router {srv.address} failed mid-stream: .*worker died"):
                c.generate("hi")

    async def run():
        async with AsyncClient([srv.address, DEAD], retry=FAST_RETRY) as ac:
            for _ in range(2):
                with pytest.raises(GenerationFailedError, match=f"router {srv.address} failed mid-stream"):
                    await ac.generate("hi")

    asyncio.run(run())
    assert len(servicer.calls) == 4


def test_failover_takes_a_fresh_id_unless_the_caller_chose_it(srv, servicer):
    """A dead router may have left a decode reservation under the old id (ALREADY_EXISTS for a reuse) until its TTL:
    an id the SDK made is replaced when the call moves to another router; one the caller gave is kept."""
    servicer.script = _answers
    other = ServerThread()
    try:
        other.servicer.script = abort_with(grpc.StatusCode.UNAVAILABLE, "router going away")
        with Client([other.address, srv.address], retry=FAST_RETRY) as c:
            for _ in range(2):
                s = c.generate_stream("hi")
                s.until_done()
            c.generate("hi", request_id="mine")
        tried = [r.request_id for _, r in other.servicer.calls]
        served = [r.request_id for _, r in servicer.calls]
        assert served[-1] == "mine"  # kept, whichever router the call started on
        sdk_tried, sdk_served = [t for t in tried if t != "mine"], [t for t in served if t != "mine"]
        assert sdk_tried and not set(sdk_tried) & set(sdk_served)
        assert all(t.startswith("sdk-") for t in sdk_served)
    finally:
        other.stop()
