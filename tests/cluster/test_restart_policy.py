"""The local cluster's restart policy (pdserve.cluster.restart): a crashed pod comes back on its port after an
exponential back-off and registers with every router again; a pod whose TP rank died fails its liveness probe and
is restarted; a router comes back and the pods register with it; each restart is logged; ``never`` leaves the dead
service down."""

from __future__ import annotations

import os
import signal
import time

import grpc
import psutil
import pytest
from e2e_helpers import e2e_cluster
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client import Client, UnavailableError
from pdserve.cluster.restart import RestartPolicy
from pdserve_api.v1 import common_pb2

pytestmark = pytest.mark.slow  # restarts real services, minutes

PROMPT = [5, 17, 99, 3, 250, 41, 7]


def test_backoff_doubles_up_to_its_cap():
    p = RestartPolicy("on-failure", backoff_s=0.5, backoff_max_s=3.0)
    assert [p.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_which_exits_restart():
    assert not RestartPolicy("never").restarts(1)
    assert RestartPolicy("on-failure").restarts(1) and RestartPolicy("on-failure").restarts(-9)
    assert not RestartPolicy("on-failure").restarts(0)
    assert RestartPolicy("always").restarts(0)


@pytest.mark.parametrize(
    "bad,says",
    [
        (dict(mode="sometimes"), "restart policy must be one of"),
        (dict(backoff_s=5, backoff_max_s=1), "backoff_max_s"),
        (dict(liveness_failures=0), "liveness_failures"),
        (dict(liveness_period_s=0), "liveness_period_s"),
        (dict(startup_timeout_s=0), "startup_timeout_s"),
    ],
)
def test_bad_policy_is_refused_with_the_field_named(bad, says):
    with pytest.raises(ValueError, match=says):
        RestartPolicy(**bad)


@pytest.fixture(scope="module")
def tiny(tiny_factory):
    return tiny_factory("llama", num_heads=4, num_kv_heads=1)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tiny):
    policy = RestartPolicy(
        "on-failure",
        backoff_s=0.5,
        backoff_max_s=4.0,
        liveness_period_s=1.0,
        liveness_timeout_s=2.0,
        liveness_failures=2,
        startup_timeout_s=20.0,
    )
    lines: list[str] = []
    c = e2e_cluster(
        tmp_path_factory.mktemp("restart"),
        tiny,
        num_prefill=1,
        num_decode=1,
        decode_tp=2,
        decode_dcp=2,
        num_kv_blocks=64,
        restart_policy=policy,
        num_routers=2,
        echo=lines.append,
    )
    c.start()
    c.lines = lines
    c.supervise_in_background(0.1)
    yield c
    c.stop()


def _answer(cluster) -> list[int]:
    with Client(",".join(cluster.router_addresses), timeout=60) as client:
        client.wait_ready(90)
        return list(client.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True).token_ids)


def _wait_restarted(cluster, name: str, count: int, timeout: float = 90) -> None:
    end = time.monotonic() + timeout
    while sum(e.service == name for e in cluster.restart_events) < count:
        assert time.monotonic() < end, f"{name} not restarted {count} times:\n" + cluster.log_tails(20)
        time.sleep(0.1)


def _wait_ready_everywhere(cluster, name: str, timeout: float = 90) -> None:
    """The pod is READY in every router under a registration newer than its last restart (it registered with each
    by itself; the router's record of the killed instance does not count)."""
    end = time.monotonic() + timeout
    restarted = max([e.at for e in cluster.restart_events if e.service == name], default=0.0)
    for addr in cluster.router_addresses:
        with Client(addr) as client:
            while True:
                try:
                    st = client.cluster_status(timeout=5)
                except UnavailableError as e:  # a restarted router not yet listening
                    st = e
                now = time.monotonic()
                if not isinstance(st, UnavailableError) and any(
                    p.pod_id == name and p.state == common_pb2.POD_STATE_READY and p.uptime_s <= now - restarted
                    for p in st.pods
                ):
                    break
                assert time.monotonic() < end, f"{name} not READY in {addr}: {st}"
                time.sleep(0.2)


def test_crashed_prefill_pod_restarts_with_backoff_and_rejoins_every_router(cluster):
    before = _answer(cluster)
    svc = cluster.service("p0")
    for n in (1, 2):
        old = svc.pid
        os.killpg(old, signal.SIGKILL)
        _wait_restarted(cluster, "p0", n)
        assert svc.pid != old and svc.exited() is None
        _wait_ready_everywhere(cluster, "p0")
    delays = [e.delay_s for e in cluster.restart_events if e.service == "p0"]
    assert delays == [0.5, 1.0]  # the second crash followed quickly: the back-off doubled
    assert all(e.exit_code == -signal.SIGKILL for e in cluster.restart_events if e.service == "p0")
    assert any("p0 exited with status -9; restarting it in 0.5s" in line for line in cluster.lines)
    assert any(line.startswith("restarted p0 (pid ") for line in cluster.lines)
    assert _answer(cluster) == before  # the restarted pod serves the same greedy tokens
    assert cluster.dead_services() == []


def test_decode_pod_whose_rank_died_fails_liveness_and_is_restarted(cluster):
    before = _answer(cluster)
    svc = cluster.service("d0")
    old = svc.pid
    ranks = [k for k in psutil.Process(old).children(recursive=True) if "resource_tracker" not in " ".join(k.cmdline())]
    assert ranks, "the TP 2 decode pod has no rank process"
    n = sum(e.service == "d0" for e in cluster.restart_events)
    ranks[0].kill()  # the pod itself lives on, NOT_SERVING: only the probe can tell
    _wait_restarted(cluster, "d0", n + 1)
    ev = [e for e in cluster.restart_events if e.service == "d0"][-1]
    assert ev.reason == "liveness" and svc.pid != old
    assert any("d0 failed 2 liveness probes in a row" in line for line in cluster.lines)
    _wait_ready_everywhere(cluster, "d0")
    assert _answer(cluster) == before


def test_killed_router_restarts_and_the_pods_register_with_it_again(cluster):
    before = _answer(cluster)
    os.killpg(cluster.service("router-1").pid, signal.SIGKILL)
    _wait_restarted(cluster, "router-1", 1)
    for pod in ("p0", "d0"):
        _wait_ready_everywhere(cluster, pod)
    with Client(cluster.router_addresses[1], timeout=60) as client:
        client.wait_ready(60)
        assert list(client.generate(PROMPT, max_tokens=6, temperature=0, ignore_eos=True).token_ids) == before


def test_a_restarted_service_stuck_while_starting_is_killed_and_started_again(cluster):
    """A router that is restarted and then hangs before it serves (SIGSTOPped at once) is killed after the startup
    timeout, as Kubernetes' startupProbe would, and started again; the next start serves."""
    svc = cluster.service("router-1")
    before = sum(e.service == "router-1" for e in cluster.restart_events)
    os.killpg(svc.pid, signal.SIGKILL)
    _wait_restarted(cluster, "router-1", before + 1)
    os.killpg(svc.pid, signal.SIGSTOP)
    _wait_restarted(cluster, "router-1", before + 2, timeout=120)
    assert any(e.service == "router-1" and e.reason == "startup" for e in cluster.restart_events)
    assert any("router-1 is not serving" in line for line in cluster.lines)
    for name in ("p0", "d0"):
        _wait_ready_everywhere(cluster, name)
    assert len(_answer(cluster)) == 6


def _health(address: str) -> int | None:
    """The pod's grpc.health.v1 status, or None while it does not answer."""
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status
        except grpc.RpcError:
            return None


def test_a_restarted_pod_that_says_not_serving_before_any_probe_is_restarted_by_liveness(tmp_path, tiny):
    """A restarted decode pod serves, then loses a rank before the supervisor's first probe of it: its NOT_SERVING is
    an answer (it started, then failed), so the liveness probes restart it within seconds rather than the supervisor
    waiting out the startup timeout for a SERVING it will never see. heal() runs only when this test calls it, so the
    order is the same every run."""
    policy = RestartPolicy(
        "on-failure", backoff_s=0.2, liveness_period_s=0.5, liveness_failures=2, startup_timeout_s=600.0
    )
    c = e2e_cluster(tmp_path, tiny, num_prefill=0, num_decode=1, decode_tp=2, num_kv_blocks=32, restart_policy=policy)
    c.start()
    try:
        svc = c.service("d0")
        os.killpg(svc.pid, signal.SIGKILL)
        end = time.monotonic() + 30
        while not c.restart_events:
            assert time.monotonic() < end, c.log_tails(20)
            c.heal()
            time.sleep(0.05)
        end = time.monotonic() + 120
        while _health(svc.address) != health_pb2.HealthCheckResponse.SERVING:  # up again, not yet probed
            assert time.monotonic() < end, c.log_tails(20)
            time.sleep(0.1)
        ranks = [
            k
            for k in psutil.Process(svc.pid).children(recursive=True)
            if "resource_tracker" not in " ".join(k.cmdline())
        ]
        ranks[0].kill()
        while _health(svc.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < end, c.log_tails(20)
            time.sleep(0.1)
        end = time.monotonic() + 30  # a few probe periods; the startup timeout is 600 s
        while len(c.restart_events) < 2:
            assert time.monotonic() < end, "the pod that said NOT_SERVING was not restarted:\n" + c.log_tails(20)
            c.heal()
            time.sleep(0.05)
        assert c.restart_events[-1].reason == "liveness"
    finally:
        c.stop()


def test_policy_never_leaves_a_dead_service_down(tmp_path, tiny):
    c = e2e_cluster(tmp_path, tiny, num_prefill=1, num_decode=0, num_kv_blocks=32)
    c.start()
    try:
        c.kill("p0")
        c.heal()
        assert [s.name for s in c.dead_services()] == ["p0"] and c.restart_events == []
    finally:
        c.stop()
