"""The local cluster end to end (``pdserve bench cluster``): what a user of ``pdserve up`` waits for.

``pdserve up``'s default topology for this machine (router, a prefill pod, a decode pod: the same supervisor,
LocalCluster, started from this process), one streamed request at a time through the router with the SDK, against
the in-process engine (TP 1, this process) on the same prompt, alternating sides round by round:

- ms per token: time from the first streamed token to the last over the tokens after the first (the decode rate a
  user sees), greedy, ``ignore_eos`` so both sides produce the same number of tokens;
- TTFT: request sent to first token (cluster: client-measured, so it includes the router, the prefill pod, the KV
  transfer to the decode pod and the gRPC hops; engine: add_request to the first token out of step()).

Target: ``ratios.cluster_ms_per_token_vs_engine`` <= 1.5. The full run adds a cluster whose decode pod runs TP 9 x DCP
3 (nine shared-memory ranks) beside it."""

from __future__ import annotations

import statistics
import tempfile
import time
from typing import Any

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def _engine_request(engine, prompt: str, new_tokens: int) -> tuple[float, float]:
    """(ttft_s, s per token after the first) of one request on the in-process engine."""
    from pdserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True))
    stamps: list[float] = []
    while engine.has_unfinished():
        for out in engine.step():
            stamps += [time.perf_counter()] * len(out.new_token_ids)
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def _cluster_request(router: str, prompt: str, new_tokens: int) -> tuple[float, float]:
    from pdserve.client import Client

    with Client(router, timeout=600) as c:
        t0 = time.perf_counter()
        stamps: list[float] = []
        for chunk in c.generate_stream(prompt, max_tokens=new_tokens, temperature=0, ignore_eos=True):
            stamps += [time.perf_counter()] * len(chunk.token_ids)
    if len(stamps) != new_tokens:
        raise RuntimeError(f"the cluster streamed {len(stamps)} tokens, asked for {new_tokens}")
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def run(quick: bool = False) -> dict[str, Any]:
    from pdserve.cluster.supervisor import LocalCluster
    from pdserve.cluster.topology import Topology
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine

    t_start = time.perf_counter()
    new_tokens = 24 if quick else 64
    rounds = 3 if quick else 5
    layouts: list[tuple[str, dict[str, int]]] = [("default", {})]
    if not quick:
        layouts.append(("tp9_dcp3", {"decode_tp": 9, "decode_dcp": 3}))
    default = Topology().resolve().decode[0]
    engine = LLMEngine(EngineConfig(num_kv_blocks=256))
    rows, ratios, raw = [], {}, {"prompt": PROMPT, "new_tokens": new_tokens, "rounds": rounds, "layouts": {}}
    try:
        _engine_request(engine, PROMPT, 4)  # warm-up
        eng: list[tuple[float, float]] = []
        for name, flags in layouts:
            with tempfile.TemporaryDirectory(prefix="pdserve-bench-cluster-") as logs:
                topo = Topology(router_port=0, http_port=None).with_overrides(**flags).resolve()
                cluster = LocalCluster(topo, log_dir=logs, echo=lambda line: None)
                t0 = time.perf_counter()
                endpoints = cluster.start()
                startup = time.perf_counter() - t0
                try:
                    pod = topo.decode[0]
                    _cluster_request(endpoints.router, PROMPT, 4)  # warm-up
                    clu: list[tuple[float, float]] = []
                    for _ in range(rounds):  # alternate, so both sides see the same machine
                        clu.append(_cluster_request(endpoints.router, PROMPT, new_tokens))
                        eng.append(_engine_request(engine, PROMPT, new_tokens))
                finally:
                    cluster.stop(grace=10.0)
            c_ms = statistics.median(t for _, t in clu) * 1e3
            c_ttft = statistics.median(t for t, _ in clu) * 1e3
            e_ms = statistics.median(t for _, t in eng) * 1e3
            e_ttft = statistics.median(t for t, _ in eng) * 1e3
            layout = f"TP{pod.tensor_parallel_size} DCP{pod.decode_context_parallel_size}"
            key = "cluster" if name == "default" else f"cluster_{name}"
            ratios[f"{key}_ms_per_token_vs_engine"] = c_ms / e_ms
            ratios[f"{key}_ttft_vs_engine"] = c_ttft / e_ttft
            rows.append(
                {
                    "cluster": f"{name} (decode {layout})",
                    "cluster ms/token": c_ms,
                    "engine ms/token": e_ms,
                    "ms/token ratio": c_ms / e_ms,
                    "target <= 1.5": "ok" if c_ms / e_ms <= 1.5 else "MISSED",
                    "cluster TTFT ms": c_ttft,
                    "engine TTFT ms": e_ttft,
                    "startup s": startup,
                }
            )
            raw["layouts"][name] = {
                "decode_tp": pod.tensor_parallel_size,
                "decode_dcp": pod.decode_context_parallel_size,
                "startup_seconds": startup,
                "cluster_ttft_s": [t for t, _ in clu],
                "cluster_s_per_token": [t for _, t in clu],
                "engine_ttft_s": [t for t, _ in eng],
                "engine_s_per_token": [t for _, t in eng],
            }
    finally:
        engine.shutdown()
    raw["default_topology_here"] = {
        "decode_tp": default.tensor_parallel_size,
        "decode_dcp": default.decode_context_parallel_size,
    }
    return {
        "benchmark": "cluster",
        "quick": quick,
        "table": rows,
        "ratios": ratios,
        **raw,
        "seconds": time.perf_counter() - t_start,
    }
