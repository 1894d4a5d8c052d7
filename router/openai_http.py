"""OpenAI-compatible HTTP API in front of the router: /v1/completions, /v1/chat/completions (both with SSE
streaming), /v1/models, and /health.

Every request goes through the router's own gRPC Generate path (the pdserve AsyncClient over a channel to the
router), so HTTP and gRPC outputs are the same for the same request. Errors have OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``, with the HTTP status that matches the router's gRPC status.

The router mounts it with ``await start_openai_http(router, host, port)``; it also runs on its own:

    python -m router.openai_http --router 127.0.0.1:50051 --port 8000

HTTPS: ``--http-tls-cert-file`` / ``--http-tls-key-file`` (this server's certificate; add ``--http-tls-ca-file`` and
``--http-tls-require-client-cert`` for mutual TLS), env ``PDSERVE_HTTP_TLS_*``. The ``--tls-*`` flags are the client
side: how this front reaches a router that serves TLS.

Supported request fields: model, prompt (text, token ids, or a list of either) / messages (text content or text
parts), max_tokens / max_completion_tokens, temperature, top_p, seed, stop, presence_penalty, frequency_penalty,
logit_bias, logprobs (completions: an int; chat: a bool with top_logprobs), echo (completions, text prompts; with
logprobs the prompt tokens' logprobs too), n (the prompt is prefilled once for all n), best_of (completions, not
streamed), stream, stream_options.include_usage, user (ignored), plus vLLM's extras top_k, min_p, min_tokens,
repetition_penalty, ignore_eos, stop_token_ids, skip_special_tokens, return_tokens_as_token_ids. Structured output:
response_format (text, json_object, json_schema) and vLLM's guided_json, guided_regex, guided_choice, guided_grammar
(guided_decoding_backend "xgrammar"), on both endpoints. Chat tools: tools, tool_choice (none, auto, required, a
named function) and parallel_tool_calls; tools go to the chat template, calls come back as tool_calls (parsed with
the --tool-call-parser; with required or a named function the arguments are constrained by the function's JSON
schema). Any other OpenAI field with a non-default value (functions, suffix, ...) is refused with a 400 rather than
silently ignored.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import grpc
from aiohttp import web

from pdserve.client import AsyncClient, PdserveError
from pdserve.engine.config import MAX_N
from pdserve.heap import freeze_startup_heap
from pdserve.client.aio import AsyncGenerateStream
from pdserve.client.types import GenerateChunk
from pdserve.security import TLSConfig, check_https_serving, secrets_match
from router.config import OpenAIHttpConfig
from router.tool_parsers import ParsedToolCall, ToolParser, calls_from_required, required_schema, tool_parser

log = logging.getLogger("router.openai_http")

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

_FINISH = {"stop": "stop", "length": "length", "cancelled": "abort", "error": "error"}


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
    return ApiError(400, message, "invalid_request_error", param, code)


# ----------------------------------------------------------------------------------------------------------------
# Request parsing
# ----------------------------------------------------------------------------------------------------------------

_COMMON = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "stop",
    "presence_penalty",
    "frequency_penalty",
    "stream",
    "stream_options",
    "n",
    "user",
    "logit_bias",
    "logprobs",
    # vLLM extensions
    "top_k",
    "min_tokens",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "skip_special_tokens",
    "min_p",
    "request_id",
    "return_tokens_as_token_ids",
}
_COMMON |= {
    "response_format",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_decoding_backend",
}
_COMPLETION_ONLY = {"prompt", "echo", "best_of", "suffix"}
_CHAT_ONLY = {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "parallel_tool_calls",
    "add_generation_prompt",
    "metadata",
    "store",
    "service_tier",
    "modalities",
    "reasoning_effort",
}


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class Parsed:
    model: str
    stream: bool
    include_usage: bool
    sampling: dict[str, Any]
    request_id: str | None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    top_logprobs: int | None = None  # None: no logprobs in the response
    echo: bool = False
    tools: list[dict[str, Any]] | None = None  # what the chat template gets (None: tool_choice none / no tools)
    tool_choice: str = "none"  # none, auto, required, or "function" (named)
    tool_name: str = ""  # the named function
    n: int = 1


def _structured(body: dict[str, Any]) -> dict[str, Any] | None:
    """The SDK's structured_output from response_format or vLLM's guided_* fields (one of them at most)."""
    given = [k for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None:
        if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
            raise bad("response_format.type must be one of text, json_object, json_schema", "response_format")
        if rf["type"] != "text":
            given.append("response_format")
    if len(given) > 1:
        raise bad(f"only one kind of structured output may be given, got {', '.join(given)}", given[1])
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend != "xgrammar":
        raise bad(
            f"guided_decoding_backend {backend!r} is not available; this server uses xgrammar",
            "guided_decoding_backend",
        )
    if not given:
        return None
    kind = given[0]
    if kind == "response_format" and isinstance(rf, dict):
        if rf["type"] == "json_object":
            return {"json_object": True}
        js = rf.get("json_schema")
        if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
            raise bad(
                "response_format json_schema needs a json_schema object with a 'schema' object", "response_format"
            )
        return {"json_schema": js.get("schema", {})}
    v = body[kind]
    if kind == "guided_json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except json.JSONDecodeError as e:
                raise bad(f"guided_json is not valid JSON: {e}", kind) from None
        if not isinstance(v, dict):
            raise bad("guided_json must be a JSON schema object", kind)
        return {"json_schema": v}
    if kind == "guided_choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) for c in v):
            raise bad("guided_choice must be a non-empty list of strings", kind)
        return {"choice": v}
    if not isinstance(v, str) or not v:
        raise bad(f"{kind} must be a non-empty string", kind)
    return {"regex": v} if kind == "guided_regex" else {"grammar": v}


def _tools(body: dict[str, Any], p: Parsed) -> None:
    """tools / tool_choice / parallel_tool_calls -> what the template gets and the constraint, on p."""
    for name in ("functions", "function_call"):
        if body.get(name) is not None:
            raise bad(f"{name} is deprecated and not supported; use tools and tool_choice", name)
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("'tools' must be a list of tool objects", "tools")
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if (
                not isinstance(t, dict)
                or t.get("type", "function") != "function"
                or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)
                or not fn["name"]
            ):
                raise bad(f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}', "tools")
            if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
                raise bad(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
    tools = tools or None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(
                'tool_choice must be none, auto, required or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        names = [t["function"]["name"] for t in tools or []]
        if fn["name"] not in names:
            raise bad(
                f"tool_choice names function {fn['name']!r}, which is not in tools ({', '.join(names) or 'none'})",
                "tool_choice",
            )
        p.tool_choice, p.tool_name = "function", fn["name"]
    elif choice in ("none", "auto", "required"):
        p.tool_choice = choice
    else:
        raise bad(f"tool_choice {choice!r} is not one of none, auto, required or a named function", "tool_choice")
    if p.tool_choice != "none" and not tools:
        raise bad(f"tool_choice {choice!r} needs tools", "tool_choice")
    ptc = body.get("parallel_tool_calls")
    if ptc is not None and not isinstance(ptc, bool):
        raise bad("'parallel_tool_calls' must be a boolean", "parallel_tool_calls")
    if p.tool_choice == "none":
        return
    p.tools = tools
    if p.tool_choice in ("required", "function"):
        if "structured_output" in p.sampling:
            raise bad(
                f"tool_choice {choice!r} cannot be combined with response_format / guided decoding", "tool_choice"
            )
        if p.tool_choice == "required":
            schema = required_schema(tools or [], ptc is not False)
        else:
            fn = next(t["function"] for t in tools or [] if t["function"]["name"] == p.tool_name)
            schema = fn.get("parameters") or {"type": "object"}
        p.sampling["structured_output"] = {"json_schema": schema}


def _parse_common(body: dict[str, Any], allowed: set[str], default_max_tokens: int | None) -> Parsed:
    unknown = [k for k in body if k not in allowed]
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
    model = body.get("model", "")
    if model is None:
        model = ""
    if not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    n = body.get("n")
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
        raise bad(f"'n' must be an integer in [1, {MAX_N}]", "n")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be a boolean", "stream")
    so = body.get("stream_options")
    include_usage = False
    if so is not None:
        if not isinstance(so, dict):
            raise bad("'stream_options' must be an object", "stream_options")
        if not stream:
            raise bad("stream_options is only allowed when stream is true", "stream_options")
        include_usage = bool(so.get("include_usage", False))

    s: dict[str, Any] = {}
    for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
        v = body.get(name)
        if v is not None:
            if not _is_num(v):
                raise bad(f"'{name}' must be a number", name)
            s[name] = float(v)
    for name in ("seed", "top_k", "min_tokens"):
        v = body.get(name)
        if v is not None:
            if not _is_int(v):
                raise bad(f"'{name}' must be an integer", name)
            s[name] = v
    mt = body.get("max_tokens", default_max_tokens)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        mt = body["max_completion_tokens"]
    if mt is not None:
        if not _is_int(mt):
            raise bad("'max_tokens' must be an integer", "max_tokens")
        s["max_tokens"] = mt
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(x, str) for x in stop):
            raise bad("'stop' must be a string or a list of strings", "stop")
        if stop:
            s["stop"] = stop
    sti = body.get("stop_token_ids")
    if sti is not None:
        if not isinstance(sti, list) or not all(_is_int(x) for x in sti):
            raise bad("'stop_token_ids' must be a list of integers", "stop_token_ids")
        s["stop_token_ids"] = sti
    for name in ("ignore_eos", "skip_special_tokens"):
        v = body.get(name)
        if v is not None:
            if not isinstance(v, bool):
                raise bad(f"'{name}' must be a boolean", name)
            s[name] = v
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, dict):
            raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
        bias: dict[int, float] = {}
        for k, v in lb.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise bad(f"logit_bias key {k!r} is not a token id (an integer)", "logit_bias") from None
            if not _is_num(v):
                raise bad(f"logit_bias value for token {k} must be a number", "logit_bias")
            bias[tok] = float(v)
        if bias:
            s["logit_bias"] = bias
    as_ids = body.get("return_tokens_as_token_ids")
    if as_ids is not None and not isinstance(as_ids, bool):
        raise bad("'return_tokens_as_token_ids' must be a boolean", "return_tokens_as_token_ids")
    rid = body.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not rid):
        raise bad("'request_id' must be a non-empty string", "request_id")
    structured = _structured(body)
    if structured is not None:
        s["structured_output"] = structured
    if n > 1:
        s["n"] = n
    return Parsed(
        model=model,
        stream=stream,
        include_usage=include_usage,
        sampling=s,
        request_id=rid,
        n=n,
        tokens_as_ids=bool(as_ids),
    )


def _want_logprobs(p: Parsed, k: int) -> None:
    p.top_logprobs = k
    p.sampling["logprobs"] = True
    p.sampling["top_logprobs"] = k


def parse_completion(body: dict[str, Any]) -> tuple[Parsed, list[str | list[int]]]:
    p = _parse_common(body, _COMMON | _COMPLETION_ONLY, default_max_tokens=16)
    echo = body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("'echo' must be a boolean", "echo")
    p.echo = bool(echo)
    lp = body.get("logprobs")
    if lp is not None:
        if not _is_int(lp):
            raise bad("'logprobs' must be an integer", "logprobs")
        if lp < 0:
            raise bad("`logprobs` must be a positive value.", "logprobs")
        if p.echo:
            p.sampling["prompt_logprobs"] = lp
        _want_logprobs(p, lp)
    best_of = body.get("best_of")
    if best_of is not None:
        if not _is_int(best_of) or not p.n <= best_of <= MAX_N:
            raise bad(f"best_of must be an integer in [n, {MAX_N}] (n={p.n}), got {best_of!r}", "best_of")
        if best_of > p.n:
            if p.stream:
                raise bad("best_of > n cannot be streamed: the best sequences are known only when all end", "best_of")
            p.sampling["best_of"] = best_of
    if body.get("suffix"):
        raise bad("suffix is not supported", "suffix")
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required", "prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts: list[str | list[int]] = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(isinstance(x, str) for x in prompt):
        prompts = list(prompt)
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in prompt)
    ):
        prompts = [list(x) for x in prompt]
    else:
        raise bad(
            "'prompt' must be a string, a list of strings, a list of token ids, or a list of token-id lists", "prompt"
        )
    if p.echo and not all(isinstance(x, str) for x in prompts):
        raise bad("echo is supported for text prompts only", "echo")
    return p, prompts


def parse_chat(body: dict[str, Any]) -> tuple[Parsed, list[dict[str, Any]], bool | None]:
    p = _parse_common(body, _COMMON | _CHAT_ONLY, default_max_tokens=None)
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if lp is not None and not isinstance(lp, bool):
        raise bad("'logprobs' must be a boolean", "logprobs")
    if top is not None:
        if not _is_int(top):
            raise bad("'top_logprobs' must be an integer", "top_logprobs")
        if top < 0:
            raise bad("`top_logprobs` must be a positive value.", "top_logprobs")
        if not lp:
            raise bad("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if lp:
        _want_logprobs(p, top or 0)
    _tools(body, p)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a 'role'", f"messages[{i}]")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(
                f"messages[{i}].role {m['role']!r} is not one of system, developer, user, assistant, tool",
                f"messages[{i}].role",
            )
        content = m.get("content")
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(
                        f"messages[{i}].content[{j}]: only text content parts are supported", f"messages[{i}].content"
                    )
                parts.append(part["text"])
            text = "".join(parts)
        else:
            raise bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")
        msg: dict[str, Any] = {"role": role, "content": text}
        calls = m.get("tool_calls")
        if calls is not None:
            if role != "assistant" or not isinstance(calls, list):
                raise bad(f"messages[{i}].tool_calls must be a list, on an assistant message", f"messages[{i}]")
            for j, c in enumerate(calls):
                fn = c.get("function") if isinstance(c, dict) else None
                if (
                    not isinstance(fn, dict)
                    or not isinstance(fn.get("name"), str)
                    or not isinstance(fn.get("arguments", ""), str)
                ):
                    raise bad(
                        f"messages[{i}].tool_calls[{j}] must have function.name and function.arguments (JSON text)",
                        f"messages[{i}].tool_calls",
                    )
                try:
                    json.loads(fn.get("arguments") or "{}")
                except json.JSONDecodeError as e:
                    raise bad(
                        f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}",
                        f"messages[{i}].tool_calls",
                    ) from None
            msg["tool_calls"] = calls
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                if not isinstance(m[key], str):
                    raise bad(f"messages[{i}].{key} must be a string", f"messages[{i}].{key}")
                msg[key] = m[key]
        out.append(msg)
    agp = body.get("add_generation_prompt")
    if agp is not None and not isinstance(agp, bool):
        raise bad("'add_generation_prompt' must be a boolean", "add_generation_prompt")
    return p, out, agp


# ----------------------------------------------------------------------------------------------------------------
# The server
# ----------------------------------------------------------------------------------------------------------------


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


def _lp_parts(c: Any) -> tuple[list[int], list[str], list[float], list[dict[int, float]], list[dict[int, str]]]:
    """Token ids, token texts, logprobs, alternatives and their texts of a GenerateChunk or a Completion."""
    return (
        list(c.token_ids),
        list(c.tokens or []),
        list(c.logprobs or []),
        list(c.top_logprobs or []),
        list(c.top_tokens or []),
    )


def _tok(tid: int, text: str, as_ids: bool) -> str:
    return f"token_id:{tid}" if as_ids else text


def completion_logprobs(c: Any, as_ids: bool, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions logprobs object; like vLLM, each top_logprobs entry also holds the chosen token."""
    ids, texts, lps, tops, names = _lp_parts(c)
    toks = [_tok(t, texts[i] if i < len(texts) else "", as_ids) for i, t in enumerate(ids)]
    top_out: list[dict[str, float]] = []
    offsets: list[int] = []
    for i, tok in enumerate(toks):
        alts = tops[i] if i < len(tops) else {}
        alt_names = names[i] if i < len(names) else {}
        d = {_tok(a, alt_names.get(a, ""), as_ids): lp for a, lp in alts.items()}
        d.setdefault(tok, lps[i])
        top_out.append(d)
        offsets.append(offset)
        offset += len(texts[i]) if i < len(texts) else 0
    return {"tokens": toks, "token_logprobs": lps[: len(toks)], "top_logprobs": top_out, "text_offset": offsets}


def echo_logprobs(pl: Any, as_ids: bool) -> dict[str, list[Any]]:
    """The prompt's part of an echoed completions logprobs object: its tokens, their logprobs (None for the first,
    as OpenAI), alternatives (each also holding the prompt token itself, like vLLM) and text offsets from 0."""
    toks = [_tok(t, pl.tokens[i] if i < len(pl.tokens) else "", as_ids) for i, t in enumerate(pl.token_ids)]
    tops: list[dict[str, float] | None] = []
    offsets, at = [], 0
    for i, tok in enumerate(toks):
        alts, names = pl.top_logprobs[i], pl.top_tokens[i]
        if alts is None:
            tops.append(None)
        else:
            d = {_tok(a, names.get(a, ""), as_ids): lp for a, lp in alts.items()}
            d.setdefault(tok, pl.logprobs[i])
            tops.append(d)
        offsets.append(at)
        at += len(pl.tokens[i]) if i < len(pl.tokens) else 0
    return {"tokens": toks, "token_logprobs": list(pl.logprobs), "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: Any, as_ids: bool) -> dict[str, Any]:
    """OpenAI's chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    ids, texts, lps, tops, names = _lp_parts(c)

    def entry(tid: int, text: str, lp: float) -> dict[str, Any]:
        tok = _tok(tid, text, as_ids)
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

    content = []
    for i, t in enumerate(ids):
        e = entry(t, texts[i] if i < len(texts) else "", lps[i])
        alt_names = names[i] if i < len(names) else {}
        e["top_logprobs"] = [entry(a, alt_names.get(a, ""), lp) for a, lp in (tops[i] if i < len(tops) else {}).items()]
        content.append(e)
    return {"content": content}


def _usage(u: Any) -> dict[str, int]:
    d = {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }
    if getattr(u, "cached_prompt_tokens", 0):
        d["prompt_tokens_details"] = {"cached_tokens": u.cached_prompt_tokens}
    return d


class OpenAIHttpServer:
    """The aiohttp application and its listening site. ``await start()`` -> port; ``await stop()``.

    ``tls``: this server's certificate (server side; None = plain HTTP). With ``tls.require_client_cert`` it is
    mutual TLS: a client without a certificate signed by ``tls.ca_file`` is refused at the handshake."""

    def __init__(
        self,
        client: AsyncClient,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        api_key: str | None = None,
        own_client: bool = False,
        tls: TLSConfig | None = None,
        tool_call_parser: str = "hermes",
    ) -> None:
        check_https_serving(tls)
        self.tool_parser: ToolParser = tool_parser(tool_call_parser)
        self.tls = tls
        self.client = client
        self.host = host
        self.port = port
        self.api_key = api_key
        self._own_client = own_client
        self.created = int(time.time())
        self.app = web.Application(middlewares=[self._errors_middleware])
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
        )
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{self.host}:{self.port}"

    async def start(self) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the gRPC call, so the
        # router frees the request's KV.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        ssl_context = self.tls.ssl_server_context() if self.tls is not None else None
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=ssl_context)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info(
            "OpenAI-compatible HTTP API on %s/v1%s",
            self.url,
            " (mutual TLS)" if self.tls is not None and self.tls.require_client_cert else "",
        )
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._own_client:
            await self.client.close()

    # --- plumbing ----------------------------------------------------------------------------------------------
    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            if self.api_key is not None and request.path.startswith("/v1/"):
                auth = request.headers.get("Authorization", "")
                if not (auth[:7].lower() == "bearer " and secrets_match(auth[7:].strip(), self.api_key)):
                    raise ApiError(401, "Incorrect API key provided.", "authentication_error", None, "invalid_api_key")
            return await handler(request)
        except ApiError as e:
            return e.response()
        except PdserveError as e:
            return ApiError.from_sdk(e).response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            msg = {
                404: f"Unknown route {request.method} {request.path}",
                405: f"Method {request.method} is not allowed on {request.path}",
            }.get(e.status, e.reason)
            return ApiError(
                e.status, msg, "invalid_request_error", None, "unknown_url" if e.status == 404 else None
            ).response()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every failure leaves in OpenAI's shape
            log.exception("unexpected error on %s %s", request.method, request.path)
            return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response()

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise bad("We could not parse the JSON body of your request. Send a JSON object.") from None
        if not isinstance(body, dict):
            raise bad("The request body must be a JSON object.")
        return body

    async def _model_names(self) -> list[str]:
        st = await self.client.cluster_status(timeout=10.0)
        names = list(st.ready_models)
        for p in st.pods:
            if p.model and p.model not in names:
                names.append(p.model)
        return names

    async def _response_model(self, requested: str) -> str:
        if requested:
            return requested
        try:
            names = await self._model_names()
        except PdserveError:
            return ""
        return names[0] if names else ""

    # --- endpoints ---------------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(self, request: web.Request) -> web.Response:
        names = await self._model_names()
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": n, "object": "model", "created": self.created, "owned_by": "pdserve"} for n in names],
            }
        )

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in await self._model_names():
            raise ApiError(
                404, f"The model '{name}' does not exist", "invalid_request_error", "model", "model_not_found"
            )
        return web.json_response({"id": name, "object": "model", "created": self.created, "owned_by": "pdserve"})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        p, prompts = parse_completion(await self._json(request))
        base = p.request_id or uuid.uuid4().hex
        rids = [base if len(prompts) == 1 else f"{base}-{i}" for i in range(len(prompts))]
        streams = [
            self.client.generate_stream(pr, model=p.model, request_id=rid, **p.sampling)
            for pr, rid in zip(prompts, rids)
        ]
        cid = f"cmpl-{base}"
        model = await self._response_model(p.model)

        want_lp = p.top_logprobs is not None

        n = p.n
        # Choice k of prompt i is index i * n + k (OpenAI's and vLLM's numbering); each echoes its prompt once.
        echo = [pr if p.echo and isinstance(pr, str) else "" for pr in prompts for _ in range(n)]
        offsets = [0] * (len(prompts) * n)  # text_offset of the next token, per choice
        prompt_lps: dict[int, Any] = {}  # prompt i -> its prompt logprobs (echo with logprobs), until sent

        head_sent: set[int] = set()  # choices whose logprobs already began with the echoed prompt's

        def choice(j: int, text: str, finish: str | None, c: Any = None) -> dict[str, Any]:
            lp = None
            if want_lp and c is not None:
                head = None
                if j // n in prompt_lps and j not in head_sent:  # echo with logprobs: the prompt's come first
                    head_sent.add(j)
                    head = echo_logprobs(prompt_lps[j // n], p.tokens_as_ids)
                    offsets[j] = len(prompts[j // n])
                lp = completion_logprobs(c, p.tokens_as_ids, offsets[j])
                offsets[j] = (lp["text_offset"][-1] + len(c.tokens[-1])) if c.token_ids and c.tokens else offsets[j]
                if head is not None:
                    lp = {k: head[k] + lp[k] for k in lp}
            return {"index": j, "text": text, "logprobs": lp, "finish_reason": finish}

        if not p.stream:
            comps = await self._gather(streams)
            usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            out = []
            for i, c in enumerate(comps):
                for k, v in _usage(c.usage).items():
                    if isinstance(v, int):
                        usage[k] += v
                if c.prompt_logprobs is not None:
                    prompt_lps[i] = c.prompt_logprobs
                for sub in c.choices or [c]:
                    j = i * n + sub.index
                    out.append(
                        choice(j, echo[j] + sub.text, _FINISH.get(sub.finish_reason or "", sub.finish_reason), sub)
                    )
            return web.json_response(
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": out,
                    "usage": usage,
                }
            )

        def frame(i: int, chunk: GenerateChunk) -> list[dict[str, Any]]:
            j = i * n + chunk.index
            if chunk.prompt_logprobs is not None:
                prompt_lps[i] = chunk.prompt_logprobs
            if not chunk.text and not chunk.finished and not (want_lp and chunk.token_ids) and not echo[j]:
                return []
            text, echo[j] = echo[j] + chunk.text, ""  # the prompt goes out once, ahead of the first tokens
            return [
                {
                    "id": cid,
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [
                        choice(
                            j,
                            text,
                            _FINISH.get(chunk.finish_reason or "", chunk.finish_reason) if chunk.finished else None,
                            chunk,
                        )
                    ],
                }
            ]

        def usage_frame(total: dict[str, int]) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [],
                "usage": total,
            }

        return await self._stream(request, streams, frame, [], usage_frame if p.include_usage else None)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        p, messages, agp = parse_chat(await self._json(request))
        rid = p.request_id or uuid.uuid4().hex
        stream = self.client.chat_stream(
            messages, add_generation_prompt=agp, model=p.model, request_id=rid, tools=p.tools, **p.sampling
        )
        cid = f"chatcmpl-{rid}"
        model = await self._response_model(p.model)
        want_lp = p.top_logprobs is not None

        def finish_of(reason: str | None, calls: list[dict[str, Any]]) -> str | None:
            finish = _FINISH.get(reason or "", reason)
            # OpenAI: a call the model chose (auto / required) ends with "tool_calls"; a named one with "stop".
            return "tool_calls" if calls and finish == "stop" and p.tool_choice != "function" else finish

        if not p.stream:
            (c,) = await self._gather([stream])
            return web.json_response(
                {
                    "id": cid,
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": model,
                    "choices": [self._chat_choice(p, ch, want_lp, finish_of) for ch in (c.choices or [c])],
                    "usage": _usage(c.usage),
                }
            )

        def chunk_obj(delta: dict[str, Any], finish: str | None, lp: Any = None, index: int = 0) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            }

        marker = self.tool_parser.start_marker
        text_so_far: dict[int, str] = {}  # per choice: all its text; with tools, what is not sent yet starts at sent
        sent: dict[int, int] = {}

        def frame(i: int, chunk: GenerateChunk) -> list[dict[str, Any]]:
            out = []
            if p.tool_choice == "none":
                if chunk.text or (want_lp and chunk.token_ids):
                    out.append(
                        chunk_obj(
                            {"content": chunk.text},
                            None,
                            chat_logprobs(chunk, p.tokens_as_ids) if want_lp else None,
                            chunk.index,
                        )
                    )
                if chunk.finished:
                    out.append(
                        chunk_obj({}, _FINISH.get(chunk.finish_reason or "", chunk.finish_reason), index=chunk.index)
                    )
                return out
            # With tools: auto streams text until a call may be starting (held back from a possible marker on);
            # required / named calls, and every call, go out whole when the generation ends. Per choice index.
            k = chunk.index
            text_so_far[k] = full = text_so_far.get(k, "") + chunk.text
            done = sent.get(k, 0)
            if p.tool_choice == "auto" and not chunk.finished and marker not in full:
                upto = len(full)
                for j in range(1, len(marker)):
                    if full.endswith(marker[:j]):
                        upto = len(full) - j
                if upto > done:
                    out.append(chunk_obj({"content": full[done:upto]}, None, index=k))
                    sent[k] = done = upto
            if chunk.finished:
                content, calls = self._tool_calls(p, full)
                if calls:
                    rest = (content or "")[done:] if content and len(content) > done else ""
                    if rest:
                        out.append(chunk_obj({"content": rest}, None, index=k))
                    out.append(
                        chunk_obj({"tool_calls": [dict(c, index=j) for j, c in enumerate(calls)]}, None, index=k)
                    )
                elif len(full) > done:
                    out.append(chunk_obj({"content": full[done:]}, None, index=k))
                out.append(chunk_obj({}, finish_of(chunk.finish_reason, calls), index=k))
            return out

        def usage_frame(total: dict[str, int]) -> dict[str, Any]:
            return {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": model,
                "choices": [],
                "usage": total,
            }

        head = [chunk_obj({"role": "assistant", "content": ""}, None, index=k) for k in range(p.n)]
        return await self._stream(request, [stream], frame, head, usage_frame if p.include_usage else None)

    def _chat_choice(
        self, p: Parsed, c: Any, want_lp: bool, finish_of: Callable[[str | None, list[dict[str, Any]]], str | None]
    ) -> dict[str, Any]:
        """One finished chat choice: its message (tool calls parsed out of the text) and finish reason."""
        content, calls = self._tool_calls(p, c.text)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": c.index,
            "message": message,
            "logprobs": chat_logprobs(c, p.tokens_as_ids) if want_lp else None,
            "finish_reason": finish_of(c.finish_reason, calls),
        }

    def _tool_calls(self, p: Parsed, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """The message's content and OpenAI tool_calls for a finished generation."""
        if p.tool_choice == "auto":
            content, parsed = self.tool_parser.parse(text)
        elif p.tool_choice == "required":
            parsed = calls_from_required(text)
            content = None if parsed else text  # a truncated array stays visible as text
        elif p.tool_choice == "function":
            content, parsed = None, [ParsedToolCall(p.tool_name, text)]
        else:
            return text, []
        return content, [c.openai() for c in parsed]

    # --- generation helpers ------------------------------------------------------------------------------------
    async def _gather(self, streams: list[AsyncGenerateStream]) -> list[Any]:
        tasks = [asyncio.ensure_future(s.until_done()) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for s, t in zip(streams, tasks):
                t.cancel()
                s.cancel()
            raise

    async def _stream(
        self,
        request: web.Request,
        streams: list[AsyncGenerateStream],
        frame: Callable[[int, GenerateChunk], list[dict[str, Any]]],
        head: list[dict[str, Any]],
        usage_frame: Callable[[dict[str, int]], dict[str, Any]] | None,
    ) -> web.StreamResponse:
        """SSE: the first chunk of every stream is awaited before the headers go out, so an error before the first
        token is still an ordinary HTTP error; a failure after it is sent as an ``error`` event."""
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
                await resp.write(_sse(obj))
            total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            async for i, chunk in self._merge(streams, firsts):
                if isinstance(chunk, PdserveError):
                    await resp.write(_sse(ApiError.from_sdk(chunk).body()))
                    break
                for obj in frame(i, chunk):
                    await resp.write(_sse(obj))
                if chunk.finished and chunk.usage is not None:
                    for k, v in _usage(chunk.usage).items():
                        if isinstance(v, int):
                            total[k] += v
            else:
                if usage_frame is not None:
                    await resp.write(_sse(usage_frame(total)))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
        finally:
            for s in streams:
                s.cancel()  # no-op for finished streams; a gone client frees the request's KV
        return resp

    @staticmethod
    async def _merge(streams: list[AsyncGenerateStream], firsts: list[GenerateChunk]) -> AsyncIterator[tuple[int, Any]]:
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


def _client_for(router: Any, api_key: str | None = None, tls: TLSConfig | None = None) -> tuple[AsyncClient, bool]:
    """An AsyncClient for what the router passes: an address, an AsyncClient, a grpc.aio channel, or a running
    server object exposing ``port`` and ``host`` / ``config.host``. ``api_key``: the one key both APIs share, sent
    on to the router's gRPC API; ``tls``: how to reach a router serving TLS."""
    if isinstance(router, AsyncClient):
        return router, False
    if isinstance(router, str):
        return AsyncClient(router, api_key=api_key, tls=tls), True
    if isinstance(router, grpc.aio.Channel):
        return AsyncClient(channel=router, api_key=api_key), True
    port = getattr(router, "port", None)
    host = getattr(router, "host", None) or getattr(getattr(router, "config", None), "host", None)
    if isinstance(port, int) and port > 0 and isinstance(host, str):
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return AsyncClient(f"{host}:{port}", api_key=api_key, tls=tls), True
    raise TypeError(
        "start_openai_http needs the router's address ('host:port'), an AsyncClient, a grpc.aio "
        f"channel, or a started server with .port and .config.host; got {type(router).__name__}"
    )


async def start_openai_http(
    router: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    router_tls: TLSConfig | None = None,
    tls: TLSConfig | None = None,
    tool_call_parser: str = "hermes",
) -> OpenAIHttpServer:
    """Serve the OpenAI-compatible API on ``host:port`` (0: any free port, see ``.port``) in the running event
    loop, over ``router``'s gRPC Generate path. ``await server.stop()`` to stop it.

    ``router_tls``: how to reach a router serving TLS (client side). ``tls``: this server's own certificate, to
    serve HTTPS (mutual TLS with ``require_client_cert``; see pdserve.security.http_server_tls)."""
    check_https_serving(tls)  # before a client is made that would then need closing
    client, own = _client_for(router, api_key, router_tls)
    server = OpenAIHttpServer(
        client, host, port, api_key=api_key, own_client=own, tls=tls, tool_call_parser=tool_call_parser
    )
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    return server


def parser() -> argparse.ArgumentParser:
    """The ``python -m router.openai_http`` command line: one flag per OpenAIHttpConfig field."""
    from pdserve import cli_config

    ap = cli_config.build_parser(
        OpenAIHttpConfig, "python -m router.openai_http", "OpenAI-compatible HTTP API in front of a pdserve router"
    )
    cli_config.add_log_level(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    from pdserve import cli_config

    ap = parser()
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:  # every certificate file is read now: a bad one fails here, naming its flag
        cfg = cli_config.from_args(OpenAIHttpConfig, args)
        http_tls, router_tls = cfg.http_tls, cfg.router_tls
    except ValueError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr, flush=True)
        return 2

    async def run() -> None:
        import signal

        server = await start_openai_http(
            cfg.router,
            cfg.host,
            cfg.port,
            api_key=cfg.api_key,
            router_tls=router_tls,
            tls=http_tls,
            tool_call_parser=cfg.tool_call_parser,
        )
        print(f"pdserve OpenAI-compatible API on {server.url}/v1 (router {cfg.router})", flush=True)
        freeze_startup_heap("OpenAI front")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
