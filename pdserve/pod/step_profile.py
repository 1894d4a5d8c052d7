"""A pod's step-time profile: the prefill time of a few prompt lengths and the decode step time at batch 1, measured
on the pod's own engine at start (idle, one request at a time) and sent with its registration (StepProfile in
registry.proto). The router's ``--local-prefill-max-tokens auto`` derives a decode pod's threshold from it
(router/local_prefill.py); docs/DESIGN.md says how and what the measurement costs.

The measurement leaves the engine as it found it: prefix caching is off while it runs (no cached blocks, no hits
counted) and the engine's token counters are put back, so a pod's metrics start at zero.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from pdserve.engine.llm_engine import LLMEngine
from pdserve.pod.config import PodServing
from pdserve.sampling_params import SamplingParams
from pdserve_api.v1 import registry_pb2

# Prompt lengths timed, as fractions of the engine's prefill chunk: the short prompts a local prefill is for, up to
# a quarter chunk so the whole measurement stays within a second or two on a small CPU model (docs/DESIGN.md).
CHUNK_FRACTIONS = (1 / 32, 1 / 16, 1 / 8, 1 / 4)
DECODE_STEPS = 8  # decode steps timed (their mean is the profile's step time)
# Token ids of the timed prompts step through the vocabulary by this stride: distinct from one length to the next
# and unlike any prompt a client sends, so nothing is shared with real requests.
_ID_STRIDE = 7919


@dataclass(frozen=True)
class StepProfile:
    """Measured step times of one pod."""

    prefill_tokens: tuple[int, ...]  # ascending prompt lengths
    prefill_s: tuple[float, ...]  # seconds from a request's arrival to its first token, per length
    decode_step_s: float  # seconds of one decode step with one running sequence

    def describe(self) -> str:
        tokens = "/".join(map(str, self.prefill_tokens))
        ms = "/".join(f"{t * 1e3:.0f}" for t in self.prefill_s)
        return f"prefill of {tokens} tokens: {ms} ms; decode step at batch 1: {self.decode_step_s * 1e3:.1f} ms"

    def to_proto(self) -> registry_pb2.StepProfile:
        return registry_pb2.StepProfile(
            prefill_tokens=list(self.prefill_tokens), prefill_s=list(self.prefill_s), decode_step_s=self.decode_step_s
        )


def profile_lengths(chunk_tokens: int, max_tokens: int, block_size: int) -> list[int]:
    """The prompt lengths to time: CHUNK_FRACTIONS of the chunk, whole blocks (at least one), at most
    ``max_tokens`` (what the pod's context and KV cache can hold beside the decode steps), ascending, distinct."""
    out: set[int] = set()
    for f in CHUNK_FRACTIONS:
        n = max(block_size, int(chunk_tokens * f) // block_size * block_size)
        if n <= max_tokens:
            out.add(n)
    return sorted(out)


def _prompt(length: int, salt: int, vocab: int) -> list[int]:
    return [(salt * length + i * _ID_STRIDE) % vocab for i in range(length)]


def _run(engine: LLMEngine, prompt: list[int], max_tokens: int) -> tuple[float, float]:
    """(seconds to the first token, seconds from it to the end) of one greedy request run alone."""
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    t0 = time.perf_counter()
    first = None
    while engine.has_unfinished():
        if engine.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    first = end if first is None else first
    return first - t0, end - first


def wanted(serving: PodServing) -> bool:
    """Whether a pod measures its profile: only when it registers with a router, and --step-profile is on."""
    return bool(serving.router_address) and serving.step_profile


def measure(engine: LLMEngine) -> StepProfile | None:
    """Time the prefills of ``profile_lengths`` and DECODE_STEPS decode steps on an idle engine; None when the
    engine is too small to hold the shortest length (a tiny test cache or context)."""
    cfg = engine.config
    vocab = engine.model_config.vocab_size
    blocks = engine.blocks.num_blocks * cfg.decode_context_parallel_size
    room = min(engine.max_model_len - 1 - DECODE_STEPS, (blocks - 1) * cfg.block_size - DECODE_STEPS)
    lengths = profile_lengths(cfg.prefill_chunk_size, room, cfg.block_size)
    if not lengths:
        return None
    caching, bm = engine.blocks.prefix_caching, engine.blocks
    counters = (engine.num_prompt_tokens_computed, engine.num_generated_tokens, bm.prefix_hits, bm.prefix_queries)
    bm.prefix_caching = False
    try:
        _run(engine, _prompt(lengths[0], 0, vocab), 1)  # untimed: the first forward pass pays one-off set-up
        times = [_run(engine, _prompt(n, k + 1, vocab), 1)[0] for k, n in enumerate(lengths)]
        _, decode = _run(engine, _prompt(lengths[0], len(lengths) + 1, vocab), 1 + DECODE_STEPS)
    finally:
        bm.prefix_caching = caching
        engine.num_prompt_tokens_computed, engine.num_generated_tokens, bm.prefix_hits, bm.prefix_queries = counters
    return StepProfile(tuple(lengths), tuple(times), decode / DECODE_STEPS)
