"""Engine vs HF transformers on SmolLM2, side by side in one run: prefill tokens/s, decode tokens/s at batch 1 and 8,
both on one device (``--device``, default cpu), in float32 and in bfloat16 (each side in the same dtype).

Both sides use the same torch thread count: torch's default, or PDSERVE_BENCH_THREADS (as bench/prefill.py: on a small
CPU shared with other work, 1 thread avoids intra-op threads spinning against other processes)."""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from bench.common import timed
from pdserve.default_model import ensure_default_model
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams


def _prompt_ids(tok, n: int, salt: int) -> list[int]:
    ids = tok.encode(" ".join(f"word{(i * 7 + salt) % 97}" for i in range(n)))
    return ids[:n]


def _engine_decode(eng: LLMEngine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s: time from every request having its first token to the last token."""
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for p in prompts:
        eng.add_request(p, sp)
    started = set()
    while len(started) < len(prompts):
        for o in eng.step():
            started.add(o.request_id)
    t0 = time.perf_counter()
    produced = 0
    while eng.has_unfinished():
        produced += sum(len(o.new_token_ids) for o in eng.step())
    return produced / (time.perf_counter() - t0)


def _synced(fn, device: str):
    """fn, then wait for the device: CUDA kernels run asynchronously, so a timer must wait for them."""

    def call():
        out = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return out

    return call


def _hf_decode(model, prompts: list[list[int]], new_tokens: int, device: str = "cpu") -> float:
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        t1 = timed(_synced(lambda: model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw), device))
        tn = timed(
            _synced(lambda: model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw), device)
        )
    return len(prompts) * (new_tokens - 1) / (tn - t1)


# Both sides in each dtype on the same weights; float32 keys keep their names, bfloat16 ones gain "_bf16".
DTYPES = ("float32", "bfloat16")


def _run_dtype(
    path, dtype: str, device: str, prefill_len: int, new_tokens: int, rows: list, ratios: dict, raw: dict
) -> None:
    from transformers import AutoModelForCausalLM

    sfx, label = ("", "") if dtype == "float32" else ("_bf16", " bf16")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
    eng = LLMEngine(
        EngineConfig(
            model=str(path),
            enable_prefix_caching=False,
            prefill_chunk_size=2048,
            max_num_batched_tokens=4096,
            device=device,
            dtype=dtype,
        )
    )
    try:
        tok = eng.tokenizer
        prompt = _prompt_ids(tok, prefill_len, 0)
        one = SamplingParams(temperature=0, max_tokens=1)
        eng.generate([prompt], one)  # warm-up
        e_pre = prefill_len / timed(lambda: eng.generate([prompt], one), repeat=2)
        with torch.no_grad():
            h_pre = prefill_len / timed(_synced(lambda: hf(torch.tensor([prompt], device=device)), device), repeat=2)
        rows.append(
            {
                "metric": f"prefill tok/s ({prefill_len} tokens){label}",
                "pdserve": e_pre,
                "transformers": h_pre,
                "ratio": e_pre / h_pre,
            }
        )
        ratios[f"prefill{sfx}_vs_transformers"] = e_pre / h_pre
        raw[f"prefill{sfx}_tok_s"] = {"pdserve": e_pre, "transformers": h_pre}
        for bs in (1, 8):
            prompts = [_prompt_ids(tok, 32, salt) for salt in range(bs)]
            _engine_decode(eng, prompts, 2)  # warm-up: oneDNN builds its kernels per batch shape
            e_dec = _engine_decode(eng, prompts, new_tokens)
            h_dec = _hf_decode(hf, prompts, new_tokens, device)
            rows.append(
                {
                    "metric": f"decode tok/s (batch {bs}){label}",
                    "pdserve": e_dec,
                    "transformers": h_dec,
                    "ratio": e_dec / h_dec,
                }
            )
            ratios[f"decode_bs{bs}{sfx}_vs_transformers"] = e_dec / h_dec
            raw[f"decode_bs{bs}{sfx}_tok_s"] = {"pdserve": e_dec, "transformers": h_dec}
    finally:
        eng.shutdown()


def run(quick: bool = False, device: str = "cpu", dtypes: tuple[str, ...] = DTYPES) -> dict[str, Any]:
    unknown = sorted(set(dtypes) - set(DTYPES))
    if unknown:
        raise ValueError(f"unknown dtype(s) {unknown}: pass some of {list(DTYPES)}")
    if os.environ.get("PDSERVE_BENCH_THREADS"):
        torch.set_num_threads(int(os.environ["PDSERVE_BENCH_THREADS"]))
    path = ensure_default_model()
    prefill_len = 256 if quick else 1024
    new_tokens = 16 if quick else 64
    raw: dict[str, Any] = {
        "device": device,
        "prefill_tokens": prefill_len,
        "new_tokens": new_tokens,
        "threads": torch.get_num_threads(),
    }
    rows: list[dict[str, Any]] = []
    ratios: dict[str, float] = {}
    for dtype in dtypes:
        _run_dtype(path, dtype, device, prefill_len, new_tokens, rows, ratios, raw)
    for key in ("prefill", "decode_bs1", "decode_bs8") if set(DTYPES) <= set(dtypes) else ():
        fp32, bf16 = raw[f"{key}_tok_s"]["pdserve"], raw[f"{key}_bf16_tok_s"]["pdserve"]
        ratios[f"{key}_bf16_vs_fp32"] = bf16 / fp32
    return {"benchmark": "engine", "quick": quick, "table": rows, "ratios": ratios, **raw}
