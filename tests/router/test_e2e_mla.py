"""MLA end to end with real processes: a router, prefill pods of TP 1 and TP 2 and MLA decode pods of every
(tp, dcp) in {(1,1), (2,2), (4,2), (4,4), (8,8)} serving a tiny DeepSeek-V3 checkpoint (8 query heads, MoE with a
shared expert and group-limited routing, a dense first layer). The prompt's latent KV moves from a prefill pod to a
decode pod through kv_transfer; the greedy tokens must equal transformers' own generate.

One cluster per data path. The TCP fallback cluster runs DCP interleave 1 on (2,2), (4,4) and 4 on (4,2), (8,8); the
NIXL cluster the other way round, so every pair meets both interleaves. Requests go in concurrent waves until every
(prefill pod, decode pod) pair of the cluster has served one (RoutingInfo says which pair did)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest
from e2e_helpers import HEARTBEAT_S, service_env
from hf_helpers import hf_greedy

from kv_transfer.factory import nixl_available
from pdserve.cluster.supervisor import LocalCluster
from pdserve.cluster.topology import PodSpec, Topology
from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

MAX_TOKENS = 6
WAVE = 10  # concurrent requests per wave
MAX_WAVES = 10  # placement picks by load, so coverage of every pair can take more waves when decoding is fast
# transport -> decode pods (tp, dcp, interleave)
DECODE_PODS = {
    "tcp": [(1, 1, 1), (2, 2, 1), (4, 2, 4), (4, 4, 1), (8, 8, 4)],
    "nixl": [(2, 2, 4), (4, 2, 1), (4, 4, 4), (8, 8, 1)],
}
PREFILL_TPS = (1, 2)

_NIXL_OK, _NIXL_WHY = nixl_available()
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not _NIXL_OK, reason=f"NIXL unusable: {_NIXL_WHY}"))]


@pytest.fixture(scope="module")
def mla_model(tmp_path_factory, smollm2_path) -> Path:
    from pdserve.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-mla"), "deepseek_v3", num_heads=8, tokenizer_from=smollm2_path
    )


def _cluster(workdir: Path, model: Path, transport: str) -> LocalCluster:
    interval = ["--heartbeat-interval-s", str(HEARTBEAT_S)]
    topo = Topology(
        model=str(model),
        router_port=0,
        http_port=None,
        router_args=[*interval, "--eviction-timeout-s", "10", "--missed-heartbeats-unhealthy", "8"],
        prefill=[
            PodSpec(
                "prefill", tp, num_kv_blocks=128, name=f"p{tp}", extra_args=[*interval, "--kv-transport", transport]
            )
            for tp in PREFILL_TPS
        ],
        decode=[
            PodSpec(
                "decode",
                tp,
                dcp,
                dcp_kv_cache_interleave_size=i,
                num_kv_blocks=64,
                name=f"d{tp}x{dcp}i{i}",
                extra_args=["--kv-transfer-backend", transport],
            )
            for tp, dcp, i in DECODE_PODS[transport]
        ],
    )
    topo.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    return LocalCluster(topo, log_dir=workdir, env=service_env())


def _greedy(ids: list[int]) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    )


async def _generate(stub, ids: list[int]) -> tuple[list[int], tuple[str, str], common_pb2.TransferMode.ValueType]:
    tokens: list[int] = []
    final = None
    async for m in stub.Generate(_greedy(ids), timeout=600):
        tokens += m.token_ids
        final = m
    assert final is not None
    return tokens, (final.routing.prefill_pod_id, final.routing.decode_pod_id), final.routing.transfer_mode


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_mla_decode_pods_match_transformers(tmp_path, mla_model, transport):
    cluster = _cluster(tmp_path / "cluster", mla_model, transport)
    pairs = {(f"p{p}", f"d{t}x{d}i{i}") for p in PREFILL_TPS for t, d, i in DECODE_PODS[transport]}
    rng = random.Random(17)
    want_mode = {"tcp": common_pb2.TRANSFER_MODE_TCP, "nixl": common_pb2.TRANSFER_MODE_NIXL_PULL}[transport]
    cluster.start(timeout=900)
    try:

        async def wave(prompts: list[list[int]]):
            async with grpc.aio.insecure_channel(cluster.router_address) as ch:
                stub = router_pb2_grpc.RouterStub(ch)
                return await asyncio.gather(*(_generate(stub, p) for p in prompts))

        seen: set[tuple[str, str]] = set()
        for _ in range(MAX_WAVES):
            # 18-60 tokens: every DCP rank of every pod holds some of the prompt at both interleaves
            prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(18, 60))] for _ in range(WAVE)]
            results = asyncio.run(wave(prompts))
            want = hf_greedy(mla_model, prompts, MAX_TOKENS)
            for p, w, (got, pair, mode) in zip(prompts, want, results):
                assert got == w, f"{pair} ({len(p)} prompt tokens): {got} != transformers {w}"
                assert mode == want_mode, pair
                seen.add(pair)
            if pairs <= seen:
                break
        assert pairs <= seen, f"never routed: {sorted(pairs - seen)}"
    finally:
        cluster.stop()
