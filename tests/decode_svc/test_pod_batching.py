"""Continuous batching on a decode pod (TP 2, DCP 2, MQA tiny model): 16 sequences of different lengths started at
different steps are each token-identical to their solo run; cancellation and finishing free every block; when blocks
run out new requests wait and the youngest sequence is preempted and recomputed, never lost; AllocateKV-style
reservations hold exactly each rank's DCP share and expire. The pod lands KV synchronously here (--kv-load sync), so
each step's admissions are deterministic; test_async_kv_load.py proves the same behaviours with KV received off the
engine thread."""

from __future__ import annotations

import math

import grpc
import pytest
from dsvc_helpers import Handed, drain_pod, greedy, record

from decode_svc.config import DecodeConfig
from decode_svc.kv_source import KVDeliveryError, PullerFactory, TransferKVSource
from decode_svc.pod import DecodePod, RequestExists
from pdserve.cli_config import build
from pdserve.engine.block_manager import dcp_local_count
from pdserve.engine.llm_engine import RequestError

TP, DCP, BLOCK = 2, 2, 8
N = 16
# Different prompt lengths (5..50) and output lengths (8..23).
PROMPTS = [[1] + [(13 * i + 7 * j + 5) % 240 + 3 for j in range(4 + 3 * i)] for i in range(N)]
MAX_TOKENS = [8 + i for i in range(N)]


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def clock():
    return FakeClock()


@pytest.fixture(scope="module")
def pod(tiny_models, clock):
    cfg = build(
        DecodeConfig,
        model=str(tiny_models["mqa"]),
        tensor_parallel_size=TP,
        decode_context_parallel_size=DCP,
        block_size=BLOCK,
        num_kv_blocks=160,
        reservation_ttl_s=5.0,
        admission_timeout_s=600.0,
        kv_load="sync",
    )
    p = DecodePod(cfg, clock=clock)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def prefilled(prefill_standins, pod):
    return Handed(prefill_standins["mqa"], pod, PROMPTS)


@pytest.fixture(scope="module")
def solo(pod, prefilled):
    """Each sequence alone on the pod."""
    out = []
    for i, (src, first, lp) in enumerate(prefilled):
        res, fin = {}, {}
        record([pod.submit(f"solo{i}", PROMPTS[i], greedy(MAX_TOKENS[i]), first, lp, src)], res, fin)
        drain_pod(pod, res, fin)
        assert fin[f"solo{i}"] == "length"
        out.append(res[f"solo{i}"])
        assert pod.idle() and pod.free_blocks_per_rank() == [pod.num_blocks] * TP
    return out


def _staggered(pod, prefilled, cancel_at: dict[int, int] | None = None, tag="c"):
    """Start sequence i at step 2*i; cancel_at: {i: step}. Returns (tokens, finish reasons, blocks freed per cancel)."""
    cancel_at = cancel_at or {}
    res: dict[str, list[int]] = {}
    fin: dict[str, str] = {}
    freed = {}
    step = 0
    while step < 2 * N or pod.has_work():
        for i in range(N):
            if 2 * i == step:
                src, first, lp = prefilled[i]
                out = pod.submit(f"{tag}{i}", PROMPTS[i], greedy(MAX_TOKENS[i]), first, lp, src)
                assert out is not None
                record([out], res, fin)
            if cancel_at.get(i) == step and f"{tag}{i}" not in fin:
                held = [len(t) for t in pod.block_tables_of(f"{tag}{i}")]
                before = pod.free_blocks_per_rank()
                assert pod.cancel(f"{tag}{i}")
                after = pod.free_blocks_per_rank()
                freed[i] = (held, [a - b for a, b in zip(after, before)])
                fin[f"{tag}{i}"] = "cancelled"
        record(pod.step(), res, fin)
        step += 1
        assert step < 2000
    return res, fin, freed


def test_sixteen_staggered_sequences_match_solo_runs(pod, prefilled, solo):
    running_max = 0
    res, fin, _ = _staggered(pod, prefilled)
    for i in range(N):
        assert fin[f"c{i}"] == "length"
        assert res[f"c{i}"] == solo[i], f"sequence {i} differs from its solo run"
        running_max = max(running_max, len(res[f"c{i}"]))
    assert pod.idle()
    assert pod.free_blocks_per_rank() == [pod.num_blocks] * TP
    assert pod.kv_seconds == {}  # no per-request bookkeeping outlives its request (it grew forever before)


def test_cancel_half_midway_frees_blocks_at_once(pod, prefilled, solo):
    cancel_at = {i: 2 * i + 4 for i in range(1, N, 2)}  # odd ones, 4 steps after they started
    res, fin, freed = _staggered(pod, prefilled, cancel_at, tag="h")
    for i in range(N):
        if i % 2:
            assert fin[f"h{i}"] == "cancelled"
            got = res.get(f"h{i}", [])
            assert 0 < len(got) < MAX_TOKENS[i] and got == solo[i][: len(got)]
            held, released = freed[i]
            assert released == held and sum(held) > 0  # exactly its blocks, right away
        else:
            assert fin[f"h{i}"] == "length" and res[f"h{i}"] == solo[i]
    assert pod.idle()
    assert pod.free_blocks_per_rank() == [pod.num_blocks] * TP


def test_reservation_accounting_takeover_and_expiry(pod, prefilled, solo, clock):
    total = pod.num_blocks
    for n in (1, 7, 8, 9, 16, 17, 33, 100):
        tables = pod.reserve(f"acc{n}", n)
        assert len(tables) == DCP
        for r in range(DCP):
            local = dcp_local_count(n, DCP, 1, r)
            assert local in (n // DCP, math.ceil(n / DCP))
            assert len(tables[r]) == math.ceil(local / BLOCK)
        tp_tables = pod.tp_tables(tables)
        assert [len(t) for t in tp_tables] == [len(tables[r % DCP]) for r in range(TP)]
        assert pod.free_blocks_per_rank() == [total - len(tables[r % DCP]) for r in range(TP)]
        assert pod.cancel(f"acc{n}")
        assert pod.free_blocks_per_rank() == [total] * TP
    # extra output tokens are reserved too
    tables = pod.reserve("extra", 10, extra_tokens=30)
    assert [len(t) for t in tables] == [math.ceil(20 / BLOCK)] * DCP
    pod.cancel("extra")
    # bad and duplicate requests
    with pytest.raises(RequestError):
        pod.reserve("bad", 0)
    pod.reserve("dup", 5)
    with pytest.raises(RequestExists):
        pod.reserve("dup", 5)
    # Decode takes the reservation over: same blocks, identical tokens.
    src, first, lp = prefilled[3]
    tables = pod.reserve("take", len(PROMPTS[3]))
    short = prefilled.standin.source(pod, PROMPTS[3], num_tokens=len(PROMPTS[3]) - 1)
    with pytest.raises(RequestError):  # wrong prompt length for the reservation
        pod.submit("take", PROMPTS[3][:-1], greedy(MAX_TOKENS[3]), first, lp, short)
    res, fin = {}, {}
    record([pod.submit("take", PROMPTS[3], greedy(MAX_TOKENS[3]), first, lp, src)], res, fin)
    assert [t[: len(tables[r])] for r, t in enumerate(pod.engine.block_tables_of("take"))] == tables
    drain_pod(pod, res, fin)
    assert res["take"] == solo[3]
    # an unused reservation expires after its TTL
    assert "dup" in pod.reservations
    clock.t += 10
    assert pod.expire_reservations() == ["dup"]
    assert pod.idle() and pod.free_blocks_per_rank() == [total] * TP


def test_out_of_blocks_waits_and_preempts_without_losing_requests(pod, prefilled, solo):
    # One TP group per process: squeeze the module's pod with a reservation that leaves 18 blocks per rank free
    # (about 6 of the 16 sequences fit at once).
    filler_blocks = pod.num_blocks - 18
    assert pod.reserve("filler", filler_blocks * BLOCK * DCP) is not None
    assert pod.free_blocks_per_rank() == [18] * TP
    res: dict[str, list[int]] = {}
    fin: dict[str, str] = {}
    queued = preempted = 0
    for step in range(3000):
        if step < N:
            src, first, lp = prefilled[step]
            out = pod.submit(f"p{step}", PROMPTS[step], greedy(MAX_TOKENS[step]), first, lp, src)
            if out is None:
                queued += 1
            else:
                record([out], res, fin)
        if step == N:  # one that can never fit waits, then fails cleanly
            src, first, lp = prefilled.standin.handed(pod, [1] * 400)
            assert pod.submit("toolong", [1] * 400, greedy(4), first, lp, src, wait_s=0.0) is None
        preempted += len(pod.engine.scheduler.waiting)
        record(pod.step(), res, fin)
        if step > N and not pod.has_work():
            break
    assert queued > 0, "the pod was expected to run out of blocks"
    assert preempted > 0, "the pod was expected to preempt"
    assert fin.pop("toolong") == "failed:RESOURCE_EXHAUSTED"
    for i in range(N):
        assert fin[f"p{i}"] == "length", i
        assert res[f"p{i}"] == solo[i], f"sequence {i} differs from its solo run"
    assert pod.free_blocks_per_rank() == [18] * TP
    assert pod.cancel("filler")
    assert pod.idle() and pod.free_blocks_per_rank() == [pod.num_blocks] * TP


def test_kv_leases_renewed_while_queued_and_a_lost_lease_fails(pod, prefilled, solo, clock):
    """Every submission above pulled over kv_transfer (TCP) from a TP 1 prefill engine's cache into the pod's DCP
    blocks; here the lease is kept alive while the request waits for blocks, and one that is gone fails cleanly."""
    assert pod.kv_bytes_received > 0
    res, fin = {}, {}
    # Queued for blocks: the lease is renewed while it waits, then the pull happens on admission.
    assert pod.reserve("filler", pod.num_blocks * BLOCK * DCP) is not None
    src, first, lp = prefilled[5]
    assert pod.submit("kvq", PROMPTS[5], greedy(MAX_TOKENS[5]), first, lp, src) is None
    clock.t += 6
    pod.keep_queued_alive()
    assert pod.queue[0].renewed_at == clock.t
    pod.cancel("filler")
    drain_pod(pod, res, fin)
    assert res["kvq"] == solo[5]
    # A lease that is gone: the pull fails with kv_transfer's code and the pod keeps nothing.
    standin = prefilled.standin
    handoff = standin.handoff(PROMPTS[4])
    standin.publisher.abort(handoff.lease_id)
    first, lp = standin.prefill(PROMPTS[4])
    src = TransferKVSource(
        handoff.to_json(), len(PROMPTS[4]), PullerFactory.for_engine(pod.engine, backend="tcp"), timeout_s=10
    )
    with pytest.raises(KVDeliveryError) as ei:
        pod.submit("gone", PROMPTS[4], greedy(4), first, lp, src)
    assert ei.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert not pod.knows("gone")
    assert pod.idle() and pod.free_blocks_per_rank() == [pod.num_blocks] * TP
