"""pdserve/pod/step_profile.py: the lengths a pod times, and a measurement on a real (tiny) engine that leaves the
engine as it found it (no blocks held, no cached prefix, token counters unchanged)."""

from __future__ import annotations

import pytest

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.pod.step_profile import _prompt, measure, profile_lengths


def test_lengths_are_whole_blocks_of_chunk_fractions_within_room():
    assert profile_lengths(1024, 4096, 16) == [32, 64, 128, 256]
    assert profile_lengths(1024, 100, 16) == [32, 64]  # what the context / cache can hold
    assert profile_lengths(16, 4096, 16) == [16]  # at least one block, each length once
    assert profile_lengths(1024, 8, 16) == []


@pytest.fixture(scope="module")
def engine(tiny_factory):
    eng = LLMEngine(EngineConfig(model=str(tiny_factory("llama")), num_kv_blocks=64, max_model_len=512))
    yield eng
    eng.shutdown()


def test_measure_times_every_length_and_leaves_the_engine_as_it_was(engine):
    free = engine.blocks.num_free()
    p = measure(engine)
    assert p is not None
    assert p.prefill_tokens == (32, 64, 128, 256)
    assert len(p.prefill_s) == 4 and all(t > 0 for t in p.prefill_s) and p.decode_step_s > 0
    assert engine.blocks.num_free() == free and not engine.has_unfinished()
    assert engine.blocks.prefix_caching is True
    assert engine.num_prompt_tokens_computed == engine.num_generated_tokens == engine.blocks.prefix_hits == 0
    msg = p.to_proto()
    assert list(msg.prefill_tokens) == [32, 64, 128, 256] and msg.decode_step_s == p.decode_step_s
    assert "decode step at batch 1" in p.describe()
    # the prompts the profile computed left nothing in the prefix cache
    engine.generate([_prompt(32, 1, engine.model_config.vocab_size)], None)
    assert engine.blocks.prefix_hits == 0


def test_an_engine_too_small_for_one_length_gives_no_profile(tiny_factory):
    eng = LLMEngine(EngineConfig(model=str(tiny_factory("llama")), num_kv_blocks=2, max_model_len=512))
    try:
        assert measure(eng) is None
    finally:
        eng.shutdown()
