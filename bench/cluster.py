"""The local cluster end to end (``pdserve bench cluster``): what a user of ``pdserve up`` waits for.

``pdserve up``'s default topology for this machine (router, a prefill pod, a decode pod: the same supervisor,
LocalCluster, started from this process), one streamed request at a time through the router with the SDK, against
the in-process engine (TP 1, this process) on the same prompt, alternating sides round by round:

- ms per token: time from the first streamed token to the last over the tokens after the first (the decode rate a
  user sees), greedy, ``ignore_eos`` so both sides produce the same number of tokens;
- TTFT: request sent to first token (cluster: client-measured, so it includes the router, the prefill pod, the KV
  transfer to the decode pod and the gRPC hops; engine: add_request to the first token out of step()).
- a long generation (``LONG_TOKENS``) on the default cluster through both of a user's paths, the SDK and the OpenAI
  front's chat completions as Server-Sent Events (the HTTP front, the router, the pods: every hop of a token), each
  beside the engine on the same generation, alternating.

Targets: ``ratios.cluster_ms_per_token_vs_engine`` <= 1.5, ``ratios.openai_ms_per_token_vs_engine`` <= 1.1. The full
run adds a cluster whose decode pod runs TP 9 x DCP 3 (nine shared-memory ranks) beside it."""

from __future__ import annotations

import http.client
import json
import statistics
import tempfile
import time
import urllib.parse
from typing import Any

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
LONG_TOKENS = 256  # a long answer: the per-token path dominates it, TTFT does not


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


def _model_of(http_url: str) -> str:
    u = urllib.parse.urlsplit(http_url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=60)
    try:
        conn.request("GET", "/v1/models")
        return json.loads(conn.getresponse().read())["data"][0]["id"]
    finally:
        conn.close()


def _openai_request(http_url: str, model: str, prompt: str, new_tokens: int) -> tuple[float, float]:
    """(ttft_s, s per token after the first) of one chat completion streamed as SSE by the OpenAI front, read the way
    an HTTP client reads it: each ``data:`` event stamped as it arrives, the token count from the usage event."""
    u = urllib.parse.urlsplit(http_url)
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=600)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"the OpenAI front answered {resp.status}: {resp.read()[:500]!r}")
        stamps: list[float] = []
        tokens = 0
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            if line.startswith(b"data: [DONE]"):
                break
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(c["delta"].get("content") for c in event.get("choices", ())):
                stamps.append(now)
    finally:
        conn.close()
    if tokens != new_tokens or len(stamps) < 2:
        raise RuntimeError(f"the OpenAI front streamed {tokens} tokens in {len(stamps)} events, asked {new_tokens}")
    # an event may carry more than one token (held-back bytes of a character): the rate is over the tokens
    return stamps[0] - t0, (stamps[-1] - stamps[0]) / (tokens - 1)


def _long_paths(router: str, http_url: str, rounds: int, engine) -> dict[str, list[tuple[float, float]]]:
    """LONG_TOKENS through the SDK and through the OpenAI front, the engine between them, alternating."""
    model = _model_of(http_url)
    _openai_request(http_url, model, PROMPT, 4)  # warm-up
    out: dict[str, list[tuple[float, float]]] = {"sdk": [], "openai": [], "engine": []}
    for r in range(rounds):
        first, second = ("sdk", "openai") if r % 2 == 0 else ("openai", "sdk")
        for side in (first, "engine", second):
            if side == "sdk":
                out[side].append(_cluster_request(router, PROMPT, LONG_TOKENS))
            elif side == "openai":
                out[side].append(_openai_request(http_url, model, PROMPT, LONG_TOKENS))
            else:
                out[side].append(_engine_request(engine, PROMPT, LONG_TOKENS))
    return out


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
                # the default layout also serves the OpenAI front (any free port) for the long-generation paths
                http_port = 0 if name == "default" else None
                topo = Topology(router_port=0, http_port=http_port).with_overrides(**flags).resolve()
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
                    if name == "default":
                        assert endpoints.http is not None
                        long = _long_paths(endpoints.router, endpoints.http, rounds, engine)
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
    e_long = statistics.median(t for _, t in long["engine"]) * 1e3
    for side, label in (("sdk", "SDK"), ("openai", "OpenAI SSE")):
        ms = statistics.median(t for _, t in long[side]) * 1e3
        target = 1.5 if side == "sdk" else 1.1
        ratios[f"{'cluster_long' if side == 'sdk' else 'openai'}_ms_per_token_vs_engine"] = ms / e_long
        rows.append(
            {
                "cluster": f"default, {LONG_TOKENS} tokens, {label}",
                "cluster ms/token": ms,
                "engine ms/token": e_long,
                "ms/token ratio": ms / e_long,
                f"target <= {target}": "ok" if ms / e_long <= target else "MISSED",
                "cluster TTFT ms": statistics.median(t for t, _ in long[side]) * 1e3,
                "engine TTFT ms": statistics.median(t for t, _ in long["engine"]) * 1e3,
            }
        )
    raw["long"] = {
        "new_tokens": LONG_TOKENS,
        **{
            f"{side}_{what}": [x[i] for x in v]
            for side, v in long.items()
            for i, what in ((0, "ttft_s"), (1, "s_per_token"))
        },
    }
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
