"""Router overhead and routed requests/s, on a real loopback cluster (``pdserve bench router``).

Processes: ``python -m router``, one prefill pod and one decode pod (tiny random llama checkpoint, so the pods'
compute is small next to the router's work), and this client. The main requests have max_tokens=1, which the router
serves with one pod call: Prefill (the prefill pod samples the only token and keeps no KV; no decode pod, no
AllocateKV / Decode / CancelDecode). A quarter as many max_tokens=4 requests measure the full journey's overhead
(AllocateKV + Prefill before the first token, then the Decode stream).

- Router overhead per request = the client's time to first token minus the pods' own time on that path, where the
  pods' time is the router's measured duration of the pod calls on the path (Prefill; AllocateKV too for longer
  requests), returned in the call's trailing metadata ``pdserve-pod-time-s``. It therefore includes the client <->
  router gRPC hop (client stack included), admission, placement, tokenizer-free validation, the detokenizer and the
  router's event loop. "router-internal" leaves out
  the client hop: router TTFT (arrival -> first token handed to gRPC) minus the pod calls.
- Routed requests/s: many concurrent clients, max_tokens=1, wall clock.
- gRPC floor: the client's time to the first message of a no-op streaming call (same messages, a grpc.aio server
  process that yields at once), alternating with the router requests so both see the same machine load: the part of
  the overhead no router logic can remove (this client's own cost included), and a gauge of how loaded the (shared)
  machine is. The JSON's "definitions" states each measure.
Target: p99 router overhead <= 2 ms (sequential requests).
"""
from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TARGET_P99_MS = 2.0
DECODE_MAX_TOKENS = 4  # the decode-path rows: max_tokens > 1 books a decode pod
DEFINITIONS = {
    "router overhead": "client time to first token minus the durations of the pod calls on that path as the router "
                       "measured them (Prefill; AllocateKV too when a decode pod is booked), i.e. what putting the "
                       "router in front of the pods adds: the client->router hop (this client's gRPC stack "
                       "included), validation, placement, detokenizing and the router's event loop. The router->pod "
                       "hop stands for the call a client would make to a pod directly, so it is not counted. "
                       "Sequential requests, max_tokens=1. Target: p99 <= 2 ms.",
    "router-internal overhead": "router TTFT (arrival in the servicer -> first message handed to gRPC) minus the "
                                "pod calls and the queue wait: the router's own code only.",
    "gRPC floor": "client time to the first message of a no-op Generate served by a bare grpc.aio process, "
                  "alternating with the router requests: this client's and gRPC's own cost, no router logic.",
    "pod self-reported time": "the prefill pod's PrefillResponse queue_s + compute_s (engine queue + compute); "
                              "client TTFT minus it also counts the router->pod hop and both pods' gRPC stacks.",
}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    i = min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))
    return s[i]


def _row(name: str, xs_s: list[float], **extra: Any) -> dict[str, Any]:
    ms = [x * 1000 for x in xs_s]
    return {"measure": name, "n": len(ms), "p50_ms": _pct(ms, 50), "p99_ms": _pct(ms, 99),
            "mean_ms": statistics.fmean(ms) if ms else float("nan"), **extra}


async def _one(stub, req) -> dict[str, float]:
    import grpc

    t0 = time.perf_counter()
    call = stub.Generate(req)
    first = await call.read()
    t_first = time.perf_counter()
    if first is grpc.aio.EOF:
        raise RuntimeError(f"no token: {await call.code()} {await call.details()}")
    while (await call.read()) is not grpc.aio.EOF:
        pass
    if await call.code() != grpc.StatusCode.OK:
        raise RuntimeError(f"request failed: {await call.code()} {await call.details()}")
    md = dict(await call.trailing_metadata())
    pod = float(md["pdserve-pod-time-s"])
    return {"client_ttft": t_first - t0, "router_ttft": float(md["pdserve-router-ttft-s"]), "pod": pod,
            "pod_self": float(md.get("pdserve-pod-self-s", "nan")), "queue": float(md["pdserve-queue-s"]),
            "e2e": time.perf_counter() - t0}


def _start_echo() -> tuple[Any, int]:
    """The gRPC floor's server: a separate grpc.aio process whose Generate yields one message at once."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "from bench.router import _echo_server; _echo_server()"],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
    return proc, int(proc.stdout.readline())


async def _echo_once(stub, req) -> float:
    """Client time to the first message of one no-op Generate."""
    import grpc

    t0 = time.perf_counter()
    call = stub.Generate(req)
    await call.read()
    t1 = time.perf_counter()
    while (await call.read()) is not grpc.aio.EOF:
        pass
    return t1 - t0


def _echo_server() -> None:
    import grpc

    from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

    class Echo(router_pb2_grpc.RouterServicer):
        async def Generate(self, request, context):
            yield router_pb2.GenerateResponse(request_id="echo", token_ids=[1], text="x",
                                              finish_reason=common_pb2.FINISH_REASON_LENGTH)

    async def main() -> None:
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(Echo(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await server.wait_for_termination()

    _run_loop(main())


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and its threads (Linux /proc)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(address: str, n_seq: int, n_load: int, concurrency: int, vocab: int,
                   pids: dict[str, int]) -> dict[str, Any]:
    import grpc

    from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

    rng = random.Random(0)

    def req(max_tokens: int = 1) -> Any:
        ids = [rng.randrange(3, vocab) for _ in range(16)]
        sp = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), sampling_params=sp)

    echo_proc, echo_port = _start_echo()
    try:
        async with grpc.aio.insecure_channel(address) as ch, \
                grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}") as echo_ch:
            stub, echo = router_pb2_grpc.RouterStub(ch), router_pb2_grpc.RouterStub(echo_ch)
            for _ in range(30):  # warm-up: channels, code paths, the pods' first forward passes
                await _one(stub, req())
                await _echo_once(echo, req())
            # Router request and no-op call alternate, so both see the same (shared, noisy) machine.
            seq, floor, dec = [], [], []
            for _ in range(n_seq):
                seq.append(await _one(stub, req()))
                floor.append(await _echo_once(echo, req()))
            # The full journey (decode pod booked: AllocateKV + Prefill before the first token, then Decode).
            for _ in range(10):  # warm-up of the decode pod
                await _one(stub, req(DECODE_MAX_TOKENS))
            for _ in range(max(1, n_seq // 4)):
                dec.append(await _one(stub, req(DECODE_MAX_TOKENS)))
    finally:
        echo_proc.kill()
        echo_proc.wait()

    async with grpc.aio.insecure_channel(address) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        load: list[dict[str, float]] = []
        remaining = n_load

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                load.append(await _one(stub, req()))

        cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
        client0 = time.process_time()  # this client's own CPU (it shares the machine with the processes measured)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = {name: (_cpu_s(pid) - cpu0[name]) / len(load) for name, pid in pids.items()}
        cpu["bench client"] = (time.process_time() - client0) / len(load)
    return {"sequential": seq, "load": load, "load_wall_s": wall, "floor": floor, "cpu_s_per_request": cpu,
            "decode_path": dec}


def _start_cluster(work: Path) -> tuple[Any, Any, Any, float]:
    """Router + one prefill + one decode pod (TP 1) on a tiny checkpoint, through LocalCluster (``pdserve up``'s)."""
    import os

    from pdserve.cluster.supervisor import LocalCluster
    from pdserve.cluster.topology import PodSpec, Topology
    from pdserve.default_model import ensure_default_model
    from pdserve.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(work / "tiny", "llama", num_kv_heads=1, tokenizer_from=ensure_default_model())
    interval = 0.5
    topo = Topology(model=str(model), router_port=0, http_port=None,
                    prefill=[PodSpec("prefill", num_kv_blocks=1024,
                                     extra_args=["--heartbeat-interval", str(interval)])],
                    decode=[PodSpec("decode", num_kv_blocks=1024)],
                    router_args=["--heartbeat-interval-s", str(interval), "--eviction-timeout-s", "10",
                                 "--missed-heartbeats-unhealthy", "8", "--log-level", "WARNING"]).resolve()
    repo = str(Path(__file__).resolve().parents[1])
    # One thread per process: the router's cost is what is measured, next to pods on a few shared cores.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cluster = LocalCluster(topo, log_dir=work / "cluster", env=env, echo=lambda line: None)
    t0 = time.perf_counter()
    endpoints = cluster.start(timeout=240.0)
    return cluster, topo, endpoints, time.perf_counter() - t0


def run(quick: bool = False) -> dict[str, Any]:
    n_seq, n_load, concurrency = (200, 300, 16) if quick else (2000, 3000, 32)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    cluster, topo, endpoints, t_up = _start_cluster(work)
    try:
        pids = {s.name: s.pid for s in cluster.services if s.pid is not None}
        res = _run_loop(_measure(endpoints.router, n_seq, n_load, concurrency, 256, pids))
    finally:
        cluster.stop(grace=3.0)  # a benchmark needs no graceful drain

    seq, load = res["sequential"], res["load"]
    overhead = [r["client_ttft"] - r["pod"] for r in seq]
    internal = [r["router_ttft"] - r["pod"] - r["queue"] for r in seq]
    with_pod_hop = [r["client_ttft"] - r["pod_self"] for r in seq]
    over_floor = [o - f for o, f in zip(overhead, res["floor"])]  # each request against the no-op call next to it
    load_overhead = [r["client_ttft"] - r["pod"] - r["queue"] for r in load]
    rps = len(load) / res["load_wall_s"]
    cpu = res["cpu_s_per_request"]
    router_cpu_ms = cpu["router"] * 1000
    table = [
        _row("router overhead (client TTFT - pod calls), sequential", overhead, target_p99_ms=TARGET_P99_MS),
        _row("router-internal overhead (router TTFT - pod calls), sequential", internal),
        _row("gRPC floor: no-op streaming call, client time to first message (interleaved)", res["floor"]),
        _row("router overhead minus the gRPC floor call next to it, sequential", over_floor),
        _row("client TTFT - prefill pod's self-reported time (includes router->pod hop), sequential",
             with_pod_hop),
        _row("client TTFT, sequential", [r["client_ttft"] for r in seq]),
        _row("pod calls on the path (Prefill), sequential", [r["pod"] for r in seq]),
        _row(f"router overhead, max_tokens={DECODE_MAX_TOKENS} (AllocateKV + Prefill path), sequential",
             [r["client_ttft"] - r["pod"] for r in res["decode_path"]]),
        _row(f"pod calls on the path (AllocateKV + Prefill), max_tokens={DECODE_MAX_TOKENS}, sequential",
             [r["pod"] for r in res["decode_path"]]),
        _row(f"router overhead under load (concurrency {concurrency})", load_overhead),
        _row(f"client TTFT under load (concurrency {concurrency})", [r["client_ttft"] for r in load],
             requests_per_s=rps),
        {"measure": "router CPU per routed request under load (ms); ceiling = 1 core / it",
         "n": len(load), "mean_ms": router_cpu_ms, "requests_per_s": 1000 / router_cpu_ms if router_cpu_ms else None},
        {"measure": "bench client CPU per request under load (ms)", "n": len(load),
         "mean_ms": cpu["bench client"] * 1000},
    ]
    p99 = _pct(overhead, 99) * 1000
    ratios = {
        "overhead_p99_over_target": p99 / TARGET_P99_MS,  # <= 1.0 meets the target
        "internal_overhead_p99_over_target": _pct(internal, 99) * 1000 / TARGET_P99_MS,
        "decode_path_overhead_p99_over_target":
            _pct([r["client_ttft"] - r["pod"] for r in res["decode_path"]], 99) * 1000 / TARGET_P99_MS,
        "overhead_p50_over_grpc_floor_p50": statistics.median(overhead) / statistics.median(res["floor"]),
        "overhead_incl_pod_hop_p99_over_target": _pct(with_pod_hop, 99) * 1000 / TARGET_P99_MS,
        "overhead_p50_share_of_ttft": statistics.median(overhead) / statistics.median(r["client_ttft"] for r in seq),
        "routed_requests_per_s_max_tokens_1": rps,
        "router_cpu_ms_per_request": router_cpu_ms,
        "router_cpu_share_of_all_cpu_per_request": cpu["router"] / sum(v for k, v in cpu.items() if k in pids),
        "bench_client_cpu_ms_per_request": cpu["bench client"] * 1000,
    }
    return {
        "benchmark": "router",
        "quick": quick,
        "table": table,
        "ratios": ratios,
        "definitions": DEFINITIONS,
        "target": {"overhead_p99_ms": TARGET_P99_MS, "met": p99 <= TARGET_P99_MS,
                   "internal_met": _pct(internal, 99) * 1000 <= TARGET_P99_MS},
        "setup": {"prefill_pods": 1, "decode_pods": 1, "model": "tiny random llama (2 layers, 8 heads, 1 KV head)",
                  "max_tokens": 1, "decode_path_max_tokens": DECODE_MAX_TOKENS, "prompt_tokens": 16,
                  "sequential_requests": n_seq, "load_requests": n_load, "concurrency": concurrency,
                  "cluster_start_s": t_up, "notes": topo.notes},
        "raw": {"sequential": seq, "decode_path": res["decode_path"], "load": load, "load_wall_s": res["load_wall_s"],
                "grpc_floor_s": res["floor"], "cpu_s_per_request_by_process": cpu},
    }
