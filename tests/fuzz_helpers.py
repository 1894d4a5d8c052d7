"""Helpers for the bad-input property tests (tests/*/test_*_fuzz.py): a small real cluster (router + one prefill
pod + one decode pod, separate processes, tiny checkpoint), a snapshot of everything a refused request must leave
untouched, and the hypothesis settings those tests share.

The snapshot reads only what the cluster itself reports: ClusterStatus (the registry, the router's queue and
in-flight counts, and each pod's own heartbeat: free KV blocks per rank, leases / reservations held, queued work).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import grpc
from e2e_helpers import e2e_cluster
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from pdserve.cluster.supervisor import LocalCluster
from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

# Stable in CI: the same examples every run, no wall-clock deadline (2 shared cores), modest counts.
FUZZ_SETTINGS = settings(
    max_examples=30,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)

VOCAB = 256  # write_tiny_checkpoint's default
MAX_MODEL_LEN = 256  # given to both pods, so "too long" prompts stay cheap
NUM_KV_BLOCKS = 64
HOLD_S = "600"  # lease / reservation TTL: a leaked one stays visible for the whole module

NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


def ok_ids(min_size=1, max_size=20):
    return st.lists(st.integers(3, VOCAB - 1), min_size=min_size, max_size=max_size)


# --- invalid SamplingParams: each strategy breaks exactly one field, the rest stay valid -----------------------
def _sp(**kw) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(**kw)


_BAD_STOP = st.builds(lambda s: _sp(stop=s), st.lists(st.sampled_from(["", "x"]), min_size=1).filter(lambda s: "" in s))
BAD_SAMPLING_VALUES = [
    st.builds(lambda v: _sp(temperature=v), st.one_of(st.floats(max_value=-(2**-20), width=32), NON_FINITE)),
    st.builds(
        lambda v: _sp(top_p=v),
        st.one_of(st.floats(max_value=0.0, width=32), st.floats(min_value=1.0, exclude_min=True, width=32), NON_FINITE),
    ),
    st.builds(lambda v: _sp(top_k=v), st.integers(-(2**31), -2)),
    st.builds(lambda v: _sp(max_tokens=v), st.integers(-(2**31), 0)),
    st.builds(lambda v: _sp(seed=v), st.integers(-(2**63), -1)),
    st.builds(lambda v: _sp(min_tokens=v), st.integers(-(2**31), -1)),
    st.builds(lambda m, extra: _sp(max_tokens=m, min_tokens=m + extra), st.integers(1, 100), st.integers(1, 100)),
    _BAD_STOP,
    st.builds(lambda v: _sp(stop_token_ids=[5, v]), st.integers(-(2**31), -1)),
    st.builds(lambda v: _sp(top_logprobs=v), st.integers(-(2**31), -1)),
    st.builds(lambda v: _sp(repetition_penalty=v), st.one_of(st.floats(max_value=0.0, width=32), NON_FINITE)),
    st.builds(
        lambda name, v: _sp(**{name: v}),
        st.sampled_from(["presence_penalty", "frequency_penalty"]),
        st.one_of(
            st.floats(min_value=2.0, exclude_min=True, width=32),
            st.floats(max_value=-2.0, exclude_max=True, width=32),
            NON_FINITE,
        ),
    ),
]
# Well-formed values past vLLM's limits (top_logprobs above 20, min_p outside [0, 1], logit_bias ids outside the
# vocabulary): refused by every service, never clamped or ignored.
OVER_LIMIT_SAMPLING = st.one_of(
    st.builds(lambda v: _sp(top_logprobs=v), st.integers(21, 2**31 - 1)),
    st.builds(
        lambda v: _sp(min_p=v),
        st.one_of(
            st.floats(max_value=0.0, exclude_max=True, width=32),
            st.floats(min_value=1.0, exclude_min=True, width=32),
            NON_FINITE,
        ),
    ),
    st.builds(lambda t: _sp(logit_bias={t: 1.0}), st.one_of(st.integers(-(2**31), -1), st.integers(VOCAB, 2**31 - 1))),
)
# Stop lists the router will not match after every token (too many, too long), and too many stop token ids.
_HUGE_STOPS = st.one_of(
    st.builds(lambda n: _sp(stop=["x"] * n), st.integers(65, 5000)),
    st.builds(lambda n: _sp(stop=["y" * n]), st.integers(1025, 1 << 20)),
    st.builds(lambda n: _sp(stop_token_ids=[5] * n), st.integers(1025, 100_000)),
)
BAD_SAMPLING_VALUES.append(OVER_LIMIT_SAMPLING)
BAD_SAMPLING = st.one_of(*BAD_SAMPLING_VALUES, _HUGE_STOPS)
# Pods ignore stop strings (whoever detokenizes applies them), so an empty one is the router's refusal only.
POD_BAD_SAMPLING = st.one_of(*[s for s in BAD_SAMPLING_VALUES if s is not _BAD_STOP])


def start_cluster(workdir: Path, model: Path) -> LocalCluster:
    """Router + p0 + d0 (TP 1), registered through their own RegisterWorker / Heartbeat."""
    c = e2e_cluster(
        workdir,
        model,
        num_prefill=1,
        num_decode=1,
        prefill_tp=1,
        decode_tp=1,
        decode_dcp=1,
        num_kv_blocks=NUM_KV_BLOCKS,
        prefill_args=["--max-model-len", str(MAX_MODEL_LEN), "--lease-ttl-s", HOLD_S, "--kv-transport", "tcp"],
        decode_args=["--max-model-len", str(MAX_MODEL_LEN), "--reservation-ttl-s", HOLD_S],
    )
    c.start()
    return c


@contextlib.contextmanager
def tiny_cluster(tmp_path_factory, tokenizer_from: Path) -> Iterator[LocalCluster]:
    """start_cluster on a fresh tiny llama checkpoint (1 KV head); stopped on exit."""
    from pdserve.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny-fuzz"), "llama", num_kv_heads=1, tokenizer_from=tokenizer_from
    )
    c = start_cluster(tmp_path_factory.mktemp("cluster-fuzz"), model)
    try:
        yield c
    finally:
        c.stop()


@dataclass(frozen=True)
class PodSnapshot:
    role: int
    address: str
    state: int
    free_blocks: tuple[int, ...]
    total_blocks: tuple[int, ...]
    leases: int  # LoadStats.num_active_leases: prefill KV leases / decode reservations + incoming transfers
    running: int
    waiting: int
    queued_prompt_tokens: int
    inflight: int  # the router's count of requests it has in flight on this pod


@dataclass(frozen=True)
class ClusterSnapshot:
    pods: dict[str, PodSnapshot]
    router_queue_depth: int
    num_inflight_requests: int
    ready_models: tuple[str, ...]


def snapshot(status: router_pb2.ClusterStatusResponse) -> ClusterSnapshot:
    pods = {
        p.pod_id: PodSnapshot(
            p.role,
            p.address,
            p.state,
            tuple(k.free_blocks for k in p.kv),
            tuple(k.total_blocks for k in p.kv),
            p.load.num_active_leases,
            p.load.num_running_seqs,
            p.load.num_waiting_seqs,
            p.load.queued_prompt_tokens,
            p.num_inflight_requests,
        )
        for p in status.pods
    }
    return ClusterSnapshot(
        pods, status.router_queue_depth, status.num_inflight_requests, tuple(sorted(status.ready_models))
    )


def cluster_snapshot(router_address: str) -> ClusterSnapshot:
    with grpc.insecure_channel(router_address) as ch:
        return snapshot(router_pb2_grpc.RouterStub(ch).ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=10))


def settled_snapshot(
    router_address: str, want: ClusterSnapshot | None = None, heartbeat_s: float = 0.25, timeout_s: float = 30.0
) -> ClusterSnapshot:
    """The snapshot once the pods' heartbeats have caught up: equal to ``want`` (returned as soon as it is), or,
    without ``want``, the same on three reads in a row. After ``timeout_s`` the latest read is returned (the caller's
    assertion then shows the difference)."""
    t0 = time.monotonic()
    last, same = None, 0
    while True:
        time.sleep(2 * heartbeat_s)
        now = cluster_snapshot(router_address)
        if want is not None and now == want:
            return now
        same = same + 1 if now == last else 0
        if (want is None and same >= 2) or time.monotonic() - t0 > timeout_s:
            return now
        last = now


def idle(snap: ClusterSnapshot) -> bool:
    """Nothing queued or in flight anywhere, every pod READY."""
    return (
        snap.router_queue_depth == 0
        and snap.num_inflight_requests == 0
        and all(
            p.state == common_pb2.POD_STATE_READY
            and p.inflight == 0
            and p.running == 0
            and p.waiting == 0
            and p.leases == 0
            for p in snap.pods.values()
        )
    )


def assert_refused(
    err: grpc.RpcError, allowed: tuple[grpc.StatusCode, ...] = (grpc.StatusCode.INVALID_ARGUMENT,), what: str = ""
) -> None:
    """A refusal a user can act on: one of ``allowed`` and a non-empty message."""
    assert err.code() in allowed, f"{what}: got {err.code()} ({err.details()!r}), want one of {allowed}"
    assert (err.details() or "").strip(), f"{what}: {err.code()} without a message"
