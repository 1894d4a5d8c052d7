"""A unified (colocated) pod behind the router: one engine that computes its own prompts (chunked prefill steps
between decode steps) and decodes them, registered as ROLE_UNIFIED, with no prefill pod and no KV transfer. Real
processes on loopback (router, OpenAI front, the pod); the expected tokens are transformers' own greedy output."""

from __future__ import annotations

import asyncio
import random

import grpc
import openai
import pytest
from e2e_helpers import HEARTBEAT_S, service_env
from hf_helpers import hf_greedy

from pdserve.cluster.supervisor import LocalCluster
from pdserve.cluster.topology import PodSpec, Topology
from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_kv_heads=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny):
    interval = ["--heartbeat-interval-s", str(HEARTBEAT_S)]
    # Chunks of 16 prompt tokens: the longer prompts take several prefill steps, interleaved with others' decoding.
    topo = Topology(
        model=str(tiny),
        router_port=0,
        http_port=0,
        prefill=[],
        decode=[],
        router_args=interval,
        unified=[
            PodSpec("unified", num_kv_blocks=128, name="u0", extra_args=[*interval, "--prefill-chunk-size", "16"])
        ],
    ).resolve()
    c = LocalCluster(topo, log_dir=tmp_path_factory.mktemp("unified"), env=service_env())
    c.start()
    try:
        yield c
    finally:
        c.stop()


def prompts(n: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 70))] for _ in range(n)]


def test_greedy_tokens_match_transformers_through_the_router(cluster, tiny):
    ps = prompts(8)
    want = hf_greedy(tiny, ps, NEW_TOKENS)

    async def one(stub, ids):
        req = router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=ids),
            sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
        )
        return [m async for m in stub.Generate(req, timeout=120)]

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            got = await asyncio.gather(*(one(stub, p) for p in ps))  # concurrent: prefill interleaves with decode
            status = await stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=10)
            return got, status

    got, status = asyncio.run(body())
    for msgs, w in zip(got, want):
        assert [t for m in msgs for t in m.token_ids] == w
        last = msgs[-1]
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.routing.decode_pod_id == "u0" and last.routing.prefill_pod_id == ""  # no prefill pod involved
        assert last.timing.ttft_s > 0 and last.usage.completion_tokens == NEW_TOKENS
    (pod,) = status.pods
    assert pod.role == common_pb2.ROLE_UNIFIED and list(status.ready_models)


def test_openai_front_serves_the_unified_pod(cluster, tiny):
    p = prompts(1)[0]
    client = openai.OpenAI(base_url=cluster.endpoints.http + "/v1", api_key="none")
    stream = client.completions.create(
        model=cluster.endpoints.model,
        prompt=p,
        max_tokens=NEW_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == NEW_TOKENS
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert (
        text
        == client.completions.create(
            model=cluster.endpoints.model,
            prompt=p,
            max_tokens=NEW_TOKENS,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )


def test_a_client_that_goes_away_gets_every_block_back(cluster):
    """Closing the stream mid-decode cancels the request on the pod: its free KV returns to the total."""

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            req = router_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=list(range(10, 60))),
                sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
            )
            call = stub.Generate(req, timeout=120)
            got = 0
            async for m in call:
                got += len(m.token_ids)
                if got >= 3:
                    break
            call.cancel()
            for _ in range(200):
                st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=10)
                kv = st.pods[0].kv
                if st.pods[0].num_inflight_requests == 0 and kv and all(r.free_blocks == r.total_blocks for r in kv):
                    return got, True
                await asyncio.sleep(HEARTBEAT_S)
            return got, False

    got, freed = asyncio.run(body())
    assert got >= 3 and freed
