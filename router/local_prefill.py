"""Conditional disaggregation's threshold per decode pod: ``--local-prefill-max-tokens N`` for every pod, or ``auto``,
derived from each decode pod's step-time profile when it registers (pdserve/pod/step_profile.py measures it).

Pure functions, no I/O: the flag's parser and check, the interpolation of a profile and the auto rule. The registry
stores the result on the pod's entry (router/registry.py) and placement applies it to the pod a request is booked on
(router/placement.py ``prefill_locally``). The rule and its reason are in docs/DESIGN.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve_api.v1 import registry_pb2

AUTO = "auto"
FLAG = "--local-prefill-max-tokens"
# auto: a step that also computes a local prompt may take at most this many decode steps at batch 1, i.e. the pod's
# running streams wait at most one extra step per local prefill.
STEP_BUDGET = 2.0


def parse_max_tokens(raw: str) -> int | str:
    """The flag's text as a value: ``auto`` or an integer >= 0; a ValueError says what to pass."""
    text = raw.strip().lower()
    if text == AUTO:
        return AUTO
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(
            f"{FLAG} must be an integer >= 0 (0: always prefill on a prefill pod) or auto (each decode pod's "
            f"threshold from its measured step times), got {raw!r}"
        )
    return n


def max_tokens_problem(value: object) -> str | None:
    """Why ``value`` is no RouterConfig.local_prefill_max_tokens, or None."""
    if value == AUTO or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return None
    return (
        f"must be an integer >= 0 (0: always prefill on a prefill pod) or {AUTO!r} (each decode pod's threshold from "
        f"its measured step times; flag {FLAG})"
    )


@dataclass(frozen=True)
class Threshold:
    """A decode pod's threshold and why it is what it is (for the router's log)."""

    tokens: int
    why: str


def profile_problem(p: registry_pb2.StepProfile) -> str | None:
    """What makes a reported profile unusable (RegisterWorker refuses it as malformed), or None."""
    if len(p.prefill_tokens) != len(p.prefill_s):
        return f"step_profile lists {len(p.prefill_tokens)} prompt lengths but {len(p.prefill_s)} prefill times"
    if any(n <= 0 for n in p.prefill_tokens) or any(b <= a for a, b in zip(p.prefill_tokens, p.prefill_tokens[1:])):
        return f"step_profile.prefill_tokens must be ascending positive lengths, got {list(p.prefill_tokens)}"
    times = [*p.prefill_s, p.decode_step_s]
    if any(not math.isfinite(t) or t < 0 for t in times):
        return "step_profile times must be finite and >= 0 seconds"
    return None


def prefill_seconds(tokens: float, points: list[tuple[int, float]]) -> float:
    """The prefill time of a ``tokens``-token prompt, linear between ``points`` ((prompt tokens, seconds), ascending
    lengths). Times are made non-decreasing first (a longer prompt never costs less, so a noisy point opens no
    window); outside the points the nearest segment goes on, never under 0."""
    if not points:
        raise ValueError("a profile needs at least one measured prompt length")
    xs = [x for x, _ in points]
    ys = [max(y for _, y in points[: i + 1]) for i in range(len(points))]
    if len(points) == 1:
        return ys[0] * tokens / xs[0]
    i = 1
    while i < len(xs) - 1 and tokens > xs[i]:
        i += 1
    (x0, y0), (x1, y1) = (xs[i - 1], ys[i - 1]), (xs[i], ys[i])
    return max(0.0, y0 + (y1 - y0) * (tokens - x0) / (x1 - x0))


def auto_threshold(profile: registry_pb2.StepProfile | None) -> Threshold:
    """``auto`` for one decode pod: the longest prompt whose whole prefill costs at most STEP_BUDGET decode steps at
    batch 1 on that pod (the step that carries it delays the running streams by at most one step), at most the
    longest length measured (no extrapolation). The prefill of 1 token is taken as one decode step (the same forward
    pass of one row), so a pod with a profile gets at least 1. No profile, or one without a decode step time: 0
    (never local)."""
    if profile is None or not profile.prefill_tokens:
        return Threshold(0, "the pod sent no step profile (--no-step-profile, or an older pod): never local")
    step = profile.decode_step_s
    if step <= 0:
        return Threshold(0, "the pod's profile has no decode step time: never local")
    points = [(1, step)] + [(n, t) for n, t in zip(profile.prefill_tokens, profile.prefill_s) if n > 1]
    budget = STEP_BUDGET * step
    lo, hi = 1, points[-1][0]  # the largest n in [lo, hi] whose prefill fits the budget (time grows with n)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prefill_seconds(mid, points) <= budget:
            lo = mid
        else:
            hi = mid - 1
    capped = " (the longest length measured)" if lo == points[-1][0] and lo > 1 else ""
    return Threshold(
        lo,
        f"a prefill of {lo} tokens{capped} takes ~{prefill_seconds(lo, points) * 1e3:.1f} ms on the pod, within "
        f"{STEP_BUDGET:g} decode steps of {step * 1e3:.1f} ms",
    )
