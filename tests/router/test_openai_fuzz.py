"""Fuzzing the OpenAI HTTP front from its own /openapi.json with schemathesis, over a real tiny cluster (router + a
prefill pod + a decode pod, separate processes): requests that fit the schema and requests that break it, on every
route, with a fixed seed. Every answer is a 2xx, or a refusal (400 / 422, or 404 for an unknown model) with an error
body in OpenAI's shape; none is a 5xx; none hangs; a 200 body matches the response schema the document declares;
and afterwards the pods hold no KV blocks.

Generated bodies are trimmed where they would only cost time (max_tokens, n, best_of capped, max_tokens set when
unset; a model name replaced by the served one so the request reaches the pods): each field's type is still whatever
was generated.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections import Counter

import hypothesis
import pytest
import schemathesis
from e2e_helpers import metered_http_cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from pdserve.net import free_port

pytestmark = pytest.mark.slow

BLOCKS = 128
CASES = 340  # over all routes, both generation modes
SEED = 41
ROUTES = [
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/models", "GET"),
    ("/v1/models/{model}", "GET"),
    ("/health", "GET"),
]
CAPS = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2, "best_of": 3, "min_tokens": 4}


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)


@pytest.fixture(scope="module")
def ports():
    return {"prefill": free_port(), "decode": free_port()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny, ports):
    with metered_http_cluster(tmp_path_factory.mktemp("fuzz"), tiny, ports, BLOCKS) as endpoints:
        yield endpoints


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M))


def served_model(base: str) -> str:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def trim(body: dict, model: str) -> None:
    """Cap what only costs time; keep every generated type (a capped field stays an int)."""
    for k, cap in CAPS.items():
        v = body.get(k)
        if type(v) is int and v > cap:
            body[k] = cap
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = CAPS["max_tokens"]  # unset, a chat would run to the context's end
    if type(body.get("model")) is str:
        body["model"] = model


def check_refusal(path: str, status: int, body: object) -> None:
    allowed = {400, 422} | ({404} if path.startswith("/v1/models/") else set())
    assert status in allowed, (status, body)
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str) and err["message"]


def test_fuzzed_requests_are_answered_or_refused_in_openai_shape(cluster, ports):
    schema = schemathesis.openapi.from_url(f"{cluster.http}/openapi.json")
    model = served_model(cluster.http)
    strategies = [
        schema[path][method].as_strategy(generation_mode=mode)
        for path, method in ROUTES
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    ]
    seen: Counter = Counter()

    @settings(
        max_examples=CASES,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        phases=[hypothesis.Phase.generate],
    )
    @hypothesis.seed(SEED)
    @given(case=st.one_of(strategies))
    def run(case) -> None:
        if type(case.body) is dict:
            trim(case.body, model)
        t0 = time.monotonic()
        resp = case.call(base_url=cluster.http, timeout=60)
        assert time.monotonic() - t0 < 60
        path = case.operation.path
        seen[(path, resp.status_code // 100)] += 1
        assert resp.status_code < 500, (path, case.body, resp.text)
        if resp.status_code >= 400:
            check_refusal(path, resp.status_code, resp.json())
        elif "text/event-stream" not in resp.headers.get("content-type", ""):
            case.operation.validate_response(resp)

    run()
    total = sum(seen.values())
    print(f"schemathesis: {total} cases: {dict(sorted(seen.items()))}")
    assert total >= 300
    assert {p for p, _ in seen} == {p for p, _ in ROUTES}
    assert any(p == "/v1/completions" and s == 2 for p, s in seen) and any(
        p == "/v1/chat/completions" and s == 2 for p, s in seen
    )
    deadline = time.monotonic() + 20  # every request ended: no block held on either pod
    while time.monotonic() < deadline:
        held = metric(ports["prefill"], "pdserve_prefill_kv_held_blocks")
        free = metric(ports["decode"], "pdserve_decode_kv_blocks_free")
        if held == 0 and free == BLOCKS:
            break
        time.sleep(0.2)
    assert (held, free) == (0, BLOCKS)
    assert metric(ports["prefill"], "pdserve_prefill_kv_leases") == 0
