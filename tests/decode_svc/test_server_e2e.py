"""The decode service end to end, in a subprocess started the way operators start it (python -m decode_svc, TP 2,
DCP 2): AllocateKV -> KV pulled over kv_transfer (TCP) from an engine publishing it as a prefill pod does -> Decode
stream (token-identical to transformers) -> CancelDecode frees blocks; grpc.health.v1; Prometheus gauges, also
under vLLM's names; SIGTERM drains (in-flight streams finish, new calls get UNAVAILABLE); an invalid parallel
config refuses to start with the rule's message."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from dsvc_helpers import PROMPTS
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hf_helpers import hf_greedy
from vllm_metrics_helpers import bucket_bounds, scrape_vllm

from pdserve.pod.convert import handoff_to_kv_handle
from pdserve.pod.vllm_metrics import ITL_BUCKETS, REQUEST_LATENCY_BUCKETS
from pdserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, registry_pb2, registry_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
NUM_BLOCKS = 64
BLOCK = 8


class RecordingRegistry(registry_pb2_grpc.RegistryServicer):
    """The router's Registry, reduced to recording what the pod sends."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.lock = threading.Lock()

    def of(self, kind: str) -> list:
        with self.lock:
            return [r for k, r in self.calls if k == kind]

    def _log(self, kind: str, req) -> None:
        with self.lock:
            self.calls.append((kind, req))

    def RegisterWorker(self, request, context):
        self._log("register", request)
        return registry_pb2.RegisterWorkerResponse(accepted=True, message="hi", heartbeat_interval_s=0.2)

    def Heartbeat(self, request, context):
        self._log("heartbeat", request)
        return registry_pb2.HeartbeatResponse(known=True)

    def DeregisterWorker(self, request, context):
        self._log("deregister", request)
        return registry_pb2.DeregisterWorkerResponse()


@pytest.fixture(scope="module")
def registry():
    from concurrent import futures

    reg = RecordingRegistry()
    server = grpc.server(futures.ThreadPoolExecutor(4))
    registry_pb2_grpc.add_RegistryServicer_to_server(reg, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield reg, f"127.0.0.1:{port}"
    server.stop(0)


class Pod:
    def __init__(self, model: Path, *args: str) -> None:
        self.model_name = model.name
        cmd = [
            sys.executable,
            "-m",
            "decode_svc",
            "--model",
            str(model),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--block-size",
            str(BLOCK),
            "--num-kv-blocks",
            str(NUM_BLOCKS),
            "--log-level",
            "WARNING",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.lines: list[str] = []
        ready = threading.Event()

        def pump() -> None:
            for line in self.proc.stdout:
                self.lines.append(line)
                if "decode_svc ready" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(240) or self.proc.poll() is not None:
            self.kill()
            raise AssertionError("decode_svc did not start:\n" + "".join(self.lines))
        line = next(x for x in self.lines if "decode_svc ready" in x)
        self.port = int(re.search(r"DecodeWorker on [^:]+:(\d+)", line).group(1))
        self.metrics_port = int(re.search(r"metrics on [^:]+:(\d+)", line).group(1))
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = decode_pb2_grpc.DecodeWorkerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    def metrics(self) -> dict[str, float]:
        body = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).read().decode()
        out = {}
        for line in body.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def vllm(self) -> tuple[dict[str, float], dict[str, str]]:
        return scrape_vllm(self.metrics_port, self.model_name)

    def free_blocks(self) -> list[float]:
        m = self.metrics()
        return [m[f'pdserve_decode_kv_blocks_free{{pod="decode-0",rank="{r}"}}'] for r in range(2)]

    def wait_free(self, want: list[float], timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.free_blocks() == want:
                return
            time.sleep(0.05)
        assert self.free_blocks() == want

    def wait_metric(self, name: str, value: float, timeout: float = 20) -> None:
        deadline = time.time() + timeout
        while self.metrics().get(name) != value and time.time() < deadline:
            time.sleep(0.02)
        assert self.metrics().get(name) == value, name

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _request(rid, prompt, handed, max_tokens, logprobs=False):
    """A DecodeRequest as the router sends it; handed = (standin, first token, logprob): the KV on a fresh lease."""
    standin, first, lp = handed
    return decode_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        first_token_id=first,
        first_token_logprob=lp,
        sampling_params=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
        ),
        kv_handle=handoff_to_kv_handle(standin.handoff(prompt), "prefill-test", 60.0),
    )


@pytest.fixture(scope="module")
def handed(prefill_standins):
    standin = prefill_standins["mqa"]
    return [(standin, *standin.prefill(p)) for p in PROMPTS]


def test_invalid_parallel_config_refuses_to_start(tiny_models):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "decode_svc",
            "--model",
            str(tiny_models["gqa"]),
            "--tensor-parallel-size",
            "2",
            "--decode-context-parallel-size",
            "2",
            "--port",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    assert (
        "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (2) to be greater than the "
        "model's total number of KV heads (2). Increase `--tensor-parallel-size` or set "
        "`--decode-context-parallel-size 1`."
    ) in r.stderr
    assert "decode_svc ready" not in r.stdout


def test_decode_service_end_to_end(tiny_models, handed, registry):
    want = hf_greedy(tiny_models["mqa"], PROMPTS, 32)
    reg, reg_addr = registry
    pod = Pod(
        tiny_models["mqa"],
        "--tensor-parallel-size",
        "2",
        "--decode-context-parallel-size",
        "2",
        "--dcp-kv-cache-interleave-size",
        "4",
        "--kv-transfer-backend",
        "tcp",
        "--router",
        reg_addr,
        "--pod-id",
        "decode-0",
    )
    try:
        # Registered with the router as a decode pod with its layout; heartbeats carry free KV per rank.
        deadline = time.time() + 30
        while not reg.of("heartbeat") and time.time() < deadline:
            time.sleep(0.05)
        r = reg.of("register")[0]
        assert r.role == common_pb2.ROLE_DECODE and r.pod_id == "decode-0" and r.address.endswith(f":{pod.port}")
        assert r.parallel.tensor_parallel_size == 2 and r.parallel.decode_context_parallel_size == 2
        assert r.kv_layout.dcp_kv_cache_interleave_size == 4 and r.kv_layout.num_blocks == NUM_BLOCKS
        assert [k.free_blocks for k in reg.of("heartbeat")[-1].kv] == [NUM_BLOCKS, NUM_BLOCKS]

        for svc in ("", "pdserve.v1.DecodeWorker"):
            assert (
                pod.health.Check(health_pb2.HealthCheckRequest(service=svc)).status
                == health_pb2.HealthCheckResponse.SERVING
            )
        m = pod.metrics()
        assert m['pdserve_decode_running_seqs{pod="decode-0"}'] == 0
        assert pod.free_blocks() == [NUM_BLOCKS, NUM_BLOCKS]

        # AllocateKV: per-rank tables holding each DCP rank's share (interleave 4: 37 tokens -> 20 + 17).
        prompt, h1 = PROMPTS[1], handed[1]
        first = h1[1]
        resp = pod.stub.AllocateKV(decode_pb2.AllocateKVRequest(request_id="a", num_tokens=len(prompt)))
        assert resp.layout.tp_size == 2 and resp.layout.dcp_size == 2 and resp.layout.num_blocks == NUM_BLOCKS
        assert resp.layout.dcp_kv_cache_interleave_size == 4 and resp.layout.num_kv_heads_per_rank == 1
        assert [bt.num_tokens for bt in resp.block_tables] == [20, 17]
        assert [len(bt.block_ids) for bt in resp.block_tables] == [3, 3]
        assert resp.expires_at_unix_ms > time.time() * 1000
        pod.wait_free([NUM_BLOCKS - 3, NUM_BLOCKS - 3])  # the gauges follow the next stats refresh
        m = pod.metrics()
        assert m['pdserve_decode_kv_blocks_used{pod="decode-0",rank="0"}'] == 3
        v, types = pod.vllm()
        assert v["vllm:kv_cache_usage_perc"] == 3 / NUM_BLOCKS and v["vllm:num_requests_running"] == 0
        # the first token and its prompt are the prefill pod's: no TTFT or prompt tokens here
        assert "vllm:time_to_first_token_seconds" not in types and "vllm:prompt_tokens" not in types
        assert types["vllm:inter_token_latency_seconds"] == "histogram" and types["vllm:generation_tokens"] == "counter"
        assert bucket_bounds(v, "vllm:inter_token_latency_seconds") == [*ITL_BUCKETS, float("inf")]
        assert bucket_bounds(v, "vllm:time_per_output_token_seconds") == [*ITL_BUCKETS, float("inf")]
        assert bucket_bounds(v, "vllm:e2e_request_latency_seconds") == [*REQUEST_LATENCY_BUCKETS, float("inf")]

        with pytest.raises(grpc.RpcError) as ei:
            pod.stub.AllocateKV(decode_pb2.AllocateKVRequest(request_id="a", num_tokens=5))
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
        with pytest.raises(grpc.RpcError) as ei:
            pod.stub.AllocateKV(decode_pb2.AllocateKVRequest(request_id="z", num_tokens=0))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as ei:
            pod.stub.AllocateKV(decode_pb2.AllocateKVRequest(request_id="z", num_tokens=4000))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as ei:
            req = _request("u", prompt, h1, 4)
            req.kv_handle.kv_transfer_address = ""
            list(pod.stub.Decode(req))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert list(resp.transfer_modes) == [common_pb2.TRANSFER_MODE_TCP]

        # Decode the reserved request: the stream starts at the second token, token-identical to transformers.
        chunks = list(pod.stub.Decode(_request("a", prompt, h1, 32, logprobs=True)))
        tokens = [t for c in chunks for t in c.token_ids]
        assert [first] + tokens == want[1]
        assert sum(len(c.logprobs) for c in chunks) == 31
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert chunks[-1].num_output_tokens == 32
        assert all(c.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
        assert len(chunks) > 1  # streamed as produced, not in one piece
        pod.wait_free([NUM_BLOCKS, NUM_BLOCKS])
        assert pod.metrics()['pdserve_decode_generated_tokens_total{pod="decode-0"}'] >= 31
        # vLLM's names: the 31 tokens this pod sampled, one gap each (the first timed from prefill's token landing)
        v, _ = pod.vllm()
        assert v["vllm:generation_tokens_total"] == 31
        assert v["vllm:inter_token_latency_seconds_count"] == 31 == v["vllm:time_per_output_token_seconds_count"]
        assert 0 < v["vllm:inter_token_latency_seconds_sum"] < v["vllm:e2e_request_latency_seconds_sum"]
        assert v["vllm:e2e_request_latency_seconds_count"] == 1
        assert v['vllm:request_success_total{finished_reason="length"}'] == 1
        assert v['vllm:request_success_total{finished_reason="stop"}'] == 0
        assert (v["vllm:num_requests_running"], v["vllm:num_requests_waiting"], v["vllm:kv_cache_usage_perc"]) == (
            0,
            0,
            0,
        )

        # A Decode without reservation, the other prompt: every rank pulls its share from the publisher.
        chunks = list(pod.stub.Decode(_request("t", PROMPTS[0], handed[0], 32)))
        assert [handed[0][1]] + [t for c in chunks for t in c.token_ids] == want[0]
        assert chunks[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        pod.wait_free([NUM_BLOCKS, NUM_BLOCKS])
        assert pod.metrics()['pdserve_decode_kv_received_bytes_total{pod="decode-0"}'] > 0

        # A Decode without reservation, cancelled by CancelDecode midway: blocks freed, stream ends CANCELLED.
        prompt0, h0 = PROMPTS[0], handed[0]
        first0 = h0[1]
        stream = pod.stub.Decode(_request("b", prompt0, h0, 3000))
        got = next(stream)
        assert len(got.token_ids) >= 1
        pod.wait_metric('pdserve_decode_running_seqs{pod="decode-0"}', 1)
        with pytest.raises(grpc.RpcError) as ei:  # the same id cannot decode twice
            list(pod.stub.Decode(_request("b", prompt0, h0, 4)))
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert pod.stub.CancelDecode(decode_pb2.CancelDecodeRequest(request_id="b")).found
        rest = list(stream)
        assert rest[-1].finish_reason == common_pb2.FINISH_REASON_CANCELLED
        streamed = list(got.token_ids) + [t for c in rest for t in c.token_ids]
        assert [first0] + streamed[:31] == want[0][: len(streamed[:31]) + 1]
        pod.wait_free([NUM_BLOCKS, NUM_BLOCKS])
        assert not pod.stub.CancelDecode(decode_pb2.CancelDecodeRequest(request_id="nope")).found
        v, _ = pod.vllm()  # "a", "t" ran to their length; "b" was cancelled: vLLM's abort
        assert v['vllm:request_success_total{finished_reason="length"}'] == 2
        assert v['vllm:request_success_total{finished_reason="abort"}'] == 1
        assert v["vllm:e2e_request_latency_seconds_count"] == 3 and v["vllm:num_requests_running"] == 0
        assert (
            v["vllm:generation_tokens_total"]
            == pod.metrics()['pdserve_decode_generated_tokens_total{pod="decode-0"}']
            == 31 + 31 + len(streamed)
        )

        # A client that closes its stream frees the blocks too.
        stream = pod.stub.Decode(_request("c", prompt0, h0, 3000))
        next(stream)
        stream.cancel()
        pod.wait_free([NUM_BLOCKS, NUM_BLOCKS])

        # A reservation that is cancelled frees its blocks.
        pod.stub.AllocateKV(decode_pb2.AllocateKVRequest(request_id="r", num_tokens=30))
        deadline = time.time() + 20  # the gauges follow the engine loop's next stats refresh
        while pod.free_blocks() == [NUM_BLOCKS, NUM_BLOCKS] and time.time() < deadline:
            time.sleep(0.02)
        assert pod.free_blocks() != [NUM_BLOCKS, NUM_BLOCKS]
        assert pod.stub.CancelDecode(decode_pb2.CancelDecodeRequest(request_id="r")).found
        pod.wait_free([NUM_BLOCKS, NUM_BLOCKS])

        # SIGTERM: the in-flight stream finishes, new work is refused with UNAVAILABLE, then the pod exits.
        stream = pod.stub.Decode(_request("d", prompt, h1, 200))
        first_chunk = next(stream)
        pod.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while (
            pod.health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        ):
            assert time.time() < deadline
            time.sleep(0.02)
        for call in (
            lambda: pod.stub.AllocateKV(decode_pb2.AllocateKVRequest(request_id="e", num_tokens=5)),
            lambda: list(pod.stub.Decode(_request("e", prompt0, h0, 4))),
        ):
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in ei.value.details()  # refused by the draining pod, not a closed port
        pod.wait_metric('pdserve_decode_draining{pod="decode-0"}', 1)
        rest = list(stream)
        tokens = list(first_chunk.token_ids) + [t for c in rest for t in c.token_ids]
        assert len(tokens) == 199 and rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert [first] + tokens[:31] == want[1]
        assert pod.proc.wait(60) == 0
        assert any("decode_svc stopped" in x for x in pod.lines)
        assert any(h.state == common_pb2.POD_STATE_DRAINING for h in reg.of("heartbeat"))
        assert [d.pod_id for d in reg.of("deregister")] == ["decode-0"]
    finally:
        pod.kill()
