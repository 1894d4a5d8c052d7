"""What every benchmark shares: timing, the table printer and the JSON writer used by `pdserve bench`; the cluster
side the serve and interference benchmarks start (a unified pod on two cores, or a prefill pod and a decode pod on one
core each); and the load that the soak and the chaos soak both drive (its config, the request plan, one streamed
request, cluster snapshots, the offline reference), so neither of those imports the other."""

from __future__ import annotations

import asyncio
import json
import math
import os
import platform
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch


class BenchUnavailable(RuntimeError):
    """A benchmark cannot run on this machine; the message says why and what to do (`pdserve bench` exits 2)."""


def timed(fn: Callable[[], Any], repeat: int = 1) -> float:
    """Best wall time of `repeat` runs (best-of filters the noise of a shared machine)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def cpu_info() -> dict[str, Any]:
    """What to tune for (machines change between runs): model, cores, SIMD flags and torch's CPU capability."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    except OSError:
        pass
    wanted = sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4")))
    return {
        "model": model,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "flags": wanted,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": cpu_info(),
    }


def format_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "(no rows)"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths))
    sep = "-+-".join("-" * w for w in widths)
    body = "\n".join(" | ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells)
    return f"{line}\n{sep}\n{body}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def write_result(result: dict[str, Any], out: str | Path | None) -> None:
    if "ratios" not in result:
        raise ValueError("a benchmark result must carry a top-level 'ratios' object")
    result.setdefault("machine", machine())
    if out:
        Path(out).write_text(json.dumps(result, indent=2, default=str))


# ----------------------------------------------------------------------------------------------------------------
# A cluster side of bench serve and bench interference
# ----------------------------------------------------------------------------------------------------------------


def start_side(
    kind: str,
    model: str,
    cores: list[int],
    log_dir: Path,
    *,
    num_kv_blocks: int,
    max_num_seqs: int,
    max_model_len: int,
    dtype: str = "float32",
    decode_args: list[str] | None = None,
    router_args: list[str] | None = None,
) -> tuple[Any, str, str]:
    """Start one side on loopback with an OpenAI front: ``kind`` "unified" is one unified pod on ``cores[:2]``; any
    other kind a prefill pod on ``cores[0]`` and a decode pod (TP 1, with ``decode_args``) on ``cores[1]``. Returns
    (the started LocalCluster, the front's base URL, the served model name)."""
    from pdserve.cluster.supervisor import LocalCluster
    from pdserve.cluster.topology import PodSpec, Topology

    common: dict[str, Any] = {"num_kv_blocks": num_kv_blocks, "max_num_seqs": max_num_seqs}
    if kind == "unified":
        pods: dict[str, Any] = {
            "prefill": [],
            "decode": [],
            "unified": [PodSpec("unified", cpus=tuple(cores[:2]), **common)],
        }
    else:
        pods = {
            "prefill": [PodSpec("prefill", cpus=(cores[0],), **common)],
            "decode": [PodSpec("decode", 1, 1, cpus=(cores[1],), extra_args=list(decode_args or []), **common)],
        }
    topo = Topology(
        model=model,
        router_port=0,
        http_port=0,
        dtype=dtype,
        max_model_len=max_model_len,
        router_args=list(router_args or []),
        **pods,
    )
    topo.resolve()
    # the pods pick their own thread counts from their pinned cores
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    cluster = LocalCluster(topo, log_dir=log_dir, env=env, echo=lambda line: None)
    eps = cluster.start(timeout=600)
    assert eps.http is not None  # http_port=0 asks for the front
    return cluster, eps.http, eps.model


def local_prefill_thresholds(cluster: Any) -> dict[str, int]:
    """Each decode pod's local-prefill threshold as the cluster's router reports it (ClusterStatus): what
    ``--local-prefill-max-tokens`` (or auto, from the pod's step times) set."""
    from pdserve.client import Client

    with Client(cluster.endpoints.router) as client:
        st = client.cluster_status()
    return {p.pod_id: p.local_prefill_max_tokens for p in st.pods if p.local_prefill_max_tokens}


# ----------------------------------------------------------------------------------------------------------------
# The load the soak and chaos benchmarks both drive (bench/soak.py, bench/chaos.py)
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakConfig:
    num_requests: int = 1000  # the test's size (a few minutes on 2 shared cores); `pdserve bench soak` runs 2000
    concurrency: int = 24  # requests in flight at once (clients)
    distinct_prompts: int = 200  # 0: num_requests // 2; the rest repeat a prompt (prefix cache under load)
    prompt_len_short: tuple[int, int] = (3, 24)
    prompt_len_long: tuple[int, int] = (40, 160)
    long_fraction: float = 0.3
    max_tokens: tuple[int, int] = (8, 48)
    cancel_fraction: float = 0.15
    block_size: int = 16
    decode_num_kv_blocks: int = 20  # per rank: below what `concurrency` requests need together
    decode_tp: int = 2
    decode_dcp: int = 2  # each rank holds half of every request's tokens
    router_max_queue_len: int = 16
    router_max_queue_wait_s: float = 60.0
    request_timeout_s: float = 240.0  # a stream still open after this has hung
    baseline_timeout_s: float = 30.0  # how long free KV may take to come back (heartbeats)
    rss_interval_s: float = 0.5
    rss_growth_ratio: float = 0.10
    rss_slack_mib: float = 16.0
    warmup_requests: int = 6
    refused_backoff_s: float = 1.0  # a client refused with RESOURCE_EXHAUSTED waits this long before its next request
    alone_sample: int = 12  # distinct requests also sent alone to the quiet cluster (must match the offline engine)
    model: str | None = None  # checkpoint dir; None: a tiny random llama (1 KV head), "smollm2": the default model
    seed: int = 0
    # False: the SDK names each request, a fresh id per retry (a retry that fails over to another router must not
    # meet the first attempt's decode reservation under the same id)
    client_request_ids: bool = True

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ValueError(f"SoakConfig: {msg}")

        for name in ("num_requests", "concurrency", "block_size", "decode_num_kv_blocks", "decode_tp", "decode_dcp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("prompt_len_short", "prompt_len_long", "max_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                bad(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)!r}")
        for name in ("long_fraction", "cancel_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                bad(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if self.refused_backoff_s < 0:
            bad("refused_backoff_s must be >= 0 seconds")
        for name in ("request_timeout_s", "baseline_timeout_s", "rss_interval_s", "router_max_queue_wait_s"):
            if not getattr(self, name) > 0:
                bad(f"{name} must be > 0 seconds")
        if self.distinct_prompts < 0 or self.router_max_queue_len < 0 or self.warmup_requests < 0:
            bad("distinct_prompts, router_max_queue_len and warmup_requests must be >= 0")
        if self.decode_dcp > self.decode_tp:
            bad(f"decode_dcp ({self.decode_dcp}) cannot exceed decode_tp ({self.decode_tp})")
        need = math.ceil((self.prompt_len_long[1] + self.max_tokens[1]) / self.decode_dcp / self.block_size) + 1
        if self.decode_num_kv_blocks < need:
            bad(
                f"decode_num_kv_blocks {self.decode_num_kv_blocks} cannot hold the longest request alone "
                f"({need} blocks per rank): raise it or shorten prompt_len_long / max_tokens"
            )


@dataclass
class Planned:
    index: int
    prompt: list[int]
    max_tokens: int
    cancel: str = ""  # "", "close" (stream.cancel()) or "rpc" (Cancel RPC)
    cancel_after: int = 0  # tokens received before cancelling

    @property
    def key(self) -> tuple[tuple[int, ...], int]:
        return tuple(self.prompt), self.max_tokens


@dataclass
class Outcome:
    index: int
    status: str  # "completed", "cancelled", a gRPC status name, "error" (finish error), "hung"
    message: str = ""
    tokens: list[int] = field(default_factory=list)
    usage_tokens: int | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    token_times: list[float] = field(default_factory=list)  # arrival (monotonic) of each streamed token
    queue_s: float = 0.0
    t_start: float = 0.0
    t_end: float = 0.0


def plan_requests(cfg: SoakConfig, vocab: int) -> list[Planned]:
    rng = random.Random(cfg.seed)
    n_prompts = cfg.distinct_prompts or max(1, cfg.num_requests // 2)
    prompts = []
    for _ in range(n_prompts):
        lo, hi = cfg.prompt_len_long if rng.random() < cfg.long_fraction else cfg.prompt_len_short
        prompts.append(([rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))], rng.randint(*cfg.max_tokens)))
    out = []
    for i in range(cfg.num_requests):
        prompt, mt = prompts[i % n_prompts] if i < n_prompts else prompts[rng.randrange(n_prompts)]
        p = Planned(i, prompt, mt)
        if rng.random() < cfg.cancel_fraction and mt > 2:
            p.cancel = "close" if rng.random() < 0.5 else "rpc"
            p.cancel_after = rng.randint(1, mt - 1)
        out.append(p)
    rng.shuffle(out)
    return out


async def stream_request(client: Any, p: Planned, cfg: SoakConfig, live: list[Outcome] | None = None) -> Outcome:
    """One request to its end. ``live``: the outcome is appended there at once (its tokens fill in as they come)."""
    from pdserve.client import PdserveError

    o = Outcome(p.index, "completed", t_start=time.monotonic())
    if live is not None:
        live.append(o)
    stream = client.generate_stream(
        p.prompt,
        max_tokens=p.max_tokens,
        temperature=0.0,
        ignore_eos=True,
        request_id=f"soak-{cfg.seed}-{p.index}" if cfg.client_request_ids else None,
        timeout=cfg.request_timeout_s,
    )
    last_t: float | None = None
    rpc_sent = False

    async def consume() -> None:
        nonlocal last_t, rpc_sent
        async for chunk in stream:
            now = time.monotonic()
            if chunk.token_ids:
                if last_t is None:
                    o.ttft_s = now - o.t_start
                else:
                    o.itl_s.extend([(now - last_t) / len(chunk.token_ids)] * len(chunk.token_ids))
                last_t = now
                o.tokens.extend(chunk.token_ids)
                o.token_times.extend([now] * len(chunk.token_ids))
            if chunk.finished:
                o.finish_reason = chunk.finish_reason
                o.usage_tokens = chunk.usage.completion_tokens if chunk.usage else None
                o.queue_s = chunk.timing.queue_s if chunk.timing else 0.0
                o.message = chunk.error_message
            if p.cancel and not rpc_sent and len(o.tokens) >= p.cancel_after and not chunk.finished:
                if p.cancel == "close":
                    stream.cancel()
                    o.status = "CANCELLED"
                    o.message = "cancelled by the client (stream closed)"
                    return
                await client.cancel(stream.request_id, timeout=30)  # the stream then ends "cancelled"
                rpc_sent = True

    try:
        # the SDK's own deadline ends a stuck call; this outer one catches a stuck SDK
        await asyncio.wait_for(consume(), cfg.request_timeout_s + 30)
    except asyncio.TimeoutError:
        stream.cancel()
        o.status, o.message = "hung", f"no end of stream within {cfg.request_timeout_s + 30:.0f}s"
    except PdserveError as e:
        o.status, o.message = e.status_name, e.message
        if e.status_name == "DEADLINE_EXCEEDED":
            o.status = "hung"
    o.t_end = time.monotonic()
    if o.status == "completed" and o.finish_reason != "length":
        o.status = o.finish_reason or "no-final-message"
    return o


async def cluster_snapshot(client: Any) -> dict[str, Any]:
    """Free KV per rank of every pod, the router's queue depth and in-flight counts (ClusterStatus)."""
    st = await client.cluster_status(timeout=10)
    return {
        "kv_free": {p.pod_id: [r.free_blocks for r in p.kv] for p in st.pods},
        "kv_total": {p.pod_id: [r.total_blocks for r in p.kv] for p in st.pods},
        "pod_inflight": {p.pod_id: p.num_inflight_requests for p in st.pods},
        "pod_waiting": {p.pod_id: p.load.num_waiting_seqs + p.load.num_running_seqs for p in st.pods},
        "router_queue_depth": st.router_queue_depth,
        "router_inflight": st.num_inflight_requests,
    }


def leaked_blocks(snap: dict[str, Any], base: dict[str, Any]) -> dict[str, int]:
    return {
        pod: sum(max(0, b - a) for a, b in zip(snap["kv_free"].get(pod, [0] * len(free)), free))
        for pod, free in base["kv_free"].items()
    }


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    return s[min(len(s) - 1, max(0, int(round(q / 100 * (len(s) - 1)))))]


def resolve_model(cfg: SoakConfig, work: Path) -> Path:
    from pdserve.default_model import ensure_default_model

    if cfg.model is None:
        from pdserve.testing import write_tiny_checkpoint

        # 1 KV head (any TP x DCP is valid), SmolLM2's tokenizer for the router, a vocab big enough for its ids
        return write_tiny_checkpoint(
            work / "tiny", "llama", num_heads=8, num_kv_heads=1, vocab_size=49152, tokenizer_from=ensure_default_model()
        )
    if cfg.model == "smollm2":
        return Path(ensure_default_model())
    return Path(cfg.model)


def offline_reference(
    model: Path, keys: list[tuple[tuple[int, ...], int]], block_size: int
) -> dict[tuple[tuple[int, ...], int], list[int]]:
    """Each (prompt, max_tokens) alone on an in-process engine, greedy, ignore_eos."""
    import torch

    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: more threads only fight over a shared box's cores (docs/performance.md)
    try:
        with LLMEngine(
            EngineConfig(model=str(model), block_size=block_size, num_kv_blocks=512, enable_prefix_caching=False)
        ) as eng:
            for prompt, mt in keys:
                r = eng.generate([list(prompt)], SamplingParams(temperature=0.0, max_tokens=mt, ignore_eos=True))[0]
                out[(prompt, mt)] = list(r["token_ids"])
    finally:
        torch.set_num_threads(threads)
    return out
