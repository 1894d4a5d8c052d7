"""`pdserve bench llamacpp`: pdserve's colocated serving against llama.cpp's `llama-server` on the same cores.

Both servers run side by side on loopback and are driven by the same OpenAI streaming load generator
(bench/serve.py, /v1/completions with token-id prompts, greedy, ignore_eos), one side at a time, the order
alternating every repeat. pdserve is `pdserve up --unified` (one pod doing prefill and decode, no KV transfer: the
fastest layout on one machine); llama-server is built from source and fed the same checkpoint converted to GGUF
(bench/peer_llamacpp.py), with `--parallel 8 --cont-batching` and as many threads as pdserve's pod has cores.

Matched precisions: fp32 vs F32, bf16 vs BF16, and pdserve's `--quantization int8` vs Q8_0; with --int8-from-gguf
pdserve's int8 side loads the very Q8_0 file llama-server serves (pdserve/model/gguf_file.py), so both sides hold the
same int8 values and scales.

Workloads, fresh prompts per repeat on both sides (each server caches prompts it has seen):
- one stream: decode tok/s = (tokens - 1) / (last token time - first token time);
- 4 and 8 concurrent streams: total output tok/s (first send to last token), TTFT p50, ITL p50 / p99.
The figures of a side are the median over repeats."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bench import peer_llamacpp as llama
from bench.common import BenchUnavailable, machine
from bench.serve import run_load
from bench.serve_stats import SLO, summarize
from pdserve.cluster.supervisor import child_argv
from pdserve.default_model import cache_dir, ensure_default_model

SEED = 0
PRECISIONS = ("fp32", "bf16", "int8")
QUICK_PRECISIONS = ("fp32", "int8")
LLAMA_NAMES = {"fp32": "f32", "bf16": "bf16", "int8": "q8_0"}
PARALLEL = 8  # llama-server's slots: the largest concurrency measured
CONCURRENCY = (4, PARALLEL)
# Percentiles only: no request is judged against an SLO here.
_NO_SLO = SLO(1e9, 1e9)


@dataclass(frozen=True)
class Config:
    precisions: tuple[str, ...]
    repeats: int
    single_tokens: int  # output of the one-stream workload
    concurrent_tokens: int  # output of each stream of the concurrent workloads
    prompt_tokens: int
    threads: int
    timeout_s: float = 600.0

    @staticmethod
    def make(quick: bool, threads: int) -> Config:
        if quick:
            return Config(
                QUICK_PRECISIONS, repeats=1, single_tokens=64, concurrent_tokens=32, prompt_tokens=16, threads=threads
            )
        return Config(
            PRECISIONS, repeats=3, single_tokens=256, concurrent_tokens=128, prompt_tokens=16, threads=threads
        )


def pdserve_flags(precision: str) -> list[str]:
    """`pdserve up` flags of a precision: int8 weights come from --quantization over fp32 activations."""
    if precision == "fp32":
        return ["--dtype", "float32"]
    if precision == "bf16":
        return ["--dtype", "bfloat16"]
    if precision == "int8":
        return ["--dtype", "float32", "--quantization", "int8"]
    raise ValueError(f"unknown precision {precision!r}; known: {list(PRECISIONS)}")


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """n short random prompts (token ids clear of the special tokens at the vocabulary's ends)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


def decode_tok_s(chunk_times: Sequence[float], tokens: int) -> float | None:
    """Tokens after the first over the time after the first; None when there is no span to measure."""
    if tokens < 2 or len(chunk_times) < 2 or chunk_times[-1] <= chunk_times[0]:
        return None
    return (tokens - 1) / (chunk_times[-1] - chunk_times[0])


def ratio(a: float | None, b: float | None) -> float | None:
    """a / b, or None when either side has no figure."""
    if a is None or b is None or b <= 0:
        return None
    return a / b


class PdserveUp:
    """`pdserve up --unified` in a child process, as a user runs it; `close()` is its Ctrl-C."""

    def __init__(self, args: list[str], log_dir: Path, startup_timeout_s: float = 900.0) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.ready = log_dir / "ready.json"
        self.ready.unlink(missing_ok=True)
        self.output = log_dir / "pdserve-up.out"
        cmd = [sys.executable, "-m", "pdserve.cli", "up", *args, "--ready-file", str(self.ready)]
        cmd += ["--log-dir", str(log_dir), "--startup-timeout", str(startup_timeout_s)]
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        env.setdefault("HF_HUB_OFFLINE", "1")
        with self.output.open("wb") as out:
            self.proc = subprocess.Popen(
                child_argv(cmd, os.getpid(), deathsig="INT"),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.info: dict[str, Any] = {}
        deadline = time.monotonic() + startup_timeout_s + 30
        while not self.ready.is_file():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                break
            time.sleep(0.2)
        else:
            self.info = json.loads(self.ready.read_text())

    @property
    def started(self) -> bool:
        return bool(self.info)

    def tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.output.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(url: str, model: str, reqs: list[list[int]], tokens: int, timeout_s: float) -> dict[str, Any]:
    """All of ``reqs`` sent at once, streamed: the load generator's summary plus the one-stream decode rate."""
    recs, duration = asyncio.run(run_load(url, model, [(ids, tokens) for ids in reqs], 1e9, timeout_s))
    s = summarize(recs, duration, _NO_SLO)
    failed = [r.error for r in recs if not r.ok]
    if failed:
        raise BenchUnavailable(f"{url}: {len(failed)} of {len(recs)} streams failed: {sorted(set(failed))}")
    rates = [decode_tok_s(r.chunk_times, r.output_tokens) for r in recs]
    return {
        "output_tok_s": s["output_tok_s"],
        "decode_tok_s": statistics.median(x for x in rates if x is not None) if any(rates) else None,
        "ttft_p50_s": s["ttft_s"]["p50"],
        "itl_p50_s": s["itl_s"]["p50"],
        "itl_p99_s": s["itl_s"]["p99"],
        "output_tokens": sum(r.output_tokens for r in recs),
    }


def median_of(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per figure, the median over repeats (a figure missing from every repeat stays None)."""
    keys = dict.fromkeys(k for s in samples for k in s)
    out: dict[str, Any] = {}
    for k in keys:
        values = [s[k] for s in samples if s.get(k) is not None]
        out[k] = statistics.median(values) if values else None
    out["repeats"] = len(samples)
    return out


def workloads(cfg: Config) -> list[tuple[str, int, int]]:
    """(name, streams, output tokens per stream)."""
    return [("single", 1, cfg.single_tokens), *((f"c{c}", c, cfg.concurrent_tokens) for c in CONCURRENCY)]


def compare(
    sides: dict[str, tuple[str, str]], cfg: Config, vocab: int, precision_index: int
) -> dict[str, dict[str, dict[str, Any]]]:
    """{workload: {side: median figures}}; ``sides`` maps a side's name to (base url, model name)."""
    names = list(sides)
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {w: {n: [] for n in names} for w, _, _ in workloads(cfg)}
    for url, model in sides.values():  # warm-up: first calls allocate and compile
        measure(url, model, prompts(2, cfg.prompt_tokens, vocab, SEED - 1 - precision_index), 4, cfg.timeout_s)
    for rep in range(cfg.repeats):
        order = names if rep % 2 == 0 else names[::-1]
        for wi, (workload, streams, tokens) in enumerate(workloads(cfg)):
            seed = SEED + 1000 * (precision_index + 1) + 10 * rep + wi
            reqs = prompts(streams, cfg.prompt_tokens, vocab, seed)  # the same prompts on both sides
            for name in order:
                url, model = sides[name]
                samples[workload][name].append(measure(url, model, reqs, tokens, cfg.timeout_s))
                print(f"  {workload} {name}: {samples[workload][name][-1]['output_tok_s']:.1f} tok/s", file=sys.stderr)
    return {w: {n: median_of(per[n]) for n in names} for w, per in samples.items()}


def assemble(
    results: dict[str, dict[str, dict[str, dict[str, Any]]]], cfg: Config, llama_info: dict[str, Any]
) -> dict[str, Any]:
    """The benchmark's JSON from {precision: {workload: {"pdserve"|"llamacpp": figures}}}."""
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    c_top = f"c{PARALLEL}"
    for precision, per in results.items():
        other = LLAMA_NAMES[precision]
        for workload, sides in per.items():
            p, q = sides.get("pdserve", {}), sides.get("llamacpp", {})
            key = "decode_tok_s" if workload == "single" else "output_tok_s"
            r = ratio(p.get(key), q.get(key))
            if r is not None and workload == "single":
                ratios[f"single_stream_{precision}_vs_llamacpp_{other}"] = r
            if r is not None and workload == c_top:
                ratios[f"{c_top}_out_tok_s_vs_llamacpp_parallel_{precision}"] = r
            rows.append(
                {
                    "precision": f"{precision} / {other}",
                    "workload": workload,
                    "pdserve tok/s": p.get(key),
                    "llama tok/s": q.get(key),
                    "ratio": r,
                    "TTFT p50 ms": _pair_ms(p.get("ttft_p50_s"), q.get("ttft_p50_s")),
                    "ITL p50 ms": _pair_ms(p.get("itl_p50_s"), q.get("itl_p50_s")),
                    "ITL p99 ms": _pair_ms(p.get("itl_p99_s"), q.get("itl_p99_s")),
                }
            )
    per_precision = [v for k, v in ratios.items() if k.startswith(f"{c_top}_out_tok_s_vs_llamacpp_parallel_")]
    if per_precision:
        ratios[f"{c_top}_out_tok_s_vs_llamacpp_parallel"] = min(per_precision)
    return {
        "benchmark": "llamacpp",
        "table": rows,
        "ratios": ratios,
        "results": results,
        "config": {
            "precisions": list(cfg.precisions),
            "repeats": cfg.repeats,
            "single_stream_tokens": cfg.single_tokens,
            "concurrent_tokens_per_stream": cfg.concurrent_tokens,
            "concurrency": list(CONCURRENCY),
            "prompt_tokens": cfg.prompt_tokens,
            "threads": cfg.threads,
            "pdserve_flags": {p: ["--unified", *pdserve_flags(p)] for p in cfg.precisions},
        },
        "llamacpp": llama_info,
    }


def _pair_ms(a: float | None, b: float | None) -> str:
    """'pdserve / llama' in milliseconds."""

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.1f}"

    return f"{ms(a)} / {ms(b)}"


def run(quick: bool = False, int8_from_gguf: bool = False) -> dict[str, Any]:
    """int8_from_gguf: pdserve's int8 side loads llama-server's Q8_0 file (its int8 values and fp16 scales as they
    are) instead of quantising the fp32 checkpoint at load, so the two sides differ only in their kernels."""
    cores = sorted(os.sched_getaffinity(0))
    cfg = Config.make(quick, threads=min(2, len(cores)))
    model_dir = ensure_default_model()
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    binary = llama.ensure_server()
    ctx = cfg.prompt_tokens + max(cfg.single_tokens, cfg.concurrent_tokens) + 64
    logs = cache_dir() / "logs" / "bench-llamacpp"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    unified_cpus = ",".join(map(str, cores[: cfg.threads]))
    for i, precision in enumerate(cfg.precisions):
        gguf = llama.ensure_gguf(model_dir, precision)
        print(f"{precision}: starting pdserve up --unified and llama-server ({gguf.name})", file=sys.stderr)
        model = gguf if precision == "int8" and int8_from_gguf else model_dir
        up_args = ["--unified", "--model", str(model), "--port", "0", "--http-port", "0", "--quiet"]
        up_args += ["--unified-cpus", unified_cpus, "--max-model-len", "2048", *pdserve_flags(precision)]
        pds = PdserveUp(up_args, logs / f"pdserve-{precision}")
        if not pds.started:
            raise BenchUnavailable(f"pdserve up ({precision}) did not start:\n{pds.tail()}")
        server = None
        try:
            args = llama.server_args(gguf, _free_port(), cfg.threads, PARALLEL, ctx)
            server = llama.LlamaServer(binary, args, logs / f"llama-server-{precision}.log")
            sides = {"pdserve": (pds.info["http"], pds.info["model"]), "llamacpp": (server.url, "gguf")}
            results[precision] = compare(sides, cfg, vocab, i)
        finally:
            if server is not None:
                server.close()
            pds.close()
    out = assemble(results, cfg, {**llama.describe(binary), "threads": cfg.threads, "parallel": PARALLEL, "ctx": ctx})
    out["quick"] = quick
    out["config"]["int8_weights"] = "llama-server's Q8_0 GGUF" if int8_from_gguf else "quantised at load from fp32"
    out["machine"] = machine()
    return out
