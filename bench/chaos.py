"""Chaos soak (``pdserve bench soak --chaos``): the soak's load, above decode KV capacity, while a seeded nemesis
kills and freezes processes, Jepsen-style; the cluster heals through its restart policy (pdserve.cluster.restart).

Cluster: 2 routers (the SDK fails over between them before a request's first token), 2 prefill pods, 1 decode pod
of TP 2 x DCP 2 (its rank 1 a process of its own), every service under ``on-failure`` restarts with back-off and
liveness probes. Load: closed-loop clients, greedy ``ignore_eos`` requests with mixed prompt lengths, a few cancelled.
Timeline: ``calm_s`` of fault-free load (its token rate is the reference), then the nemesis fires each fault kind at
least once, at seeded random gaps; load goes on after the last fault until the token rate is back within
``recovery_ratio`` of the reference (or ``recovery_limit_s`` passed). Fault kinds:
- kill-prefill / freeze-prefill: SIGKILL, or SIGSTOP then SIGCONT, a prefill pod's process group;
- kill-decode-rank / freeze-decode-rank: the same to a decode rank process (the pod then fails its liveness probe and
  is restarted, or carries on after the freeze);
- kill-router / freeze-router: the same to a router;
- drop-kv-path: wait (up to 8 s) until a prefill pod reports KV held under leases, freeze the decode pod (its reads
  stop), SIGKILL that prefill pod, thaw the decode pod: its reads of those leases meet a dead publisher. The fault's
  record says how many KV blocks the killed pod held (0: no lease was caught in flight this time).

Checks (each problem is reported prefixed with its check's name): every request ends exactly once (``lost`` and
``ended_twice`` 0); completed ones stream exactly the tokens of the request run alone (offline engine, greedy);
failed ones end with an accepted status and a message before their deadline, having streamed a prefix of those
tokens (``wrong_tokens`` and ``duplicated_tokens`` 0); none hangs; afterwards every pod is READY again and its KV
blocks are all free within the prefill lease TTL (no lease outlives it: ``kv_blocks_leaked`` 0); ``recovery_s``, from
the end of the last fault to the first ``recovery_window_s`` window whose token rate is within ``recovery_ratio`` of
the fault-free rate, is at most ``recovery_limit_s``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
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

FAULT_KINDS = (
    "kill-prefill",
    "freeze-prefill",
    "kill-decode-rank",
    "freeze-decode-rank",
    "kill-router",
    "freeze-router",
    "drop-kv-path",
)
# A fault may fail the requests it touches, each with a status that says why: these are the ones a client can act on
# (retry, elsewhere or later). "error" is a stream's final message after tokens (FINISH_REASON_ERROR + message).
ACCEPTED_FAILURES = frozenset({"UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED", "DATA_LOSS", "error"})
ACCEPTED_CANCEL = frozenset({"CANCELLED", "cancelled"})


@dataclass(frozen=True)
class ChaosConfig:
    soak: SoakConfig = field(
        default_factory=lambda: SoakConfig(
            num_requests=5000,
            concurrency=10,
            distinct_prompts=40,
            max_tokens=(4, 24),
            prompt_len_long=(40, 120),
            decode_num_kv_blocks=10,
            router_max_queue_len=8,
            cancel_fraction=0.1,
            request_timeout_s=60.0,
            client_request_ids=False,
        )
    )
    calm_s: float = 12.0  # fault-free load first: the reference token rate
    num_faults: int = 7  # each kind once at least (FAULT_KINDS has 7), then seeded random kinds
    gap_s: tuple[float, float] = (3.0, 5.0)  # between the end of one fault and the next
    freeze_s: tuple[float, float] = (0.5, 2.0)  # SIGSTOP ... SIGCONT
    recovery_window_s: float = 5.0
    recovery_ratio: float = 0.8  # "within 20% of the fault-free rate"
    recovery_limit_s: float = 30.0
    lease_ttl_s: float = 10.0  # prefill pods' KV lease TTL: a lease whose reader died goes after this long
    settle_slack_s: float = 15.0  # heartbeats and restarts on top of the TTL before KV must be all free again
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_faults < 1:
            raise ValueError(f"ChaosConfig: num_faults must be >= 1, got {self.num_faults}")
        for name in ("calm_s", "recovery_window_s", "recovery_limit_s", "lease_ttl_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ChaosConfig: {name} must be > 0 seconds")
        if not 0 < self.recovery_ratio <= 1:
            raise ValueError(f"ChaosConfig: recovery_ratio must be in (0, 1], got {self.recovery_ratio}")


QUICK = ChaosConfig(calm_s=10.0, gap_s=(2.0, 3.5), freeze_s=(0.5, 1.5))
FULL = ChaosConfig(num_faults=16, calm_s=20.0)


# ----------------------------------------------------------------------------------------------------------------
# The nemesis
# ----------------------------------------------------------------------------------------------------------------


def _signal_group(pid: int | None, sig: int) -> bool:
    if pid is None:
        return False
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def _signal(pid: int, sig: int) -> bool:
    try:
        os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def decode_ranks(pid: int) -> list[int]:
    """The TP rank processes a decode pod spawned (not Python's resource tracker)."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    out = []
    for k in kids:
        try:
            if "resource_tracker" not in " ".join(k.cmdline()):
                out.append(k.pid)
        except psutil.Error:
            pass
    return sorted(out)


class Nemesis(threading.Thread):
    """Fires ``kinds`` in order at seeded gaps against a LocalCluster; records what it did and when."""

    def __init__(self, cluster: Any, cfg: ChaosConfig, t0: float) -> None:
        super().__init__(name="nemesis", daemon=True)
        self.cluster = cluster
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        kinds = list(FAULT_KINDS) + [self.rng.choice(FAULT_KINDS) for _ in range(cfg.num_faults - len(FAULT_KINDS))]
        self.rng.shuffle(kinds)
        self.kinds = kinds[: cfg.num_faults]
        self.t0 = t0
        self.faults: list[dict[str, Any]] = []
        self.last_fault_end: float | None = None
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def halt(self) -> None:
        self._halt.set()
        self.join(60)

    def run(self) -> None:
        try:
            for kind in self.kinds:
                if self._halt.wait(self.rng.uniform(*self.cfg.gap_s)):
                    return
                t = time.monotonic()
                target = getattr(self, "_" + kind.replace("-", "_"))()
                end = time.monotonic()
                self.faults.append(
                    {"kind": kind, "target": target, "at_s": round(t - self.t0, 2), "took_s": round(end - t, 2)}
                )
                self.last_fault_end = end
        except BaseException as e:  # reported as a problem of the run
            self.error = e

    # -- helpers --
    def _names(self, kind: str) -> list[str]:
        return [s.name for s in self.cluster.services if s.kind == kind]

    def _pid(self, name: str) -> int | None:
        s = self.cluster.service(name)
        return None if s.proc is None or s.proc.poll() is not None else s.proc.pid

    def _freeze(self, pids: list[int], group: bool) -> float:
        d = self.rng.uniform(*self.cfg.freeze_s)
        send = _signal_group if group else _signal
        for p in pids:
            send(p, signal.SIGSTOP)
        self._halt.wait(d)
        for p in pids:
            send(p, signal.SIGCONT)
        return d

    def _rank(self, timeout: float = 30.0) -> int | None:
        """A decode rank process (waits while the decode pod restarts)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid = self._pid(self._names("decode")[0])
            ranks = decode_ranks(pid) if pid else []
            if ranks:
                return self.rng.choice(ranks)
            time.sleep(0.2)
        return None

    # -- the faults --
    def _kill_prefill(self) -> str:
        name = self.rng.choice(self._names("prefill"))
        return f"{name} SIGKILL" + ("" if _signal_group(self._pid(name), signal.SIGKILL) else " (was down)")

    def _freeze_prefill(self) -> str:
        name = self.rng.choice(self._names("prefill"))
        pid = self._pid(name)
        return f"{name} SIGSTOP {self._freeze([pid] if pid else [], True):.1f}s"

    def _kill_decode_rank(self) -> str:
        rank = self._rank()
        return f"decode rank pid {rank} SIGKILL" if rank and _signal(rank, signal.SIGKILL) else "no decode rank up"

    def _freeze_decode_rank(self) -> str:
        rank = self._rank()
        return f"decode rank pid {rank} SIGSTOP {self._freeze([rank], False):.1f}s" if rank else "no decode rank up"

    def _kill_router(self) -> str:
        name = self.rng.choice(self._names("router"))
        return f"{name} SIGKILL" + ("" if _signal_group(self._pid(name), signal.SIGKILL) else " (was down)")

    def _freeze_router(self) -> str:
        name = self.rng.choice(self._names("router"))
        pid = self._pid(name)
        return f"{name} SIGSTOP {self._freeze([pid] if pid else [], True):.1f}s"

    def _drop_kv_path(self) -> str:
        """Freeze the decode pod so leases wait unread, kill the prefill pod holding the most KV, thaw."""
        decode = self._names("decode")[0]
        used: dict[str, int] = {}
        end = time.monotonic() + 8.0
        while time.monotonic() < end and not any(used.values()) and not self._halt.is_set():
            used = self._prefill_blocks_used()
            self._halt.wait(0.05)
        name = max(used, key=lambda n: used[n]) if any(used.values()) else self.rng.choice(self._names("prefill"))
        pid = self._pid(decode)
        if pid is not None:
            _signal_group(pid, signal.SIGSTOP)
        try:
            killed = _signal_group(self._pid(name), signal.SIGKILL)
            self._halt.wait(0.5)
        finally:
            if pid is not None:
                _signal_group(pid, signal.SIGCONT)
        return f"{decode} frozen; {name} SIGKILL{'' if killed else ' (was down)'} holding {used.get(name, 0)} KV blocks"

    def _prefill_blocks_used(self) -> dict[str, int]:
        from pdserve.client import Client, PdserveError, RetryPolicy

        try:
            with Client(self.cluster.router_addresses, timeout=3, retry=RetryPolicy(max_attempts=2)) as c:
                st = c.cluster_status(role="prefill")
            return {p.pod_id: sum(r.total_blocks - r.free_blocks for r in p.kv) for p in st.pods}
        except PdserveError:
            return {}


# ----------------------------------------------------------------------------------------------------------------
# Load and measurement
# ----------------------------------------------------------------------------------------------------------------


def token_rate(outcomes: list[Outcome], t_from: float, t_to: float) -> float:
    n = sum(1 for o in outcomes for t in o.token_times if t_from <= t < t_to)
    return n / max(1e-9, t_to - t_from)


def recovery_time(
    outcomes: list[Outcome], after: float, reference: float, cfg: ChaosConfig, until: float
) -> float | None:
    """Seconds from ``after`` to the start of the first window whose token rate is within the ratio of
    ``reference``; None if no window up to ``until`` is."""
    t = after
    while t + cfg.recovery_window_s <= until:
        if token_rate(outcomes, t, t + cfg.recovery_window_s) >= cfg.recovery_ratio * reference:
            return t - after
        t += 0.25
    return None


async def _load(addresses: list[str], plan: list[Planned], cfg: ChaosConfig, cluster: Any) -> dict[str, Any]:
    from pdserve.client import AsyncClient, RetryPolicy

    s = cfg.soak
    # Retries go to the other router (the SDK's failover); only before a first token, so nothing is repeated.
    retry = RetryPolicy(max_attempts=4, initial_backoff_s=0.2, max_backoff_s=2.0)
    async with AsyncClient(addresses, retry=retry) as client:
        for p in plan[: s.warmup_requests]:
            await client.generate(p.prompt, max_tokens=p.max_tokens, temperature=0.0, ignore_eos=True, timeout=120)
        base = await _settle(client, None, 30.0)
        if base["kv_free"] != base["kv_total"]:
            raise RuntimeError(f"the cluster is not idle after the warm-up requests: {base}")

        todo = list(plan[s.warmup_requests :])
        todo.reverse()
        live: list[Outcome] = []
        issued: list[int] = []
        done: list[Outcome] = []
        stop = asyncio.Event()
        t0 = time.monotonic()
        nemesis = Nemesis(cluster, cfg, t0)

        async def worker() -> None:
            while todo and not stop.is_set():
                p = todo.pop()
                issued.append(p.index)
                o = await stream_request(client, p, s, live)
                done.append(o)
                if o.status == "RESOURCE_EXHAUSTED":
                    await asyncio.sleep(s.refused_backoff_s)

        async def control() -> None:
            await asyncio.sleep(cfg.calm_s)
            nemesis.start()
            while nemesis.is_alive():
                await asyncio.sleep(0.25)
            # after the last fault: until the rate is back (checked on completed windows) or the limit passed
            reference = token_rate(live, t0 + 2.0, t0 + cfg.calm_s)
            end = (nemesis.last_fault_end or time.monotonic()) + cfg.recovery_limit_s + cfg.recovery_window_s
            while time.monotonic() < end:
                await asyncio.sleep(1.0)
                if (
                    nemesis.last_fault_end is not None
                    and recovery_time(live, nemesis.last_fault_end, reference, cfg, time.monotonic()) is not None
                ):
                    await asyncio.sleep(1.0)
                    break
            stop.set()

        try:
            await asyncio.gather(control(), *(worker() for _ in range(s.concurrency)))
        finally:
            nemesis.halt()
        t1 = time.monotonic()
        after = await _settle(client, base, cfg.lease_ttl_s + cfg.settle_slack_s)
        return {
            "base": base,
            "after": after,
            "outcomes": done,
            "issued": issued,
            "t0": t0,
            "t1": t1,
            "settle_s": time.monotonic() - t1,
            "nemesis": nemesis,
            "live": live,
        }


def _idle(snap: dict[str, Any], base: dict[str, Any] | None) -> bool:
    want = snap["kv_total"] if base is None else base["kv_free"]
    return (
        snap["kv_free"] == want
        and snap["router_queue_depth"] == 0
        and snap["router_inflight"] == 0
        and not any(snap["pod_inflight"].values())
        and not any(snap["pod_waiting"].values())
    )


async def _settle(client: Any, base: dict[str, Any] | None, timeout: float) -> dict[str, Any]:
    """Poll ClusterStatus (through either router) until every pod is READY with all KV free and nothing in flight,
    or ``timeout``; the last snapshot."""
    from pdserve.client import PdserveError

    end = time.monotonic() + timeout
    snap: dict[str, Any] = {}
    while True:
        try:
            snap = await cluster_snapshot(client)
            if _idle(snap, base) or time.monotonic() > end:
                return snap
        except PdserveError:
            if time.monotonic() > end:
                return snap or {
                    "kv_free": {},
                    "kv_total": {},
                    "pod_inflight": {},
                    "pod_waiting": {},
                    "router_queue_depth": -1,
                    "router_inflight": -1,
                }
        await asyncio.sleep(0.5)


def _replayed(tokens: list[int], ref: list[int]) -> int:
    """Tokens streamed twice: ``tokens`` = ref[:a] + ref[b:...] with b < a (a stream resumed from an earlier point)."""
    a = next((i for i, (x, y) in enumerate(zip(tokens, ref)) if x != y), len(tokens))
    rest = tokens[a:]
    for b in range(a - 1, -1, -1):
        if rest and ref[b : b + len(rest)] == rest:
            return a - b
    return 0


def evaluate(
    cfg: ChaosConfig, plan: list[Planned], res: dict[str, Any], ref_of: dict[Any, list[int]], cluster_pods: list[str]
) -> dict[str, Any]:
    s = cfg.soak
    by_index = {p.index: p for p in plan}
    problems: list[str] = []
    outcomes: list[Outcome] = res["outcomes"]
    issued: list[int] = res["issued"]
    ends: dict[int, int] = {}
    for o in outcomes:
        ends[o.index] = ends.get(o.index, 0) + 1
    lost = sum(1 for i in issued if i not in ends)
    ended_twice = sum(1 for n in ends.values() if n > 1)
    completed, hung, wrong, dup = 0, 0, 0, 0
    failed: dict[str, int] = {}
    for o in sorted(outcomes, key=lambda o: o.index):
        p = by_index[o.index]
        ref = ref_of[p.key]
        tag = f"request {o.index} (prompt {len(p.prompt)} tokens, max_tokens {p.max_tokens})"
        prefix_ok = o.tokens == ref[: len(o.tokens)]
        if not prefix_ok:
            d = _replayed(o.tokens, ref)
            if d:
                dup += d
                problems.append(f"duplicated_tokens: {tag} ({o.status}) streamed {d} tokens twice")
            else:
                wrong += 1
                problems.append(f"wrong_tokens: {tag} ({o.status}) streamed tokens that are not its lone run's")
        if o.status == "completed":
            completed += 1
            if len(o.tokens) != p.max_tokens:
                problems.append(f"wrong_tokens: {tag} completed with {len(o.tokens)} tokens")
            continue
        failed[o.status] = failed.get(o.status, 0) + 1
        if o.status == "hung":
            hung += 1
            problems.append(f"no_hang: {tag}: {o.message}")
        elif o.status in ACCEPTED_CANCEL and p.cancel:
            pass
        elif o.status not in ACCEPTED_FAILURES:
            problems.append(f"outcomes: {tag} ended with {o.status}: {o.message or '(no message)'}")
        elif not o.message or o.message == o.status:
            problems.append(f"outcomes: {tag} failed with {o.status} but no message saying why")
        elif o.t_end - o.t_start >= s.request_timeout_s:
            problems.append(f"outcomes: {tag} failed with {o.status} only at its deadline")
    if lost:
        problems.append(f"lost: {lost} requests never ended")
    if ended_twice:
        problems.append(f"lost: {ended_twice} requests ended twice")

    base, after = res["base"], res["after"]
    leaked = leaked_blocks(after, base)
    missing = sorted(set(cluster_pods) - set(after.get("kv_free", {})))
    if missing:
        problems.append(f"healed: pods not registered after the run: {missing}")
    if not _idle(after, base):
        problems.append(
            f"kv: {res['settle_s']:.1f}s after the load (lease TTL {cfg.lease_ttl_s:g}s) the cluster is "
            f"not idle: free KV {after.get('kv_free')} (before {base['kv_free']}), router queue "
            f"{after.get('router_queue_depth')}, in flight {after.get('router_inflight')}, pods "
            f"{after.get('pod_inflight')} / {after.get('pod_waiting')}"
        )

    nem = res["nemesis"]
    if nem.error is not None:
        problems.append(f"nemesis: {nem.error!r}")
    t0, t1 = res["t0"], res["t1"]
    live = res["live"]
    reference = token_rate(live, t0 + 2.0, t0 + cfg.calm_s)
    rec = None
    if nem.last_fault_end is not None:
        rec = recovery_time(live, nem.last_fault_end, reference, cfg, t1)
    if rec is None or rec > cfg.recovery_limit_s:
        problems.append(
            f"recovery: the token rate did not come back within {cfg.recovery_ratio:.0%} of the "
            f"fault-free {reference:.1f} tokens/s within {cfg.recovery_limit_s:g}s of the last fault"
        )
    n_issued = max(1, len(issued))
    return {
        "ok": not problems,
        "problems": problems,
        "config": dataclasses.asdict(cfg),
        "requests": len(issued),
        "completed": completed,
        "failed": failed,
        "lost": lost,
        "ended_twice": ended_twice,
        "duplicated_tokens": dup,
        "wrong_tokens": wrong,
        "hung": hung,
        "kv_blocks_leaked": sum(leaked.values()),
        "kv_blocks_leaked_by_pod": leaked,
        "settle_s": res["settle_s"],
        "recovery_s": rec,
        "fault_free_tokens_per_s": reference,
        "faults": nem.faults,
        "last_fault_at_s": None if nem.last_fault_end is None else nem.last_fault_end - t0,
        "load_s": t1 - t0,
        "ttft_ms_p50": percentile([o.ttft_s for o in outcomes if o.ttft_s is not None], 50) * 1e3,
        "ratios": {
            "completed_share": completed / n_issued,
            "recovery_s_over_limit": (rec / cfg.recovery_limit_s) if rec is not None else float("inf"),
            "lost": lost,
            "hung": hung,
            "wrong_tokens": wrong,
            "duplicated_tokens": dup,
            "kv_blocks_leaked": sum(leaked.values()),
            "passed": 1.0 if not problems else 0.0,
        },
    }


def run_chaos(cfg: ChaosConfig, work_dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """Start the cluster, run the chaos soak, stop it, check everything; the report (``report["ok"]``)."""
    import json

    from pdserve.cluster.restart import RestartPolicy
    from pdserve.cluster.supervisor import LocalCluster
    from pdserve.cluster.topology import PodSpec, Topology

    s = cfg.soak
    work = Path(work_dir) if work_dir is not None else Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    model = resolve_model(s, work)
    vocab = min(int(json.loads((model / "config.json").read_text())["vocab_size"]), 49152)
    plan = plan_requests(dataclasses.replace(s, seed=cfg.seed), vocab)
    pod_args = ["--heartbeat-interval-s", "0.5"]
    topo = Topology(
        model=str(model),
        router_port=0,
        http_port=None,
        block_size=s.block_size,
        prefill=[
            PodSpec(
                "prefill",
                name=f"p{i}",
                extra_args=[*pod_args, "--lease-ttl-s", f"{cfg.lease_ttl_s:g}", "--kv-checksum"],
            )
            for i in range(2)
        ],
        decode=[
            PodSpec(
                "decode",
                s.decode_tp,
                s.decode_dcp,
                num_kv_blocks=s.decode_num_kv_blocks,
                name="d0",
                extra_args=pod_args,
            )
        ],
        router_args=[
            "--max-queue-len",
            str(s.router_max_queue_len),
            "--max-queue-wait-s",
            f"{s.router_max_queue_wait_s:g}",
            "--heartbeat-interval-s",
            "0.5",
            "--eviction-timeout-s",
            "6",
            "--log-level",
            "WARNING",
        ],
    )
    topo.resolve()
    policy = RestartPolicy(
        "on-failure",
        backoff_s=0.5,
        backoff_max_s=8.0,
        liveness_period_s=1.0,
        liveness_timeout_s=2.0,
        liveness_failures=3,
        startup_timeout_s=60.0,
    )
    restarts: list[str] = []
    cluster = LocalCluster(topo, log_dir=work / "logs", num_routers=2, restart_policy=policy, echo=restarts.append)
    t_up = time.monotonic()
    cluster.start()
    startup_s = time.monotonic() - t_up
    try:
        cluster.supervise_in_background(0.2)
        res = asyncio.run(_load(cluster.router_addresses, plan, cfg, cluster))
        events = [dataclasses.asdict(e) for e in cluster.restart_events]
        pods = [sv.name for sv in cluster.services if sv.spec is not None]
    finally:
        cluster.stop(grace=10.0)
    t_off = time.monotonic()
    used = sorted({by.key for by in plan if any(o.index == by.index for o in res["outcomes"])})
    ref_of = offline_reference(model, used, s.block_size)
    report = evaluate(cfg, plan, res, ref_of, pods)
    report["restarts"] = [{k: (round(v - res["t0"], 2) if k == "at" else v) for k, v in e.items()} for e in events]
    report["timing_s"] = {
        "cluster_start": startup_s,
        "load": report["load_s"],
        "settle": report["settle_s"],
        "offline_reference": time.monotonic() - t_off,
    }
    report["log_dir"] = str(work / "logs")
    return report


def run(quick: bool = False) -> dict[str, Any]:
    cfg = QUICK if quick else FULL
    rep = run_chaos(cfg)
    table: list[dict[str, Any]] = [
        {"measure": "requests", "value": rep["requests"]},
        {"measure": "completed (tokens = fault-free greedy run)", "value": rep["completed"]},
    ]
    for status, n in sorted(rep["failed"].items()):
        table.append({"measure": f"failed {status}", "value": n})
    table += [
        {"measure": "lost (must be 0)", "value": rep["lost"]},
        {"measure": "duplicated tokens (must be 0)", "value": rep["duplicated_tokens"]},
        {"measure": "wrong tokens (must be 0)", "value": rep["wrong_tokens"]},
        {"measure": "hung (must be 0)", "value": rep["hung"]},
        {"measure": "KV blocks leaked (must be 0)", "value": rep["kv_blocks_leaked"]},
        {"measure": "faults injected", "value": len(rep["faults"])},
        {"measure": "restarts by the policy", "value": len(rep["restarts"])},
        {"measure": "fault-free rate tokens/s", "value": f"{rep['fault_free_tokens_per_s']:.1f}"},
        {
            "measure": "recovery s after last fault (limit 30)",
            "value": "never" if rep["recovery_s"] is None else f"{rep['recovery_s']:.1f}",
        },
        {"measure": "KV all free after load s", "value": f"{rep['settle_s']:.1f}"},
        {"measure": "chaos checks", "value": "PASS" if rep["ok"] else f"FAIL: {len(rep['problems'])}"},
    ]
    for f in rep["faults"]:
        print(f"fault at {f['at_s']:6.1f}s: {f['kind']:<18} {f['target']}")
    for prob in rep["problems"][:20]:
        print("chaos problem:", prob)
    rep["table"] = table
    return rep
