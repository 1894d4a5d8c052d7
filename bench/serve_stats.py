"""The statistics of `pdserve bench serve`, pure functions of a trace (no I/O, no clock), so they are tested on
synthetic traces with known answers.

A trace is one RequestRecord per request sent: when it was sent, when each streamed chunk arrived and how many tokens
it carried, and whether it completed. The definitions are vLLM's `bench serve` ones:

- TTFT: first chunk's arrival minus the send time.
- TPOT: (last arrival - first arrival) / (output tokens - 1); a one-token answer has no TPOT and meets any TPOT SLO.
- ITL: the gaps between consecutive chunk arrivals of a request (every request's gaps pooled).
- goodput: requests that completed within both SLOs (TTFT <= ttft_s and TPOT <= tpot_s) per second of the run.
- SLO attainment: those requests over every request sent (a failed or unfinished request is a miss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SLO {name} must be a positive number of seconds, got {v!r}")


def parse_goodput(items: Sequence[str], default: SLO) -> SLO:
    """vLLM's `--goodput` syntax: ``ttft:MS tpot:MS`` (milliseconds); a key left out keeps ``default``'s value."""
    values = {"ttft": default.ttft_s, "tpot": default.tpot_s}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in values:
            raise ValueError(
                f"--goodput takes KEY:MILLISECONDS with KEY ttft or tpot (e.g. ttft:2000 tpot:150), got {item!r}"
            )
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput {key}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise ValueError(f"--goodput {key}: must be a positive number of milliseconds, got {value}")
        values[key] = ms / 1e3
    return SLO(values["ttft"], values["tpot"])


@dataclass
class RequestRecord:
    sent_s: float  # on the load generator's clock
    prompt_tokens: int
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried output
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in each of those chunks
    ok: bool = False  # the stream ended with a finish reason
    error: str = ""

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)


def ttft(r: RequestRecord) -> float | None:
    return r.chunk_times[0] - r.sent_s if r.chunk_times else None


def tpot(r: RequestRecord) -> float | None:
    """None for a request without output; 0.0 for a one-token answer (nothing after the first token)."""
    if not r.chunk_times:
        return None
    n = r.output_tokens
    return 0.0 if n <= 1 else (r.chunk_times[-1] - r.chunk_times[0]) / (n - 1)


def itls(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.chunk_times, r.chunk_times[1:])]


def meets(r: RequestRecord, slo: SLO) -> bool:
    t, p = ttft(r), tpot(r)
    return r.ok and t is not None and p is not None and t <= slo.ttft_s and p <= slo.tpot_s


def percentiles(values: Iterable[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float | None]:
    """``{"p50": ..., ...}`` by linear interpolation (numpy's default, as vLLM's bench); None when empty."""
    v = np.asarray(list(values), dtype=np.float64)
    return {f"p{q:g}": (float(np.percentile(v, q)) if v.size else None) for q in qs}


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO) -> dict[str, Any]:
    """One rate's figures. ``duration_s``: first send to last completion (the run's wall time)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in records if r.ok]
    good = sum(meets(r, slo) for r in records)
    out_tokens = sum(r.output_tokens for r in done)
    ttfts = [t for r in done if (t := ttft(r)) is not None]
    tpots = [t for r in done if (t := tpot(r)) is not None and r.output_tokens > 1]
    gaps = [g for r in done for g in itls(r)]
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "unfinished"] = errors.get(r.error or "unfinished", 0) + 1
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "errors": errors,
        "duration_s": duration_s,
        "throughput_rps": len(done) / duration_s,
        "output_tok_s": out_tokens / duration_s,
        "goodput_rps": good / duration_s,
        "slo_attainment": good / len(records) if records else 0.0,
        "ttft_s": percentiles(ttfts),
        "tpot_s": percentiles(tpots),
        "itl_s": percentiles(gaps),
        "mean_ttft_s": float(np.mean(ttfts)) if ttfts else None,
        "mean_tpot_s": float(np.mean(tpots)) if tpots else None,
    }


def slo_capacity(sweep: Sequence[tuple[float, dict[str, Any]]], target: float = 0.9) -> float:
    """The highest swept rate whose attainment is >= target, with every lower rate meeting it too (DistServe's
    per-GPU goodput, on a grid); 0.0 when even the lowest misses."""
    best = 0.0
    for rate, s in sorted(sweep, key=lambda x: x[0]):
        if s["slo_attainment"] < target:
            break
        best = rate
    return best
