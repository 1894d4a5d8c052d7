"""The OpenAI-compatible HTTP layer's error handling, without a cluster: request validation (400 with the offending
param), the router's gRPC statuses mapped to HTTP statuses in OpenAI's error shape (also for stream=true requests,
whose errors before the first token are ordinary HTTP errors), unknown routes / methods, and the official `openai`
client raising its typed errors with the server's message. Token streams are tested against a live cluster in
test_live_cluster.py."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from client_helpers import ServerThread, abort_with, final_message

from pdserve_api.v1 import router_pb2
from router.openai_http import parse_chat, parse_completion, start_openai_http


async def _start_http(srv: ServerThread):
    return await start_openai_http(srv.address, "127.0.0.1", 0)


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(extra=_start_http)
    yield s
    s.stop()


@pytest.fixture()
def servicer(srv):
    srv.servicer.calls.clear()
    return srv.servicer


def _base(srv) -> str:
    return f"http://127.0.0.1:{srv.extra.port}"


def _post(srv, path: str, body: bytes | dict, method: str = "POST") -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(
        _base(srv) + path,
        data=data if method == "POST" else None,
        method=method,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _assert_openai_error(body: dict, *, param=None, code=None, type_=None, message=None) -> None:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    if type_ is not None:
        assert err["type"] == type_
    if message is not None:
        assert message in err["message"]


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/v1/completions", {"model": "m", "prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"model": "m", "prompt": "x", "n": 200}, "n"),
        ("/v1/completions", {"model": "m", "prompt": [1, 2], "echo": 1}, "echo"),
        ("/v1/completions", {"model": "m", "prompt": [-1, 2]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "seed": 2**64}, "seed"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 2**31}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {str(2**40): 1}}, "logit_bias"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": -1}, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logprobs": True}, "logprobs"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
        ("/v1/completions", {"model": "m", "prompt": "x", "logit_bias": {"1": "big"}}, "logit_bias"),
        ("/v1/completions", {"model": "m", "prompt": "x", "min_p": "low"}, "min_p"),
        ("/v1/completions", {"model": "m", "prompt": "x", "best_of": 3, "stream": True}, "best_of"),
        ("/v1/completions", {"model": "m", "prompt": "x", "n": 3, "best_of": 2}, "best_of"),
        ("/v1/completions", {"model": "m"}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": [1, "a"]}, "prompt"),
        ("/v1/completions", {"model": "m", "prompt": "x", "temperature": "hot"}, "temperature"),
        ("/v1/completions", {"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stop": [1]}, "stop"),
        ("/v1/completions", {"model": "m", "prompt": "x", "frobnicate": 1}, "frobnicate"),
        ("/v1/completions", {"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ("/v1/chat/completions", {"model": "m", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]},
            "tools",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1},
            "top_logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}},
            "response_format",
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "functions": [{"name": "f"}]},
            "functions",
        ),
    ],
)
def test_bad_requests_are_400_with_the_param(srv, servicer, path, body, param):
    status, out = _post(srv, path, body)
    assert status == 400
    _assert_openai_error(out, param=param, type_="invalid_request_error")
    assert servicer.calls == []  # refused before reaching the router


def test_unparsable_json_and_non_object(srv, servicer):
    status, out = _post(srv, "/v1/completions", b"{nope")
    assert status == 400
    _assert_openai_error(out, message="could not parse the JSON body")
    status, out = _post(srv, "/v1/completions", b"[1, 2]")
    assert status == 400
    _assert_openai_error(out)


def test_unknown_route_and_wrong_method(srv):
    status, out = _post(srv, "/v1/engines", {}, method="GET")
    assert status == 404
    _assert_openai_error(out, code="unknown_url")
    status, out = _post(srv, "/v1/completions", {}, method="GET")
    assert status == 405
    _assert_openai_error(out)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "code,http,err_code",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 400, None),
        (grpc.StatusCode.NOT_FOUND, 404, "model_not_found"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded"),
        (grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable"),
        (grpc.StatusCode.INTERNAL, 500, None),
    ],
)
def test_router_status_becomes_http_status_in_openai_shape(srv, servicer, stream, code, http, err_code):
    servicer.script = abort_with(code, f"router says {code.name}")
    for path, body in (
        ("/v1/completions", {"model": "m", "prompt": "hi", "stream": stream}),
        ("/v1/chat/completions", {"model": "m", "stream": stream, "messages": [{"role": "user", "content": "hi"}]}),
    ):
        status, out = _post(srv, path, body)
        assert status == http, out
        _assert_openai_error(out, code=err_code, message=f"router says {code.name}")


def test_request_fields_reach_the_router(srv, servicer):
    servicer.script = abort_with(grpc.StatusCode.INVALID_ARGUMENT, "stop here")
    _post(
        srv,
        "/v1/chat/completions",
        {
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            ],
            "max_completion_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "seed": 1,
            "stop": "\n",
            "top_k": 3,
            "request_id": "abc",
        },
    )
    req = servicer.calls[-1][1]
    assert req.model == "m" and req.request_id == "abc"
    assert [(m.role, m.content) for m in req.chat.messages] == [("system", "be brief"), ("user", "ab")]
    sp = req.sampling_params
    assert sp.max_tokens == 7 and sp.HasField("temperature") and sp.temperature == 0
    assert sp.top_p == 0.5 and sp.seed == 1 and list(sp.stop) == ["\n"] and sp.top_k == 3
    _post(srv, "/v1/completions", {"model": "m", "prompt": [1, 2, 3]})
    req = servicer.calls[-1][1]
    assert list(req.token_ids.ids) == [1, 2, 3] and req.sampling_params.max_tokens == 16  # OpenAI's default


def test_openai_client_raises_typed_errors_with_the_server_message(srv, servicer):
    client = openai.OpenAI(base_url=_base(srv) + "/v1", api_key="unused", max_retries=0)
    servicer.script = abort_with(grpc.StatusCode.INVALID_ARGUMENT, "prompt (5000 tokens) exceeds max_model_len")
    with pytest.raises(openai.BadRequestError) as ei:
        client.completions.create(model="m", prompt="x")
    assert "exceeds max_model_len" in str(ei.value)
    assert ei.value.status_code == 400
    servicer.script = abort_with(grpc.StatusCode.NOT_FOUND, "unknown model 'gpt-4'")
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-4'"):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.NotFoundError, match="unknown model 'gpt-4'"):
        for _ in client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "x"}], stream=True
        ):
            pass
    servicer.script = abort_with(grpc.StatusCode.RESOURCE_EXHAUSTED, "router queue full")
    with pytest.raises(openai.RateLimitError, match="router queue full"):
        client.completions.create(model="m", prompt="x")
    with pytest.raises(openai.BadRequestError, match="'n' must be an integer"):
        client.completions.create(model="m", prompt="x", n=0)


def test_models_lists_the_ready_models(srv, servicer):
    client = openai.OpenAI(base_url=_base(srv) + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list()] == ["m"]
    status, out = _post(srv, "/v1/models/nope", {}, method="GET")
    assert status == 404
    _assert_openai_error(out, code="model_not_found", param="model")


def test_openapi_document_declares_every_route_and_refuses_unknown_fields(srv):
    with urllib.request.urlopen(_base(srv) + "/openapi.json", timeout=10) as r:
        doc = json.loads(r.read())
    assert doc["openapi"].startswith("3.1")
    assert set(doc["paths"]) == {
        "/health",
        "/v1/models",
        "/v1/models/{model}",
        "/v1/completions",
        "/v1/chat/completions",
    }
    schemas = doc["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        assert schemas[name]["additionalProperties"] is False
    assert schemas["CompletionRequest"]["required"] == ["prompt"]
    assert schemas["ChatCompletionRequest"]["required"] == ["messages"]
    ok = doc["paths"]["/v1/completions"]["post"]["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}


def test_parsers_directly():
    p, prompts = parse_completion(
        {"model": "x", "prompt": [[1, 2], [3]], "stream": True, "stream_options": {"include_usage": True}}
    )
    assert prompts == [[1, 2], [3]] and p.stream and p.include_usage
    p, msgs, agp = parse_chat({"messages": [{"role": "user", "content": None}], "add_generation_prompt": False})
    assert msgs == [{"role": "user", "content": ""}] and agp is False and p.sampling == {}


DEAD_ROUTER = "127.0.0.1:1"  # nothing listens: UNAVAILABLE before any token


def _answers(n, request, context):
    async def gen():
        yield final_message(request.request_id, "ok")

    return gen()


def _fails_after_a_token(n, request, context):
    async def gen():
        yield router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[7], text="a")
        await context.abort(grpc.StatusCode.UNAVAILABLE, "decode failed after 1 tokens were sent: worker died")

    return gen()


def test_front_fails_over_to_another_router_before_the_first_token_only():
    """The front given several routers (one dead) answers every request through the live one; a failure after a
    token reached the client is reported in the stream, naming the router, and the request is not sent again."""
    s = ServerThread(extra=lambda srv: start_openai_http(f"{DEAD_ROUTER},{srv.address}", "127.0.0.1", 0))
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{s.extra.port}/v1", api_key="unused", max_retries=0)
        s.servicer.script = _answers
        for _ in range(4):  # whichever router the front starts with, every call completes
            out = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert out.choices[0].message.content == "ok"
            assert client.completions.create(model="m", prompt="hi").choices[0].text == "ok"
        assert len(s.servicer.calls) == 8

        s.servicer.calls.clear()
        s.servicer.script = _fails_after_a_token
        for _ in range(2):
            texts = []
            with pytest.raises(openai.APIError, match=f"router {s.address} failed mid-stream: .*worker died"):
                for chunk in client.chat.completions.create(
                    model="m", stream=True, messages=[{"role": "user", "content": "hi"}]
                ):
                    texts.append(chunk.choices[0].delta.content if chunk.choices else None)
            assert "a" in texts
        assert len(s.servicer.calls) == 2  # one call per request: nothing re-sent after a token
    finally:
        s.stop()
