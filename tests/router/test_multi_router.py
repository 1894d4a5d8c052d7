"""Two routers in front of the same pods (LocalCluster with num_routers=2): every pod registers with both, clients
spread requests over both with the same greedy tokens as one router gives, and SIGKILL of one router under load
loses only the requests that were streaming from it: the rest complete through the other, no KV block leaks on any
pod, and the restarted router sees every pod again. Real processes on loopback, tiny random checkpoint."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time

import pytest
from e2e_helpers import HEARTBEAT_S, e2e_cluster

from pdserve.client import AsyncClient, GenerationFailedError
from pdserve_api.v1 import common_pb2

pytestmark = pytest.mark.slow

READY = common_pb2.POD_STATE_READY
LEASE_TTL_S = 4.0  # prefill pods free KV no decode pod came for after this (idle) time
BOUND_S = 60.0
PODS = {"p0", "p1", "d0", "d1"}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, smollm2_path):
    from pdserve.testing import write_tiny_checkpoint

    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-routers"), "llama", num_kv_heads=1, tokenizer_from=smollm2_path
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny_model):
    c = e2e_cluster(
        tmp_path_factory.mktemp("routers"),
        tiny_model,
        num_prefill=2,
        num_decode=2,
        decode_tp=1,
        decode_dcp=1,
        num_kv_blocks=256,
        num_routers=2,
        prefill_args=["--lease-ttl-s", str(LEASE_TTL_S), "--no-prefix-caching"],
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def prompts(n: int, seed: int, lo: int = 5, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def reference(model, ps: list[list[int]], max_tokens: int) -> list[list[int]]:
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    with LLMEngine(EngineConfig(model=str(model), num_kv_blocks=1024, enable_prefix_caching=False)) as eng:
        outs = eng.generate(ps, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return [o["token_ids"] for o in outs]


async def status(address: str):
    async with AsyncClient(address, timeout=10) as c:
        return await c.cluster_status()


async def wait_for(what: str, pred, timeout: float = BOUND_S, every: float = 0.1):
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        try:
            last = await pred()
        except Exception as e:  # a router restarting
            last = e
        else:
            if last:
                return last
        await asyncio.sleep(every)
    raise AssertionError(f"not within {timeout:.0f}s: {what} (last: {last!r})")


async def all_ready(address: str) -> bool:
    st = await status(address)
    return {p.pod_id for p in st.pods if p.state == READY} >= PODS


async def kv_all_free(address: str) -> dict[str, tuple[list[int], list[int]]] | bool:
    st = await status(address)
    kv = {p.pod_id: ([k.free_blocks for k in p.kv], [k.total_blocks for k in p.kv]) for p in st.pods}
    return kv if set(kv) >= PODS and all(f == t and t for f, t in kv.values()) else False


def test_every_router_lists_every_pod_heartbeated_within_two_intervals(cluster):
    """Each pod registers with both routers and heartbeats to both: in each router, every pod is READY and its last
    heartbeat is at most two intervals old (sampled a few times: a one-off is not a pattern)."""
    assert len(cluster.router_addresses) == 2 and cluster.router_address == cluster.router_addresses[0]

    async def main():
        worst = 0.0
        for _ in range(5):
            for a in cluster.router_addresses:
                st = await status(a)
                pods = {p.pod_id: p for p in st.pods}
                assert set(pods) == PODS, (a, set(pods))
                assert all(p.state == READY for p in pods.values()), (a, pods)
                assert st.ready_models
                worst = max(worst, *(p.last_heartbeat_age_s for p in pods.values()))
            await asyncio.sleep(HEARTBEAT_S)
        assert worst <= 2 * HEARTBEAT_S + 0.25, worst  # + scheduling slack of a loaded 2-core machine

    asyncio.run(main())


def test_pdserve_status_lists_each_router_and_what_it_sees(cluster):
    routers = ",".join(cluster.router_addresses)
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--router", routers],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for a in cluster.router_addresses:
        assert f"router {a}: 4 pods (4 ready)" in out.stdout, out.stdout
    assert "does not list" not in out.stdout
    js = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--router", routers, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert js.returncode == 0, js.stderr
    seen = {r["address"]: {p["pod_id"] for p in r["pods"]} for r in json.loads(js.stdout)["routers"]}
    assert seen == {a: PODS for a in cluster.router_addresses}
    dead = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--router", f"{routers},127.0.0.1:1", "--timeout", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dead.returncode == 1 and "router 127.0.0.1:1: error: UNAVAILABLE" in dead.stdout, dead.stdout


def test_200_requests_over_two_routers_match_one_router(cluster, tiny_model):
    """200 greedy requests through a client of both routers (round robin), then the same through the first router
    alone: identical tokens, both identical to the offline engine, and both routers carried requests."""
    ps = prompts(200, seed=7)
    want = reference(tiny_model, ps, 4)

    async def run(addresses: list[str]) -> tuple[list[list[int]], set[str]]:
        busy: set[str] = set()
        done = asyncio.Event()

        async def watch():  # which routers had requests in flight
            while not done.is_set():
                for a in cluster.router_addresses:
                    if (await status(a)).num_inflight_requests > 0:
                        busy.add(a)
                await asyncio.sleep(0.05)

        async with AsyncClient(addresses, timeout=120) as c:
            sem = asyncio.Semaphore(16)

            async def one(p):
                async with sem:
                    return list((await c.generate(p, max_tokens=4, temperature=0, ignore_eos=True)).token_ids)

            w = asyncio.ensure_future(watch())
            try:
                out = await asyncio.gather(*(one(p) for p in ps))
            finally:
                done.set()
                await w
        return out, busy

    two, busy = asyncio.run(run(cluster.router_addresses))
    one, _ = asyncio.run(run(cluster.router_addresses[:1]))
    assert two == one == want
    assert busy == set(cluster.router_addresses), busy


def test_sigkill_one_router_under_load(cluster, tiny_model):
    """SIGKILL router-1 while requests stream from both routers and new ones keep coming: the requests that had not
    received a token complete (on router 0) with the offline engine's tokens; the ones streaming from router-1 fail
    UNAVAILABLE naming it, with what arrived as their partial result; every KV block comes back on every pod once the
    prefill leases' TTL has passed; a restarted router-1 lists every pod READY again."""
    r0, r1 = cluster.router_addresses
    ps = prompts(48, seed=11)
    max_tokens = 48
    want = reference(tiny_model, ps, max_tokens)

    async def main():
        await wait_for("pods idle with all KV free", lambda: kv_all_free(r0))
        streaming = {r0: 0, r1: 0}  # requests that have a token, by the router they stream from
        killed = asyncio.Event()

        async with AsyncClient([r0, r1], timeout=120) as c:

            async def one(i: int, p: list[int]):
                if i >= 24:  # the second half starts around the kill: no token before it
                    await killed.wait()
                s = c.generate_stream(p, max_tokens=max_tokens, temperature=0, ignore_eos=True)
                on = None
                try:
                    async for chunk in s:
                        if chunk.token_ids and on is None:
                            on = s.router
                            streaming[on] += 1
                    return s.completion
                except GenerationFailedError as e:
                    return e
                finally:
                    if on is not None:
                        streaming[on] -= 1

            tasks = [asyncio.ensure_future(one(i, p)) for i, p in enumerate(ps)]
            await wait_for(
                "8 requests streaming, 2 of them from router-1",
                lambda: asyncio.sleep(0, sum(streaming.values()) >= 8 and streaming[r1] >= 2),
                every=0.005,
            )
            cluster.kill("router-1")
            killed.set()
            results = await asyncio.gather(*tasks)

        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, GenerationFailedError)]
        ok = [(i, r) for i, r in enumerate(results) if not isinstance(r, GenerationFailedError)]
        assert failed, "no request was streaming from router-1 when it was killed"
        for i, e in failed:  # only router-1's streams, each after a token, each naming the dead router
            assert e.code.name == "UNAVAILABLE" and f"router {r1}" in e.message, e.message
            assert e.partial.token_ids and list(e.partial.token_ids) == want[i][: len(e.partial.token_ids)]
        for i, r in ok:
            assert list(r.token_ids) == want[i], (i, r.finish_reason)
        assert all(i in dict(ok) for i in range(24, 48))  # started without a token: all completed
        await asyncio.sleep(LEASE_TTL_S)
        await wait_for("every KV block free again on every pod (0 leaked)", lambda: kv_all_free(r0))

    asyncio.run(main())
    cluster.restart("router-1")
    asyncio.run(wait_for("restarted router-1 lists every pod READY", lambda: all_ready(r1)))
