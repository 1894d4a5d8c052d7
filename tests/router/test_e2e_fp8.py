"""fp8 KV cache end to end with real processes: a router, a prefill pod of TP 1 and a decode pod of TP 2 x DCP 2, both
with ``--kv-cache-dtype fp8``, serving a tiny MQA Llama and a tiny DeepSeek-V3 (MLA). The prompt's 8-bit KV and its
per (layer, head) scales move through kv_transfer (TCP fallback, and NIXL where it is usable), re-sharded into the
decode pod's layout, with KV checksums on (they cover the fp8 bytes and the scales); the greedy tokens must equal
those of one in-process engine with the same fp8 cache at TP 1, and both pods must register an fp8 KV layout."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import grpc
import pytest
from e2e_helpers import e2e_cluster

from kv_transfer.factory import nixl_available
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams
from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 8
_NIXL_OK, _NIXL_WHY = nixl_available()
TRANSPORTS = ["tcp", pytest.param("nixl", marks=pytest.mark.skipif(not _NIXL_OK, reason=f"NIXL unusable: {_NIXL_WHY}"))]
MODELS = {"mqa": ("llama", dict(num_heads=4, num_kv_heads=1)), "mla": ("deepseek_v3", dict(num_heads=4))}


def _fp8_reference(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    cfg = EngineConfig(model=str(model), kv_cache_dtype="fp8", num_kv_blocks=256, max_model_len=512)
    with LLMEngine(cfg) as eng:
        outs = eng.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return [o["token_ids"] for o in outs]


async def _run(address: str, prompts: list[list[int]]) -> tuple[list[list[int]], router_pb2.ClusterStatusResponse]:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        async def one(ids: list[int]) -> tuple[list[int], int]:
            req = router_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(ids=ids),
                sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
            )
            tokens, mode = [], 0
            async for m in stub.Generate(req, timeout=300):
                tokens += m.token_ids
                mode = m.routing.transfer_mode or mode
            return tokens, mode

        got = await asyncio.gather(*(one(p) for p in prompts))
        status = await stub.ClusterStatus(router_pb2.ClusterStatusRequest())
    assert all(mode != common_pb2.TRANSFER_MODE_UNSPECIFIED for _, mode in got)
    return [t for t, _ in got], status


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("kind", list(MODELS))
def test_fp8_kv_moves_prefill_tp1_to_decode_tp2_dcp2(tmp_path, tiny_factory, transport, kind):
    family, shape = MODELS[kind]
    model = tiny_factory(family, **shape)
    rng = random.Random(5)
    # 9-40 tokens: both DCP ranks hold part of every prompt, and decoding opens new blocks on both
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(9, 40))] for _ in range(6)]
    want = _fp8_reference(model, prompts)
    fp8 = ["--kv-cache-dtype", "fp8"]
    cluster = e2e_cluster(
        tmp_path / "cluster",
        model,
        num_prefill=1,
        num_decode=1,
        prefill_tp=1,
        decode_tp=2,
        decode_dcp=2,
        num_kv_blocks=64,
        prefill_args=[*fp8, "--kv-transport", transport],
        decode_args=[*fp8, "--kv-transfer-backend", transport],
    )
    cluster.start(timeout=600)
    try:
        got, status = asyncio.run(_run(cluster.router_address, prompts))
    finally:
        cluster.stop()
    assert {p.kv_layout.dtype for p in status.pods} == {"float8_e4m3fn"}, [p.kv_layout for p in status.pods]
    for p, w, g in zip(prompts, want, got):
        assert g == w, f"{kind} over {transport}, {len(p)} prompt tokens: {g} != the TP 1 fp8 engine's {w}"
