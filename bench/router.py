"""Router overhead and routed requests/s, on a real loopback cluster (``pdserve bench router``).

Processes: two ``python -m router`` replicas (every pod registers with both), one prefill pod and one decode pod (tiny
random llama checkpoint, so the pods' compute is small next to the router's work), and this client. The main requests
have max_tokens=1, which the router serves with one pod call: Prefill (the prefill pod samples the only token and keeps
no KV; no decode pod, no AllocateKV / Decode / CancelDecode). A quarter as many max_tokens=4 requests measure the full
journey's overhead (AllocateKV + Prefill before the first token, then the Decode stream).

- Router overhead per request = the client's time to first token minus the pods' own time on that path, where the
  pods' time is the router's measured duration of the pod calls on the path (Prefill; AllocateKV too for longer
  requests), returned in the call's trailing metadata ``pdserve-pod-time-s``. It therefore includes the client <->
  router gRPC hop (client stack included), admission, placement, tokenizer-free validation, the detokenizer and the
  router's event loop. "router-internal" leaves out
  the client hop: router TTFT (arrival -> first token handed to gRPC) minus the pod calls.
- Routed requests/s: many concurrent clients, max_tokens=1, wall clock; through one router, then spread over both
  (``ratios.routed_req_s_2_routers_vs_1``). Each row reports the CPU per request of the routers and of every process,
  and what the machine's cores allow at that cost, since on a few shared cores the pods and the client bound the ratio
  before the routers do.
- gRPC floor: the client's time to the first message of a no-op streaming call (same messages, a grpc.aio server
  process that yields at once), alternating with the router requests so both see the same machine load: the part of
  the overhead no router logic can remove (this client's own cost included), and a gauge of how loaded the (shared)
  machine is. The JSON's "definitions" states each measure.
- CPU priority: the cluster is started as ``pdserve up`` starts it, the routers at nice -10 for their sessions where
  this process may raise a priority (pdserve/cluster/topology.py); ``setup.cpu_priority`` records what the kernel
  reports for each service.
Target: p99 router overhead <= 2 ms (sequential requests).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

TARGET_P99_MS = 2.0
TARGET_INTERNAL_P99_MS = 1.0  # the router's own code, under load, in every row
TARGET_ROUTER_SCALING = 1.6  # routed requests/s, 2 routers over 1
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
    return {
        "measure": name,
        "n": len(ms),
        "p50_ms": _pct(ms, 50),
        "p99_ms": _pct(ms, 99),
        "mean_ms": statistics.fmean(ms) if ms else float("nan"),
        **extra,
    }


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
    return {
        "client_ttft": t_first - t0,
        "router_ttft": float(md["pdserve-router-ttft-s"]),
        "pod": pod,
        "pod_self": float(md.get("pdserve-pod-self-s", "nan")),
        "queue": float(md["pdserve-queue-s"]),
        "e2e": time.perf_counter() - t0,
    }


def _start_echo() -> tuple[Any, int]:
    """The gRPC floor's server: a separate grpc.aio process whose Generate yields one message at once."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", "from bench.router import _echo_server; _echo_server()"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
    )
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
            yield router_pb2.GenerateResponse(
                request_id="echo", token_ids=[1], text="x", finish_reason=common_pb2.FINISH_REASON_LENGTH
            )

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


def _priority(pid: int) -> dict[str, Any]:
    """A service's CPU priority as the kernel reports it: its nice and its session's autogroup line (Linux)."""
    import os

    group = Path(f"/proc/{pid}/autogroup")
    return {
        "nice": os.getpriority(os.PRIO_PROCESS, pid),
        "autogroup": group.read_text().strip() if group.exists() else None,
    }


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and its threads (Linux /proc)."""
    import os

    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _measure(
    addresses: list[str], n_seq: int, n_load: int, concurrency: int, vocab: int, pids: dict[str, int]
) -> dict[str, Any]:
    import grpc

    from pdserve_api.v1 import common_pb2, router_pb2, router_pb2_grpc

    rng = random.Random(0)

    def req(max_tokens: int = 1) -> Any:
        ids = [rng.randrange(3, vocab) for _ in range(16)]
        sp = common_pb2.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=ids), sampling_params=sp)

    echo_proc, echo_port = _start_echo()
    try:
        async with (
            grpc.aio.insecure_channel(addresses[0]) as ch,
            grpc.aio.insecure_channel(f"127.0.0.1:{echo_port}") as echo_ch,
        ):
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

    # Routed requests/s through one router, then through both (the client spread evenly over them); the rounds
    # alternate (1, 2, 2, 1) so that drift of the shared machine falls on both rows alike.
    rounds: dict[int, list[dict[str, Any]]] = {1: [], len(addresses): []}
    for n_routers in (1, len(addresses), len(addresses), 1):
        rounds[n_routers].append(await _load(addresses[:n_routers], n_load // 2, concurrency, req, pids))
    return {
        "sequential": seq,
        "floor": floor,
        "decode_path": dec,
        "load_rounds": {n: _merge_rounds(rs) for n, rs in rounds.items()},
    }


async def _load(
    addresses: list[str], n: int, concurrency: int, req: Callable[[], Any], pids: dict[str, int]
) -> dict[str, Any]:
    """``n`` max_tokens=1 requests from ``concurrency`` workers, worker i on router i % len(addresses)."""
    import grpc

    from pdserve_api.v1 import router_pb2_grpc

    channels = [grpc.aio.insecure_channel(a) for a in addresses]
    try:
        stubs = [router_pb2_grpc.RouterStub(ch) for ch in channels]
        for stub in stubs:  # connect every channel before the clock starts
            await _one(stub, req())
        load: list[dict[str, float]] = []
        remaining = n

        async def worker(stub: Any) -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                load.append(await _one(stub, req()))

        cpu0 = {name: _cpu_s(pid) for name, pid in pids.items()}
        client0 = time.process_time()  # this client's own CPU (it shares the machine with the processes measured)
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(stubs[i % len(stubs)]) for i in range(concurrency)))
        wall = time.perf_counter() - t0
        cpu = {name: _cpu_s(pid) - cpu0[name] for name, pid in pids.items()}
        cpu["bench client"] = time.process_time() - client0
    finally:
        for ch in channels:
            await ch.close()
    return {"load": load, "wall_s": wall, "cpu_s": cpu}


def _merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The rounds of one row as one: requests pooled, wall and CPU summed; CPU per request by process."""
    load = [r for rd in rounds for r in rd["load"]]
    cpu = {k: sum(rd["cpu_s"][k] for rd in rounds) / len(load) for k in rounds[0]["cpu_s"]}
    return {"load": load, "wall_s": sum(rd["wall_s"] for rd in rounds), "cpu_s_per_request": cpu}


def _start_cluster(work: Path, num_routers: int) -> tuple[Any, Any, Any, float]:
    """``num_routers`` routers + one prefill + one decode pod (TP 1) on a tiny checkpoint, through LocalCluster
    (``pdserve up``'s); every pod registers with every router."""
    import os

    from pdserve.cluster.supervisor import LocalCluster
    from pdserve.cluster.topology import PodSpec, Topology
    from pdserve.default_model import ensure_default_model
    from pdserve.testing import write_tiny_checkpoint

    model = write_tiny_checkpoint(work / "tiny", "llama", num_kv_heads=1, tokenizer_from=ensure_default_model())
    interval = 0.5
    topo = Topology(
        model=str(model),
        router_port=0,
        http_port=None,
        num_routers=num_routers,
        prefill=[PodSpec("prefill", num_kv_blocks=1024, extra_args=["--heartbeat-interval-s", str(interval)])],
        decode=[PodSpec("decode", num_kv_blocks=1024)],
        router_args=[
            "--heartbeat-interval-s",
            str(interval),
            "--eviction-timeout-s",
            "10",
            "--missed-heartbeats-unhealthy",
            "8",
            "--log-level",
            "WARNING",
        ],
    ).resolve()
    repo = str(Path(__file__).resolve().parents[1])
    # One thread per process: the router's cost is what is measured, next to pods on a few shared cores.
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    cluster = LocalCluster(topo, log_dir=work / "cluster", env=env, echo=lambda line: None)
    t0 = time.perf_counter()
    endpoints = cluster.start(timeout=240.0)
    return cluster, topo, endpoints, time.perf_counter() - t0


def _load_rows(n_routers: int, res: dict[str, Any], router_names: list[str], cores: int) -> tuple[list, dict]:
    """Table rows and figures of one load row (``n_routers`` routers in use)."""
    load, cpu = res["load"], res["cpu_s_per_request"]
    rps = len(load) / res["wall_s"]
    internal = [r["router_ttft"] - r["pod"] - r["queue"] for r in load]
    router_cpu_ms = sum(cpu[n] for n in router_names) * 1000  # every router's CPU, idle ones included
    all_cpu_ms = sum(v for k, v in cpu.items()) * 1000
    label = f"{n_routers} router{'s' if n_routers > 1 else ''}"
    rows = [
        _row(
            f"{label}: router-internal overhead under load (router TTFT - pod calls - queue)",
            internal,
            requests_per_s=rps,
            target_p99_ms=TARGET_INTERNAL_P99_MS,
        ),
        _row(f"{label}: client TTFT under load", [r["client_ttft"] for r in load], requests_per_s=rps),
        {
            "measure": f"{label}: CPU per routed request (ms): routers / all processes incl. client",
            "n": len(load),
            "router_cpu_ms": router_cpu_ms,
            "all_cpu_ms": all_cpu_ms,
            "machine_ceiling_requests_per_s": cores * 1000 / all_cpu_ms if all_cpu_ms else None,
            "by_process_ms": {k: v * 1000 for k, v in cpu.items()},
        },
    ]
    return rows, {
        "rps": rps,
        "internal_p99_ms": _pct(internal, 99) * 1000,
        "router_cpu_ms": router_cpu_ms,
        "all_cpu_ms": all_cpu_ms,
        "client_cpu_ms": cpu["bench client"] * 1000,
    }


def run(quick: bool = False) -> dict[str, Any]:
    import os

    n_seq, n_load, concurrency = (200, 300, 16) if quick else (2000, 3000, 32)
    num_routers = 2
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    cluster, topo, endpoints, t_up = _start_cluster(work, num_routers)
    try:
        pids = {s.name: s.pid for s in cluster.services if s.pid is not None}
        priority = {name: _priority(pid) for name, pid in pids.items()}
        router_names = [s.name for s in cluster.services if s.kind == "router"]
        res = _run_loop(_measure(endpoints.routers, n_seq, n_load, concurrency, 256, pids))
    finally:
        cluster.stop(grace=3.0)  # a benchmark needs no graceful drain

    cores = len(os.sched_getaffinity(0))
    seq = res["sequential"]
    overhead = [r["client_ttft"] - r["pod"] for r in seq]
    internal = [r["router_ttft"] - r["pod"] - r["queue"] for r in seq]
    with_pod_hop = [r["client_ttft"] - r["pod_self"] for r in seq]
    over_floor = [o - f for o, f in zip(overhead, res["floor"])]  # each request against the no-op call next to it
    one_rows, one = _load_rows(1, res["load_rounds"][1], router_names, cores)
    many_rows, many = _load_rows(num_routers, res["load_rounds"][num_routers], router_names, cores)
    table = [
        _row("router overhead (client TTFT - pod calls), sequential", overhead, target_p99_ms=TARGET_P99_MS),
        _row("router-internal overhead (router TTFT - pod calls), sequential", internal),
        _row("gRPC floor: no-op streaming call, client time to first message (interleaved)", res["floor"]),
        _row("router overhead minus the gRPC floor call next to it, sequential", over_floor),
        _row("client TTFT - prefill pod's self-reported time (includes router->pod hop), sequential", with_pod_hop),
        _row("client TTFT, sequential", [r["client_ttft"] for r in seq]),
        _row("pod calls on the path (Prefill), sequential", [r["pod"] for r in seq]),
        _row(
            f"router overhead, max_tokens={DECODE_MAX_TOKENS} (AllocateKV + Prefill path), sequential",
            [r["client_ttft"] - r["pod"] for r in res["decode_path"]],
        ),
        _row(
            f"pod calls on the path (AllocateKV + Prefill), max_tokens={DECODE_MAX_TOKENS}, sequential",
            [r["pod"] for r in res["decode_path"]],
        ),
        *one_rows,
        *many_rows,
    ]
    p99 = _pct(overhead, 99) * 1000
    ratios = {
        "overhead_p99_over_target": p99 / TARGET_P99_MS,  # <= 1.0 meets the target
        "internal_overhead_p99_over_target": _pct(internal, 99) * 1000 / TARGET_P99_MS,
        "decode_path_overhead_p99_over_target": _pct([r["client_ttft"] - r["pod"] for r in res["decode_path"]], 99)
        * 1000
        / TARGET_P99_MS,
        "overhead_p50_over_grpc_floor_p50": statistics.median(overhead) / statistics.median(res["floor"]),
        "overhead_incl_pod_hop_p99_over_target": _pct(with_pod_hop, 99) * 1000 / TARGET_P99_MS,
        "overhead_p50_share_of_ttft": statistics.median(overhead) / statistics.median(r["client_ttft"] for r in seq),
        "routed_requests_per_s_max_tokens_1": one["rps"],
        f"routed_req_s_{num_routers}_routers_vs_1": many["rps"] / one["rps"],
        "router_cpu_ms_per_request": one["router_cpu_ms"],
        f"router_cpu_ms_per_request_{num_routers}_routers": many["router_cpu_ms"],
        "router_cpu_share_of_all_cpu_per_request": one["router_cpu_ms"] / (one["all_cpu_ms"] - one["client_cpu_ms"]),
        "bench_client_cpu_ms_per_request": one["client_cpu_ms"],
        "router_internal_p99_ms_under_load_1_router": one["internal_p99_ms"],
        f"router_internal_p99_ms_under_load_{num_routers}_routers": many["internal_p99_ms"],
        # what the cores allow at the CPU every request costs all processes: the bound on the routers' ratio
        f"machine_ceiling_req_s_{num_routers}_routers_vs_1_router_rps": (cores * 1000 / many["all_cpu_ms"]) / one["rps"]
        if many["all_cpu_ms"]
        else None,
    }
    return {
        "benchmark": "router",
        "quick": quick,
        "table": table,
        "ratios": ratios,
        "definitions": DEFINITIONS,
        "target": {
            "overhead_p99_ms": TARGET_P99_MS,
            "met": p99 <= TARGET_P99_MS,
            "internal_met": _pct(internal, 99) * 1000 <= TARGET_P99_MS,
            "internal_p99_under_load_ms": TARGET_INTERNAL_P99_MS,
            "internal_under_load_met": max(one["internal_p99_ms"], many["internal_p99_ms"]) <= TARGET_INTERNAL_P99_MS,
            f"routed_req_s_{num_routers}_routers_vs_1": TARGET_ROUTER_SCALING,
        },
        "setup": {
            "routers": num_routers,
            "prefill_pods": 1,
            "decode_pods": 1,
            "cores": cores,
            "model": "tiny random llama (2 layers, 8 heads, 1 KV head)",
            "max_tokens": 1,
            "decode_path_max_tokens": DECODE_MAX_TOKENS,
            "prompt_tokens": 16,
            "sequential_requests": n_seq,
            "load_requests_per_row": n_load,
            "concurrency": concurrency,
            "load_rounds": "1 router, 2 routers, 2 routers, 1 router; half the load requests each",
            "cluster_start_s": t_up,
            "cpu_priority": priority,
            "notes": topo.notes,
        },
        "raw": {
            "sequential": seq,
            "decode_path": res["decode_path"],
            "grpc_floor_s": res["floor"],
            "load_by_routers": {str(n): r for n, r in res["load_rounds"].items()},
        },
    }
