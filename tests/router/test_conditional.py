"""Conditional disaggregation through the router (--local-prefill-max-tokens): short prompts are computed on their
decode pod (a TP 2 x DCP 2 pod computing the prompt in 16-token chunks between its decode steps, no prefill pod, no
KV transfer), long ones on the prefill pod with their KV transferred; both give transformers' greedy tokens, and
the router counts each choice. With ``auto`` the threshold is the one the router derived from the decode pod's
measured step times, logged and shown in ClusterStatus. Real processes on loopback."""

from __future__ import annotations

import asyncio
import random
import re
import urllib.request

import grpc
import pytest
from e2e_helpers import e2e_cluster
from hf_helpers import hf_greedy

from pdserve.net import free_port
from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow

NEW_TOKENS = 12
LOCAL_MAX = 32  # prompts of at most this many tokens are prefilled on the decode pod


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_kv_heads=1)


@pytest.fixture(scope="module")
def metrics_port():
    return free_port()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny, metrics_port):
    c = e2e_cluster(
        tmp_path_factory.mktemp("conditional"),
        tiny,
        num_prefill=1,
        num_decode=1,
        decode_tp=2,
        decode_dcp=2,
        router_args=["--local-prefill-max-tokens", str(LOCAL_MAX), "--metrics-port", str(metrics_port)],
        decode_args=["--prefill-chunk-size", "16"],
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def choices(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    pattern = r'^pdserve_router_prefill_choice_total\{where="(\w+)"\} (\S+)$'
    return {m[1]: float(m[2]) for m in re.finditer(pattern, text, re.M)}


async def _greedy(stub, ids: list[int]) -> list:
    """Every message of a greedy generation of NEW_TOKENS tokens from the prompt ids."""
    req = router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
    )
    return [m async for m in stub.Generate(req, timeout=120)]


def test_local_and_remote_prefill_give_the_same_greedy_tokens(cluster, tiny, metrics_port):
    rng = random.Random(5)
    ps = [[rng.randrange(3, 256) for _ in range(n)] for n in (5, 17, 31, 32, 33, 48, 70, 9)]
    want = hf_greedy(tiny, ps, NEW_TOKENS)
    before = choices(metrics_port)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            return await asyncio.gather(*(_greedy(stub, p) for p in ps))  # concurrent: local prefill beside decoding

    got = asyncio.run(body())
    for ids, msgs, w in zip(ps, got, want):
        assert [t for m in msgs for t in m.token_ids] == w, f"{len(ids)}-token prompt"
        routing = msgs[-1].routing
        assert routing.decode_pod_id == "d0"
        assert routing.prefill_pod_id == ("" if len(ids) <= LOCAL_MAX else "p0"), len(ids)
    after = choices(metrics_port)
    local = sum(len(p) <= LOCAL_MAX for p in ps)
    assert after.get("local", 0) - before.get("local", 0) == local
    assert after.get("remote", 0) - before.get("remote", 0) == len(ps) - local


def test_prompt_logprobs_go_to_the_prefill_pod(cluster, tiny):
    """A short prompt that asks for its prompt logprobs is still prefilled remotely: only prefill pods compute them."""

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=[5, 6, 7, 8]),
                sampling_params=common_pb2.SamplingParams(
                    temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=0
                ),
            )
            return [m async for m in stub.Generate(req, timeout=120)]

    msgs = asyncio.run(body())
    assert msgs[-1].routing.prefill_pod_id == "p0"
    assert msgs[0].HasField("prompt_logprobs")


@pytest.fixture(scope="module")
def auto_cluster(tmp_path_factory, tiny):
    c = e2e_cluster(
        tmp_path_factory.mktemp("conditional-auto"),
        tiny,
        num_prefill=1,
        num_decode=1,
        decode_tp=1,
        decode_dcp=1,
        router_args=["--local-prefill-max-tokens", "auto"],
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def test_auto_threshold_splits_short_and_long_prompts(auto_cluster, tiny):
    """The decode pod's auto threshold T (at least 1: a one-token prefill is one decode step) is logged and shown in
    ClusterStatus; a T-token prompt is prefilled on the decode pod, a (T + 1)-token one on the prefill pod, both with
    transformers' greedy tokens."""

    async def status():
        async with grpc.aio.insecure_channel(auto_cluster.router_address) as ch:
            return await router_pb2_grpc.RouterStub(ch).ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=30)

    pods = {p.pod_id: p for p in asyncio.run(status()).pods}
    threshold = pods["d0"].local_prefill_max_tokens
    assert threshold >= 1
    assert pods["p0"].local_prefill_max_tokens == 0
    log = (auto_cluster.log_dir / "router.log").read_text()
    assert f"local prefill threshold for pod d0: {threshold} tokens (auto: " in log

    rng = random.Random(7)
    ps = [[rng.randrange(3, 256) for _ in range(n)] for n in (threshold, threshold + 1)]
    want = hf_greedy(tiny, ps, NEW_TOKENS)

    async def body():
        async with grpc.aio.insecure_channel(auto_cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            return [await _greedy(stub, p) for p in ps]

    got = asyncio.run(body())
    for ids, msgs, w in zip(ps, got, want):
        assert [t for m in msgs for t in m.token_ids] == w, f"{len(ids)}-token prompt"
    assert [msgs[-1].routing.prefill_pod_id for msgs in got] == ["", "p0"]
