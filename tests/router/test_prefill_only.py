"""max_tokens=1 is served by the prefill pod alone (real processes: ``python -m router`` + one ``python -m
prefill_svc``, no decode pod at all; tiny random checkpoint)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from e2e_helpers import e2e_cluster

from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefill_only_cluster(tmp_path_factory, smollm2_path):
    from pdserve.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-prefill-only"), "llama", num_kv_heads=1, tokenizer_from=smollm2_path
    )
    c = e2e_cluster(tmp_path_factory.mktemp("cluster"), model, num_prefill=1, num_decode=0, num_kv_blocks=64)
    c.start()
    try:
        yield c
    finally:
        c.stop(grace=5.0)


def _req(ids: list[int], max_tokens: int) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


async def _free_blocks(stub) -> list[int]:
    st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest())
    return [k.free_blocks for p in st.pods if p.pod_id == "p0" for k in p.kv]


async def _collect(stub, req) -> list[router_pb2.GenerateResponse]:
    return [m async for m in stub.Generate(req)]


def test_max_tokens_1_needs_no_decode_pod_and_keeps_no_kv(prefill_only_cluster):
    """With no decode pod registered, max_tokens=1 requests still get their one token (LENGTH, routed to the
    prefill pod only, no decode pod named), while max_tokens=2 is refused UNAVAILABLE for want of a decode pod: so
    the max_tokens=1 path books no decode KV and calls no decode pod. Afterwards the prefill pod's free KV is back
    at its starting value (it kept no lease for these requests)."""
    c = prefill_only_cluster

    async def body():
        async with grpc.aio.insecure_channel(c.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            before = await _free_blocks(stub)
            outs = await asyncio.gather(*(_collect(stub, _req([5 + i, 7, 9, 11] * 5, 1)) for i in range(8)))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                async for _ in stub.Generate(_req([5, 7, 9], 2)):
                    pass
            t0 = time.monotonic()  # the pod reports its free KV in heartbeats
            after = await _free_blocks(stub)
            while after != before and time.monotonic() - t0 < 20:
                await asyncio.sleep(0.2)
                after = await _free_blocks(stub)
            return outs, e.value, before, after

    outs, err, before, after = asyncio.run(body())
    for msgs in outs:
        assert len(msgs) == 1
        msg = msgs[0]
        assert len(msg.token_ids) == 1 and msg.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert msg.usage.completion_tokens == 1
        assert msg.routing.prefill_pod_id == "p0" and msg.routing.decode_pod_id == ""
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "no READY decode pod" in err.details(), err
    assert before and after == before, (before, after)
