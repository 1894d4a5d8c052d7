"""Decode pod benchmark (`pdserve bench decode`), in one run:

1. Decode tokens/s of a decode pod serving SmolLM2-135M at TP 9 (DCP 3, and DCP 1 in the full run), its ranks
   talking through shared memory (the default) and through gloo, at batch 1 and 32 (and 8 in the full run), against
   the in-process engine (TP 1) on the same prompts, and against transformers' generate. The prompt KV reaches the
   pod over kv_transfer (TCP), published by a TP 1 engine as a prefill pod publishes it. Decode = tokens after the
   first over the time after the first token, on every side.
2. KV capacity: for a fixed per-rank KV budget, how many 2,048-token sequences AllocateKV admits at DCP 1, 2 and 3
   (SmolLM2 at TP 9 where the parallel rules allow it; a tiny 12-query / 1-KV-head checkpoint at TP 6 for all three).
   Target: count(DCP d) >= 0.95 * d * count(DCP 1).

3. Sampling cost per decode step at batch 8 on the in-process engine (SmolLM2, TP 1), plain seeded sampling against
   the same with presence / frequency / repetition penalties and against a structured-output constraint (xgrammar's
   token bitmask, a JSON schema), each decode step timed, side by side in interleaved rounds; the ratio compares the
   fastest steps (robust to other load), medians are reported too. Target: ratio <= 1.15.

Quick mode: fewer tokens, batches 1 and 32, and the TP 9 x DCP 3 pod only (shared memory and gloo); fewer sampling
rounds."""
from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import timed

CAPACITY_SEQ_LEN = 2048
CAPACITY_BUDGET_MIB = 256  # per rank
CAPACITY_BLOCK = 16


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[1] + [(97 * i + 31 * j + 7) % (vocab - 10) + 10 for j in range(length - 1)] for i in range(n)]


# --- decode throughput ---
def _pod_decode_tok_s(pod, prefill, prompts: list[list[int]], new_tokens: int) -> float:
    """Submit every request (KV pulled from prefill's publisher), then time the decode steps until all finished."""
    from decode_svc.kv_source import PullerFactory, TransferKVSource
    from pdserve.sampling import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    factory = PullerFactory.for_engine(pod.engine, backend="tcp")
    ids = []
    for prompt in prompts:
        rid = f"b{time.monotonic_ns()}"
        first, lp = prefill.prefill(prompt)
        src = TransferKVSource(prefill.handoff(prompt).to_json(), len(prompt), factory, 120.0)
        out = pod.submit(rid, prompt, sp, first, lp, src)
        if out is None:
            raise RuntimeError("decode pod has too few KV blocks for the benchmark batch")
        ids.append(rid)
    produced = 0
    t0 = time.perf_counter()
    while pod.has_work():
        produced += sum(len(o.new_token_ids) for o in pod.step() if hasattr(o, "new_token_ids"))
    dt = time.perf_counter() - t0
    if not pod.idle():
        raise RuntimeError("decode pod did not drain after the benchmark batch")
    return produced / dt


def _hf_decode_tok_s(model, prompts: list[list[int]], new_tokens: int, repeat: int = 1) -> float:
    ids = torch.tensor(prompts)
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t1 = timed(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), repeat)
        tn = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw), repeat)
    return len(prompts) * (new_tokens - 1) / max(tn - t1, 1e-9)


def _engine_decode_tok_s(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """The in-process engine: prefill every prompt, then time the decode steps (tokens after the first)."""
    from pdserve.sampling import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = {engine.add_request(p, sp) for p in prompts}
    started: set[str] = set()
    while len(started) < len(ids):  # prefill steps until every request has its first token
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    produced, t0 = 0, time.perf_counter()
    while engine.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in engine.step())
    return produced / (time.perf_counter() - t0)


def _throughput(quick: bool) -> tuple[list[dict], dict[str, float], dict[str, Any]]:
    from transformers import AutoModelForCausalLM

    from decode_svc.config import DecodeConfig
    from pdserve.cli_config import build
    from decode_svc.pod import DecodePod
    from pdserve.default_model import ensure_default_model
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.testing import EnginePrefill

    path = str(ensure_default_model())
    batches = (1, 32) if quick else (1, 8, 32)
    prompt_len = 32 if quick else 128
    new_tokens = 8 if quick else 32
    pods = [(9, 3, "shm"), (9, 3, "gloo")] if quick else [(9, 3, "shm"), (9, 1, "shm"), (9, 3, "gloo")]
    t_start = time.perf_counter()
    blocks = math.ceil((prompt_len + new_tokens) / 16) * max(batches) + 8
    engine = LLMEngine(EngineConfig(model=path, num_kv_blocks=blocks, max_num_seqs=64, enable_prefix_caching=False))
    try:
        prompts = _prompts(max(batches), prompt_len, engine.model_config.vocab_size)
        _engine_decode_tok_s(engine, prompts[:1], 3)  # warm-up
        engine_tok_s = {bs: _engine_decode_tok_s(engine, prompts[:bs], new_tokens) for bs in batches}
    finally:
        engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf_tok_s = {bs: _hf_decode_tok_s(hf, prompts[:bs], new_tokens, 1 if quick else 2) for bs in batches}
    del hf
    pod_tok_s: dict[tuple[int, int, str], dict[int, float]] = {}
    startup_s: dict[str, float] = {}
    per_seq = prompt_len + new_tokens
    # The prefill side: every prompt prefilled once by a TP 1 engine, its KV published on a new lease per request.
    prefill = EnginePrefill(path, num_kv_blocks=math.ceil(prompt_len / 16) * max(batches) + 8)
    for tp, dcp, coll in pods:
        blocks = math.ceil(math.ceil(per_seq / dcp) / 16) * max(batches) + 8
        cfg = build(DecodeConfig, model=path, tensor_parallel_size=tp, decode_context_parallel_size=dcp, block_size=16,
                    num_kv_blocks=blocks, max_model_len=512, max_num_seqs=64, cpu_collectives=coll)
        t0 = time.perf_counter()
        pod = DecodePod(cfg)
        startup_s[f"tp{tp}_dcp{dcp}_{coll}"] = time.perf_counter() - t0
        try:
            _pod_decode_tok_s(pod, prefill, prompts[:1], 3)  # warm-up
            pod_tok_s[(tp, dcp, coll)] = {bs: _pod_decode_tok_s(pod, prefill, prompts[:bs], new_tokens)
                                          for bs in batches}
        finally:
            pod.shutdown()
    prefill.close()
    rows, ratios = [], {}
    for bs in batches:
        row: dict[str, Any] = {"metric": f"decode tok/s, batch {bs}", "engine TP1": engine_tok_s[bs],
                               "transformers": hf_tok_s[bs]}
        for (tp, dcp, coll), d in pod_tok_s.items():
            row[f"TP{tp} DCP{dcp} {coll}"] = d[bs]
        for (tp, dcp, coll), d in pod_tok_s.items():
            r = d[bs] / engine_tok_s[bs]
            row[f"TP{tp} DCP{dcp} {coll} / engine"] = r
            suffix = "" if coll == "shm" else f"_{coll}"
            ratios[f"decode_pod_tp{tp}_dcp{dcp}{suffix}_bs{bs}_vs_engine"] = r
            ratios[f"decode_bs{bs}_tp{tp}_dcp{dcp}{suffix}_vs_transformers"] = d[bs] / hf_tok_s[bs]
        rows.append(row)
    for bs in batches:  # the headline names: the shared-memory TP 9 x DCP 3 pod against transformers
        ratios[f"decode_bs{bs}_vs_transformers"] = pod_tok_s[(9, 3, "shm")][bs] / hf_tok_s[bs]
    raw = {"model": "SmolLM2-135M-Instruct", "prompt_tokens": prompt_len, "new_tokens": new_tokens,
           "batches": list(batches),
           "decode_tok_s": {f"tp{tp}_dcp{dcp}_{c}": {str(b): v for b, v in d.items()}
                            for (tp, dcp, c), d in pod_tok_s.items()},
           "engine_decode_tok_s": {str(b): v for b, v in engine_tok_s.items()},
           "transformers_decode_tok_s": {str(b): v for b, v in hf_tok_s.items()},
           "pod_startup_seconds": startup_s,
           "threads": {"engine": torch.get_num_threads(), "transformers": torch.get_num_threads(),
                       "pod_per_rank": "max(1, cores // tp)"},
           "throughput_seconds": time.perf_counter() - t_start}
    return rows, ratios, raw


# --- KV capacity: the AllocateKV admission path (DecodePod.reserve) over the engine's block manager ---
def _admitted(model_path: str, tp: int, dcp: int, budget_bytes: int) -> dict[str, Any]:
    from decode_svc.config import DecodeConfig
    from pdserve.cli_config import build
    from decode_svc.pod import DecodePod
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.model.config import ModelConfig
    from pdserve.parallel_config import ParallelConfigError

    mc = ModelConfig.from_path(model_path)
    heads_per_rank = max(1, mc.num_kv_heads // tp)
    block_bytes = mc.num_layers * 2 * CAPACITY_BLOCK * heads_per_rank * mc.head_dim * 4  # fp32 cache
    num_blocks = budget_bytes // block_bytes
    try:
        cfg = build(DecodeConfig, model=model_path, tensor_parallel_size=tp, decode_context_parallel_size=dcp,
                    block_size=CAPACITY_BLOCK, num_kv_blocks=num_blocks, max_num_seqs=1_000_000)
    except ParallelConfigError as e:
        return {"allowed": False, "refusal": e.message, "blocks_per_rank": num_blocks}
    # Admission is pure block accounting: an engine without model ranks counts exactly what a live pod admits.
    pod = DecodePod(cfg, engine=LLMEngine.bookkeeping(cfg.engine, CAPACITY_SEQ_LEN + 1))
    n = 0
    while pod.reserve(f"cap{n}", CAPACITY_SEQ_LEN) is not None:
        n += 1
    per_seq = [len(t) for t in pod.block_tables_of("cap0")] if n else []
    return {"allowed": True, "admitted": n, "blocks_per_rank": num_blocks, "blocks_per_seq_per_rank": per_seq,
            "used_blocks_per_rank": pod.used_blocks_per_rank()}


def _capacity() -> tuple[list[dict], dict[str, float], dict[str, Any]]:
    from pdserve.default_model import ensure_default_model
    from transformers import LlamaConfig

    budget = CAPACITY_BUDGET_MIB << 20
    tmp = tempfile.TemporaryDirectory(prefix="pdserve-bench-cap-")
    # Admission needs the shape only: a config.json with SmolLM2's per-rank KV bytes (30 layers, head_dim 64, one KV
    # head per rank) but 12 query heads and 1 KV head, so that TP 6 allows DCP 1, 2 and 3.
    tiny = Path(tmp.name) / "tiny-12q1kv"
    LlamaConfig(vocab_size=256, hidden_size=768, intermediate_size=64, num_hidden_layers=30, num_attention_heads=12,
                num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
                architectures=["LlamaForCausalLM"]).save_pretrained(str(tiny))
    models = [("SmolLM2-135M", str(ensure_default_model()), 9), ("tiny 12q/1kv", str(tiny), 6)]
    rows, ratios, raw = [], {}, {}
    for name, path, tp in models:
        res = {dcp: _admitted(path, tp, dcp, budget) for dcp in (1, 2, 3)}
        base = res[1]["admitted"]
        row: dict[str, Any] = {
            "metric": f"{CAPACITY_SEQ_LEN}-token seqs admitted, {CAPACITY_BUDGET_MIB} MiB/rank, {name}", "TP": tp}
        checks = []
        for dcp, r in res.items():
            if not r["allowed"]:
                row[f"DCP{dcp}"] = "refused"
                continue
            row[f"DCP{dcp}"] = r["admitted"]
            if dcp > 1:
                ratio = r["admitted"] / (dcp * base)
                key = "smollm2" if name.startswith("SmolLM2") else "tiny"
                ratios[f"kv_capacity_{key}_dcp{dcp}_vs_dcp1_x_{dcp}"] = ratio
                checks.append(f"DCP{dcp}: {ratio:.3f} x (DCP x DCP1) {'ok' if ratio >= 0.95 else 'MISSED'}")
        row["target >= 0.95"] = "; ".join(checks)
        rows.append(row)
        raw[name] = {"tp": tp, **{f"dcp{d}": r for d, r in res.items()}}
    tmp.cleanup()
    return rows, ratios, {"kv_budget_mib_per_rank": CAPACITY_BUDGET_MIB, "seq_len": CAPACITY_SEQ_LEN,
                          "block_size": CAPACITY_BLOCK, "capacity": raw}


# A schema the model stays inside for the whole run (an open-ended list of strings), so every step is masked.
SAMPLING_SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
                   "required": ["notes"]}


def _decode_step_times(engine, prompts: list[list[int]], sp: Any) -> list[float]:
    """Seconds of each decode step (every request past its first token) of one batch on the in-process engine."""
    for p in prompts:
        engine.add_request(p, sp)
    started: set[str] = set()
    while len(started) < len(prompts):  # prefill steps until every request has its first token
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    times = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def _sampling_cost(quick: bool) -> tuple[list[dict], dict[str, float], dict[str, Any]]:
    """Plain sampling vs penalties vs a JSON-schema constraint, per decode step at batch 8, interleaved rounds. The
    headline is the fastest step of each (robust to other load on the machine); medians are in the JSON too."""
    from pdserve.default_model import ensure_default_model
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling import SamplingParams
    from pdserve.structured import StructuredSpec

    bs, new_tokens, rounds = 8, (8 if quick else 16), (10 if quick else 20)  # short rounds: more quiet windows
    prompt_len = 32
    base = dict(temperature=1.0, seed=0, max_tokens=new_tokens, ignore_eos=True)
    variants = {
        "plain": SamplingParams(**base),
        "penalties": SamplingParams(**base, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
        "structured_json": SamplingParams(**base, structured=StructuredSpec.json_schema(SAMPLING_SCHEMA)),
    }
    engine = LLMEngine(EngineConfig(model=str(ensure_default_model()), num_kv_blocks=bs * 8 + 8, max_num_seqs=bs,
                                    enable_prefix_caching=False))
    steps: dict[str, list[float]] = {k: [] for k in variants}
    try:
        prompts = _prompts(bs, prompt_len, engine.model_config.vocab_size)
        for sp in variants.values():  # warm-up (and the grammar's compile, cached afterwards)
            _decode_step_times(engine, prompts, SamplingParams(**{**sp.__dict__, "max_tokens": 3}))
        for _ in range(rounds):  # interleaved, so drift of the machine hits every variant alike
            for name, sp in variants.items():
                steps[name] += _decode_step_times(engine, prompts, sp)
    finally:
        engine.shutdown()
    fastest = {k: min(v) for k, v in steps.items()}
    median = {k: sorted(v)[len(v) // 2] for k, v in steps.items()}
    ratios = {f"{k}_bs{bs}_vs_plain": fastest[k] / fastest["plain"] for k in ("structured_json", "penalties")}
    row: dict[str, Any] = {"metric": f"engine decode step, batch {bs}, vs plain sampling (fastest step)",
                           **{f"{k} ms/step": 1e3 * v for k, v in fastest.items()},
                           **{f"{k} median ms/step": 1e3 * v for k, v in median.items()},
                           **ratios,
                           "target <= 1.15": "; ".join(f"{k}: {'ok' if v <= 1.15 else 'MISSED'}"
                                                        for k, v in ratios.items())}
    raw = {"sampling_cost": {"batch": bs, "new_tokens": new_tokens, "prompt_tokens": prompt_len, "rounds": rounds,
                             "schema": SAMPLING_SCHEMA, "fastest_step_s": fastest, "median_step_s": median,
                             "median_ratio_vs_plain": {k: median[k] / median["plain"] for k in median},
                             "steps": {k: len(v) for k, v in steps.items()}, "threads": torch.get_num_threads()}}
    return [row], ratios, raw


def run(quick: bool = False) -> dict[str, Any]:
    t0 = time.perf_counter()
    cap_rows, cap_ratios, cap_raw = _capacity()
    s_rows, s_ratios, s_raw = _sampling_cost(quick)
    tp_rows, tp_ratios, tp_raw = _throughput(quick)
    return {"benchmark": "decode", "quick": quick, "table": tp_rows + s_rows + cap_rows,
            "ratios": {**tp_ratios, **s_ratios, **cap_ratios}, **tp_raw, **s_raw, **cap_raw,
            "seconds": time.perf_counter() - t0}
