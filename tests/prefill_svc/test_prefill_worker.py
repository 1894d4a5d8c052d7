"""The prefill engine loop: batching order, KV hand-off to kv_transfer layer by layer, cancel / release / errors."""

from __future__ import annotations

import asyncio
import threading
from contextlib import contextmanager

import pytest
import torch
from prefill_ref import cached_kv, greedy, hf_prefill, random_prompt

from kv_transfer.factory import make_puller
from kv_transfer.layout import KVLayout
from pdserve.cli_config import build
from prefill_svc.config import PrefillConfig
from prefill_svc.worker import AlreadyExists, Cancelled, Draining, Exhausted, InvalidRequest, PrefillWorker


@contextmanager
def worker(model, **kw):
    kw.setdefault("kv_transport", "none")
    w = PrefillWorker(build(PrefillConfig, model=str(model), **kw))
    w.start()
    try:
        yield w
    finally:
        w.stop()


async def _long_and_short(w: PrefillWorker, long_len: int, short_len: int) -> list[tuple[str, str]]:
    events: list[tuple[str, str]] = []
    w.on_event = lambda kind, rid: events.append((kind, rid))
    params, client = greedy()
    longs = [
        asyncio.ensure_future(w.prefill(f"long{i}", random_prompt(long_len, 10 + i), params, client)) for i in range(2)
    ]
    while sum(1 for k, _ in events if k == "queued") < 2:  # both long prompts are admitted first
        await asyncio.sleep(0.001)
    shorts = [
        asyncio.ensure_future(w.prefill(f"short{i}", random_prompt(short_len, 20 + i), params, client))
        for i in range(10)
    ]
    results = await asyncio.gather(*longs, *shorts)
    assert all(not r.finished for r in results)
    return [(k, rid) for k, rid in events if k == "first_token"]


def test_short_prompts_do_not_wait_for_long_ones(tiny_model):
    """2 long + 10 short concurrent prompts: every short one's first token comes before either long one finishes."""
    with worker(tiny_model, prefill_chunk_size=256, max_num_batched_tokens=1024, num_kv_blocks=512) as w:
        done = asyncio.run(_long_and_short(w, 2048, 24))
    order = [rid for _, rid in done]
    first_long = min(order.index("long0"), order.index("long1"))
    assert all(order.index(f"short{i}") < first_long for i in range(10)), order


def test_without_chunking_short_prompts_wait(tiny_model):
    """Contrast (the ordering test can fail): when a long prompt takes the whole step, short ones wait for it."""
    with worker(tiny_model, prefill_chunk_size=2048, max_num_batched_tokens=2048, num_kv_blocks=512) as w:
        done = asyncio.run(_long_and_short(w, 2048, 24))
    order = [rid for _, rid in done]
    assert order.index("long0") < min(order.index(f"short{i}") for i in range(10)), order


def _decode_region(layout: KVLayout, num_blocks: int) -> torch.Tensor:
    return torch.full(
        (layout.num_layers, 2, num_blocks, layout.block_size, layout.kv_heads_per_rank, layout.head_dim), float("nan")
    )


def test_kv_published_layer_by_layer_and_pulled_by_kv_transfer(tiny_model):
    ids = random_prompt(300, seed=7)
    with worker(
        tiny_model, kv_transport="tcp", prefill_chunk_size=128, max_num_batched_tokens=512, num_kv_blocks=64
    ) as w:
        pub = w.engine.executor.runner.kv_connector.publisher
        calls = []
        real_publish, real_ready = pub.publish, pub.set_layers_ready
        pub.publish = lambda *a, **k: calls.append(("publish", k["layers_ready"])) or real_publish(*a, **k)
        pub.set_layers_ready = lambda lid, n: calls.append(("ready", n)) or real_ready(lid, n)
        params, client = greedy()
        res = asyncio.run(w.prefill("r", ids, params, client))
        # published during the last chunk, then one layer at a time as each layer wrote its KV
        assert calls == [("publish", 1)] + [("ready", n) for n in range(2, w.layout.num_layers + 1)]
        h = res.handoff
        assert h is not None and h.num_tokens == 300 and h.block_tables == [res.block_table]
        assert w.stats.num_leases == 1 and w.stats.kv_held_blocks == len(res.block_table)

        dst = KVLayout(
            num_layers=h.layout.num_layers,
            num_kv_heads=h.layout.num_kv_heads,
            head_dim=h.layout.head_dim,
            dtype="float32",
            block_size=16,
            tp_size=1,
            num_blocks=40,
        )
        region = _decode_region(dst, 40)
        table = list(range(39, 39 - 19, -1))  # 19 blocks, reversed: any placement works
        with make_puller(dst, 0, region, backend="tcp") as puller:
            landed = []
            puller.pull(h, table, on_layers_landed=landed.append)
        assert landed[-1] == dst.num_layers
        k, v = cached_kv(region, table, 300)
        hf_tok, hk, hv = hf_prefill(tiny_model, ids)
        assert res.first_token_id == hf_tok
        torch.testing.assert_close(k, hk, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(v, hv, atol=2e-4, rtol=1e-4)
        # decode said done on every rank: the lease is freed and the blocks go back, with no ReleaseKV
        for _ in range(200):
            if w.stats.num_leases == 0:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert w.stats.num_leases == 0 and w.stats.free_blocks == 64
        assert w.stats.leases_freed == {"done": 1}


def test_release_and_cancel_free_the_lease(tiny_model):
    with worker(
        tiny_model, kv_transport="tcp", prefill_chunk_size=64, max_num_batched_tokens=256, num_kv_blocks=64
    ) as w:
        params, client = greedy()

        async def scenario():
            r = await w.prefill("a", random_prompt(40, 1), params, client)
            assert await w.release(r.lease_id)
            assert not await w.release("no-such-lease")
            r2 = await w.prefill("b", random_prompt(40, 2), params, client)
            assert await w.cancel("b")  # after its first token: drops the lease
            # cancel between two chunks of a prompt: its Prefill call fails with CANCELLED
            gate, chunks = threading.Event(), []

            scheduled = []

            def on_event(kind, rid):  # engine thread: hold the loop before c's third chunk until cancel is queued
                if kind == "scheduled":
                    scheduled.append(rid)
                if kind == "scheduled" and rid == "c":
                    chunks.append(rid)
                    if len(chunks) == 3:
                        gate.wait(10)

            w.on_event = on_event
            long = asyncio.ensure_future(w.prefill("c", random_prompt(900, 3), params, client))
            while len(chunks) < 3:
                await asyncio.sleep(0.001)
            cancelled = asyncio.ensure_future(w.cancel("c"))
            await asyncio.sleep(0.05)  # the cancel command is queued behind the running step
            gate.set()
            assert await cancelled
            with pytest.raises(Cancelled):
                await long
            assert len(chunks) == 3  # it never got to a fourth chunk
            # cancel while queued (behind a blocked loop): never computed at all
            gate2 = threading.Event()
            w._call(lambda: gate2.wait(10))
            queued = asyncio.ensure_future(w.prefill("d", random_prompt(100, 4), params, client))
            await asyncio.sleep(0.01)
            cancelled = asyncio.ensure_future(w.cancel("d"))
            await asyncio.sleep(0.01)
            gate2.set()
            assert await cancelled
            with pytest.raises(Cancelled):
                await queued
            assert "d" not in scheduled
            assert not await w.cancel("zzz")
            for _ in range(200):
                if w.stats.num_leases == 0 and w.stats.free_blocks == 64:
                    break
                await asyncio.sleep(0.01)
            return r2

        asyncio.run(scenario())
        assert w.stats.num_leases == 0 and w.stats.free_blocks == 64 and w.idle


def test_request_errors(tiny_model):
    with worker(
        tiny_model, prefill_chunk_size=64, max_num_batched_tokens=256, num_kv_blocks=16, max_leases=2, max_model_len=512
    ) as w:
        params, client = greedy()

        async def scenario():
            with pytest.raises(InvalidRequest, match="empty"):
                await w.prefill("e", [], params, client)
            with pytest.raises(InvalidRequest, match="out of range"):
                await w.prefill("e", [1, 10**6], params, client)
            with pytest.raises(InvalidRequest, match="max_model_len"):
                await w.prefill("e", [5] * 600, params, client)
            with pytest.raises(Exhausted, match="KV blocks"):
                await w.prefill("e", [5] * 300, params, client)  # 19 blocks > 16 on the pod
            r = await w.prefill("x", [5] * 20, params, client, lease_id="my-lease")
            assert r.lease_id == "my-lease"
            with pytest.raises(AlreadyExists):
                await w.prefill("x", [5] * 20, params, client)  # request id still holds a lease
            with pytest.raises(AlreadyExists):
                await w.prefill("y", [5] * 20, params, client, lease_id="my-lease")
            await w.prefill("y", [6] * 20, params, client)
            with pytest.raises(Exhausted, match="leases"):
                await w.prefill("z", [7] * 20, params, client)  # max_leases=2
            w.begin_drain()
            with pytest.raises(Draining):
                await w.prefill("w", [7] * 20, params, client)

        asyncio.run(scenario())


def test_finished_at_first_token_keeps_no_kv(tiny_model):
    from pdserve_api.v1 import common_pb2 as pb
    from prefill_svc.sampling import sampling_from_proto

    with worker(
        tiny_model, kv_transport="tcp", prefill_chunk_size=64, max_num_batched_tokens=256, num_kv_blocks=32
    ) as w:
        params, client = sampling_from_proto(pb.SamplingParams(temperature=0.0, max_tokens=1))
        r = asyncio.run(w.prefill("one", random_prompt(50, 4), params, client))
        assert r.finished and r.finish_reason == "length" and r.lease_id is None and r.handoff is None
        # first token is a stop token: finished with "stop"
        params, client = sampling_from_proto(pb.SamplingParams(temperature=0.0, stop_token_ids=[r.first_token_id]))
        r2 = asyncio.run(w.prefill("two", random_prompt(50, 4), params, client))
        assert r2.finished and r2.finish_reason == "stop"
        for _ in range(200):
            if w.stats.num_leases == 0:
                break
            asyncio.run(asyncio.sleep(0.01))
        assert w.stats.num_leases == 0 and w.stats.free_blocks == 32
