"""`pdserve bench dcp`: what Decode Context Parallelism buys a decode pod whose KV memory is the limit.

The DCP result it reproduces at pod scale (vLLM's "Decode Context Parallel" write-up for DeepSeek models): under
tensor parallelism alone an MLA model's latent KV (or an MQA model's one KV head) is whole on every rank, so the KV
budget fills at a small batch; with DCP each rank keeps 1/DCP of every request's tokens, the pod holds DCP times the
requests, and the weights read once per step serve that many more tokens.

Per model, a decode pod at TP 2 x DCP 1 and at TP 2 x DCP 2 with the same KV blocks per rank (sized so TP only
holds ``FIT_SEQS`` requests of the mean length), fed over kv_transfer's TCP path by a TP 1 engine that publishes
each prompt's KV as a prefill pod does (pdserve.testing.EnginePrefill; the prompts are prefilled once before the
sweep and every request pulls its own copy on a fresh lease, so TTFT here is queueing + transfer, not prefill).
Concurrency C: C clients each keep one request in flight (prompt lengths and output lengths drawn from fixed
lists, greedy, ignore_eos). Admission is the router's, done here: a request waits until the pod reserves its
prompt and its whole output (AllocateKV with num_reserved_output_tokens), so the pod never preempts and a request
either decodes or waits. Each point is measured over a window that opens when the first request finishes (the
batch is full and mixed by then) and lasts ``window_s``; then every request still in flight is cancelled.

Per point: output tok/s (pod and per rank), requests running / waiting, KV usage (blocks held / blocks, every rank),
preemptions, TPOT p50/p99 of requests that finished in the window, TTFT p50/p99 of requests that started in it, and
the step time split on the driver rank: Python (the step minus the ranks' model call), and inside the model call
(MLA's op path) attention, DCP merge (all-gather of partial outputs and LSE) and TP all-reduces; the rest of the
model call is weights (linears, experts, LM head) and small ops. A least-squares model of the step time, ``a + b *
batch + c * local KV tokens``, fitted on every step of a layout, predicts each point's tok/s and the DCP 8 / TP 8
ratio of the same per-rank model.

Models (random weights, written with transformers' own classes so the pods load real checkpoints): an MLA + MoE
model with DeepSeek-V3's attention dims (kv_lora_rank 512 + rope 64, qk_nope 128, v 128) and 16 heads (V3's heads
per rank at TP 8), hidden 1024, 4 layers (one dense), 8 routed experts (top 2 in 2 of 4 groups) + 1 shared: ~170 MB
of fp32 weights per rank at TP 2, so that a batch-1 step reads weights for longer than its Python takes; an MQA
Llama of about the same weight bytes per rank (16 query heads of 128, one KV head). SmolLM2-135M at TP 9 x DCP 1
and DCP 3 in the full run only.

Quick mode: shorter prompts and outputs, concurrency 4-64, a shorter window, no SmolLM2 (the JSON's ``workload``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import BenchUnavailable, machine

BLOCK = 16
FIT_SEQS = 24  # TP-only pod holds this many requests of the mean length (the issue: 16-32)

MLA_SHAPE: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=2048,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=384,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    max_position_embeddings=8192,
)
MQA_SHAPE: dict[str, Any] = dict(
    vocab_size=8192,
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=1,
    head_dim=128,
    max_position_embeddings=8192,
)


@dataclass
class Workload:
    prompt_lens: tuple[int, ...]
    output_lens: tuple[int, ...]
    concurrency: tuple[int, ...]
    window_s: float
    fit_seqs: int = FIT_SEQS
    models: tuple[str, ...] = ("mla", "mqa")

    @property
    def mean_tokens(self) -> float:
        return statistics.mean(self.prompt_lens) + statistics.mean(self.output_lens)


QUICK = Workload((512, 640, 768, 896), (32, 48, 64, 80, 96), (4, 8, 16, 32, 64), 12.0)
FULL = Workload(
    (1024, 1365, 1707, 2048),
    (128, 160, 192, 224, 256),
    (4, 8, 16, 32, 64, 128, 256),
    40.0,
    models=("mla", "mqa", "smollm2"),
)


def kv_blocks_per_rank(mean_tokens: float, fit_seqs: int, block: int = BLOCK) -> int:
    """KV blocks of one rank such that a TP-only pod (every rank holds every token) holds fit_seqs requests of
    mean_tokens each; a DCP d pod with the same blocks holds about d times as many."""
    return fit_seqs * math.ceil(mean_tokens / block)


def local_blocks(num_tokens: int, dcp: int, dcp_rank: int, interleave: int = 1, block: int = BLOCK) -> int:
    from pdserve.engine.block_manager import dcp_local_count

    return math.ceil(dcp_local_count(num_tokens, dcp, interleave, dcp_rank) / block)


# --- checkpoints ---
def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "bench-dcp"


def write_checkpoint(kind: str, shape: dict[str, Any], root: Path | None = None) -> Path:
    """A random-weight checkpoint written by transformers' own model class (cached by shape: writing takes time)."""
    import transformers

    arch = {"mla": "DeepseekV3", "mqa": "Llama"}[kind]
    key = hashlib.sha256(json.dumps([arch, shape], sort_keys=True).encode()).hexdigest()[:12]
    path = (root or _cache_dir()) / f"{kind}-{key}"
    if (path / "model.safetensors").exists() or (path / "model.safetensors.index.json").exists():
        return path
    cfg = getattr(transformers, f"{arch}Config")(
        **shape, bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32"
    )
    cfg.architectures = [f"{arch}ForCausalLM"]
    torch.manual_seed(0)
    model = getattr(transformers, f"{arch}ForCausalLM")(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # zero in a fresh V3, not in a trained one
                b.normal_(0, 0.1)
    tmp = path.with_name(path.name + ".part")
    model.save_pretrained(str(tmp), safe_serialization=True)
    del model
    _copy_tokenizer(tmp)
    tmp.rename(path)
    return path


def _copy_tokenizer(path: Path) -> None:
    """The default model's tokenizer (pods load one; the bench feeds token ids, so its vocabulary never matters)."""
    import shutil

    from pdserve.default_model import ensure_default_model

    src = Path(ensure_default_model())
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, path / f)


def weight_bytes_per_rank(model_path: str, tp: int) -> dict[str, int]:
    """Bytes of fp32 weights one TP rank reads in a decode step of a large batch (every expert chosen by some
    token; the embedding is only indexed), from the model's own per-rank shapes built on the meta device."""
    from pdserve.attention import select_backend
    from pdserve.model.config import ModelConfig
    from pdserve.model.parallel_state import ParallelState
    from pdserve.model.registry import build_model

    mc = ModelConfig.from_path(model_path)
    with torch.device("meta"):
        model = build_model(mc, ParallelState(tp_size=tp), select_backend("cpu"), max_positions=16)
    layers = sum(p.numel() * 4 for n, p in model.named_parameters() if n.startswith("layers."))
    vocab_rows = model.ps.vocab_shard(mc.vocab_size)[1]
    return {"layers": layers, "lm_head_shard": vocab_rows * mc.hidden_size * 4}


# --- one pod, one concurrency ---
@dataclass
class _Req:
    rid: str
    prompt: list[int]
    max_tokens: int
    t_submit: float
    t_first: float | None = None
    t_last: float | None = None
    made: int = 0


@dataclass
class StepRecord:
    t: float
    dt: float
    batch: int
    local_kv_tokens: int  # on the busiest rank
    model_s: float
    parts: dict[str, float] = field(default_factory=dict)


class _Timers:
    """Wall time of the driver rank's model call and, where the model goes op by op, of its attention, DCP merge
    and TP all-reduces, per step (monkeypatched on this process's objects; other ranks are not timed)."""

    def __init__(self, engine: Any) -> None:
        self.acc: dict[str, float] = {}
        ex = engine.executor
        self._wrap(ex, "execute", "model")
        runner = ex.runner
        ps = runner.ps
        self._wrap(ps, "dcp_merge", "dcp_merge")
        self._wrap(ps, "all_reduce", "all_reduce")
        layers = getattr(runner.model, "layers", [])
        if layers and hasattr(layers[0], "self_attn") and hasattr(layers[0].self_attn, "backend"):
            backend = layers[0].self_attn.backend
            if hasattr(backend, "forward_decode"):
                self._wrap(backend, "forward_decode", "attention")

    def _wrap(self, obj: Any, name: str, key: str) -> None:
        fn = getattr(obj, name)
        acc = self.acc

        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[key] = acc.get(key, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        self.acc.clear()
        return out


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def run_point(
    pod: Any,
    prefill: Any,
    prompts: list[list[int]],
    wl: Workload,
    concurrency: int,
    timers: _Timers,
    seed: int,
) -> tuple[dict[str, Any], list[StepRecord]]:
    """C clients, one request each in flight, for the window; returns the point's figures and its window steps."""
    from decode_svc.kv_source import PullerFactory, TransferKVSource
    from decode_svc.pod import Failure
    from pdserve.sampling_params import SamplingParams

    rng = random.Random(seed)
    factory = PullerFactory.for_engine(pod.engine, backend="tcp")
    sched = pod.engine.scheduler
    pre0 = sched.num_preemptions
    n_ranks = pod.tp
    total_blocks = pod.num_blocks
    waiting: list[_Req] = []  # at the "router": no KV room on the pod yet
    live: dict[str, _Req] = {}
    done: list[_Req] = []
    seq_no = [0]

    def new_request(now: float) -> None:
        i = rng.randrange(len(prompts))
        seq_no[0] += 1
        waiting.append(_Req(f"c{concurrency}-{seq_no[0]}", prompts[i], rng.choice(wl.output_lens), now))

    t0 = time.perf_counter()
    for _ in range(concurrency):
        new_request(t0)
    window_start: float | None = None
    window_end = math.inf
    steps: list[StepRecord] = []
    samples: list[tuple[int, int, float]] = []  # (running, waiting, kv used fraction) per window step
    tokens_in_window = 0
    timers.take()
    while True:
        now = time.perf_counter()
        if now >= window_end:
            break
        if window_start is None and now - t0 > 600:
            raise RuntimeError(f"no request finished within 600 s at concurrency {concurrency}")
        while waiting:  # admission as the router's: reserve prompt + whole output, or wait
            r = waiting[0]
            if pod.reserve(r.rid, len(r.prompt), r.max_tokens - 1) is None:
                break
            waiting.pop(0)
            first, lp = prefill.prefill(r.prompt)
            src = TransferKVSource(prefill.handoff(r.prompt).to_json(), len(r.prompt), factory, 120.0)
            sp = SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True)
            live[r.rid] = r
            out = pod.submit(r.rid, r.prompt, sp, first, lp, src)
            if out is not None:
                raise RuntimeError("expected the asynchronous KV load")
        if pod.only_receiving() or not pod.has_work():
            time.sleep(0.002)
            events = pod.step() if pod.has_work() else []
            dt = 0.0
        else:
            batch = len(sched.running)
            local = _local_kv_tokens(pod)
            t = time.perf_counter()
            events = pod.step()
            dt = time.perf_counter() - t
            parts = timers.take()
            if window_start is not None:
                steps.append(StepRecord(t, dt, batch, local, parts.pop("model", 0.0), parts))
                used = max(pod.used_blocks_per_rank())
                samples.append((batch, len(waiting) + pod.num_waiting, used / total_blocks))
        tnow = time.perf_counter()
        for ev in events:
            if isinstance(ev, Failure):
                raise RuntimeError(f"request {ev.request_id} failed: {ev.message}")
            req = live.get(ev.request_id)
            if req is None:
                continue
            r = req
            n = len(ev.new_token_ids)
            if n and r.t_first is None:
                r.t_first = tnow
            r.made += n
            if n:
                r.t_last = tnow
            if window_start is not None and dt > 0:
                tokens_in_window += n
            if ev.finished:
                del live[r.rid]
                done.append(r)
                if window_start is None:
                    window_start = tnow
                    window_end = tnow + wl.window_s
                new_request(tnow)
    window = time.perf_counter() - (window_start or t0)
    seen = done + list(live.values())  # TTFT counts requests whose first token came in the window, finished or not
    for rid in list(live):
        pod.cancel(rid)
    for r in waiting:
        pod.cancel(r.rid)
    while not pod.idle():  # given-up transfers hand their blocks back once no rank writes
        pod.step()
        time.sleep(0.002)
    assert window_start is not None
    tpot = [
        (r.t_last - r.t_first) / (r.made - 1)
        for r in done
        if r.t_first is not None and r.t_last is not None and r.t_last >= window_start and r.made > 1
    ]
    started = [r for r in seen if r.t_first is not None and r.t_first >= window_start]
    ttft = [r.t_first - r.t_submit for r in started if r.t_first is not None]
    run_mean = statistics.mean(s[0] for s in samples) if samples else 0.0
    point = {
        "concurrency": concurrency,
        "window_s": window,
        "steps": len(steps),
        "output_tok_s": tokens_in_window / window,
        "output_tok_s_per_rank": tokens_in_window / window / n_ranks,
        "running_mean": run_mean,
        "running_max": max((s[0] for s in samples), default=0),
        "waiting_mean": statistics.mean(s[1] for s in samples) if samples else 0.0,
        "kv_usage_mean": statistics.mean(s[2] for s in samples) if samples else 0.0,
        "kv_usage_max": max((s[2] for s in samples), default=0.0),
        "preemptions": sched.num_preemptions - pre0,
        "tpot_s": {"p50": _pct(tpot, 50), "p99": _pct(tpot, 99), "n": len(tpot)},
        "ttft_s": {"p50": _pct(ttft, 50), "p99": _pct(ttft, 99), "n": len(ttft)},
        "step_s_median": _pct([s.dt for s in steps], 50),
        "split_s_per_step": _split(steps),
    }
    return point, steps


def _local_kv_tokens(pod: Any) -> int:
    """KV tokens the busiest rank attends over in the next decode step (every running sequence's tokens, 1/DCP)."""
    from pdserve.engine.block_manager import dcp_local_count

    total = [0] * pod.dcp
    for s in pod.engine.scheduler.running:
        n = s.num_tokens
        for r in range(pod.dcp):
            total[r] += dcp_local_count(n, pod.dcp, pod.interleave, r)
    return max(total)


def _split(steps: list[StepRecord]) -> dict[str, float]:
    """Mean seconds per step: python (step minus the model call), and the driver's timed parts of the model call."""
    if not steps:
        return {}
    n = len(steps)
    out = {"step": sum(s.dt for s in steps) / n, "model_call": sum(s.model_s for s in steps) / n}
    out["python"] = out["step"] - out["model_call"]
    keys = sorted({k for s in steps for k in s.parts})
    for k in keys:
        out[k] = sum(s.parts.get(k, 0.0) for s in steps) / n
    out["weights_and_small_ops"] = out["model_call"] - sum(out[k] for k in keys)
    return out


# --- the step-time model ---
def _nnls(rows: list[tuple[float, ...]], y: list[float]) -> list[float] | None:
    """Non-negative least squares for a few terms: the NNLS optimum is the least-squares fit on some subset of the
    terms with no negative coefficient, so try every subset."""
    x = torch.tensor(rows, dtype=torch.float64)
    yt = torch.tensor(y, dtype=torch.float64).unsqueeze(1)
    m = x.shape[1]
    best: tuple[float, list[float]] | None = None
    for mask in range(1, 1 << m):
        cols = [j for j in range(m) if mask >> j & 1]
        sol = torch.linalg.lstsq(x[:, cols], yt).solution.squeeze(1).tolist()
        if min(sol) < 0:
            continue
        coef = [0.0] * m
        for j, v in zip(cols, sol):
            coef[j] = v
        resid = float(((x @ torch.tensor(coef, dtype=torch.float64).unsqueeze(1) - yt) ** 2).sum())
        if best is None or resid < best[0]:
            best = (resid, coef)
    return None if best is None else best[1]


def fit_step_model(points: list[list[StepRecord]]) -> dict[str, float] | None:
    """Step seconds = a + b * batch + c * local KV tokens (per rank), fitted to each sweep point's mean step, batch
    and local KV (a point's rate is its batch over its mean step; every point weighs the same however many steps it
    ran), with no negative term: no part of a step costs less than nothing.

    In a sweep whose prompts come from one distribution, KV grows with the batch, so the step time alone cannot tell
    a per-sequence cost from a per-KV-token one. Where the driver timed its attention (the op-by-op path), c comes
    from that time against the local KV and a, b from the rest of the step; else all three from the step
    (``attention_timed`` 0: b and c then share what they cannot be told apart by)."""
    pts = []
    for steps in points:
        sel = [s for s in steps if s.batch > 0]
        if sel:
            n = len(sel)
            att = [s.parts.get("attention") for s in sel]
            pts.append(
                (
                    sum(s.batch for s in sel) / n,
                    sum(s.local_kv_tokens for s in sel) / n,
                    sum(s.dt for s in sel) / n,
                    None if None in att else sum(a for a in att if a is not None) / n,
                )
            )
    if len(pts) < 3:
        return None
    if all(p[3] is not None for p in pts):
        (c,) = _nnls([(k,) for _, k, _, _ in pts], [att for _, _, _, att in pts if att is not None]) or [0.0]
        ab = _nnls([(1.0, b) for b, _, _, _ in pts], [dt - c * k for _, k, dt, _ in pts])
        if ab is None:
            return None
        return {"a_s": ab[0], "b_s_per_seq": ab[1], "c_s_per_kv_token": c, "attention_timed": 1.0}
    abc = _nnls([(1.0, b, k) for b, k, _, _ in pts], [dt for _, _, dt, _ in pts])
    if abc is None:
        return None
    return {"a_s": abc[0], "b_s_per_seq": abc[1], "c_s_per_kv_token": abc[2], "attention_timed": 0.0}


def predict_tok_s(model: dict[str, float], batch: float, local_kv_tokens: float) -> float:
    dt = model["a_s"] + model["b_s_per_seq"] * batch + model["c_s_per_kv_token"] * local_kv_tokens
    return batch / dt if dt > 0 else math.nan


# --- one model: both layouts ---
def _prompts(lens: tuple[int, ...], vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[1] + [rng.randrange(10, vocab - 10) for _ in range(n - 1)] for n in lens]


def run_model(
    name: str,
    path: str,
    tp: int,
    dcps: tuple[int, ...],
    wl: Workload,
    device: str = "cpu",
    concurrency: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    from decode_svc.config import DecodeConfig
    from decode_svc.pod import DecodePod
    from pdserve.cli_config import build
    from pdserve.model.config import ModelConfig
    from pdserve.testing import EnginePrefill

    mc = ModelConfig.from_path(path)
    blocks = kv_blocks_per_rank(wl.mean_tokens, wl.fit_seqs)
    max_len = max(wl.prompt_lens) + max(wl.output_lens) + BLOCK
    prompts = _prompts(wl.prompt_lens, mc.vocab_size)
    t = time.perf_counter()
    prefill = EnginePrefill(path, num_kv_blocks=sum(math.ceil(n / BLOCK) for n in wl.prompt_lens) + 8)
    for p in prompts:
        prefill.prefill(p)
    prefill_s = time.perf_counter() - t
    layouts: dict[str, Any] = {}
    try:
        for dcp in dcps:
            cfg = build(
                DecodeConfig,
                model=path,
                tensor_parallel_size=tp,
                decode_context_parallel_size=dcp,
                block_size=BLOCK,
                num_kv_blocks=blocks,
                max_model_len=max_len,
                max_num_seqs=4096,
                max_num_batched_tokens=max(4096, max_len),
                enable_prefix_caching=False,
                device=device,
            )
            t = time.perf_counter()
            pod = DecodePod(cfg)
            startup = time.perf_counter() - t
            try:
                timers = _Timers(pod.engine)
                points, all_steps = [], []
                for i, c in enumerate(concurrency or wl.concurrency):
                    pt, steps = run_point(pod, prefill, prompts, wl, c, timers, seed=1000 * dcp + i)
                    points.append(pt)
                    all_steps += steps
                    print(
                        f"  {name} TP{tp} DCP{dcp} C={c}: {pt['output_tok_s']:.1f} tok/s, running "
                        f"{pt['running_mean']:.1f}, waiting {pt['waiting_mean']:.1f}, KV {pt['kv_usage_mean']:.0%}",
                        flush=True,
                    )
                per_point = [all_steps[lo:hi] for lo, hi in _ranges(all_steps, points)]
                model = fit_step_model(per_point)
                for pt, sel in zip(points, per_point):
                    if model and sel:
                        b = statistics.mean(s.batch for s in sel)
                        k = statistics.mean(s.local_kv_tokens for s in sel)
                        pt["model_tok_s"] = predict_tok_s(model, b, k)
                        pt["local_kv_tokens_mean"] = k
                layouts[f"dcp{dcp}"] = {
                    "tp": tp,
                    "dcp": dcp,
                    "kv_blocks_per_rank": blocks,
                    "startup_s": startup,
                    "collectives": pod.engine.executor.collectives,
                    "points": points,
                    "step_model": model,
                }
            finally:
                pod.shutdown()
    finally:
        prefill.close()
    return {
        "model": name,
        "path_shape": mc.raw,
        "weights_bytes_per_rank": weight_bytes_per_rank(path, tp),
        "kv_bytes_per_token_per_rank_dcp1": _kv_bytes_per_token(path, tp),
        "prefill_once_s": prefill_s,
        "layouts": layouts,
    }


def _ranges(steps: list[StepRecord], points: list[dict[str, Any]]) -> list[tuple[int, int]]:
    out, at = [], 0
    for pt in points:
        out.append((at, at + pt["steps"]))
        at += pt["steps"]
    return out


def _kv_bytes_per_token(path: str, tp: int) -> float:
    from pdserve.engine.kv_cache import KVCacheLayout
    from pdserve.model.config import ModelConfig

    mc = ModelConfig.from_path(path)
    return KVCacheLayout.for_model(mc, tp, BLOCK).bytes_per_block(torch.float32) / BLOCK


# --- ratios, table, plot ---
def summarize(key: str, res: dict[str, Any], dcp_hi: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    lo, hi = res["layouts"]["dcp1"], res["layouts"][f"dcp{dcp_hi}"]
    rows = []
    for lay in (lo, hi):
        for p in lay["points"]:
            rows.append(
                {
                    "model": res["model"],
                    "layout": f"TP{lay['tp']} DCP{lay['dcp']}",
                    "C": p["concurrency"],
                    "tok/s": p["output_tok_s"],
                    "tok/s/rank": p["output_tok_s_per_rank"],
                    "model tok/s": p.get("model_tok_s", math.nan),
                    "running": p["running_mean"],
                    "waiting": p["waiting_mean"],
                    "KV %": 100 * p["kv_usage_mean"],
                    "preempt": p["preemptions"],
                    "TPOT p50/p99 ms": _ms(p["tpot_s"]),
                    "TTFT p50/p99 ms": _ms(p["ttft_s"]),
                    "step ms": 1e3 * (p["step_s_median"] or math.nan),
                }
            )

    def peak(lay: dict[str, Any]) -> dict[str, Any]:
        return max(lay["points"], key=lambda p: p["output_tok_s"])

    def max_conc(lay: dict[str, Any]) -> int:
        return max((p["running_max"] for p in lay["points"] if p["preemptions"] == 0), default=0)

    ratios = {
        f"{key}_dcp{dcp_hi}_peak_tok_s_vs_dcp1_peak": peak(hi)["output_tok_s"] / peak(lo)["output_tok_s"],
        f"{key}_dcp{dcp_hi}_max_concurrency_vs_dcp1": max_conc(hi) / max(1, max_conc(lo)),
        f"{key}_dcp{dcp_hi}_kv_usage_at_peak": peak(hi)["kv_usage_mean"],
    }
    # Equal batch and context: the largest concurrency at which both layouts ran every request at once.
    both = [
        (p, q)
        for p in lo["points"]
        for q in hi["points"]
        if p["concurrency"] == q["concurrency"] and p["waiting_mean"] < 0.5 and q["waiting_mean"] < 0.5
    ]
    if both:
        p, q = both[-1]
        ratios[f"{key}_dcp{dcp_hi}_step_vs_dcp1_at_c{p['concurrency']}"] = q["step_s_median"] / p["step_s_median"]
    errs = [
        abs(p["model_tok_s"] / p["output_tok_s"] - 1)
        for lay in (lo, hi)
        for p in lay["points"]
        if p.get("model_tok_s") and p["output_tok_s"] > 0
    ]
    if errs:
        ratios[f"{key}_step_model_max_error"] = max(errs)
    m = lo.get("step_model")
    # Only a fit that tells per-sequence from per-KV-token costs apart (attention timed) says how 8x the requests
    # would cost; the other's split between them is arbitrary.
    if m and m.get("attention_timed"):
        # The TP-only fit carried to 8 ranks: DCP 8 holds 8x the requests in the same blocks. Each rank attends with
        # its whole DCP group's heads over 1/DCP of the tokens, so its attention FLOPs grow 8x with the batch while
        # the bytes it reads stay those of the TP-only pod: two bounds, by which of them the attention is bound by.
        n = max_conc(lo)
        k = peak(lo).get("local_kv_tokens_mean", 0.0)
        base = predict_tok_s(m, n, k)
        ratios[f"{key}_model_8_ranks_dcp8_vs_dcp1_attention_bytes_bound"] = predict_tok_s(m, 8 * n, k) / base
        ratios[f"{key}_model_8_ranks_dcp8_vs_dcp1_attention_flops_bound"] = predict_tok_s(m, 8 * n, 8 * k) / base
    return rows, ratios


def _ms(d: dict[str, Any]) -> str:
    if d.get("p50") is None:
        return "-"
    return f"{1e3 * d['p50']:.0f}/{1e3 * d['p99']:.0f}"


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, res in zip(axes[0], results.values()):
        for lay in res["layouts"].values():
            pts = lay["points"]
            c = [p["concurrency"] for p in pts]
            tok = [p["output_tok_s"] for p in pts]
            label = f"TP{lay['tp']} x DCP{lay['dcp']}"
            fits = [i for i, p in enumerate(pts) if p["waiting_mean"] < 0.5]
            end = (fits[-1] + 1) if fits else 1
            (line,) = ax.plot(c[:end], tok[:end], marker="o", label=label)
            if end < len(c):  # past its KV: requests wait, the batch stops growing
                ax.plot(c[end - 1 :], tok[end - 1 :], linestyle=":", color=line.get_color(), marker="x")
                ax.annotate("KV full", (c[end - 1], tok[end - 1]), textcoords="offset points", xytext=(4, -12))
        ax.set_xscale("log", base=2)
        ax.set(xlabel="requests in flight", ylabel="output tok/s (pod)", title=res["model"])
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(quick: bool = False, device: str = "cpu", out: str | None = None) -> dict[str, Any]:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BenchUnavailable("--device cuda: torch sees no CUDA device here")
    wl = QUICK if quick else FULL
    t0 = time.perf_counter()
    results: dict[str, dict[str, Any]] = {}
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    names = {"mla": "MLA+MoE (DeepSeek-V3 attention dims)", "mqa": "MQA Llama"}
    for key in wl.models:
        if key == "smollm2":
            from pdserve.default_model import ensure_default_model

            res = run_model("SmolLM2-135M", str(ensure_default_model()), 9, (1, 3), wl, device, (4, 16, 64))
            r, q = summarize(key, res, 3)
        else:
            path = write_checkpoint(key, MLA_SHAPE if key == "mla" else MQA_SHAPE)
            res = run_model(names[key], str(path), 2, (1, 2), wl, device)
            r, q = summarize(key, res, 2)
        results[key] = res
        rows += r
        ratios.update(q)
    result: dict[str, Any] = {
        "benchmark": "dcp",
        "quick": quick,
        "device": device,
        "table": rows,
        "ratios": ratios,
        "workload": {
            "prompt_lens": list(wl.prompt_lens),
            "output_lens": list(wl.output_lens),
            "concurrency": list(wl.concurrency),
            "window_s": wl.window_s,
            "fit_seqs_tp_only": wl.fit_seqs,
            "kv_blocks_per_rank": kv_blocks_per_rank(wl.mean_tokens, wl.fit_seqs),
            "block_size": BLOCK,
            "dtype": "float32",
            "kv_path": "kv_transfer TCP from a TP 1 engine publishing each prompt's KV (prefilled once before the "
            "sweep; every request pulls its own copy on a fresh lease), --kv-load async",
            "admission": "prompt + whole output reserved before the transfer (AllocateKV), so no preemption",
            "quick_note": "quick: prompts 512-896 (full 1024-2048), outputs 32-96 (full 128-256), C 4-64 (full "
            "4-256), 12 s windows (full 40 s), no SmolLM2"
            if quick
            else "",
        },
        "results": results,
        "seconds": time.perf_counter() - t0,
        "machine": machine(),
    }
    if out:
        png = Path(out).with_suffix(".png")
        plot(results, png)
        result["plot"] = str(png)
    return result
