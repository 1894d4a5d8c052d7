"""Prefill pod vs HF transformers on SmolLM2, same run: prompt tokens/s at 128, 2,048 and 8,192 tokens.

pdserve side: the prefill pod's engine loop (prefill_svc.worker.PrefillWorker) end to end: admit the prompt, compute
it (chunked as configured), sample the first token, hold the KV under a lease published layer by layer to a kv_transfer
TCP publisher; timed from submission to the answer, then the lease is released. transformers side: one forward pass of
the prompt building its KV cache, logits of the last position only (``logits_to_keep=1``, as generate() does).

Three sides, each in a process of its own: the pod as deployed (prefill GEMMs on oneDNN-packed weights), the pod with
exact_prefill (F.linear, logits bit-identical to transformers: the "exact" columns, what that exactness costs), and
transformers. Best of N runs each; every repeat runs all three back to back, each going first in turn, so a shared
machine's noise hits all alike.

Why a process each: with libgomp (torch's OpenMP on Linux), a second thread that runs parallel ops gets its own OpenMP
pool; once a process holds more pool threads than CPUs, libgomp throttles the spin-wait of every pool to ~100
iterations, so each small op pays a futex wake-up (figures: docs/performance.md). Running transformers on the main
thread beside a pod's engine thread measured that artefact, not either engine; running one pod config after the other
let the machine's load change between them. All sides use the same torch thread count: torch's default, or
PDSERVE_BENCH_THREADS (on a small CPU shared with other work, 1 thread avoids intra-op threads spinning against other
processes and gives far steadier numbers). The "cpu-time ratio" column compares process CPU seconds (best of N)
instead of wall time: on a busy machine it tracks the work done more closely; with more than one thread it also counts
intra-op threads' spinning.

SmolLM2's context is 8,192 positions and a prompt must leave room for the first token, so the "8192" row runs
8,191 tokens on both sides. Quick mode runs 128 and 2,048 only (the 8k row alone takes minutes on a small CPU)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import time
from dataclasses import replace
from typing import Any

import torch

from pdserve.default_model import ensure_default_model


def _prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _cpu_and_wall(fn) -> tuple[float, float]:
    """(process CPU seconds, wall seconds) of fn(): CPU time is what the work cost whatever else the machine ran."""
    c0, t0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - t0


def _pod_prefill_s(worker, ids: list[int], rid: str) -> tuple[float, float]:
    from pdserve_api.v1 import common_pb2 as pb
    from prefill_svc.sampling import sampling_from_proto

    params, client = sampling_from_proto(pb.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))

    async def go() -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        res = await worker.prefill(rid, ids, params, client)
        cpu, dt = time.process_time() - c0, time.perf_counter() - t0
        await worker.release(res.lease_id)
        return cpu, dt

    return asyncio.run(go())


def _hf_side(conn, path: str, threads: int | None) -> None:
    """Child process: transformers' forward over each prompt sent, answering (cpu s, wall s)."""
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    conn.send(hf.config.vocab_size)
    while (ids := conn.recv()) is not None:
        with torch.inference_mode():
            conn.send(_cpu_and_wall(lambda: hf(torch.tensor([ids]), logits_to_keep=1)))
    conn.close()


def _pod_side(conn, cfg, threads: int | None) -> None:
    """Child process: a prefill pod's engine loop (PrefillWorker) over each prompt sent, answering (cpu s, wall s)."""
    from prefill_svc.worker import PrefillWorker

    if threads:
        torch.set_num_threads(threads)
    worker = PrefillWorker(cfg)
    worker.start()
    conn.send(worker.engine.model_config.vocab_size)
    counter = iter(range(10**9))
    try:
        while (ids := conn.recv()) is not None:
            conn.send(_pod_prefill_s(worker, ids, f"r{next(counter)}"))
    finally:
        worker.stop()
        conn.close()


class _Side:
    """One side of the comparison in a process of its own (see the module docstring for why)."""

    def __init__(self, target, *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()

    def ready(self) -> int:
        """Waits until the side has loaded its model; returns the vocabulary size."""
        return self.conn.recv()

    def prefill_s(self, ids: list[int]) -> tuple[float, float]:
        self.conn.send(ids)
        return self.conn.recv()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.proc.join(timeout=60)
        if self.proc.is_alive():
            self.proc.kill()


def run(quick: bool = False) -> dict[str, Any]:
    from pdserve.cli_config import build
    from prefill_svc.config import PrefillConfig

    threads = int(os.environ["PDSERVE_BENCH_THREADS"]) if os.environ.get("PDSERVE_BENCH_THREADS") else None
    path = ensure_default_model()
    lengths = [128, 2048] if quick else [128, 2048, 8191]
    # A 128-token prefill takes a quarter second: many repeats cost little and steady its best-of.
    repeats = {128: 6, 2048: 2, 8191: 2} if quick else {128: 12, 2048: 3, 8191: 2}
    chunk = 2048
    cfg = build(
        PrefillConfig,
        model=str(path),
        kv_transport="tcp",
        enable_prefix_caching=False,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=8192,
        num_kv_blocks=8192 // 16 + 16,
    )
    sides = {
        "pod": _Side(_pod_side, cfg, threads),
        "exact": _Side(_pod_side, replace(cfg, engine=replace(cfg.engine, exact_prefill=True)), threads),
        "hf": _Side(_hf_side, str(path), threads),
    }
    best = {name: {} for name in sides}  # name -> length -> [cpu s, wall s]
    try:
        vocab = min(side.ready() for side in sides.values())
        for side in sides.values():
            side.prefill_s(_prompt(64, 0, vocab))  # warm-up
        names = list(sides)
        for n in lengths:
            ids = _prompt(n, n, vocab)
            for name in names:
                best[name][n] = [float("inf")] * 2
            for rep in range(repeats[n]):
                for name in names[rep % 3 :] + names[: rep % 3]:  # each side goes first in turn
                    best[name][n] = [min(a, b) for a, b in zip(best[name][n], sides[name].prefill_s(ids))]
    finally:
        for side in sides.values():
            side.close()
    rows, ratios = [], {}
    raw: dict[str, Any] = {
        "chunk_size": chunk,
        "threads": threads or torch.get_num_threads(),
        "repeats": repeats,
        "tok_s": {},
    }
    for n in lengths:
        (pod_cpu, pod_wall), (_, exact_wall), (hf_cpu, hf_wall) = best["pod"][n], best["exact"][n], best["hf"][n]
        pod_tps, exact_tps, hf_tps = n / pod_wall, n / exact_wall, n / hf_wall
        label = 8192 if n == 8191 else n
        rows.append(
            {
                "prompt tokens": n,
                "pdserve prefill tok/s": pod_tps,
                "transformers tok/s": hf_tps,
                "ratio": pod_tps / hf_tps,
                "cpu-time ratio": hf_cpu / pod_cpu,
                "exact-prefill tok/s": exact_tps,
                "exact ratio": exact_tps / hf_tps,
                "chunks": -(-n // chunk),
            }
        )
        ratios[f"prefill_{label}_vs_transformers"] = pod_tps / hf_tps
        ratios[f"prefill_exact_{label}_vs_transformers"] = exact_tps / hf_tps
        raw["tok_s"][str(n)] = {
            "pdserve": pod_tps,
            "pdserve_exact_prefill": exact_tps,
            "transformers": hf_tps,
            "pdserve_wall_s": pod_wall,
            "pdserve_exact_prefill_wall_s": exact_wall,
            "transformers_wall_s": hf_wall,
            "pdserve_cpu_s": pod_cpu,
            "transformers_cpu_s": hf_cpu,
            "cpu_time_ratio": hf_cpu / pod_cpu,
        }
    return {"benchmark": "prefill", "quick": quick, "model": path.name, "table": rows, "ratios": ratios, **raw}
