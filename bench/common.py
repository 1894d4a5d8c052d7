"""What every benchmark shares: timing, the table printer and the JSON writer used by `pdserve bench`."""

from __future__ import annotations

import json
import os
import platform
import time
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
