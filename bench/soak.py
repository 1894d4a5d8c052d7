"""Soak: many streamed requests, more at once than decode KV holds, against a local cluster (``pdserve bench soak``).

The cluster is started by ``pdserve.cluster.LocalCluster`` (the code ``pdserve up`` runs): a router, one prefill
pod and one decode pod (TP 2 x DCP 2), by default on a tiny random checkpoint (``PDSERVE_SOAK_MODEL=smollm2``, or a
checkpoint path, for a real one; its decode pod is TP 1 x DCP 1 unless ``PDSERVE_SOAK_DECODE=3x3``-style). The decode
pod gets only ``num_kv_blocks`` blocks per rank, fewer than the concurrent requests need, so the router queues
requests for decode KV (some may get RESOURCE_EXHAUSTED when its queue is full) and the decode pod preempts and
recomputes sequences whose KV grows past the router's booking. Requests are greedy, ``ignore_eos`` (so each must
produce exactly ``max_tokens`` tokens), with mixed prompt lengths; a fraction is cancelled mid-stream, half by
closing the stream and half by the Cancel RPC.

Checks (the soak passes when all hold; each problem found is reported prefixed with its check's name):
- outcomes: every request either completed or failed with an acceptable status and a message saying why
  (RESOURCE_EXHAUSTED for any request, CANCELLED / finish "cancelled" for the cancelled ones); anything else
  (UNAVAILABLE, INTERNAL, a finish "error", ...) fails the soak;
- no_hang: every stream ended before its deadline (``request_timeout_s``);
- tokens: each completed request's streamed tokens equal what the same request gives alone (which also proves no
  token was lost, repeated or taken from another request); their count equals the router's usage.completion_tokens
  and max_tokens; a cancelled request's tokens are a prefix of its lone run. "Alone" is the offline engine
  (``LLMEngine``, TP 1, one request at a time, after the cluster stopped: cheap for hundreds of distinct prompts);
  ``alone_sample`` of them are also sent one by one to the quiet cluster after the soak and must give the same
  tokens, which ties the offline reference to the cluster's own lone answer (check "reference");
- baseline: afterwards every pod's free KV blocks per rank are back at the idle value measured before the soak
  (every block free), the router queue is empty and nothing is in flight or waiting on any pod (ClusterStatus, fed
  by the pods' heartbeats, polled for up to ``baseline_timeout_s``); "KV blocks leaked" is the shortfall;
- rss: no process (router, pods, their TP ranks) has a peak RSS in the second half of the soak above its first-half
  peak by more than ``rss_growth_ratio`` x first-half peak + ``rss_slack_mib``. Why this bound: a leak grows with
  the requests served, and each half serves about as many, so a leak shows up again in full in the second half;
  without one, the peaks of the two halves differ only by allocator noise (batch shapes vary with load; glibc
  and torch keep or return arenas), measured at up to ~15 MiB here. 10% + 16 MiB stays clear of that noise and,
  with the benchmark's 2000 requests (~1000 per half), still catches a leak of ~50 KiB per request in a ~350 MiB
  pod or ~25 KiB per request in the ~80 MiB router (the test's 1000 requests: ~100 / ~50 KiB; smaller leaks need
  a longer soak: raise num_requests);
- overload: the run really exceeded capacity (router queueing + RESOURCE_EXHAUSTED + decode preemptions > 0).

``run_soak(SoakConfig(...))`` is what both this benchmark and tests/soak/test_soak.py call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import re
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import (
    Outcome,
    Planned,
    SoakConfig,
    cluster_snapshot,
    leaked_blocks,
    offline_reference,
    percentile,
    plan_requests,
    resolve_model,
    stream_request,
)

ACCEPTED_FAILURES = frozenset({"RESOURCE_EXHAUSTED"})  # for any request
ACCEPTED_CANCEL = frozenset({"CANCELLED", "cancelled"})  # for requests the soak cancels itself


# ----------------------------------------------------------------------------------------------------------------
# RSS sampling
# ----------------------------------------------------------------------------------------------------------------


class RssSampler:
    """Samples the RSS of every service process and each of its descendants (TP ranks) in a thread."""

    def __init__(self, roots: dict[str, int], interval_s: float) -> None:
        import psutil

        self.interval_s = interval_s
        self.samples: dict[str, list[tuple[float, int]]] = {}
        self._procs: dict[str, Any] = {}
        for name, pid in roots.items():
            root = psutil.Process(pid)
            self._procs[name] = root
            kids = [k for k in root.children(recursive=True) if "resource_tracker" not in " ".join(_cmdline(k))]
            for i, k in enumerate(sorted(kids, key=lambda k: k.pid), start=1):
                self._procs[f"{name}/rank{i}"] = k
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sample()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def sample(self) -> None:
        now = time.monotonic()
        for name, p in self._procs.items():
            try:
                self.samples.setdefault(name, []).append((now, p.memory_info().rss))
            except Exception:  # a process that died shows up as missing samples (and in outcomes)
                pass

    def halves(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        """Per process: peak RSS (MiB) over the whole soak, in its first and in its second half."""
        mid = (t0 + t1) / 2
        out = {}
        for name, xs in self.samples.items():
            a = [r for t, r in xs if t <= mid]
            b = [r for t, r in xs if t > mid]
            if not a or not b:
                continue
            mib = 1 << 20
            out[name] = {
                "peak_mib": max(r for _, r in xs) / mib,
                "first_half_peak_mib": max(a) / mib,
                "second_half_peak_mib": max(b) / mib,
            }
        return out


def _cmdline(p: Any) -> list[str]:
    try:
        return p.cmdline()
    except Exception:
        return []


# ----------------------------------------------------------------------------------------------------------------
# The requests
# ----------------------------------------------------------------------------------------------------------------


async def _drive(client: Any, plan: list[Planned], cfg: SoakConfig) -> tuple[list[Outcome], float, float]:
    todo = list(plan)
    outcomes: list[Outcome] = []

    async def worker() -> None:
        while todo:
            p = todo.pop()
            o = await stream_request(client, p, cfg)
            outcomes.append(o)
            if o.status == "RESOURCE_EXHAUSTED":
                await asyncio.sleep(cfg.refused_backoff_s)  # what a polite client does (else refusals dominate)

    t0 = time.monotonic()
    await asyncio.gather(*(worker() for _ in range(cfg.concurrency)))
    return outcomes, t0, time.monotonic()


async def _alone(client: Any, keys: list[tuple[tuple[int, ...], int]], timeout: float) -> dict[Any, list[int]]:
    out = {}
    for prompt, mt in keys:
        c = await client.generate(list(prompt), max_tokens=mt, temperature=0.0, ignore_eos=True, timeout=timeout)
        out[(prompt, mt)] = list(c.token_ids)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Cluster state
# ----------------------------------------------------------------------------------------------------------------


def _settled(snap: dict[str, Any], base: dict[str, Any]) -> bool:
    return (
        snap["kv_free"] == base["kv_free"]
        and snap["router_queue_depth"] == 0
        and snap["router_inflight"] == 0
        and not any(snap["pod_inflight"].values())
        and not any(snap["pod_waiting"].values())
    )


async def wait_baseline(client: Any, base: dict[str, Any], timeout: float) -> dict[str, Any]:
    end = time.monotonic() + timeout
    while True:
        snap = await cluster_snapshot(client)
        if _settled(snap, base) or time.monotonic() > end:
            return snap
        await asyncio.sleep(0.5)


def scrape_counter(url: str, name: str) -> float:
    """Sum of a Prometheus counter's samples at url (all labels)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for m in re.finditer(rf"^{name}(?:_total)?(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.M):
        total += float(m.group(1))
    return total


# ----------------------------------------------------------------------------------------------------------------
# The soak
# ----------------------------------------------------------------------------------------------------------------


def run_soak(cfg: SoakConfig, work_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Start the cluster, run the soak, check everything, stop the cluster; returns the report (``report["ok"]``)."""
    import json

    from pdserve.cluster.supervisor import LocalCluster
    from pdserve.cluster.topology import PodSpec, Topology
    from pdserve.net import free_port

    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model(cfg, work)
    vocab = min(int(json.loads((model / "config.json").read_text())["vocab_size"]), 49152)
    plan = plan_requests(cfg, vocab)

    metrics_port = free_port()
    topo = Topology(
        model=str(model),
        router_port=0,
        http_port=None,
        block_size=cfg.block_size,
        prefill=[PodSpec("prefill")],
        decode=[
            PodSpec(
                "decode",
                cfg.decode_tp,
                cfg.decode_dcp,
                num_kv_blocks=cfg.decode_num_kv_blocks,
                extra_args=["--metrics-port", str(metrics_port)],
            )
        ],
        router_args=[
            "--max-queue-len",
            str(cfg.router_max_queue_len),
            "--max-queue-wait-s",
            f"{cfg.router_max_queue_wait_s:g}",
            "--log-level",
            "WARNING",
        ],
    )
    topo.resolve()
    cluster = LocalCluster(topo, log_dir=work / "logs")
    t_up = time.monotonic()
    endpoints = cluster.start()
    startup_s = time.monotonic() - t_up
    try:
        roots = {s.name: s.pid for s in cluster.services if s.pid is not None}
        sampler = RssSampler(roots, cfg.rss_interval_s)
        res = asyncio.run(_session(endpoints.router, plan, cfg, sampler))
        res["preemptions"] = scrape_counter(f"http://{topo.host}:{metrics_port}/metrics", "pdserve_decode_preemptions")
        dead = [s.name for s in cluster.dead_services()]
    finally:
        cluster.stop(grace=10.0)
    t0, t1 = res["t0"], res["t1"]
    t_off = time.monotonic()
    offline = offline_reference(model, sorted({p.key for p in plan}), cfg.block_size)
    report = _evaluate(
        cfg,
        plan,
        res["outcomes"],
        offline,
        res["alone"],
        res["base"],
        res["after"],
        res["preemptions"],
        sampler.halves(t0, t1),
        dead,
    )
    report["timing_s"] = {
        "cluster_start": startup_s,
        "soak": t1 - t0,
        "cluster_alone_runs": res["ref_s"],
        "offline_reference": time.monotonic() - t_off,
    }
    report["log_dir"] = str(work / "logs")
    return report


async def _session(address: str, plan: list[Planned], cfg: SoakConfig, sampler: RssSampler) -> dict[str, Any]:
    """Everything that talks to the cluster, in one event loop: warm-up, baseline, soak, settle, lone runs."""
    from pdserve.client import AsyncClient, RetryPolicy

    # No retries: a refused request is an outcome of the soak, not something to hide.
    async with AsyncClient(address, retry=RetryPolicy(max_attempts=1)) as client:
        for p in plan[: cfg.warmup_requests]:  # first forward passes, channels, allocator warm-up
            await client.generate(p.prompt, max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True, timeout=120)
        # The baseline is an idle cluster: every block free on every pod (prefix-cached blocks count as free).
        first = await cluster_snapshot(client)
        base = await wait_baseline(client, {**first, "kv_free": first["kv_total"]}, cfg.baseline_timeout_s)
        if base["kv_free"] != base["kv_total"] or not _settled(base, base):
            raise RuntimeError(
                f"the cluster is not idle after the warm-up requests ({cfg.baseline_timeout_s:g}s): {base}"
            )
        sampler.start()
        try:
            outcomes, t0, t1 = await _drive(client, plan, cfg)
        finally:
            sampler.stop()
        after = await wait_baseline(client, base, cfg.baseline_timeout_s)
        t_ref = time.monotonic()
        keys = sorted({p.key for p in plan})
        alone = await _alone(
            client, random.Random(cfg.seed).sample(keys, min(cfg.alone_sample, len(keys))), cfg.request_timeout_s
        )
        return {
            "outcomes": outcomes,
            "t0": t0,
            "t1": t1,
            "base": base,
            "after": after,
            "alone": alone,
            "ref_s": time.monotonic() - t_ref,
        }


def _evaluate(
    cfg: SoakConfig,
    plan: list[Planned],
    outcomes: list[Outcome],
    ref_of: dict[Any, list[int]],
    alone: dict[Any, list[int]],
    base: dict[str, Any],
    after: dict[str, Any],
    preemptions: float,
    rss: dict[str, dict[str, float]],
    dead: list[str],
) -> dict[str, Any]:
    by_index = {p.index: p for p in plan}
    problems: list[str] = []
    for key, toks in alone.items():
        if toks != ref_of[key]:
            problems.append(
                f"reference: a {len(key[0])}-token prompt sent alone to the quiet cluster gave "
                f"{toks[:8]}... but the offline engine {ref_of[key][:8]}..."
            )
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.status] = counts.get(o.status, 0) + 1
    for o in sorted(outcomes, key=lambda o: o.index):
        p = by_index[o.index]
        ref = ref_of[p.key]
        tag = f"request {o.index} (prompt {len(p.prompt)} tokens, max_tokens {p.max_tokens}, cancel {p.cancel or '-'})"
        if o.status == "completed":
            if o.tokens != ref:
                first = next((i for i, (a, b) in enumerate(zip(o.tokens, ref)) if a != b), min(len(o.tokens), len(ref)))
                problems.append(
                    f"tokens: {tag} streamed {len(o.tokens)} tokens that differ from its lone run "
                    f"({len(ref)}) first at index {first}"
                )
            if o.usage_tokens != len(o.tokens) or len(o.tokens) != p.max_tokens:
                problems.append(
                    f"tokens: {tag} streamed {len(o.tokens)} tokens, router usage says "
                    f"{o.usage_tokens}, max_tokens {p.max_tokens}"
                )
        elif o.status in ACCEPTED_CANCEL and p.cancel:
            if o.tokens != ref[: len(o.tokens)]:
                problems.append(f"tokens: cancelled {tag}: its {len(o.tokens)} tokens are not a prefix of its lone run")
        elif o.status in ACCEPTED_FAILURES:
            if not o.message or o.message == o.status:
                problems.append(f"outcomes: {tag} failed with {o.status} but no message saying why")
            if o.tokens:
                problems.append(f"outcomes: {tag} got {o.status} after {len(o.tokens)} tokens")
        elif o.status == "hung":
            problems.append(f"no_hang: {tag}: {o.message}")
        else:
            problems.append(f"outcomes: {tag} ended with {o.status}: {o.message or '(no message)'}")
    if len(outcomes) != len(plan):
        problems.append(f"outcomes: {len(plan) - len(outcomes)} requests have no outcome")
    if dead:
        problems.append(f"outcomes: services died during the soak: {dead}")

    leaked = leaked_blocks(after, base)
    if not _settled(after, base):
        problems.append(
            f"baseline: {cfg.baseline_timeout_s:g}s after the soak the cluster is not back at baseline: "
            f"free KV {after['kv_free']} (before {base['kv_free']}), router queue "
            f"{after['router_queue_depth']}, router in flight {after['router_inflight']}, pods in "
            f"flight {after['pod_inflight']}, pods running/waiting {after['pod_waiting']}"
        )

    rss_rows = []
    for name, r in sorted(rss.items()):
        growth = r["second_half_peak_mib"] - r["first_half_peak_mib"]
        allowed = cfg.rss_growth_ratio * r["first_half_peak_mib"] + cfg.rss_slack_mib
        r["growth_mib"], r["allowed_growth_mib"] = growth, allowed
        if growth > allowed:
            problems.append(
                f"rss: {name} peak RSS grew {growth:.1f} MiB from the first half of the soak to the "
                f"second ({r['first_half_peak_mib']:.1f} -> {r['second_half_peak_mib']:.1f} MiB), above "
                f"the bound {allowed:.1f} MiB"
            )
        rss_rows.append({"process": name, **r})

    queued = sum(1 for o in outcomes if o.queue_s > 0.05)
    exhausted = counts.get("RESOURCE_EXHAUSTED", 0)
    if queued + exhausted + preemptions == 0:
        problems.append(
            "overload: no request queued in the router, none was refused and the decode pod never "
            "preempted: the soak did not exceed KV capacity (lower decode_num_kv_blocks)"
        )

    ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
    itl = [x for o in outcomes for x in o.itl_s]
    return {
        "ok": not problems,
        "problems": problems,
        "config": dataclasses.asdict(cfg),
        "counts": counts,
        "requests": len(plan),
        "queued_in_router": queued,
        "resource_exhausted": exhausted,
        "decode_preemptions": int(preemptions),
        "kv_blocks_leaked": leaked,
        "kv_blocks_leaked_total": sum(leaked.values()),
        "baseline": base,
        "after": after,
        "ttft_ms": {"p50": percentile(ttft, 50) * 1e3, "p99": percentile(ttft, 99) * 1e3, "n": len(ttft)},
        "itl_ms": {"p50": percentile(itl, 50) * 1e3, "p99": percentile(itl, 99) * 1e3, "n": len(itl)},
        "rss": rss_rows,
    }


# ----------------------------------------------------------------------------------------------------------------
# pdserve bench soak
# ----------------------------------------------------------------------------------------------------------------

QUICK = SoakConfig(
    num_requests=120,
    concurrency=12,
    distinct_prompts=40,
    max_tokens=(4, 24),
    decode_num_kv_blocks=10,
    prompt_len_long=(40, 120),
    router_max_queue_len=8,
    warmup_requests=3,
    alone_sample=4,
)


FULL = SoakConfig(num_requests=2000, distinct_prompts=250)


def run(quick: bool = False) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    model = os.environ.get("PDSERVE_SOAK_MODEL")  # "smollm2" or a checkpoint directory; unset: the tiny one
    if model:
        # TP 1 x DCP 1 is valid for every model (SmolLM2's 9 heads / 3 KV heads refuse TP 2); PDSERVE_SOAK_DECODE=TPxDCP
        tp, _, dcp = os.environ.get("PDSERVE_SOAK_DECODE", "1x1").partition("x")
        cfg = dataclasses.replace(cfg, model=model, decode_tp=int(tp), decode_dcp=int(dcp or 1))
    rep = run_soak(cfg)
    table: list[dict[str, Any]] = []
    for status, n in sorted(rep["counts"].items()):
        table.append({"measure": f"requests {status}", "value": n})
    table += [
        {"measure": "requests queued in router (>50 ms)", "value": rep["queued_in_router"]},
        {"measure": "decode preemptions", "value": rep["decode_preemptions"]},
        {"measure": "TTFT p50 / p99 ms", "value": f"{rep['ttft_ms']['p50']:.1f} / {rep['ttft_ms']['p99']:.1f}"},
        {"measure": "ITL p50 / p99 ms", "value": f"{rep['itl_ms']['p50']:.1f} / {rep['itl_ms']['p99']:.1f}"},
        {"measure": "KV blocks leaked (must be 0)", "value": rep["kv_blocks_leaked_total"]},
    ]
    for r in rep["rss"]:
        table.append(
            {
                "measure": f"peak RSS MiB {r['process']}",
                "value": f"{r['peak_mib']:.1f} (halves {r['first_half_peak_mib']:.1f} -> "
                f"{r['second_half_peak_mib']:.1f}, bound +{r['allowed_growth_mib']:.1f})",
            }
        )
    table.append({"measure": "soak checks", "value": "PASS" if rep["ok"] else f"FAIL: {len(rep['problems'])}"})
    for prob in rep["problems"][:20]:
        print("soak problem:", prob)
    n = max(1, rep["requests"])
    growth = [r["second_half_peak_mib"] / r["first_half_peak_mib"] for r in rep["rss"] if r["first_half_peak_mib"]]
    rep["table"] = table
    rep["ratios"] = {
        "completed_share": rep["counts"].get("completed", 0) / n,
        "acceptable_outcome_share": sum(
            v for k, v in rep["counts"].items() if k in ("completed", "CANCELLED", "cancelled", "RESOURCE_EXHAUSTED")
        )
        / n,
        "max_rss_growth_ratio": max(growth) if growth else float("nan"),
        "kv_blocks_leaked": rep["kv_blocks_leaked_total"],
        "passed": 1.0 if rep["ok"] else 0.0,
    }
    return rep
