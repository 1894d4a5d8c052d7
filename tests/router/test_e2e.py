"""End to end with real processes on loopback: ``python -m router``, 2 prefill pods and 2 decode pods with
TP=2, DCP=2 (tiny random checkpoint, 1 KV head), all separate processes. No pod is faked: the expected tokens come
from pdserve's own LLMEngine run offline on the same checkpoint.

- First tokens (max_tokens=1: prefill alone -> first token, no decode pod involved): correct greedy
  tokens for 32 concurrent requests, placement spread over both prefill pods.
- The whole journey (needs decode pods that register themselves and pull KV from prefill): correct greedy outputs
  for 32 concurrent requests, spread over pods (ClusterStatus / routing), cancelling half of them midway returns
  every pod's free KV to its baseline.
- Failures: a decode pod killed mid-stream ends its streams with UNAVAILABLE after the tokens already sent (none
  repeated); a prefill pod killed is retried on the other one.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
import urllib.request

import grpc
import pytest
from e2e_helpers import HEARTBEAT_S, e2e_cluster, supports_flag

from pdserve.net import free_port
from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow

NUM_REQUESTS = 32
DECODE_REGISTERS = supports_flag("decode_svc", "--router")
NEEDS_DECODE = pytest.mark.skipif(
    not DECODE_REGISTERS,
    reason="`python -m decode_svc` has no --router flag: decode pods cannot register with the router (no Heartbeat "
    "load or free KV per rank), so the decode journey and ClusterStatus KV checks cannot run",
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path):
    from pdserve.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-e2e"), "llama", num_kv_heads=1, tokenizer_from=smollm2_path
    )


@pytest.fixture(scope="module")
def metrics_port():
    """The router's Prometheus port."""
    return free_port()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model, metrics_port):
    c = e2e_cluster(
        tmp_path_factory.mktemp("cluster"),
        tiny_model,
        num_prefill=2,
        num_decode=2,
        decode_tp=2,
        decode_dcp=2,
        num_kv_blocks=256,
        router_args=["--metrics-port", str(metrics_port), "--affinity-max-imbalance-tokens", "64"],
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 60))] for _ in range(n)]


def reference(model, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    with LLMEngine(EngineConfig(model=str(model), num_kv_blocks=512, enable_prefix_caching=False)) as eng:
        outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o["token_ids"] for o in outs]


async def collect(stub, req, timeout=120.0, on_message=None):
    call = stub.Generate(req, timeout=timeout)
    msgs = []
    try:
        async for m in call:
            msgs.append(m)
            if on_message is not None:
                await on_message(call, m, msgs)
        code, details = grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details()
    except asyncio.CancelledError:
        code, details = grpc.StatusCode.CANCELLED, "client cancelled"
    return msgs, code, details


def greedy(ids: list[int], max_tokens: int, rid: str = "") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_first_tokens_of_32_concurrent_requests(cluster, tiny_model):
    ps = prompts(NUM_REQUESTS, seed=1)
    want = reference(tiny_model, ps, 1)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            baseline = await settled_kv(stub, cluster)
            results = await asyncio.gather(*(collect(stub, greedy(p, 1)) for p in ps))
            return results, baseline, await settled_kv(stub, cluster, baseline)

    results, baseline, after = asyncio.run(body())
    assert after == baseline, (baseline, after)  # all KV back: nothing leaked on the max_tokens=1 path
    prefill_pods = []
    for (msgs, code, details), w in zip(results, want):
        assert code == grpc.StatusCode.OK, details
        assert [t for m in msgs for t in m.token_ids] == w
        final = msgs[-1]
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert final.usage.prompt_tokens > 0 and final.usage.completion_tokens == 1
        prefill_pods.append(final.routing.prefill_pod_id)
    # Least-queued placement (with the router's own in-flight accounting) spreads a burst over both pods.
    assert min(prefill_pods.count("p0"), prefill_pods.count("p1")) >= NUM_REQUESTS // 4, prefill_pods


def _kv_by_pod(st: router_pb2.ClusterStatusResponse) -> dict[str, list[int]]:
    return {p.pod_id: [k.free_blocks for k in p.kv] for p in st.pods}


async def settled_kv(stub, cluster, want: dict | None = None, timeout: float = 30.0) -> dict:
    """Free KV per pod once it stops changing (or equals ``want``) across a few heartbeats."""
    t0 = time.monotonic()
    last = None
    while True:
        await asyncio.sleep(3 * HEARTBEAT_S)
        st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest())
        now = _kv_by_pod(st)
        if (want is not None and now == want) or (want is None and now == last) or time.monotonic() - t0 > timeout:
            return now
        last = now


def test_stop_string_in_the_first_token_ends_at_once_and_frees_the_lease(cluster, tiny_model):
    """The router applies stop strings: a stop matching the first token's text ends the request right after
    prefill (no Decode call), and the prefill lease and decode reservation are released."""
    from pdserve.tokenizer import Tokenizer

    tok = Tokenizer(tiny_model)
    ps = prompts(40, seed=6)
    firsts = reference(tiny_model, ps, 1)
    pick = [(p, f[0]) for p, f in zip(ps, firsts) if tok.decode([f[0]]).strip() and "\ufffd" not in tok.decode([f[0]])][
        :4
    ]
    assert pick

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            baseline = await settled_kv(stub, cluster)
            out = []
            for p, first in pick:
                text = tok.decode([first])
                req = router_pb2.GenerateRequest(
                    token_ids=common_pb2.TokenIds(ids=p),
                    sampling_params=(
                        common_pb2.SamplingParams(temperature=0, max_tokens=50, stop=[text.strip()], ignore_eos=True)
                    ),
                )
                out.append(await collect(stub, req))
            return out, baseline, await settled_kv(stub, cluster, baseline)

    out, baseline, after = asyncio.run(body())
    for (msgs, code, details), (_, first) in zip(out, pick):
        assert code == grpc.StatusCode.OK, details
        assert [t for m in msgs for t in m.token_ids] == [first]
        final = msgs[-1]
        assert final.finish_reason == common_pb2.FINISH_REASON_STOP and final.stop_reason
        assert tok.decode([first]).strip() == final.stop_reason
        assert "".join(m.text for m in msgs) == tok.decode([first])[: tok.decode([first]).find(final.stop_reason)]
    assert after == baseline, (baseline, after)  # the prefill lease was released (ReleaseKV), blocks free again


@NEEDS_DECODE
def test_generate_32_concurrent_spread_then_cancel_half_frees_all_kv(cluster, tiny_model):
    ps = prompts(NUM_REQUESTS, seed=2)
    max_tokens = 12
    want = reference(tiny_model, ps, max_tokens)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await asyncio.sleep(4 * HEARTBEAT_S)
            baseline = _kv_by_pod(await stub.ClusterStatus(router_pb2.ClusterStatusRequest()))

            # --- 32 concurrent requests, watching ClusterStatus while they run ---
            seen_inflight: dict[str, int] = {}
            done = asyncio.Event()

            async def watch():
                while not done.is_set():
                    st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest())
                    for p in st.pods:
                        seen_inflight[p.pod_id] = max(seen_inflight.get(p.pod_id, 0), p.num_inflight_requests)
                    await asyncio.sleep(0.02)

            watcher = asyncio.create_task(watch())
            results = await asyncio.gather(*(collect(stub, greedy(p, max_tokens)) for p in ps))
            done.set()
            await watcher

            # --- 32 long requests; cancel half midway (8 by Cancel RPC, 8 by closing the stream) ---
            long_ps = prompts(NUM_REQUESTS, seed=3)
            started = {i: asyncio.Event() for i in range(NUM_REQUESTS)}

            async def on_message(i):
                async def cb(call, m, msgs):
                    if sum(len(x.token_ids) for x in msgs) >= 2:
                        started[i].set()

                return cb

            tasks = [
                asyncio.create_task(collect(stub, greedy(p, 400, rid=f"long-{i}"), on_message=await on_message(i)))
                for i, p in enumerate(long_ps)
            ]
            for i in range(NUM_REQUESTS // 2):
                await asyncio.wait_for(started[i].wait(), 120)
            for i in range(0, NUM_REQUESTS // 2, 2):
                assert (await stub.Cancel(router_pb2.CancelRequest(request_id=f"long-{i}"))).found
            for i in range(1, NUM_REQUESTS // 2, 2):
                tasks[i].cancel()
            long_results = await asyncio.gather(*tasks, return_exceptions=True)

            # --- every pod's free KV back to its baseline (through heartbeats) ---
            t0 = time.monotonic()
            while True:
                st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest())
                now = _kv_by_pod(st)
                if now == baseline and st.num_inflight_requests == 0 or time.monotonic() - t0 > 30:
                    break
                await asyncio.sleep(0.1)
            return baseline, seen_inflight, results, long_results, now, st

    baseline, seen_inflight, results, long_results, after, st = asyncio.run(body())
    routes = []
    for (msgs, code, details), w in zip(results, want):
        assert code == grpc.StatusCode.OK, details
        assert [t for m in msgs for t in m.token_ids] == w
        final = msgs[-1]
        assert final.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert "".join(m.text for m in msgs) == cluster_tokenizer(tiny_model).decode(w)
        routes.append((final.routing.prefill_pod_id, final.routing.decode_pod_id))
    for pod in ("p0", "p1", "d0", "d1"):
        n = sum(pod in r for r in routes)
        assert n >= NUM_REQUESTS // 4, (pod, routes)  # RoutingInfo: every pod took a fair share
    # ClusterStatus, polled while they ran, showed requests in flight on both decode pods (prefill calls on a tiny
    # model last a few ms, too short to be caught reliably by polling).
    assert seen_inflight.get("d0", 0) > 0 and seen_inflight.get("d1", 0) > 0, seen_inflight
    for i, r in enumerate(long_results):
        msgs, code, _ = r
        if i < NUM_REQUESTS // 2 and i % 2 == 0:
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
        elif i < NUM_REQUESTS // 2:
            assert code == grpc.StatusCode.CANCELLED
        else:
            assert code == grpc.StatusCode.OK and msgs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert after == baseline, (baseline, after)
    assert all(len(v) == (1 if k.startswith("p") else 2) for k, v in baseline.items())


def cluster_tokenizer(model):
    from pdserve.tokenizer import Tokenizer

    return Tokenizer(model)


@NEEDS_DECODE
def test_client_deadline_propagates_and_frees_kv(cluster):
    """A deadline shorter than the generation: the client gets DEADLINE_EXCEEDED after some tokens, and the pods
    (which got the deadline as their call timeout) free everything."""
    ps = prompts(4, seed=7)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            baseline = await settled_kv(stub, cluster)
            out = await asyncio.gather(*(collect(stub, greedy(p, 3000), timeout=2.0) for p in ps))
            return out, baseline, await settled_kv(stub, cluster, baseline)

    out, baseline, after = asyncio.run(body())
    for msgs, code, details in out:
        assert code == grpc.StatusCode.DEADLINE_EXCEEDED, details
        assert sum(len(m.token_ids) for m in msgs) >= 1
    assert after == baseline, (baseline, after)


@NEEDS_DECODE
def test_decode_pod_killed_mid_stream_ends_with_unavailable_after_tokens(cluster):
    ps = prompts(8, seed=4)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            killed = asyncio.Event()

            async def cb(call, m, msgs):
                if not killed.is_set() and sum(len(x.token_ids) for x in msgs) >= 3:
                    killed.set()
                    cluster.kill("d1")  # streams on d1 are mid-way now

            tasks = [collect(stub, greedy(p, 200, rid=f"kill-{i}"), on_message=cb) for i, p in enumerate(ps)]
            return await asyncio.gather(*tasks)

    results = asyncio.run(body())
    on_d1 = [(msgs, code, details) for msgs, code, details in results if code == grpc.StatusCode.UNAVAILABLE]
    assert on_d1, "no stream was on the killed decode pod"
    for msgs, code, _ in results:
        if code == grpc.StatusCode.OK:
            assert msgs[-1].routing.decode_pod_id == "d0" and sum(len(m.token_ids) for m in msgs) == 200
    for msgs, _, details in on_d1:
        assert "decode" in details
        assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ERROR and msgs[-1].error_message
        n = sum(len(m.token_ids) for m in msgs)
        assert n >= 1 and msgs[-1].usage.completion_tokens == n  # every token sent once, counted once


def test_prefill_pod_killed_is_retried_on_the_other(cluster, tiny_model, metrics_port):
    ps = prompts(8, seed=5)
    want = reference(tiny_model, ps, 1)
    before = metric(metrics_port, "pdserve_router_prefill_retries_total")
    cluster.kill("p1")  # the router still lists it READY until its heartbeats are missed

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            return await asyncio.gather(*(collect(stub, greedy(p, 1)) for p in ps))

    results = asyncio.run(body())
    for (msgs, code, details), w in zip(results, want):
        assert code == grpc.StatusCode.OK, details
        assert [t for m in msgs for t in m.token_ids] == w
        assert msgs[-1].routing.prefill_pod_id == "p0"
    assert metric(metrics_port, "pdserve_router_prefill_retries_total") > before
