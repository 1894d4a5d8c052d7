"""One error model for every service: a ServiceError carries the gRPC status it is answered with, and one handler
wrapper turns it (and the engine's bad-request errors) into that status."""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar, cast

import grpc

from pdserve.sampling_params import SamplingParamsError

# Trailing metadata of a Decode call that failed because the request's prompt KV could not be loaded (value: the
# prefill pod it came from): the router may then compute the KV again elsewhere (--kv-load-failure-policy).
KV_LOAD_FAILED_METADATA = "pdserve-kv-load-failed"


class ServiceError(Exception):
    """A request refused or failed with a gRPC status; message is what the client reads."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, code: grpc.StatusCode | None, message: str) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:  # raised in rank processes and pickled back to the driver
        return _restore, (type(self), dict(self.__dict__))


def _restore(cls: type[ServiceError], state: dict[str, Any]) -> ServiceError:
    e = cls.__new__(cls)
    Exception.__init__(e, state["message"])
    e.__dict__.update(state)
    return e


class _Coded(ServiceError):
    """A ServiceError whose subclass fixes the code: raised with the message only."""

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


class InvalidArgument(_Coded):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(_Coded):
    code = grpc.StatusCode.ALREADY_EXISTS


class ResourceExhausted(_Coded):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(_Coded):
    code = grpc.StatusCode.UNAVAILABLE


class FailedPrecondition(_Coded):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Unauthenticated(_Coded):
    code = grpc.StatusCode.UNAUTHENTICATED


class Cancelled(_Coded):
    code = grpc.StatusCode.CANCELLED


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status a handler answers exc with, or None for an exception that is a bug (left to grpc: UNKNOWN)."""
    if isinstance(exc, ServiceError):
        return exc.code, exc.message
    if isinstance(exc, SamplingParamsError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    engine = sys.modules.get("pdserve.engine.llm_engine")  # loaded wherever one can be raised (not in the router)
    if engine is not None and isinstance(exc, engine.RequestError):  # the engine's "change the request" error
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    shm = sys.modules.get("pdserve.engine.shm")
    if shm is not None and isinstance(exc, shm.RankFailure):  # this pod lost a rank; another pod may serve it
        return grpc.StatusCode.UNAVAILABLE, f"a TP rank of this pod failed: {exc}"
    return None


F = TypeVar("F", bound=Callable[..., Any])


def grpc_errors(handler: F) -> F:
    """Wrap a grpc.aio servicer method (unary or streaming) so a ServiceError aborts the call with its status."""
    if inspect.isasyncgenfunction(handler):

        @functools.wraps(handler)
        async def stream(self: Any, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async for item in handler(self, request, context):
                    yield item
            except Exception as e:
                await _abort_with(context, e)

        return cast(F, stream)

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except Exception as e:
            await _abort_with(context, e)

    return cast(F, unary)


async def _abort_with(context: grpc.aio.ServicerContext, e: Exception) -> None:
    """Abort the call with e's status; anything that carries none propagates unchanged."""
    status = status_of(e)
    if status is None:
        raise e
    await context.abort(*status)
