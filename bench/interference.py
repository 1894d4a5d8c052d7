"""`pdserve bench interference`: do arriving prompts slow the streams already decoding?

Disaggregation exists so that they do not (DistServe's argument). Sides, one after the other on the same two cores,
each through its OpenAI front with the same client (bench/serve.py's streamed /v1/completions, token-id prompts,
greedy, ignore_eos):

- disaggregated pairs: a prefill pod pinned to the first core, a decode pod pinned to the second, its KV landed
  synchronously (``--kv-load sync``: the decode engine thread waits for each transfer) or asynchronously (the
  default: the ranks receive on transfer threads while the batch steps), over the TCP fallback and over NIXL (UCX
  held to TCP and shared memory, as the pods pick) where NIXL is installed;
- conditional: the async TCP pair with the router's conditional disaggregation on (``--local-prefill-max-tokens``,
  ``auto`` unless ``pdserve bench --local-prefill-max-tokens N`` says otherwise): prompts up to the decode pod's
  threshold prefill there (no transfer), longer ones on the prefill pod; the JSON records the threshold the router
  chose;
- unified: one unified pod (prefill and decode in one engine, chunked prefill between decode steps) on both cores;
- vllm: vLLM's CPU build on both cores (full runs, where its venv installs here).

Per side: ``streams`` requests decode long outputs; first a window without arrivals, then long prompts (1K, 4K and
8K tokens; 1K and 4K with --quick), one after another, each sent as soon as the previous one's first token came (as
fast as prefill produces them), while the streams go on; then the same lengths again with max_tokens 1 (prefill
only: nothing transferred, nothing decoded), which is what the other core's compute alone costs the streams through
the caches and memory bus they share. Figures: the streams' inter-token gaps (p50 / p99 / max) in each window, the
long prompts' TTFT, and a low-load row: short requests one at a time, their TTFT.

Targets (issue: decode never waits on a transfer): on the async path, over each transport,
``itl_p99_with_long_arrivals_vs_without`` <= 1.15 and ``itl_max_with_long_arrivals_vs_without`` <= 1.3, with the
synchronous path's figures beside them; ``ttft_low_load_conditional_vs_unified`` <= 1.10 while the conditional side's
long-prompt ITL ratios hold as well.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import BenchUnavailable, local_prefill_thresholds, machine, start_side
from bench.serve import RequestRecord, _one, _VLLMServer, check_loopback
from bench.serve_stats import itls, percentiles, ttft

SEED = 7
MAX_MODEL_LEN = 8192
SHORT_PROMPT = 64  # tokens of a low-load request
SHORT_OUTPUT = 8


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab - 100) for _ in range(n)]


def _side(
    kind: str,
    model: str,
    cores: list[int],
    logs: Path,
    kv_load: str = "async",
    backend: str = "tcp",
    local_prefill_max_tokens: int | str = 0,
) -> Any:
    """A running cluster of this side: (cluster, OpenAI base URL, model name)."""
    local = local_prefill_max_tokens != 0
    name = f"{kind}-{kv_load}-{backend}" + (f"-local{local_prefill_max_tokens}" if local else "")
    return start_side(
        kind,
        model,
        cores,
        logs / name,
        num_kv_blocks=4096,
        max_num_seqs=32,
        max_model_len=MAX_MODEL_LEN,
        decode_args=["--kv-load", kv_load, "--kv-transfer-backend", backend],
        router_args=["--local-prefill-max-tokens", str(local_prefill_max_tokens)] if local else [],
    )


async def _measure(
    base_url: str, model: str, streams: int, stream_tokens: int, long_lens: list[int], quiet_s: float, vocab: int
) -> dict[str, Any]:
    """Streams decoding; a quiet window, then long prompts back to back; the streams' gaps in each window."""
    import aiohttp

    check_loopback(base_url)
    url = base_url.rstrip("/") + "/v1/completions"
    rng = random.Random(SEED)
    loop = asyncio.get_running_loop()
    timeout = 1800.0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        warm = RequestRecord(loop.time(), 16)
        await _one(session, url, model, _ids(rng, 16, vocab), 4, warm, timeout)
        recs = [RequestRecord(loop.time(), 32) for _ in range(streams)]
        tasks = [
            asyncio.ensure_future(_one(session, url, model, _ids(rng, 32, vocab), stream_tokens, r, timeout))
            for r in recs
        ]
        while not all(len(r.chunk_times) >= 3 for r in recs):  # every stream decoding
            await asyncio.sleep(0.05)
            if all(t.done() for t in tasks):
                break
        quiet = (loop.time(), loop.time() + quiet_s)
        await asyncio.sleep(quiet_s)
        longs = []
        t_arrivals = loop.time()
        for n in long_lens:
            rec = RequestRecord(loop.time(), n)
            await _one(session, url, model, _ids(rng, n, vocab), 2, rec, timeout)
            longs.append(rec)
        busy = (t_arrivals, loop.time())
        # The same prompts' compute with nothing transferred (max_tokens 1 ends at prefill): what the other core's
        # prefill alone does to the streams through the shared caches and memory bus.
        t_prefill_only = loop.time()
        for n in long_lens:
            rec = RequestRecord(loop.time(), n)
            await _one(session, url, model, _ids(rng, n, vocab), 1, rec, timeout)
            longs.append(rec)
        prefill_only = (t_prefill_only, loop.time())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        low = []
        for _ in range(5):  # low load: short requests one at a time
            rec = RequestRecord(loop.time(), SHORT_PROMPT)
            await _one(session, url, model, _ids(rng, SHORT_PROMPT, vocab), SHORT_OUTPUT, rec, timeout)
            low.append(rec)

    def gaps(window: tuple[float, float]) -> list[float]:
        out = []
        for r in recs:
            ts = r.chunk_times
            out += [b - a for a, b in zip(ts, ts[1:]) if window[0] <= b <= window[1]]
        return out

    errors = [r.error for r in recs + longs + low if r.error and r.error != "CancelledError"]
    quiet_gaps, busy_gaps = gaps(quiet), gaps(busy)
    low_gaps = [g for r in low for g in itls(r)]
    low_ttfts = [x for x in map(ttft, low) if x is not None]

    def summary(g: list[float]) -> dict[str, Any]:
        p = percentiles(g, (50, 99))
        return {"n": len(g), "p50_ms": _ms(p["p50"]), "p99_ms": _ms(p["p99"]), "max_ms": _ms(max(g) if g else None)}

    return {
        "itl_without_arrivals": summary(quiet_gaps),
        "itl_with_long_arrivals": summary(busy_gaps),
        "itl_with_prefill_only_arrivals": summary(gaps(prefill_only)),
        "long_ttft_ms": {n: _ms(ttft(r)) for n, r in zip(long_lens, longs)},  # the first, transferred, ones
        "low_load_ttft_ms": _ms(statistics.median(low_ttfts) if low_ttfts else None),
        "low_load_itl_ms": _ms(statistics.median(low_gaps) if low_gaps else None),
        "windows_s": {"without": quiet_s, "with": round(busy[1] - busy[0], 2)},
        "errors": errors,
    }


def _ms(s: float | None) -> float | None:
    return None if s is None else round(1000 * s, 2)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _plot(results: dict[str, Any], path: Path) -> None:
    """Per side: the streams' inter-token p50 / p99 / max without and with long prompts arriving."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sides = [k for k, r in results.items() if "skipped" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=False)
    for ax, stat in zip(axes, ("p50_ms", "p99_ms", "max_ms")):
        x = range(len(sides))
        quiet = [results[k]["itl_without_arrivals"][stat] or 0 for k in sides]
        busy = [results[k]["itl_with_long_arrivals"][stat] or 0 for k in sides]
        ax.bar([i - 0.2 for i in x], quiet, 0.4, label="no arrivals")
        ax.bar([i + 0.2 for i in x], busy, 0.4, label="long prompts arriving")
        ax.set_xticks(list(x), sides, rotation=30, ha="right")
        ax.set(ylabel="ms", title=f"running streams' inter-token {stat[:-3]}")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool = False, out: str | None = None, local_prefill_max_tokens: int | str = "auto") -> dict[str, Any]:
    """``local_prefill_max_tokens``: the conditional side's router threshold (auto: each decode pod's, derived from
    its step times; the JSON records what the router chose)."""
    from kv_transfer.factory import nixl_available
    from pdserve.default_model import ensure_default_model
    from pdserve.model.config import ModelConfig

    t_start = time.perf_counter()
    model = str(ensure_default_model())
    vocab = ModelConfig.from_path(model).vocab_size
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError("bench interference pins prefill and decode to a core each: it needs two cores")
    streams = 4
    long_lens = [1024, 4096] if quick else [1024, 4096, 8000]
    quiet_s = 8.0 if quick else 20.0
    stream_tokens = 1500 if quick else 4000
    backends = ["tcp"] + (["nixl"] if nixl_available() else [])
    sides: list[tuple[str, dict[str, Any]]] = []
    for b in backends:
        sides += [(f"async_{b}", {"kind": "disaggregated", "kv_load": "async", "backend": b})]
        sides += [(f"sync_{b}", {"kind": "disaggregated", "kv_load": "sync", "backend": b})]
    # conditional disaggregation: short prompts prefill on the decode pod, longer ones remotely
    local = local_prefill_max_tokens
    sides.append(("conditional_tcp", {"kind": "disaggregated", "local_prefill_max_tokens": local}))
    sides.append(("unified", {"kind": "unified"}))
    results: dict[str, Any] = {}
    logs = Path(tempfile.mkdtemp(prefix="pdserve-bench-interference-"))
    for name, spec in sides:
        print(f"side {name} ...", file=sys.stderr, flush=True)
        kind = spec.pop("kind")
        cluster, url, served = _side(kind, model, cores, logs, **spec)
        try:
            results[name] = asyncio.run(_measure(url, served, streams, stream_tokens, long_lens, quiet_s, vocab))
            if spec.get("local_prefill_max_tokens"):  # what the router chose per decode pod (auto: measured)
                results[name]["local_prefill_max_tokens"] = local_prefill_thresholds(cluster)
        finally:
            cluster.stop()
    if quick:
        results["vllm"] = {"skipped": "quick run"}
    else:
        print("side vllm ...", file=sys.stderr, flush=True)
        try:
            vllm = _VLLMServer(model, cores[:2], logs / "vllm.log", max_model_len=MAX_MODEL_LEN)
        except BenchUnavailable as e:
            results["vllm"] = {"skipped": f"vLLM's CPU build does not serve here: {e}"}
        else:
            try:
                args = (streams, stream_tokens, long_lens, quiet_s, vocab)
                results["vllm"] = asyncio.run(_measure(vllm.url, model, *args))
            finally:
                vllm.close()
    if any(r.get("errors") for r in results.values()):  # the services' logs say why
        print(f"requests failed: the services' logs are kept in {logs}", file=sys.stderr)
    else:
        shutil.rmtree(logs, ignore_errors=True)
    rows, ratios = [], {}
    for name, r in results.items():
        if "skipped" in r:
            rows.append({"side": name, "note": r["skipped"]})
            continue
        q, b, f = r["itl_without_arrivals"], r["itl_with_long_arrivals"], r["itl_with_prefill_only_arrivals"]
        p99_ratio, max_ratio = _ratio(b["p99_ms"], q["p99_ms"]), _ratio(b["max_ms"], q["max_ms"])
        rows.append(
            {
                "side": name,
                "ITL p50/p99/max quiet (ms)": f"{q['p50_ms']}/{q['p99_ms']}/{q['max_ms']}",
                "ITL p50/p99/max arrivals (ms)": f"{b['p50_ms']}/{b['p99_ms']}/{b['max_ms']}",
                "ITL p50/p99/max prefill-only (ms)": f"{f['p50_ms']}/{f['p99_ms']}/{f['max_ms']}",
                "p99 ratio": p99_ratio,
                "max ratio": max_ratio,
                "long TTFT (ms)": "/".join(str(v) for v in r["long_ttft_ms"].values()),
                "low-load TTFT (ms)": r["low_load_ttft_ms"],
                "errors": len(r["errors"]),
            }
        )
        ratios[f"itl_p99_with_long_arrivals_vs_without_{name}"] = p99_ratio
        ratios[f"itl_max_with_long_arrivals_vs_without_{name}"] = max_ratio
        # what the path adds beyond the prompts' compute: arrivals with KV transferred vs the same, prefill only
        ratios[f"itl_p99_with_long_arrivals_vs_prefill_only_{name}"] = _ratio(b["p99_ms"], f["p99_ms"])
        ratios[f"itl_max_with_long_arrivals_vs_prefill_only_{name}"] = _ratio(b["max_ms"], f["max_ms"])
    asyncs = [k for k in results if k.startswith("async_")]
    ratios["itl_p99_with_long_arrivals_vs_without_conditional"] = ratios.pop(
        "itl_p99_with_long_arrivals_vs_without_conditional_tcp"
    )
    ratios["itl_max_with_long_arrivals_vs_without_conditional"] = ratios.pop(
        "itl_max_with_long_arrivals_vs_without_conditional_tcp"
    )
    ratios["itl_p99_with_long_arrivals_vs_without"] = max(
        ratios[f"itl_p99_with_long_arrivals_vs_without_{k}"] or 0 for k in asyncs
    )
    ratios["itl_max_with_long_arrivals_vs_without"] = max(
        ratios[f"itl_max_with_long_arrivals_vs_without_{k}"] or 0 for k in asyncs
    )
    ratios["ttft_low_load_disaggregated_vs_unified"] = _ratio(
        results["async_tcp"]["low_load_ttft_ms"], results["unified"]["low_load_ttft_ms"]
    )
    ratios["ttft_low_load_conditional_vs_unified"] = _ratio(
        results["conditional_tcp"]["low_load_ttft_ms"], results["unified"]["low_load_ttft_ms"]
    )
    if out:
        _plot(results, Path(out).with_suffix(".png"))
    return {
        "benchmark": "interference",
        "quick": quick,
        "machine": machine(),
        "setup": {
            "model": Path(model).name,
            "dtype": "float32",
            "cores": cores[:2],
            "placement": "disaggregated: prefill pod on the first core, decode pod on the second; unified: both",
            "streams": streams,
            "long_prompts": long_lens,
            "arrivals": "one after another, each sent when the previous one's first token came",
            "quiet_window_s": quiet_s,
            "low_load": f"{SHORT_PROMPT}-token prompts, {SHORT_OUTPUT} tokens, one at a time",
            "conditional": f"router --local-prefill-max-tokens {local} (async KV load, TCP fallback; the thresholds "
            "the router chose per decode pod: sides.conditional_tcp.local_prefill_max_tokens)",
            "transports": backends,
        },
        "sides": results,
        "table": rows,
        "ratios": ratios,
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
