"""--quantization int8 against the full-precision model on SmolLM2 (the default model), in-process engines:
batch-1 decode ms/token of each, and int8's accuracy: greedy continuations of the same prompts (how many agree with
full precision on their first tokens) and the perplexity of each on a fixed text (bench/data/perplexity_text.md).

    pdserve bench quant [--quick]    (quick: 8 prompts x 32 tokens)
    python -m bench.quant [--prompts 64] [--tokens 64] [--decode-tokens 64]"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pdserve.default_model import ensure_default_model
from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams

_SUBJECTS = ("The history of", "A short guide to", "Why scientists study", "The best way to learn", "My opinion on")
_TOPICS = (
    "the Roman empire",
    "photosynthesis",
    "black holes",
    "baking bread",
    "the Python language",
    "ocean tides",
    "jazz music",
    "volcanoes",
    "chess openings",
    "the human heart",
    "electric cars",
    "honey bees",
    "the printing press",
)
# The opening of pdserve's design doc, frozen here so the figures stay comparable as the doc changes
_TEXT = Path(__file__).resolve().parent / "data" / "perplexity_text.md"


def linear_us(n: int, k: int, rows: int, repeats: int = 200) -> dict[str, float]:
    """Microseconds per call of one [n, k] layer on `rows` activation rows: fp32 through oneDNN's packed weight
    (and pdserve's gemv for one row) against int8_linear (per row) and int8_linear_grouped (32-column blocks, what
    --quantization int8 runs)."""
    import torch

    from pdserve import kernels
    from pdserve.model import linear as plinear
    from pdserve.model.quant import GROUP, quantize_per_channel, quantize_per_group

    if not kernels.available():
        raise RuntimeError("pdserve's CPU kernels are unavailable (see the log)")
    w, x = torch.randn(n, k) * 0.05, torch.randn(rows, k)
    packed = plinear.pack(w)
    wq, ws = quantize_per_channel(w)
    gq, gs = quantize_per_group(w)
    calls = {
        "fp32_packed": lambda: plinear.linear(x, w, packed),
        "int8_per_row": lambda: kernels.int8_linear(x, wq, ws),
        "int8_q8_0": lambda: kernels.int8_linear_grouped(x, gq, gs, GROUP),
    }
    if rows == 1:
        calls["fp32_gemv"] = lambda: kernels.gemv(x, w)
    out = {}
    for name, fn in calls.items():
        for _ in range(10):
            fn()
        best = math.inf
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(repeats):
                fn()
            best = min(best, (time.perf_counter() - t0) / repeats)
        out[name] = best * 1e6
    return out


def prompts(n: int) -> list[str]:
    """n distinct English prompt openings (subject x topic)."""
    out = [f"{s} {t}" for t in _TOPICS for s in _SUBJECTS]
    if n > len(out):
        raise ValueError(f"at most {len(out)} prompts")
    return out[:n]


def engine(model: str, quantization: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(model=model, quantization=quantization, enable_prefix_caching=False, num_kv_blocks=256)
    )


def decode_ms_per_token(eng: LLMEngine, new_tokens: int, repeats: int = 3) -> float:
    """Batch-1 decode: the best of `repeats` runs of ms per token after the first (prefill) token."""
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    best = math.inf
    for r in range(repeats):
        eng.add_request(eng.tokenizer.encode(prompts(r + 1)[-1]), sp)
        eng.step()  # prefill and the first token
        t0 = time.perf_counter()
        produced = 0
        while eng.has_unfinished():
            produced += sum(len(o.new_token_ids) for o in eng.step())
        best = min(best, (time.perf_counter() - t0) * 1e3 / produced)
    return best


def greedy(eng: LLMEngine, texts: list[str], new_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    return [r["token_ids"] for r in eng.generate(texts, sp)]


def perplexity(eng: LLMEngine, max_tokens: int = 1024) -> float:
    """exp of the mean negative log-likelihood of the first max_tokens tokens of the fixed text."""
    ids = eng.tokenizer.encode(_TEXT.read_text())[:max_tokens]
    res = eng.generate([ids], SamplingParams(temperature=0, max_tokens=1), prompt_logprobs=0)[0]
    lps = [lp[0] for lp in res["prompt_logprobs"] if lp is not None and lp[0] is not None]
    return math.exp(-sum(lps) / len(lps))


def fake_quant_perplexity(model: str, mode: str, max_tokens: int = 300) -> float:
    """transformers' model with its decoder linears' weights rounded as int8 would round them (mode "w8"), and
    their input rows too ("w8a8"), or neither ("fp32"): where int8's loss comes from, apart from pdserve's kernels."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.model.quant import quantize_per_channel

    def round_rows(_module, args):
        x = args[0]
        amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-12)
        return (torch.round(x * (127 / amax)) * (amax / 127),)

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    if mode != "fp32":
        for name, mod in m.named_modules():
            if name.startswith("model.layers.") and isinstance(mod, torch.nn.Linear):
                q, s = quantize_per_channel(mod.weight.data)
                mod.weight.data = q.float() * s[:, None]
                if mode == "w8a8":
                    mod.register_forward_pre_hook(round_rows)
    ids = AutoTokenizer.from_pretrained(model).encode(_TEXT.read_text())[:max_tokens]
    with torch.no_grad():
        lp = m(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
    return math.exp(-lp.gather(1, torch.tensor(ids[1:])[:, None]).mean().item())


@dataclass
class Report:
    prompts: int
    tokens: int
    ms_per_token_none: float
    ms_per_token_int8: float
    same_first_32: float  # fraction of prompts whose first 32 greedy tokens match full precision's
    same_all: float  # fraction whose every token matches
    mean_matching_prefix: float  # tokens before the first difference, averaged
    ppl_none: float
    ppl_int8: float


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def measure(model: str, num_prompts: int, new_tokens: int, decode_tokens: int) -> Report:
    texts = prompts(num_prompts)
    res = {}
    for q in ("none", "int8"):
        with engine(model, q) as eng:
            res[q] = (decode_ms_per_token(eng, decode_tokens), greedy(eng, texts, new_tokens), perplexity(eng))
    ref, got = res["none"][1], res["int8"][1]
    prefix = [matching_prefix(a, b) for a, b in zip(ref, got)]
    first = min(32, new_tokens)
    return Report(
        prompts=num_prompts,
        tokens=new_tokens,
        ms_per_token_none=res["none"][0],
        ms_per_token_int8=res["int8"][0],
        same_first_32=sum(p >= first for p in prefix) / num_prompts,
        same_all=sum(p == new_tokens for p in prefix) / num_prompts,
        mean_matching_prefix=sum(prefix) / num_prompts,
        ppl_none=res["none"][2],
        ppl_int8=res["int8"][2],
    )


def run(quick: bool = False) -> dict:
    """`pdserve bench quant`: the issue's accuracy check (64 prompts x 64 tokens; quick: 8 x 32) and decode speed."""
    n, tokens = (8, 32) if quick else (64, 64)
    r = measure(str(ensure_default_model()), n, tokens, 16 if quick else 64)
    table = [
        {
            "quantization": q,
            "decode_ms_per_token": getattr(r, f"ms_per_token_{q}"),
            "perplexity": getattr(r, f"ppl_{q}"),
        }
        for q in ("none", "int8")
    ]
    ratios = {
        "decode_speedup_int8": r.ms_per_token_none / r.ms_per_token_int8,
        "perplexity_ratio_int8": r.ppl_int8 / r.ppl_none,
        "same_first_32": r.same_first_32,
    }
    return {"benchmark": "quant", "quick": quick, "table": table, "ratios": ratios, **asdict(r)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bundled SmolLM2)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=64)
    a = ap.parse_args()
    model = a.model or str(ensure_default_model())
    print(json.dumps(asdict(measure(model, a.prompts, a.tokens, a.decode_tokens)), indent=2))


if __name__ == "__main__":
    main()
