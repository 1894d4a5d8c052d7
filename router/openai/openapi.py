"""The OpenAPI 3.1 document served at ``/openapi.json``: paths written out here (five routes), every body's schema
generated from the pydantic models in protocol.py, so the document cannot drift from what the server validates.
Tools read it: schemathesis fuzzes the front from it (tests/router/test_openai_fuzz.py), client generators make
typed clients."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from router.openai import protocol as pr

_REF = "#/components/schemas/{model}"
_ERRORS = {
    "400": "the request is invalid: the error names the field",
    "401": "a missing or wrong API key",
    "404": "an unknown model",
    "429": "the router's queue is full",
    "503": "no router or pod can serve the request",
}


def _ref(model: type[BaseModel], refs: dict[Any, Any], mode: str) -> dict[str, Any]:
    return refs[(model, mode)]


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(refs: dict[Any, Any], codes: tuple[str, ...]) -> dict[str, Any]:
    err = _ref(pr.ErrorResponse, refs, "serialization")
    return {code: _json(err, _ERRORS[code]) for code in codes}


def _generate(refs: dict[Any, Any], req: type[BaseModel], resp: type[BaseModel], summary: str) -> dict[str, Any]:
    """A POST generation route: a JSON answer, or SSE with ``stream: true``."""
    ok = _json(_ref(resp, refs, "serialization"), "the answer; with stream true, Server-Sent Events of its chunks")
    ok["content"]["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(req, refs, "validation")}},
            },
            "responses": {"200": ok, **_errors(refs, ("400", "401", "404", "429", "503"))},
        }
    }


def _get(refs: dict[Any, Any], model: type[BaseModel], summary: str, errors: tuple[str, ...]) -> dict[str, Any]:
    ok = _json(_ref(model, refs, "serialization"), summary)
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(refs, errors)}}}


def _paths(refs: dict[Any, Any]) -> dict[str, Any]:
    one_model = _get(refs, pr.ModelCard, "one model", ("401", "404"))
    one_model["get"]["parameters"] = [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}]
    return {
        "/health": _get(refs, pr.Health, "liveness", ()),
        "/v1/models": _get(refs, pr.ModelList, "the models the cluster serves", ("401",)),
        "/v1/models/{model}": one_model,
        "/v1/completions": _generate(refs, pr.CompletionRequest, pr.CompletionResponse, "text completion"),
        "/v1/chat/completions": _generate(refs, pr.ChatCompletionRequest, pr.ChatCompletionResponse, "chat completion"),
    }


def openapi_document(auth: bool = False) -> dict[str, Any]:
    """The document; ``auth``: the /v1 routes need ``Authorization: Bearer KEY``."""
    models: list[tuple[type[BaseModel], Any]] = [
        (pr.CompletionRequest, "validation"),
        (pr.ChatCompletionRequest, "validation"),
        (pr.CompletionResponse, "serialization"),
        (pr.ChatCompletionResponse, "serialization"),
        (pr.ModelList, "serialization"),
        (pr.ModelCard, "serialization"),
        (pr.Health, "serialization"),
        (pr.ErrorResponse, "serialization"),
    ]
    refs, defs = models_json_schema(models, ref_template=_REF)
    paths = _paths(refs)
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": "pdserve OpenAI-compatible API", "version": "1"},
        "paths": paths,
        "components": {"schemas": defs.get("$defs", {})},
    }
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, item in paths.items():
            for op in item.values():
                op["security"] = [{"bearer": []}] if path.startswith("/v1/") else []
    return doc
