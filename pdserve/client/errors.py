"""Typed exceptions of the pdserve SDK, one per gRPC status the router returns.

Every exception carries the server's message as ``str(e)`` / ``e.message``, the gRPC status as ``e.code``
(a ``grpc.StatusCode``) and, for Generate calls, ``e.request_id``.

    try:
        client.generate("...", max_tokens=10_000_000)
    except pdserve.client.InvalidArgumentError as e:
        print(e.message)
"""

from __future__ import annotations

from typing import Any

import grpc


class PdserveError(Exception):
    """Base class of every error the SDK raises for a failed call."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        message: str,
        *,
        code: grpc.StatusCode | None = None,
        request_id: str | None = None,
        debug_error_string: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.request_id = request_id
        self.debug_error_string = debug_error_string

    @property
    def status_name(self) -> str:
        """The gRPC status name, e.g. ``"INVALID_ARGUMENT"``."""
        return self.code.name

    def __repr__(self) -> str:
        rid = f", request_id={self.request_id!r}" if self.request_id else ""
        return f"{type(self).__name__}({self.status_name}: {self.message!r}{rid})"


class InvalidArgumentError(PdserveError, ValueError):
    """Bad sampling parameters, a prompt that is too long, a malformed request."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(PdserveError):
    """Unknown model (or model path, for ValidateConfig)."""

    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(PdserveError):
    """The request_id is already in use by an in-flight request."""

    code = grpc.StatusCode.ALREADY_EXISTS


class UnavailableError(PdserveError):
    """The router is unreachable, or no READY prefill/decode pod can take the request. The SDK retries these (with
    backoff) as long as no token has been received; this is raised once the retries are spent."""

    code = grpc.StatusCode.UNAVAILABLE


class ResourceExhaustedError(PdserveError):
    """The router's queue is full (or a request waited too long in it)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceededError(PdserveError, TimeoutError):
    """The call's deadline (``timeout=``) passed before it finished."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(PdserveError):
    """The call was cancelled by the server side (a local ``stream.cancel()`` never raises)."""

    code = grpc.StatusCode.CANCELLED


class PermissionDeniedError(PdserveError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(PdserveError):
    code = grpc.StatusCode.UNAUTHENTICATED


class FailedPreconditionError(PdserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRangeError(PdserveError):
    code = grpc.StatusCode.OUT_OF_RANGE


class AbortedError(PdserveError):
    code = grpc.StatusCode.ABORTED


class UnimplementedError(PdserveError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(PdserveError):
    code = grpc.StatusCode.INTERNAL


class DataLossError(PdserveError):
    code = grpc.StatusCode.DATA_LOSS


class UnknownError(PdserveError):
    code = grpc.StatusCode.UNKNOWN


class GenerationFailedError(UnavailableError):
    """The server aborted a request after tokens were already streamed (a worker died, a KV transfer failed).

    The SDK never re-sends such a request (it would repeat tokens). ``partial`` is the :class:`Completion` built from
    what arrived (``finish_reason == "error"``)."""

    def __init__(self, message: str, *, partial: Any = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.partial = partial


_BY_CODE: dict[grpc.StatusCode, type[PdserveError]] = {
    cls.code: cls
    for cls in (
        InvalidArgumentError,
        NotFoundError,
        AlreadyExistsError,
        UnavailableError,
        ResourceExhaustedError,
        DeadlineExceededError,
        CancelledError,
        PermissionDeniedError,
        UnauthenticatedError,
        FailedPreconditionError,
        OutOfRangeError,
        AbortedError,
        UnimplementedError,
        InternalError,
        DataLossError,
        UnknownError,
    )
}


def exception_class_for(code: grpc.StatusCode) -> type[PdserveError]:
    """The SDK exception class for a gRPC status code (UnknownError for codes without their own class)."""
    return _BY_CODE.get(code, UnknownError)


def from_rpc_error(e: grpc.RpcError, request_id: str | None = None) -> PdserveError:
    """Map a grpc (sync or aio) RpcError to the SDK's exception, keeping the server's message."""
    code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    details = e.details() if hasattr(e, "details") else None
    message = details if details else code.name
    debug = None
    if hasattr(e, "debug_error_string"):
        try:
            debug = e.debug_error_string()
        except Exception:  # pragma: no cover - depends on the grpc build
            debug = None
    cls = exception_class_for(code)
    return cls(message, code=code, request_id=request_id, debug_error_string=debug)


__all__ = [
    "PdserveError",
    "InvalidArgumentError",
    "NotFoundError",
    "AlreadyExistsError",
    "UnavailableError",
    "ResourceExhaustedError",
    "DeadlineExceededError",
    "CancelledError",
    "PermissionDeniedError",
    "UnauthenticatedError",
    "FailedPreconditionError",
    "OutOfRangeError",
    "AbortedError",
    "UnimplementedError",
    "InternalError",
    "DataLossError",
    "UnknownError",
    "GenerationFailedError",
    "exception_class_for",
    "from_rpc_error",
]
