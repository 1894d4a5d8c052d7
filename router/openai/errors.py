"""Errors in OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``: ApiError, the HTTP status of each of
the router's gRPC statuses, and the one 400 a pydantic ValidationError becomes (naming the offending field)."""

from __future__ import annotations

from typing import Any

import grpc
from aiohttp import web
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from pdserve.client import PdserveError

# gRPC status -> (HTTP status, OpenAI error type, OpenAI error code)
_HTTP_OF_STATUS: dict[grpc.StatusCode, tuple[int, str, str | None]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", None),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error", None),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", None),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "invalid_request_error", "request_id_in_use"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", None),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "rate_limit_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "invalid_request_error", "request_cancelled"),
    grpc.StatusCode.UNIMPLEMENTED: (501, "server_error", None),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error", "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error", "timeout"),
}


class ApiError(Exception):
    """An error to return in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status)

    @classmethod
    def from_sdk(cls, e: PdserveError) -> "ApiError":
        status, type_, code = _HTTP_OF_STATUS.get(e.code, (500, "server_error", None))
        param = "model" if e.code == grpc.StatusCode.NOT_FOUND else None
        return cls(status, e.message, type_, param, code)


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 invalid_request_error naming ``param``."""
    return ApiError(400, message, "invalid_request_error", param, code)


# What a wrong type of value is called, by the first word of pydantic's error type (int_type, int_parsing, ...).
_KIND = {
    "int": "an integer",
    "float": "a number",
    "bool": "a boolean",
    "string": "a string",
    "list": "a list",
    "dict": "an object",
    "model": "an object",
}


def _param(loc: tuple[int | str, ...]) -> str:
    """The field an error is about: a top-level field, or ``messages[i].field`` inside a message."""
    if loc[0] == "messages" and len(loc) > 1:
        return f"messages[{loc[1]}]" + (f".{loc[2]}" if len(loc) > 2 else "")
    return str(loc[0])


def _path(loc: tuple[int | str, ...]) -> str:
    """A location as one names it in JSON: ``messages[0].tool_calls[1].function``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")


def _message(err: ErrorDetails, param: str, shapes: dict[str, str], value: Any) -> str:
    kind = err["type"]
    shape = shapes.get(param.split("].")[-1] if param.startswith("messages[") else param)
    if shape is not None:
        return shape.format(param=param, value=value)
    if kind == "missing":
        return f"'{_path(err['loc'])}' is required"
    if kind in ("greater_than_equal", "less_than_equal") and err.get("ctx", {}).get("ge") == 0:
        return f"`{param}` must be a positive value."  # vLLM's wording
    if kind == "literal_error":
        return f"{param} {err['input']!r} is not one of {err.get('ctx', {}).get('expected', '')}"
    noun = _KIND.get(kind.split("_")[0])
    if noun is not None:
        return f"'{param}' must be {noun}"
    return f"'{param}': {err['msg']}"


def from_validation(e: ValidationError, body: Any, shapes: dict[str, str]) -> ApiError:
    """The 400 for a request body pydantic refused: an unknown field first (pdserve's rule: a field this server does
    not serve is refused, not ignored), else the first field in error, with ``shapes`` (field -> what it must be,
    a template of ``{param}`` and ``{value}``) saying what a union-typed field takes."""
    errors = e.errors()
    extra = [x for x in errors if x["type"] == "extra_forbidden"]
    if extra:
        name = ".".join(str(p) for p in extra[0]["loc"])
        return bad(f"Unrecognized request argument supplied: {name}", name)
    if not errors or not errors[0]["loc"]:
        return bad("The request body must be a JSON object.")
    first = errors[0]
    param = _param(first["loc"])
    value = body.get(first["loc"][0]) if hasattr(body, "get") else None
    return bad(_message(first, param, shapes, value), param)
