"""A decode pod receives prompt KV off its engine thread (--kv-load async, the default): on a TP 2 x DCP 2 pod (MQA,
rank processes, KV pulled over kv_transfer's TCP path from a TP 1 engine publishing as a prefill pod does),

- running streams get a token at every step while another request's transfer is stuck (its publisher never
  finishes a layer), and the stuck request then fails alone with the transfer's status, its blocks back;
- a request whose share lands late on one rank is never admitted before every rank has it, and its tokens equal
  transformers';
- cancelling a request still receiving its KV ends it at once, and its blocks come back once the ranks stopped;
- a transfer that fails (lease gone) or reads bytes that fail their checksums fails that request only."""

from __future__ import annotations

import time

import grpc
import pytest
from dsvc_helpers import PROMPTS, DelayedRankSource, drain_pod, greedy, record
from hf_helpers import hf_greedy

from decode_svc.config import DecodeConfig
from decode_svc.kv_source import PullerFactory, TransferKVSource
from decode_svc.pod import DecodePod, Failure
from pdserve.cli_config import build

TP, DCP, BLOCK = 2, 2, 8
STUCK_TIMEOUT_S = 4.0  # the stuck transfer's own timeout: it must fail with its status after it
BOUND_S = 60.0  # "within a bounded time" on a loaded 2-core machine


@pytest.fixture(scope="module")
def pod(tiny_models):
    cfg = build(
        DecodeConfig,
        model=str(tiny_models["mqa"]),
        tensor_parallel_size=TP,
        decode_context_parallel_size=DCP,
        block_size=BLOCK,
        num_kv_blocks=96,
    )
    assert cfg.kv_load == "async"
    p = DecodePod(cfg)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def standin(prefill_standins):
    return prefill_standins["mqa"]


@pytest.fixture(scope="module")
def want(tiny_models):
    return hf_greedy(tiny_models["mqa"], PROMPTS, 24)


def step_until(pod, done, results, finished, what: str) -> None:
    """Step the pod (recording every event) until done() holds, within BOUND_S."""
    t_end = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < t_end, f"timed out waiting for {what}"
        record(pod.step(), results, finished)
        if pod.only_receiving():
            time.sleep(0.002)


def lost_lease(standin, pod, prompt: list[int]) -> TransferKVSource:
    """A KV source on a lease its publisher already gave up (the pull fails with FAILED_PRECONDITION)."""
    handoff = standin.handoff(prompt)
    standin.publisher.abort(handoff.lease_id)
    factory = PullerFactory.for_engine(pod.engine, backend="tcp")
    return TransferKVSource(handoff.to_json(), len(prompt), factory, timeout_s=10)


def all_free(pod) -> bool:
    return pod.idle() and pod.free_blocks_per_rank() == [pod.num_blocks] * TP


def test_running_streams_step_on_while_a_transfer_is_stuck(pod, standin, want):
    res: dict[str, list[int]] = {}
    fin: dict[str, str] = {}
    src, first, lp = standin.handed(pod, PROMPTS[1])
    assert pod.submit("run", PROMPTS[1], greedy(24), first, lp, src) is None
    step_until(pod, lambda: "run" in res, res, fin, "the running stream's KV")
    stuck = standin.stalled_source(pod, PROMPTS[0], timeout_s=STUCK_TIMEOUT_S)
    first0, lp0 = standin.prefill(PROMPTS[0])
    assert pod.submit("stuck", PROMPTS[0], greedy(8), first0, lp0, stuck) is None
    # Every step while the transfer is stuck gives the running stream its next token.
    for _ in range(10):
        before = len(res["run"])
        record(pod.step(), res, fin)
        assert len(res["run"]) == before + 1
        assert pod.num_waiting_for_kv == 1 and "stuck" not in res
    drain_pod(pod, res, fin)
    assert res["run"] == want[1]
    step_until(pod, lambda: "stuck" in fin, res, fin, "the stuck transfer's timeout")
    assert fin["stuck"] in ("failed:DEADLINE_EXCEEDED", "failed:UNAVAILABLE")
    step_until(pod, lambda: all_free(pod), res, fin, "every block back")


def test_a_rank_whose_share_lands_late_holds_the_request_back(pod, standin, want):
    res: dict[str, list[int]] = {}
    fin: dict[str, str] = {}
    src, first, lp = standin.handed(pod, PROMPTS[1])
    late = DelayedRankSource(src, rank=1, delay_s=1.5)
    assert pod.submit("late", PROMPTS[1], greedy(24), first, lp, late) is None
    load = pod.loads.active["late"]
    step_until(pod, lambda: 0 in load.shares, res, fin, "rank 0's share")
    assert 1 not in load.shares
    for _ in range(20):  # rank 1 is still receiving: the request must not run
        record(pod.step(), res, fin)
        if 1 in load.shares:
            break
        assert "late" not in res and pod.num_running == 0 and pod.num_waiting_for_kv == 1
        time.sleep(0.01)
    drain_pod(pod, res, fin)
    assert fin["late"] == "length"
    assert res["late"] == want[1], "a request admitted before every rank had its share would diverge"
    assert all_free(pod)


def test_cancel_while_receiving_frees_every_block(pod, standin):
    res: dict[str, list[int]] = {}
    fin: dict[str, str] = {}
    first, lp = standin.prefill(PROMPTS[1])
    stuck = standin.stalled_source(pod, PROMPTS[1], timeout_s=BOUND_S)
    assert pod.submit("c", PROMPTS[1], greedy(8), first, lp, stuck) is None
    for _ in range(3):
        record(pod.step(), res, fin)
    assert pod.free_blocks_per_rank() != [pod.num_blocks] * TP
    t0 = time.monotonic()
    assert pod.cancel("c")
    assert not pod.knows("c") and pod.num_waiting_for_kv == 0
    step_until(pod, lambda: all_free(pod), res, fin, "the cancelled request's blocks")
    # the ranks stop at their next poll of the publisher, not at the transfer's timeout
    assert time.monotonic() - t0 < BOUND_S / 2
    assert "c" not in res and "c" not in fin


def test_a_failed_transfer_fails_only_its_request(pod, standin, want):
    res: dict[str, list[int]] = {}
    fin: dict[str, str] = {}
    src, first, lp = standin.handed(pod, PROMPTS[0])
    assert pod.submit("ok", PROMPTS[0], greedy(24), first, lp, src) is None
    first1, lp1 = standin.prefill(PROMPTS[1])
    assert pod.submit("gone", PROMPTS[1], greedy(4), first1, lp1, lost_lease(standin, pod, PROMPTS[1])) is None
    # Bytes that are not the bytes published: the checksums differ, DATA_LOSS.
    src2, first2, lp2 = standin.handed(pod, PROMPTS[1])
    blocks = -(-len(PROMPTS[1]) // 16)
    corrupt = TransferKVSource(src2.handoff_json, src2.num_tokens, src2.puller_factory, 10, (1,) * blocks, 16, "p-test")
    assert pod.submit("corrupt", PROMPTS[1], greedy(4), first2, lp2, corrupt) is None
    drain_pod(pod, res, fin)
    assert fin["gone"] == "failed:FAILED_PRECONDITION"
    assert fin["corrupt"] == "failed:DATA_LOSS"
    assert "gone" not in res and "corrupt" not in res
    assert res["ok"] == want[0]
    step_until(pod, lambda: all_free(pod), res, fin, "every block back")


def test_failures_are_events_with_the_transfer_status(pod, standin):
    """What the server streams: a Failure event naming the cause (no exception out of submit or step)."""
    first, lp = standin.prefill(PROMPTS[0])
    assert pod.submit("ev", PROMPTS[0], greedy(4), first, lp, lost_lease(standin, pod, PROMPTS[0])) is None
    events = []
    t_end = time.monotonic() + BOUND_S
    while not any(getattr(e, "request_id", "") == "ev" for e in events):
        assert time.monotonic() < t_end
        events += pod.step()
    (ev,) = [e for e in events if e.request_id == "ev"]
    assert isinstance(ev, Failure) and ev.code == grpc.StatusCode.FAILED_PRECONDITION and ev.finished
    assert "KV transfer failed" in ev.message
    assert [o.cause for o in pod.kv_outcomes if o.request_id == "ev"] == ["FAILED_PRECONDITION"]
