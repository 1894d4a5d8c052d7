"""The router process: python -m router, grpc.health.v1, Prometheus /metrics, graceful drain on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from e2e_helpers import REPO, service_env
from grpc_health.v1 import health_pb2, health_pb2_grpc
from router_helpers import register_request, run, running_router, stubs

from pdserve.net import free_port
from pdserve_api.v1 import common_pb2, router_pb2


def test_python_m_router_serves_health_and_metrics_then_drains_on_sigterm(smollm2_path):
    mport = free_port()
    p = subprocess.Popen(
        [sys.executable, "-u", "-m", "router", "--port", "0", "--metrics-port", str(mport), "--drain-timeout-s", "5"],
        cwd=REPO,
        env=service_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = ""
        t0 = time.monotonic()
        while "listening on" not in line or "pdserve router" not in line:
            line = p.stdout.readline()
            assert line or p.poll() is None, "router exited"
            assert time.monotonic() - t0 < 60
        port = int(re.search(r":(\d+)\s*$", line).group(1))
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for svc in ("", "pdserve.v1.Router", "pdserve.v1.Registry"):
                assert (
                    health.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status
                    == health_pb2.HealthCheckResponse.SERVING
                )
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        assert "pdserve_router_ttft_seconds" in text and "pdserve_router_queue_depth" in text
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_bad_config_exits_2_with_the_field():
    r = subprocess.run(
        [sys.executable, "-m", "router", "--port", "-5"],
        cwd=REPO,
        env=service_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "RouterConfig.port" in r.stderr


def test_drain_refuses_new_requests_waits_for_inflight_then_stops():
    async def body():
        async with running_router(drain_timeout_s=1.0, max_queue_wait_s=30) as (server, ch):
            router, registry = stubs(ch)
            await registry.RegisterWorker(register_request("p0", common_pb2.ROLE_PREFILL))
            await registry.RegisterWorker(register_request("d0", common_pb2.ROLE_DECODE, free=[0]))
            waiting = router.Generate(router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1])))
            for _ in range(100):
                if server.core.admission.depth:
                    break
                await asyncio.sleep(0.01)
            drain = asyncio.create_task(server.drain())
            await asyncio.sleep(0.1)
            health = health_pb2_grpc.HealthStub(ch)
            st = await health.Check(health_pb2.HealthCheckRequest(service=""))
            try:
                async for _ in router.Generate(router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1]))):
                    pass
                refused = None
            except grpc.aio.AioRpcError as e:
                refused = e.code(), e.details()
            t0 = time.monotonic()
            await drain
            took = time.monotonic() - t0
            try:
                async for _ in waiting:
                    pass
                code = grpc.StatusCode.OK
            except grpc.aio.AioRpcError as e:
                code = e.code()
            return st.status, refused, took, code

    status, refused, took, code = run(body())
    assert status == health_pb2.HealthCheckResponse.NOT_SERVING
    assert refused[0] == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused[1]
    assert 0.5 < took < 5  # waited for the in-flight (queued) request up to the grace, then stopped
    assert code != grpc.StatusCode.OK


@contextlib.contextmanager
def _router_at_info(*flags: str):
    """`python -m router --port 0 --log-level INFO *flags` up to its listening line: yields the process and the
    lines it printed; afterwards SIGTERM, from which it must exit with 0."""
    p = subprocess.Popen(
        [sys.executable, "-u", "-m", "router", "--port", "0", "--log-level", "INFO", *flags],
        cwd=REPO,
        env=service_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        seen, t0 = [], time.monotonic()
        while not any("pdserve router listening" in s for s in seen):
            line = p.stdout.readline()
            assert line or p.poll() is None, f"router exited: {seen}"
            seen.append(line)
            assert time.monotonic() - t0 < 60
        yield p, seen
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow
def test_python_m_router_runs_on_the_chosen_event_loop(smollm2_path):
    """`--event-loop asyncio` runs the router on asyncio's own loop and the default on uvloop (a dev dependency,
    installed here): the process says which loop serves it once it listens, and that it froze its startup heap out
    of garbage collection (pdserve/heap.py) before it did."""
    pytest.importorskip("uvloop")
    for flags, want in ((["--event-loop", "asyncio"], "asyncio"), ([], "uvloop")):
        with _router_at_info(*flags) as (_, seen):
            assert any(f"event loop: {want}" in s for s in seen), seen
            frozen = [int(m.group(1)) for s in seen if (m := re.search(r"router: (\d+) startup objects frozen", s))]
            assert frozen and frozen[0] > 10_000, seen  # torch, grpc and protobuf alone leave ~10^5


@pytest.mark.slow
def test_python_m_router_puts_grpc_helper_threads_under_sched_batch(smollm2_path):
    """By default every thread of the router but its event loop's runs under SCHED_BATCH (pdserve/sched.py), so
    gRPC's helpers stop preempting the loop; --helper-threads normal leaves every thread as it started."""
    if not hasattr(os, "SCHED_BATCH"):
        pytest.skip("needs Linux scheduling policies")
    for flags, helpers in (([], os.SCHED_BATCH), (["--helper-threads", "normal"], os.SCHED_OTHER)):
        with _router_at_info(*flags) as (p, seen):
            policy = {int(t): os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{p.pid}/task")}
            assert policy.pop(p.pid) == os.SCHED_OTHER  # the event loop's thread
            assert len(policy) >= 2 and set(policy.values()) == {helpers}, policy  # grpc's poller, event engine
            said = any(re.search(r"router: \d+ helper threads under SCHED_BATCH", s) for s in seen)
            assert said is (helpers == os.SCHED_BATCH), seen


@pytest.mark.slow
def test_router_and_openai_front_start_without_importing_torch():
    """The router validates requests with the torch-free pdserve.sampling_params: its process stays small (no
    torch heap to hold or collect) and starts in a fraction of a second of imports."""
    code = (
        "import sys, router.server, router.openai_http, router.__main__\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:3])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=service_env(), capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
