"""A small discrete-event model of serving on C cores, driven by measured step times (`pdserve bench serve`).

It answers: at how many cores does a prefill/decode split reach a higher SLO capacity (the highest Poisson rate with
>= 90% of requests within both SLOs) than colocated engines? Assumptions, all stated in the bench's JSON:

- Every pod runs on one core (per-core pods: on CPU, threads scale poorly for a model this small, so one pod per
  core is each architecture's most efficient use of cores); "unified" = C unified pods, "disaggregated" = the best
  split of C cores into p prefill pods and C - p decode pods.
- Step times are the measured single-core ones, linear in the work: prefill = a + b * prompt tokens of the step,
  decode = c + d * batch size. Nothing else shares the core.
- A unified pod schedules as pdserve's engine does: every step decodes each running request and fills what is left
  of `budget` tokens with prompt chunks of at most `chunk` tokens. A step with prompt tokens costs their prefill
  time plus d per decode row (the weights are read once for both; c is the decode step's own fixed cost), one
  without costs a decode step. A prefill pod runs back-to-back prefill steps of the waiting prompts; a decode pod
  decodes every running request each step, new ones joining at step bounds.
- The KV transfer costs `transfer_s` (measured: the disaggregated side's TTFT minus its prefill time, median) and the
  router places on the least loaded pod (fewest requests in it). A request's first token leaves at the end of the step
  that completed its prompt.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field
from typing import Any, Sequence

from bench.serve_stats import SLO


@dataclass(frozen=True)
class StepTimes:
    prefill_a: float  # s per prefill step
    prefill_b: float  # s per prompt token
    decode_c: float  # s per decode step
    decode_d: float  # s per sequence in the batch

    def prefill(self, tokens: int) -> float:
        return self.prefill_a + self.prefill_b * tokens

    def decode(self, batch: int) -> float:
        return self.decode_c + self.decode_d * batch


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope), both kept >= 0 (a noisy measurement must not make more work cheaper)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
    if slope < 0:
        return my, 0.0
    if my - slope * mx < 0:
        return 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    return my - slope * mx, slope


@dataclass
class _Req:
    arrival: float
    prompt: int
    output: int
    done_prompt: int = 0
    first: float | None = None
    last: float | None = None
    made: int = 0


@dataclass
class _Pod:
    kind: str  # "unified" | "prefill" | "decode"
    waiting: list[_Req] = field(default_factory=list)
    running: list[_Req] = field(default_factory=list)
    busy_until: float = 0.0

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.running)


def simulate(
    kind: str,
    cores: int,
    prefill_pods: int,
    rate: float,
    requests: Sequence[tuple[int, int]],
    st: StepTimes,
    chunk: int,
    budget: int,
    transfer_s: float,
    seed: int = 0,
) -> list[_Req]:
    """Every request's timeline; ``kind`` "unified" (``cores`` unified pods) or "disaggregated" (``prefill_pods``
    prefill pods, the rest decode pods)."""
    rng = random.Random(seed)
    t = 0.0
    reqs = []
    for p, o in requests:
        t += rng.expovariate(rate)
        reqs.append(_Req(t, p, o))
    if kind == "unified":
        pods = [_Pod("unified") for _ in range(cores)]
        entry = pods
    else:
        pods = [_Pod("prefill") for _ in range(prefill_pods)] + [_Pod("decode") for _ in range(cores - prefill_pods)]
        entry = [p for p in pods if p.kind == "prefill"]
    decoders = [p for p in pods if p.kind == "decode"]
    events: list[tuple[float, int, str, Any]] = [(r.arrival, i, "arrive", r) for i, r in enumerate(reqs)]
    heapq.heapify(events)
    seq = len(reqs)

    def push(at: float, what: str, obj: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, what, obj))

    def kick(pod: _Pod, now: float) -> None:
        if pod.busy_until > now:
            return
        decodable = list(pod.running) if pod.kind != "prefill" else []
        left, batch = budget - len(decodable), []
        for r in list(pod.waiting) if pod.kind != "decode" else []:
            if left <= 0:
                break
            n = min(r.prompt - r.done_prompt, chunk, left)
            batch.append((r, n))
            left -= n
        if not batch and not decodable:
            return
        tokens = sum(n for _, n in batch)
        dt = st.prefill(tokens) + st.decode_d * len(decodable) if batch else st.decode(len(decodable))
        pod.busy_until = now + dt
        push(now + dt, "stepped", (pod, decodable, batch))

    while events:
        now, _, what, obj = heapq.heappop(events)
        if what == "arrive":
            pod = min(entry, key=lambda p: p.load)
            pod.waiting.append(obj)
            kick(pod, now)
        elif what == "stepped":
            pod, decoded, batch = obj
            for r in decoded:
                r.made += 1
                r.last = now
                if r.made >= r.output:
                    pod.running.remove(r)
            for r, n in batch:
                r.done_prompt += n
                if r.done_prompt >= r.prompt:
                    pod.waiting.remove(r)
                    r.first = r.last = now
                    r.made = 1
                    if r.made >= r.output:
                        continue
                    if pod.kind == "unified":
                        pod.running.append(r)
                    else:
                        push(now + transfer_s, "landed", r)
            kick(pod, now)
        elif what == "landed":
            dec = min(decoders, key=lambda p: p.load)
            obj.done_prompt = obj.prompt
            dec.running.append(obj)
            kick(dec, now)
    return reqs


def attainment(reqs: Sequence[_Req], slo: SLO) -> float:
    good = 0
    for r in reqs:
        assert r.first is not None and r.last is not None
        tpot = (r.last - r.first) / (r.made - 1) if r.made > 1 else 0.0
        good += r.first - r.arrival <= slo.ttft_s and tpot <= slo.tpot_s
    return good / len(reqs)


def capacity(
    kind: str,
    cores: int,
    prefill_pods: int,
    requests: Sequence[tuple[int, int]],
    st: StepTimes,
    slo: SLO,
    chunk: int,
    budget: int,
    transfer_s: float,
    target: float = 0.9,
) -> float:
    """Highest rate (requests/s, bisection to 2%) with attainment >= target."""

    def ok(rate: float) -> bool:
        return (
            attainment(simulate(kind, cores, prefill_pods, rate, requests, st, chunk, budget, transfer_s), slo)
            >= target
        )

    lo, hi = 0.0, 1.0
    while ok(hi) and hi < 1e4:
        lo, hi = hi, hi * 2
    if hi >= 1e4:
        return lo
    while hi - lo > 0.02 * max(hi, 1e-3):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def crossover(
    requests: Sequence[tuple[int, int]],
    st: StepTimes,
    slo: SLO,
    chunk: int,
    budget: int,
    transfer_s: float,
    max_cores: int = 16,
) -> dict[str, Any]:
    """Per core count: both architectures' modelled SLO capacity (the disaggregated one at its best split), and the
    smallest core count where the split wins."""
    rows = []
    wins_at = None
    for c in range(2, max_cores + 1):
        uni = capacity("unified", c, 0, requests, st, slo, chunk, budget, transfer_s)
        split, dis = max(
            ((p, capacity("disaggregated", c, p, requests, st, slo, chunk, budget, transfer_s)) for p in range(1, c)),
            key=lambda x: x[1],
        )
        rows.append(
            {
                "cores": c,
                "unified_rps": uni,
                "disaggregated_rps": dis,
                "prefill_pods": split,
                "decode_pods": c - split,
                "ratio": dis / uni if uni else None,
            }
        )
        if wins_at is None and uni and dis > uni:
            wins_at = c
    return {"rows": rows, "disaggregated_wins_from_cores": wins_at}
