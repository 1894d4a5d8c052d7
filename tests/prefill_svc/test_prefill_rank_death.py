"""A prefill pod with TP 2 (rank 1 a process of its own) loses a rank: real processes (``python -m router`` and
``python -m prefill_svc -tp 2``, tiny random checkpoint), the rank SIGKILLed."""

from __future__ import annotations

import signal
import time

import grpc
import psutil
import pytest
from e2e_helpers import e2e_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_api.v1 import common_pb2, prefill_pb2, prefill_pb2_grpc, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.slow

BOUND_S = 60.0  # "within a bounded time", generous for a loaded 2-core machine


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, smollm2):
    from pdserve.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-rank"), "llama", num_kv_heads=2, tokenizer_from=smollm2)
    c = e2e_cluster(
        tmp_path_factory.mktemp("prefill-rank"), model, num_prefill=1, num_decode=0, prefill_tp=2, num_kv_blocks=64
    )
    c.start()
    try:
        yield c
    finally:
        c.stop()


def _greedy_one(ids: list[int]) -> router_pb2.GenerateRequest:
    return router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=ids), sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=1)
    )


def _poll(what: str, fn, timeout: float = BOUND_S):
    t0 = time.monotonic()
    last = None
    while time.monotonic() - t0 < timeout:
        last = fn()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout:.0f}s: {what} (last: {last!r})")


def test_prefill_rank_killed_turns_the_pod_unhealthy(cluster):
    """SIGKILL TP rank 1 of prefill pod p0: within a bound p0 reports NOT_SERVING on grpc.health.v1 and UNHEALTHY
    to the router (ClusterStatus), a Prefill sent to it directly ends with UNAVAILABLE saying a rank exited, and the
    router no longer places requests there (a request gets UNAVAILABLE: no READY prefill pod) instead of failing on
    the broken pod. Before the kill the same request is answered by p0."""
    prompt = list(range(5, 45))
    with grpc.insecure_channel(cluster.router_address) as ch:
        router = router_pb2_grpc.RouterStub(ch)
        first = list(router.Generate(_greedy_one(prompt), timeout=120))
        assert first[-1].routing.prefill_pod_id == "p0" and len(first[-1].token_ids) == 1
        address = {p.pod_id: p for p in router.ClusterStatus(router_pb2.ClusterStatusRequest()).pods}["p0"].address

        kids = psutil.Process(cluster.service("p0").pid).children(recursive=True)
        ranks = [k for k in kids if any("spawn_main" in a for a in k.cmdline())]
        assert len(ranks) == 1, ranks
        ranks[0].send_signal(signal.SIGKILL)

        def unhealthy():
            st = {p.pod_id: p for p in router.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=10).pods}
            return st["p0"].state == common_pb2.POD_STATE_UNHEALTHY and st["p0"]

        _poll("p0 UNHEALTHY in ClusterStatus", unhealthy)
        with grpc.insecure_channel(address) as pch:

            def not_serving():
                health = health_pb2_grpc.HealthStub(pch).Check(
                    health_pb2.HealthCheckRequest(service="pdserve.v1.PrefillWorker"), timeout=10
                )
                return health.status == health_pb2.HealthCheckResponse.NOT_SERVING

            _poll("p0 NOT_SERVING on grpc.health.v1", not_serving)
            with pytest.raises(grpc.RpcError) as err:
                prefill_pb2_grpc.PrefillWorkerStub(pch).Prefill(
                    prefill_pb2.PrefillRequest(
                        request_id="after-kill",
                        prompt_token_ids=prompt,
                        sampling_params=common_pb2.SamplingParams(temperature=0, max_tokens=1),
                    ),
                    timeout=60,
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            assert "rank" in err.value.details()

        with pytest.raises(grpc.RpcError) as err:
            list(router.Generate(_greedy_one(prompt), timeout=60))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "prefill" in err.value.details(), err.value.details()
    assert "TP rank process of this prefill pod exited" in cluster.service("p0").log_path.read_text(errors="replace")
