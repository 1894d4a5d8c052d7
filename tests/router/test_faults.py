"""Fault injection with real processes on loopback: ``python -m router``, 2 prefill pods (TP 1) and 2 decode
pods with TP 2 x DCP 2 (so a decode "rank" is a process of its own), tiny random checkpoint. Nothing is faked: faults
are real signals (SIGKILL, SIGSTOP / SIGCONT) sent to real processes, and expected tokens come from pdserve's own
LLMEngine run offline on the same checkpoint.

The tests share one cluster and run in file order, the harmless faults first (each test checks the pods it needs are
READY before it starts): router restart, stalled transfer, then a decode rank killed (d1 stays broken), then a
prefill pod killed (p1 gone). Timeouts are set short on the pods (prefill lease TTL, decode KV-transfer timeout) and
every wait is a poll with a generous deadline: "within N seconds, no hang", never a speed check.
"""

from __future__ import annotations

import asyncio
import random
import re
import signal
import time
import urllib.request
from typing import Any, Awaitable, Callable

import grpc
import psutil
import pytest
from e2e_helpers import e2e_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.net import free_port
from pdserve_api.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

pytestmark = pytest.mark.slow

READY = common_pb2.POD_STATE_READY
UNHEALTHY = common_pb2.POD_STATE_UNHEALTHY
LEASE_TTL_S = 8.0  # prefill pods free KV no decode pod came for after this (idle) time
KV_TRANSFER_TIMEOUT_S = 4.0  # decode pods give up a KV pull after this
BOUND_S = 60.0  # "within a bounded time": generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path):
    from pdserve.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-faults"), "llama", num_kv_heads=1, tokenizer_from=smollm2_path
    )


@pytest.fixture(scope="module")
def metrics_port():
    """The router's Prometheus port."""
    return free_port()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model, metrics_port):
    c = e2e_cluster(
        tmp_path_factory.mktemp("faults"),
        tiny_model,
        num_prefill=2,
        num_decode=2,
        decode_tp=2,
        decode_dcp=2,
        num_kv_blocks=256,
        router_args=["--metrics-port", str(metrics_port), "--kv-load-failure-policy", "recompute"],
        prefill_args=["--lease-ttl-s", str(LEASE_TTL_S), "--no-prefix-caching"],
        decode_args=["--kv-transfer-timeout-s", str(KV_TRANSFER_TIMEOUT_S)],
    )
    c.start()
    try:
        yield c
    finally:
        for s in c.services:  # a test that failed half-way may leave a pod stopped
            c.kill(s.name, signal.SIGCONT)
        c.stop()


# --- helpers ---


def prompts(n: int, seed: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def reference(model, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    with LLMEngine(EngineConfig(model=str(model), num_kv_blocks=1024, enable_prefix_caching=False)) as eng:
        outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o["token_ids"] for o in outs]


def greedy(ids: list[int], max_tokens: int, rid: str = "") -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=ids),
        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
    )


async def collect(stub, req, timeout: float = 180.0, on_message=None):
    """(messages, status code, details) of one Generate call; the deadline makes a hang a failure, not a stall."""
    call = stub.Generate(req, timeout=timeout)
    msgs = []
    try:
        async for m in call:
            msgs.append(m)
            if on_message is not None:
                on_message(m, msgs)
        code, details = grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        code, details = e.code(), e.details()
    return msgs, code, details


def tokens(msgs) -> list[int]:
    return [t for m in msgs for t in m.token_ids]


async def pods(stub) -> dict[str, router_pb2.PodStatus]:
    st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=10)
    return {p.pod_id: p for p in st.pods}


async def wait_for(what: str, pred: Callable[[], Awaitable[Any]], timeout: float = BOUND_S, every: float = 0.1):
    """Poll ``pred`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    t0 = time.monotonic()
    last: Any = None
    while time.monotonic() - t0 < timeout:
        try:
            last = await pred()
        except grpc.aio.AioRpcError as e:  # e.g. the router is restarting
            last = e
        else:
            if last:
                return last
        await asyncio.sleep(every)
    raise AssertionError(f"not within {timeout:.0f}s: {what} (last: {last!r})")


def kv_free(st: dict[str, router_pb2.PodStatus], pod: str) -> list[int]:
    return [k.free_blocks for k in st[pod].kv]


async def wait_kv(stub, cluster, want: dict[str, list[int]], what: str, timeout: float = BOUND_S):
    """Free KV per rank of the pods in ``want`` (as the pods themselves report it in heartbeats) equals ``want``."""

    async def check():
        st = await pods(stub)
        now = {p: kv_free(st, p) if p in st else None for p in want}  # a stopped pod may be evicted meanwhile
        return now == want and now

    try:
        return await wait_for(what, check, timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}\nwanted {want}\n{cluster.log_tails(15)}") from None


async def settled_kv(stub, cluster, names: list[str]) -> dict[str, list[int]]:
    """Free KV of ``names`` once idle: every block free (nothing in flight when this is called)."""
    st = await pods(stub)
    full = {p: [k.total_blocks for k in st[p].kv] for p in names}
    return await wait_kv(stub, cluster, full, "pods idle with all KV free")


async def require_ready(stub, names: set[str]) -> None:
    async def ok():
        st = await pods(stub)
        return all(n in st and st[n].state == READY for n in names)

    await wait_for(f"pods {sorted(names)} READY", ok)


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def rank_processes(c, pod: str) -> list[psutil.Process]:
    """The spawned TP rank processes (ranks 1..N-1) of a decode pod: its multiprocessing spawn children."""
    kids = psutil.Process(c.service(pod).pid).children(recursive=True)
    return [k for k in kids if any("spawn_main" in a for a in k.cmdline())]


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="pdserve.v1.DecodeWorker"), timeout=5
        )
        return r.status


# --- 3. router restart ---
def test_router_restart_pods_register_again_and_requests_work(cluster, tiny_model):
    """SIGKILL the router and start a new one (empty registry) on the same port: every pod registers again on its
    own (its heartbeat is answered "unknown pod"), ClusterStatus lists all four READY with their KV, and new requests
    go end to end (prefill -> KV transfer -> decode) with the greedy tokens of the offline engine."""
    ps = prompts(4, seed=31)
    want = reference(tiny_model, ps, 12)
    every = {"p0", "p1", "d0", "d1"}

    async def before():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            await require_ready(router_pb2_grpc.RouterStub(ch), every)

    asyncio.run(before())
    log_sizes = {p: cluster.service(p).log_path.stat().st_size for p in every}
    restarted = time.monotonic()  # before: pods may register with the new router while restart() waits for it
    cluster.restart("router")

    async def after():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await require_ready(stub, every)
            st = await pods(stub)
            since = time.monotonic() - restarted
            for p in every:  # registered with the new router (not a leftover), with their load and KV reports
                assert st[p].uptime_s <= since + 1.0, (p, st[p].uptime_s, since)
                assert len(st[p].kv) == st[p].parallel.tensor_parallel_size, st[p]
            results = await asyncio.gather(*(collect(stub, greedy(p, 12, rid=f"rr-{i}")) for i, p in enumerate(ps)))
            return results

    results = asyncio.run(after())
    for p in every:  # each pod's own registrar noticed (heartbeat answered "unknown pod") and registered again
        with open(cluster.service(p).log_path, errors="replace") as f:
            f.seek(log_sizes[p])
            assert "registering again" in f.read(), cluster.service(p).log_tail()
    for (msgs, code, details), w in zip(results, want):
        assert code == grpc.StatusCode.OK, details + "\n" + cluster.log_tails(15)
        assert tokens(msgs) == w
        assert msgs[-1].routing.decode_pod_id in ("d0", "d1")


# --- 4. stalled transfer ---
def test_stalled_transfer_times_out_and_frees_kv_on_both_sides(cluster, tiny_model):
    """Two stalls, driving the pods' RPCs the way the router does (AllocateKV on d0, Prefill on p0 with the decode
    target) so the fault lands exactly between prefill and the pull:
    (a) p0 is SIGSTOPped after it published the KV; Decode on d0 then cannot pull: it ends within a bound with
        DEADLINE_EXCEEDED / UNAVAILABLE (never hangs), and d0's KV is free again at once. Meanwhile a stream on d0
        (its KV from p1) keeps its pace: d0 receives KV off its engine thread, so a frozen publisher stalls only its
        own request. After SIGCONT, p0's lease (nobody finished pulling) expires and p0's KV is back at baseline.
    (b) a decode side that reserves and never pulls: AllocateKV with a short ttl_s, Prefill, no Decode: the decode
        reservation expires on d0 and the lease expires on p0: both back at baseline."""
    ps = prompts(2, seed=41, lo=40, hi=80)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await require_ready(stub, {"p0", "p1", "d0"})
            st = await pods(stub)
            baseline = await settled_kv(stub, cluster, ["p0", "d0"])
            pch = grpc.aio.insecure_channel(st["p0"].address)
            dch = grpc.aio.insecure_channel(st["d0"].address)
            pstub, dstub = prefill_pb2_grpc.PrefillWorkerStub(pch), decode_pb2_grpc.DecodeWorkerStub(dch)

            p1ch = grpc.aio.insecure_channel(st["p1"].address)
            p1stub = prefill_pb2_grpc.PrefillWorkerStub(p1ch)

            async def allocate_and_prefill(
                rid: str, prompt: list[int], ttl_s: float = 0.0, max_tokens: int = 8, prefill=None
            ):
                alloc = await dstub.AllocateKV(
                    decode_pb2.AllocateKVRequest(
                        request_id=rid,
                        num_tokens=len(prompt),
                        num_reserved_output_tokens=8,
                        prefill_layout=st["p0"].kv_layout,
                        ttl_s=ttl_s,
                    ),
                    timeout=30,
                )
                params = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                pre = await (prefill or pstub).Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        sampling_params=params,
                        decode_target=prefill_pb2.DecodeTarget(
                            decode_pod_id="d0",
                            layout=alloc.layout,
                            transfer_modes=alloc.transfer_modes,
                        ),
                    ),
                    timeout=60,
                )
                assert pre.kv_handle.lease_id, pre
                return params, pre

            def decode_call(rid: str, prompt: list[int], params, pre):
                return dstub.Decode(
                    decode_pb2.DecodeRequest(
                        request_id=rid,
                        prompt_token_ids=prompt,
                        first_token_id=pre.first_token_id,
                        first_token_logprob=pre.first_token_logprob,
                        sampling_params=params,
                        kv_handle=pre.kv_handle,
                        num_cached_tokens=pre.num_cached_tokens,
                    ),
                    timeout=BOUND_S,
                )

            # A stream on d0 whose KV comes from p1, running through the stall: token arrival times.
            bg_params, bg_pre = await allocate_and_prefill("stall-bg", ps[1], max_tokens=3900, prefill=p1stub)
            bg_times: list[float] = []
            bg = decode_call("stall-bg", ps[1], bg_params, bg_pre)

            async def follow():
                async for chunk in bg:
                    bg_times.extend([time.monotonic()] * len(chunk.token_ids))

            bg_task = asyncio.ensure_future(follow())
            try:
                while len(bg_times) < 20:
                    assert not bg_task.done(), "the background stream ended early"
                    await asyncio.sleep(0.01)
                t_bg = time.monotonic()
                await asyncio.sleep(1.0)
                # (a) prefill stops answering after it published.
                params, pre = await allocate_and_prefill("stall-a", ps[0])
                n_before, t_before = sum(t_bg <= t for t in bg_times), time.monotonic() - t_bg
                cluster.kill("p0", signal.SIGSTOP)
                t0 = time.monotonic()
                call = decode_call("stall-a", ps[0], params, pre)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in call:
                        pass
                took = time.monotonic() - t0
                n_during = sum(t0 <= t for t in bg_times)
                assert not bg_task.done(), "the background stream ended during the stall: give it more tokens"
                # d0 kept decoding the other stream while one of its transfers hung (within 5x of its pace before)
                assert n_during / took >= (n_before / t_before) / 5, (n_before, t_before, n_during, took)
                assert err.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE), (
                    err.value.code(),
                    err.value.details(),
                )
                assert took < BOUND_S - 5, f"the pod's KV-transfer timeout did not fire ({took:.1f}s)"
                assert "transfer" in err.value.details().lower() or "kv" in err.value.details().lower(), (
                    err.value.details()
                )
            finally:
                cluster.kill("p0", signal.SIGCONT)
                bg.cancel()
                await asyncio.gather(bg_task, return_exceptions=True)
            await wait_kv(stub, cluster, {"d0": baseline["d0"]}, "d0's KV freed after the failed pull and the cancel")
            await wait_kv(stub, cluster, baseline, "p0's lease expired after SIGCONT", timeout=BOUND_S + LEASE_TTL_S)

            # (b) a decode side that reserves and never pulls.
            await allocate_and_prefill("stall-b", ps[1], ttl_s=3.0)
            await wait_kv(
                stub, cluster, baseline, "d0's reservation and p0's lease both expired", timeout=BOUND_S + LEASE_TTL_S
            )
            await pch.close()
            await p1ch.close()
            await dch.close()

    asyncio.run(body())


# --- 1. a decode rank dies ---
def test_decode_rank_killed_mid_stream(cluster, tiny_model):
    """SIGKILL TP rank 1 (a process of its own) of decode pod d1 while requests stream from it:
    - the streams on d1 end with UNAVAILABLE after the tokens already sent (each a prefix of the right answer, none
      repeated, usage counts them), within the call deadline: no hang;
    - d1 reports NOT_SERVING on grpc.health.v1 and the router's ClusterStatus shows it UNHEALTHY, within a bound;
    - the streams on d0 complete with the offline engine's greedy tokens, and new requests all go to d0 and are
      correct too."""
    n, max_tokens = 6, 600
    ps = prompts(n, seed=11)
    want = reference(tiny_model, ps, max_tokens)
    later = prompts(4, seed=12)
    want_later = reference(tiny_model, later, 16)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await require_ready(stub, {"p0", "p1", "d0", "d1"})
            d1_address = (await pods(stub))["d1"].address
            assert await health(d1_address) == health_pb2.HealthCheckResponse.SERVING
            ranks = rank_processes(cluster, "d1")
            assert len(ranks) == 1, ranks  # TP 2: rank 0 is the pod process, rank 1 a spawned one
            got = [0] * n

            def counter(i):
                def on_message(m, msgs):
                    got[i] += len(m.token_ids)

                return on_message

            tasks = [
                asyncio.ensure_future(collect(stub, greedy(p, max_tokens, rid=f"rank-{i}"), on_message=counter(i)))
                for i, p in enumerate(ps)
            ]

            async def all_streaming_and_d1_busy():  # every stream is past its first token: all are decoding
                st = await pods(stub)
                return min(got) >= 2 and st["d1"].num_inflight_requests >= 1

            await wait_for("every stream decoding with some on d1", all_streaming_and_d1_busy, every=0.02)
            ranks[0].send_signal(signal.SIGKILL)
            results = await asyncio.wait_for(asyncio.gather(*tasks), 240)

            async def d1_unhealthy():
                st = await pods(stub)
                return (
                    st["d1"].state == UNHEALTHY
                    and await health(d1_address) == health_pb2.HealthCheckResponse.NOT_SERVING
                )

            await wait_for("d1 NOT_SERVING and UNHEALTHY in ClusterStatus", d1_unhealthy)
            newer = await asyncio.gather(
                *(collect(stub, greedy(p, 16, rid=f"after-rank-{i}")) for i, p in enumerate(later))
            )
            st = await pods(stub)
            return results, newer, st

    results, newer, st = asyncio.run(body())
    on_d1 = [r for r in results if r[0] and r[0][-1].routing.decode_pod_id == "d1"]
    assert on_d1, "no stream was on d1"
    for (msgs, code, details), w in zip(results, want):
        if msgs and msgs[-1].routing.decode_pod_id == "d1":
            assert code == grpc.StatusCode.UNAVAILABLE, (code, details)
            assert "decode" in details, details
            assert msgs[-1].finish_reason == common_pb2.FINISH_REASON_ERROR and msgs[-1].error_message
            got = tokens(msgs)
            assert 2 <= len(got) < len(w) and got == w[: len(got)]  # mid-stream, nothing repeated or wrong
            assert msgs[-1].usage.completion_tokens == len(got)
        else:
            assert code == grpc.StatusCode.OK, (code, details)
            assert msgs[-1].routing.decode_pod_id == "d0" and tokens(msgs) == w
    for (msgs, code, details), w in zip(newer, want_later):
        assert code == grpc.StatusCode.OK, details
        assert msgs[-1].routing.decode_pod_id == "d0" and tokens(msgs) == w
    assert st["d1"].state == UNHEALTHY and st["d0"].state == READY
    assert "rank 1" in cluster.service("d1").log_path.read_text(errors="replace")  # the pod's log names the dead rank


# --- 2. a prefill pod dies with queued work ---
def test_kv_load_failure_is_computed_again_on_the_other_prefill_pod(cluster, tiny_model, metrics_port):
    """--kv-load-failure-policy recompute: the prefill pod holding a request's KV dies after the client got the first
    token and before the decode pod read the KV. The decode pod reports the failed load (trailing metadata), the
    router computes the prompt again on the other prefill pod, and the client gets exactly the fault-free tokens:
    none lost, none repeated. Every KV block comes back.

    Choreography, by signals: p1 is stopped so the request goes to p0; p0 is stopped while it computes, so the decode
    pod's reservation shows in its heartbeat before that decode pod is stopped; p0 then finishes (the first token
    reaches the client) and is killed; p1 and the decode pod are thawed."""
    prompt = prompts(1, seed=51, lo=100, hi=200)[0]
    want = reference(tiny_model, [prompt], 12)[0]

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await require_ready(stub, {"p0", "p1"})
            st = await pods(stub)
            decodes = [d for d in ("d0", "d1") if d in st and st[d].state == READY]  # an earlier test may kill one
            assert decodes, cluster.log_tails(15)
            baseline = await settled_kv(stub, cluster, decodes)
            recomputes0 = metric(metrics_port, "pdserve_router_kv_recomputes_total")
            first = asyncio.Event()
            decode_pod = None
            cluster.kill("p1", signal.SIGSTOP)
            try:

                async def p1_out():
                    return (await pods(stub))["p1"].state != READY

                await wait_for("p1 no longer READY", p1_out)
                cluster.kill("p0", signal.SIGSTOP)
                task = asyncio.ensure_future(
                    collect(stub, greedy(prompt, 12, rid="recompute-0"), on_message=lambda m, msgs: first.set())
                )

                async def reserved_on():
                    st = await pods(stub)
                    return next((d for d in decodes if kv_free(st, d) != baseline[d]), None)

                decode_pod = await wait_for("the decode pod's reservation", reserved_on, timeout=30, every=0.02)
                cluster.kill(decode_pod, signal.SIGSTOP)
                cluster.kill("p0", signal.SIGCONT)
                await asyncio.wait_for(first.wait(), 30)
                cluster.kill("p0")  # its KV is gone before the decode pod could read it
            finally:
                cluster.kill("p0", signal.SIGCONT)
                cluster.kill("p1", signal.SIGCONT)
                await require_ready(stub, {"p1"})
                if decode_pod is not None:
                    cluster.kill(decode_pod, signal.SIGCONT)
            msgs, code, details = await asyncio.wait_for(task, 120)
            recomputes = metric(metrics_port, "pdserve_router_kv_recomputes_total") - recomputes0
            cluster.restart("p0")
            await require_ready(stub, {"p0", "p1", *decodes})
            await wait_kv(stub, cluster, baseline, "decode KV back at baseline")
            return msgs, code, details, recomputes

    msgs, code, details, recomputes = asyncio.run(body())
    assert code == grpc.StatusCode.OK, (details, cluster.log_tails(15))
    assert tokens(msgs) == want
    assert recomputes == 1
    assert msgs[-1].routing.prefill_pod_id == "p1" and msgs[-1].usage.completion_tokens == len(want)


def test_prefill_pod_killed_with_queued_requests_retries_elsewhere(cluster, tiny_model, metrics_port):
    """Requests queued on prefill pod p1 when it is SIGKILLed are retried on p0 and all complete with the right
    greedy tokens (none lost, none duplicated: each request's tokens equal the offline engine's exactly, each
    request id answered once); the router stops placing on p1 and d0's KV returns to its baseline (the decode
    reservations made for the retried requests are not leaked).

    p1 is first SIGSTOPped so the work sent to it stays queued however slow or fast the machine is; it is killed once
    the router has several requests in flight on it."""
    n = 8
    ps = prompts(n, seed=21, lo=300, hi=600)
    want = reference(tiny_model, ps, 8)
    later = prompts(4, seed=22)
    want_later = reference(tiny_model, later, 4)

    async def body():
        async with grpc.aio.insecure_channel(cluster.router_address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await require_ready(stub, {"p0", "p1", "d0"})
            baseline = await settled_kv(stub, cluster, ["d0"])
            retries0 = metric(metrics_port, "pdserve_router_prefill_retries_total")
            cluster.kill("p1", signal.SIGSTOP)
            tasks = [asyncio.ensure_future(collect(stub, greedy(p, 8, rid=f"queued-{i}"))) for i, p in enumerate(ps)]

            async def queued_on_p1():  # several, or as many as the router placed before p1 went UNHEALTHY (silent)
                p1 = (await pods(stub))["p1"]
                n = p1.num_inflight_requests
                return (n >= 2 or (n >= 1 and p1.state != READY)) and n

            try:
                on_p1 = await wait_for("requests queued on the stopped p1", queued_on_p1, timeout=30, every=0.02)
            finally:
                cluster.kill("p1")  # SIGKILL reaches a stopped process too
            results = await asyncio.wait_for(asyncio.gather(*tasks), 240)

            async def p1_out():
                st = await pods(stub)
                return "p1" not in st or st["p1"].state != READY

            await wait_for("p1 no longer READY in ClusterStatus", p1_out)
            newer = await asyncio.gather(*(collect(stub, greedy(p, 4)) for p in later))
            retries = metric(metrics_port, "pdserve_router_prefill_retries_total") - retries0
            await wait_kv(stub, cluster, baseline, "d0's KV back at baseline")
            return on_p1, results, newer, retries

    on_p1, results, newer, retries = asyncio.run(body())
    for i, ((msgs, code, details), w) in enumerate(zip(results, want)):
        assert code == grpc.StatusCode.OK, (code, details, cluster.log_tails(15))
        assert tokens(msgs) == w, i
        assert {m.request_id for m in msgs} == {f"queued-{i}"}
        assert msgs[-1].routing.prefill_pod_id == "p0" and msgs[-1].usage.completion_tokens == len(w)
    assert retries >= on_p1, (retries, on_p1)  # every request queued on p1 was retried, none dropped
    for (msgs, code, details), w in zip(newer, want_later):
        assert code == grpc.StatusCode.OK, details
        assert tokens(msgs) == w and msgs[-1].routing.prefill_pod_id == "p0"
