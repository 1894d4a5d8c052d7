"""The prefill pod as operators start it (python -m prefill_svc, a subprocess): Prefill returns the first token and a
KV lease, ReleaseKV frees the blocks, grpc.health.v1 SERVING, Prometheus metrics (also under vLLM's names),
registration + heartbeats with a router's Registry, and SIGTERM drains (held work finishes, new work gets
UNAVAILABLE)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prefill_ref import hf_prefill, random_prompt
from vllm_metrics_helpers import bucket_bounds, scrape_vllm

from pdserve.pod.vllm_metrics import TTFT_BUCKETS
from pdserve_api.v1 import common_pb2 as pb
from pdserve_api.v1 import prefill_pb2, prefill_pb2_grpc, registry_pb2, registry_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 512


class RecordingRegistry(registry_pb2_grpc.RegistryServicer):
    """Only observes what the pod sends (accepts everything)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def _log(self, kind, req):
        with self.lock:
            self.calls.append((kind, req))

    def of(self, kind):
        with self.lock:
            return [r for k, r in self.calls if k == kind]

    def RegisterWorker(self, request, context):
        self._log("register", request)
        return registry_pb2.RegisterWorkerResponse(
            accepted=True, message="hi", heartbeat_interval_s=0.2, router_id="test"
        )

    def Heartbeat(self, request, context):
        self._log("heartbeat", request)
        return registry_pb2.HeartbeatResponse(known=True)

    def DeregisterWorker(self, request, context):
        self._log("deregister", request)
        return registry_pb2.DeregisterWorkerResponse(found=True)


class Pod:
    def __init__(self, model: Path, tmp: Path, router: str) -> None:
        self.ready_file = tmp / "ready.json"
        cmd = [
            sys.executable,
            "-m",
            "prefill_svc",
            "--model",
            str(model),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--router",
            router,
            "--cluster-token",
            "s3cret",
            "--pod-id",
            "prefill-test-0",
            "--kv-transport",
            "tcp",
            "--num-kv-blocks",
            str(NUM_BLOCKS),
            "--prefill-chunk-size",
            "32",
            "--max-num-batched-tokens",
            "256",
            "--ready-file",
            str(self.ready_file),
            "--log-level",
            "WARNING",
        ]
        self.log = open(tmp / "pod.log", "w+")
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        deadline = time.monotonic() + 240
        while not self.ready_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError("prefill_svc did not start:\n" + self.output())
            time.sleep(0.1)
        self.info = json.loads(self.ready_file.read_text())
        self.channel = grpc.insecure_channel(self.info["address"])
        self.stub = prefill_pb2_grpc.PrefillWorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def metrics(self) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.info['metrics_port']}/metrics", timeout=5).read()
        out = {}
        for line in text.decode().splitlines():
            m = re.match(r"^(pdserve_\w+(?:\{[^}]*\})?) (\S+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def wait_metric(self, name: str, pred, timeout: float = 10.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            v = self.metrics().get(name)
            if v is not None and pred(v):
                return v
            if time.monotonic() > deadline:
                raise AssertionError(f"{name} = {v}")
            time.sleep(0.05)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def registry():
    reg = RecordingRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    registry_pb2_grpc.add_RegistryServicer_to_server(reg, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield reg, f"127.0.0.1:{port}"
    server.stop(0)


@pytest.fixture(scope="module")
def pod(tiny_model, tmp_path_factory, registry):
    p = Pod(tiny_model, tmp_path_factory.mktemp("prefill-pod"), registry[1])
    yield p
    p.kill()


def greedy_request(rid: str, ids: list[int], **kw) -> prefill_pb2.PrefillRequest:
    return prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ids, sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=32), **kw
    )


def test_prefill_returns_first_token_and_lease(pod, tiny_model):
    ids = random_prompt(200, seed=11)
    resp = pod.stub.Prefill(greedy_request("r1", ids), timeout=60)
    assert resp.first_token_id == hf_prefill(tiny_model, ids)[0]
    assert resp.num_prompt_tokens == 200 and not resp.finished
    kh = resp.kv_handle
    assert kh.lease_id and kh.prefill_pod_id == "prefill-test-0" and kh.num_tokens == 200
    assert kh.kv_transfer_address == pod.info["kv_endpoints"][0]
    assert kh.transfer_mode == pb.TRANSFER_MODE_TCP and kh.num_layers == 2 and kh.layout.num_blocks == NUM_BLOCKS
    assert len(kh.block_tables) == 1 and len(kh.block_tables[0].block_ids) == 13
    held = pod.wait_metric("pdserve_prefill_kv_held_blocks", lambda v: v == 13)
    assert held == 13 and pod.metrics()["pdserve_prefill_kv_leases"] == 1
    # a prefix hit: the second prompt shares the first 12 full blocks
    resp2 = pod.stub.Prefill(greedy_request("r2", ids[:192] + [5, 6, 7]), timeout=60)
    assert resp2.num_cached_tokens == 192
    pod.test_leases = [kh.lease_id, resp2.kv_handle.lease_id]


def test_release_kv_frees_blocks(pod):
    for lease in pod.test_leases:
        assert pod.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=lease)).released
    assert not pod.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=pod.test_leases[0])).released
    pod.wait_metric("pdserve_prefill_kv_held_blocks", lambda v: v == 0)
    pod.wait_metric("pdserve_prefill_kv_free_blocks", lambda v: v == NUM_BLOCKS)
    assert pod.metrics()["pdserve_prefill_kv_leases"] == 0


def test_errors_map_to_status_codes(pod):
    with pytest.raises(grpc.RpcError) as e:
        pod.stub.Prefill(greedy_request("bad", []), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        pod.stub.Prefill(
            prefill_pb2.PrefillRequest(
                request_id="bad2",
                prompt_token_ids=[5, 6],
                sampling_params=pb.SamplingParams(min_tokens=3, max_tokens=2),
            ),
            timeout=30,
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        # 2: the retired NIXL_PUSH, no longer a TransferMode
        pod.stub.Prefill(greedy_request("bad3", [5, 6], transfer_mode=2), timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wrong = pb.KVLayout(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64, dtype="float32", tp_size=1)
    with pytest.raises(grpc.RpcError) as e:
        pod.stub.Prefill(
            greedy_request("bad4", [5, 6], decode_target=prefill_pb2.DecodeTarget(layout=wrong)), timeout=30
        )
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "does not match" in e.value.details()
    # CancelPrefill of a long prompt in flight: its Prefill fails with CANCELLED
    call = pod.stub.Prefill.future(greedy_request("long", random_prompt(3000, seed=12)), timeout=60)
    pod.wait_metric("pdserve_prefill_queued_prompt_tokens", lambda v: v > 0)
    assert pod.stub.CancelPrefill(prefill_pb2.CancelPrefillRequest(request_id="long")).found
    with pytest.raises(grpc.RpcError) as e:
        call.result()
    assert e.value.code() == grpc.StatusCode.CANCELLED
    assert not pod.stub.CancelPrefill(prefill_pb2.CancelPrefillRequest(request_id="long")).found
    pod.wait_metric("pdserve_prefill_kv_free_blocks", lambda v: v == NUM_BLOCKS)


def test_health_serving(pod):
    for svc in ("", "pdserve.v1.PrefillWorker"):
        assert (
            pod.health.Check(health_pb2.HealthCheckRequest(service=svc)).status
            == health_pb2.HealthCheckResponse.SERVING
        )


def test_metrics_exposed(pod):
    m = pod.metrics()
    for name in (
        "pdserve_prefill_queued_prompt_tokens",
        "pdserve_prefill_tokens_per_second",
        "pdserve_prefill_prompt_tokens_computed_total",
        "pdserve_prefill_prefix_cache_hit_tokens_total",
        "pdserve_prefill_prefix_cache_hit_rate",
        "pdserve_prefill_kv_held_blocks",
        "pdserve_prefill_kv_leases",
        "pdserve_kv_leases_active",
    ):
        assert name in m, name
    assert m["pdserve_prefill_prefix_cache_hit_tokens_total"] == 192
    assert m["pdserve_prefill_prompt_tokens_computed_total"] >= 200 + 3
    assert m['pdserve_prefill_requests_total{code="OK"}'] == 2


def test_vllm_named_metrics(pod, tiny_model):
    def scrape():
        return scrape_vllm(pod.info["metrics_port"], Path(tiny_model).name)

    # so far: "r1" (200 tokens) and "r2" (195) got their first token; "long" was cancelled before it
    v, types = scrape()
    assert v["vllm:prompt_tokens_total"] == 200 + 195 and v["vllm:generation_tokens_total"] == 2
    assert v["vllm:time_to_first_token_seconds_count"] == 2 and v["vllm:time_to_first_token_seconds_sum"] > 0
    assert bucket_bounds(v, "vllm:time_to_first_token_seconds") == [*TTFT_BUCKETS, float("inf")]
    assert (v["vllm:num_requests_running"], v["vllm:num_requests_waiting"], v["vllm:kv_cache_usage_perc"]) == (0, 0, 0)
    assert types["vllm:num_requests_running"] == "gauge" and types["vllm:prompt_tokens"] == "counter"
    # both requests go on to decode: they finish there, and their later tokens are timed there
    assert all(v[f'vllm:request_success_total{{finished_reason="{r}"}}'] == 0 for r in ("stop", "length", "abort"))
    assert not {"vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"} & set(types)

    # a lease holds its blocks: 40 tokens in 3 blocks, in use until released
    resp = pod.stub.Prefill(greedy_request("v1", random_prompt(40, seed=15)), timeout=60)
    pod.wait_metric("pdserve_prefill_kv_held_blocks", lambda x: x == 3)
    assert scrape()[0]["vllm:kv_cache_usage_perc"] == 3 / NUM_BLOCKS
    assert pod.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=resp.kv_handle.lease_id)).released
    pod.wait_metric("pdserve_prefill_kv_free_blocks", lambda x: x == NUM_BLOCKS)
    # a request that ends at its first token ends on this pod
    req = greedy_request("v2", random_prompt(20, seed=16))
    req.sampling_params.max_tokens = 1
    assert pod.stub.Prefill(req, timeout=60).finished
    v, _ = scrape()
    assert v['vllm:request_success_total{finished_reason="length"}'] == 1
    assert v["vllm:prompt_tokens_total"] == 200 + 195 + 40 + 20 and v["vllm:generation_tokens_total"] == 4
    assert v["vllm:time_to_first_token_seconds_count"] == 4
    assert (v["vllm:num_requests_running"], v["vllm:kv_cache_usage_perc"]) == (0, 0)


def test_registers_and_heartbeats(pod, registry):
    reg, _ = registry
    deadline = time.monotonic() + 10
    while len(reg.of("heartbeat")) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    r = reg.of("register")[0]
    assert r.pod_id == "prefill-test-0" and r.role == pb.ROLE_PREFILL and r.cluster_token == "s3cret"
    assert r.address == pod.info["address"] and r.kv_transfer_address == pod.info["kv_endpoints"][0]
    assert r.model_shape.num_layers == 2 and r.model_shape.num_kv_heads == 2 and r.model_shape.dtype == "float32"
    assert r.parallel.tensor_parallel_size == 1 and r.kv_layout.num_blocks == NUM_BLOCKS
    assert r.capacity.max_num_batched_tokens == 256 and list(r.capacity.transfer_modes) == [pb.TRANSFER_MODE_TCP]
    assert [k.free_blocks for k in r.kv] == [NUM_BLOCKS]
    hb = reg.of("heartbeat")[-1]
    assert hb.pod_id == "prefill-test-0" and hb.state == pb.POD_STATE_READY and len(hb.kv) == 1


def test_the_real_router_registry_accepts_the_registration(pod, registry, tiny_model):
    router_registry = pytest.importorskip("router.registry")
    from router.config import RouterConfig

    reg, _ = registry
    router = router_registry.Registry(RouterConfig(cluster_token="s3cret"), model_name=Path(tiny_model).name)
    resp = router.register(reg.of("register")[0])
    assert resp.accepted, resp.message
    assert router.heartbeat(reg.of("heartbeat")[-1]).known


def test_sigterm_drains(pod, registry):
    reg, _ = registry
    held = pod.stub.Prefill(greedy_request("held", random_prompt(100, seed=13)), timeout=60)
    inflight = pod.stub.Prefill.future(greedy_request("inflight", random_prompt(3000, seed=14)), timeout=120)
    pod.wait_metric("pdserve_prefill_queued_prompt_tokens", lambda v: v > 0)
    pod.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    while pod.health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(grpc.RpcError) as e:
        pod.stub.Prefill(greedy_request("new", [5, 6, 7]), timeout=30)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    resp = inflight.result()  # the prompt it held finishes normally
    assert resp.kv_handle.lease_id and resp.num_prompt_tokens == 3000
    assert pod.proc.poll() is None  # still holding two leases
    assert any(h.state == pb.POD_STATE_DRAINING for h in reg.of("heartbeat"))
    for lease in (held.kv_handle.lease_id, resp.kv_handle.lease_id):
        assert pod.stub.ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=lease)).released
    assert pod.proc.wait(30) == 0, pod.output()
    assert [d.pod_id for d in reg.of("deregister")] == ["prefill-test-0"]
