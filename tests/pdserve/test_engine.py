"""Continuous batching in one engine: requests joining at different steps, KV pressure (waiting and preemption),
and cancellation all give each request the tokens it gets alone, and every block comes back."""

from __future__ import annotations

import random

from pdserve.engine.llm_engine import EngineConfig, LLMEngine
from pdserve.sampling_params import SamplingParams


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, 30))] for _ in range(n)]


def test_staggered_arrivals_under_kv_pressure_match_solo_runs(tiny_factory):
    path = tiny_factory("llama", num_heads=8, num_kv_heads=2)
    prompts = _prompts(12)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=512)) as eng:
        solo = [eng.generate([p], sp)[0]["token_ids"] for p in prompts]
    # 40 blocks of 4 tokens cannot hold 12 sequences of up to 50 tokens: some wait, some get preempted
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=40, enable_prefix_caching=False)) as eng:
        got: dict[str, list[int]] = {}
        ids: list[str] = []
        pending = list(prompts)
        steps = 0
        while pending or eng.has_unfinished():
            if pending and steps % 2 == 0:
                ids.append(eng.add_request(pending.pop(0), sp))
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            steps += 1
            assert steps < 5000
        assert eng.scheduler.num_preemptions > 0  # the test did exercise preemption
        assert eng.blocks.num_free() == 40
    assert [got[i] for i in ids] == solo


def test_cancel_frees_blocks_immediately(tiny_factory):
    path = tiny_factory("llama", num_heads=8, num_kv_heads=2)
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=64)) as eng:
        ids = [
            eng.add_request(p, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for p in _prompts(6, 1)
        ]
        for _ in range(5):
            eng.step()
        assert eng.blocks.num_free() < 64
        for rid in ids[::2]:
            assert eng.abort(rid)
        held = sum(len(t) for s in eng.scheduler.running for t in s.block_tables)
        assert eng.blocks.num_free() == 64 - held
        for rid in ids[1::2]:
            eng.abort(rid)
        assert eng.blocks.num_free() == 64 and not eng.has_unfinished()


def test_prompt_chunks_ride_with_decodes_within_the_token_budget(tiny_factory):
    """A prompt arriving while others decode never gets a step of its own: each step carries every decode first,
    then prompt chunks in what is left of max_num_batched_tokens; tokens are still those of solo runs."""
    path = tiny_factory("llama", num_heads=8, num_kv_heads=2)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = _prompts(4, 2)
    prompts[3] = [(7 * i) % 250 + 3 for i in range(60)]  # a long one, chunked
    with LLMEngine(EngineConfig(model=str(path), block_size=4, num_kv_blocks=256)) as eng:
        solo = [eng.generate([p], sp)[0]["token_ids"] for p in prompts]
    cfg = EngineConfig(
        model=str(path), block_size=4, num_kv_blocks=256, max_num_batched_tokens=16, prefill_chunk_size=8
    )
    with LLMEngine(cfg) as eng:
        steps = []
        schedule = eng.scheduler.schedule

        def recording():
            step = schedule()
            if step is not None:
                steps.append((step.num_decodes, list(step.chunk_lens), step.is_prefill))
            return step

        eng.scheduler.schedule = recording
        ids = [eng.add_request(prompts[0], sp)]
        got: dict[str, list[int]] = {}
        for k in range(200):
            if k in (2, 3, 5):
                ids.append(eng.add_request(prompts[len(ids)], sp))
            for out in eng.step():
                got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if not eng.has_unfinished():
                break
        assert eng.blocks.num_free() == 256
    assert [got[i] for i in ids] == solo
    mixed = [s for s in steps if s[0] and s[2]]
    assert mixed, steps  # some step decoded and prefilled at once
    for num_decodes, chunks, is_prefill in steps:
        assert chunks[:num_decodes] == [1] * num_decodes
        assert sum(chunks) <= 16 and all(c <= 8 for c in chunks[num_decodes:])
        assert is_prefill == (len(chunks) > num_decodes)
