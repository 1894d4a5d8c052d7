"""pdserve.errors: ServiceError's status reaches the client through grpc_errors, for unary and streaming
handlers; errors raised in rank processes keep their code across pickling."""

from __future__ import annotations

import asyncio
import pickle

import grpc
import pytest

from decode_svc.kv_source import KVDeliveryError
from pdserve.engine.llm_engine import RequestError
from pdserve.engine.shm import RankFailure
from pdserve.errors import AlreadyExists, InvalidArgument, ServiceError, Unavailable, grpc_errors, status_of
from pdserve.sampling_params import SamplingParamsError
from prefill_svc.worker import Exhausted


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.status: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code: grpc.StatusCode, message: str) -> None:
        self.status = (code, message)
        raise Aborted()  # grpc.aio's abort raises too


class Servicer:
    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    @grpc_errors
    async def Unary(self, request, context):
        if self.error is not None:
            raise self.error
        return request * 2

    @grpc_errors
    async def Stream(self, request, context):
        yield request
        if self.error is not None:
            raise self.error
        yield request + 1


async def _stream(svc: Servicer, ctx: FakeContext) -> list[int]:
    return [x async for x in svc.Stream(1, ctx)]


@pytest.mark.parametrize(
    "error,status",
    [
        (ServiceError(grpc.StatusCode.NOT_FOUND, "no such model"), (grpc.StatusCode.NOT_FOUND, "no such model")),
        (InvalidArgument("bad field"), (grpc.StatusCode.INVALID_ARGUMENT, "bad field")),
        (AlreadyExists("dup"), (grpc.StatusCode.ALREADY_EXISTS, "dup")),
        (Exhausted("full"), (grpc.StatusCode.RESOURCE_EXHAUSTED, "full")),
        (RequestError("prompt is empty"), (grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")),
        (SamplingParamsError("top_p"), (grpc.StatusCode.INVALID_ARGUMENT, "top_p")),
        (
            RankFailure("TP rank 1 exited", 1),
            (grpc.StatusCode.UNAVAILABLE, "a TP rank of this pod failed: TP rank 1 exited"),
        ),
    ],
)
def test_handlers_answer_service_errors_with_their_status(error, status):
    ctx = FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(Servicer(error).Unary(3, ctx))
    assert ctx.status == status
    ctx = FakeContext()
    with pytest.raises(Aborted):
        asyncio.run(_stream(Servicer(error), ctx))
    assert ctx.status == status


def test_success_and_bugs_pass_through():
    ctx = FakeContext()
    assert asyncio.run(Servicer(None).Unary(3, ctx)) == 6
    assert asyncio.run(_stream(Servicer(None), ctx)) == [1, 2] and ctx.status is None
    with pytest.raises(KeyError):  # a bug is not dressed up as a status: grpc reports it as UNKNOWN
        asyncio.run(Servicer(KeyError("x")).Unary(3, ctx))
    assert ctx.status is None and status_of(KeyError("x")) is None


def test_codes_survive_pickling():
    for e in (
        KVDeliveryError("lease gone", grpc.StatusCode.FAILED_PRECONDITION),
        Unavailable("rank 1 died"),
        ServiceError(grpc.StatusCode.ABORTED, "stop"),
    ):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and (back.code, back.message, str(back)) == (e.code, e.message, str(e))
