"""Greedy decode on a decode pod (KV received from a reference engine, off the engine thread) is token-identical to
transformers, for every (TP, DCP, interleave) the parallel rules allow on 8q/2kv and MQA checkpoints; the others are
refused with the rule's message. Also checks per-rank KV accounting for each layout."""

from __future__ import annotations

import math

import pytest
from dsvc_helpers import PROMPTS, drain_pod, greedy
from hf_helpers import hf_greedy

from decode_svc.config import DecodeConfig
from decode_svc.pod import DecodePod
from pdserve.cli_config import build
from pdserve.engine.block_manager import dcp_local_count
from pdserve.parallel_config import ParallelConfigError

NEW_TOKENS = 32
BLOCK = 8

# (model, tp, dcp, interleave) allowed by vLLM's rules (pdserve/parallel_config.py).
VALID = [
    ("gqa", 1, 1, 1),
    ("gqa", 2, 1, 1),
    ("gqa", 4, 2, 1),
    ("gqa", 4, 2, 4),
    ("mqa", 1, 1, 1),
    ("mqa", 2, 1, 1),
    ("mqa", 2, 2, 1),
    ("mqa", 2, 2, 4),
    ("mqa", 4, 2, 1),
    ("mqa", 4, 2, 4),
    ("mqa", 4, 4, 1),
    ("mqa", 4, 4, 4),
]
TP_GT_KV = (
    "Decode context parallelism for GQA/MQA requires `--tensor-parallel-size` (2) to be greater than the "
    "model's total number of KV heads (2). Increase `--tensor-parallel-size` or set "
    "`--decode-context-parallel-size 1`."
)
DCP_MAX = (
    "`--decode-context-parallel-size` (4) exceeds the maximum supported value (2) for "
    "`--tensor-parallel-size` (4) and 2 model KV heads."
)
# With 2 KV heads vLLM refuses (2, 2) and (4, 4): those cells of the grid assert the refusal instead.
REFUSED = [("gqa", 2, 2, 1, TP_GT_KV), ("gqa", 2, 2, 4, TP_GT_KV), ("gqa", 4, 4, 1, DCP_MAX), ("gqa", 4, 4, 4, DCP_MAX)]


@pytest.mark.parametrize(
    "model,tp,dcp,interleave,message", REFUSED, ids=[f"{m}-tp{t}-dcp{d}-i{i}" for m, t, d, i, _ in REFUSED]
)
def test_refused_configs(tiny_models, model, tp, dcp, interleave, message):
    with pytest.raises(ParallelConfigError) as ei:
        build(
            DecodeConfig,
            model=str(tiny_models[model]),
            tensor_parallel_size=tp,
            decode_context_parallel_size=dcp,
            dcp_kv_cache_interleave_size=interleave,
            block_size=BLOCK,
        )
    assert ei.value.message == message


def _case(model: str, tp: int, dcp: int, interleave: int) -> object:
    # more ranks than two cores take most of this file's time: the full suite runs them, --quick the rest
    slow = [pytest.mark.slow] if tp > 2 else []
    return pytest.param(model, tp, dcp, interleave, id=f"{model}-tp{tp}-dcp{dcp}-i{interleave}", marks=slow)


@pytest.mark.parametrize("model,tp,dcp,interleave", [_case(*v) for v in VALID])
def test_greedy_identical_to_transformers(tiny_models, prefill_standins, model, tp, dcp, interleave):
    path = tiny_models[model]
    want = hf_greedy(path, PROMPTS, NEW_TOKENS)
    cfg = build(
        DecodeConfig,
        model=str(path),
        tensor_parallel_size=tp,
        decode_context_parallel_size=dcp,
        dcp_kv_cache_interleave_size=interleave,
        block_size=BLOCK,
        num_kv_blocks=48,
    )
    pod = DecodePod(cfg)
    try:
        total = pod.num_blocks
        results: dict[str, list[int]] = {}
        finished: dict[str, str] = {}
        for i, prompt in enumerate(PROMPTS):
            src, first, lp = prefill_standins[model].handed(pod, prompt)
            assert first == want[i][0], "reference prefill disagrees with transformers on the first token"
            # The pod receives the KV off its engine thread (--kv-load async): the first output comes from a step.
            assert pod.submit(f"r{i}", prompt, greedy(NEW_TOKENS), first, lp, src) is None
        assert pod.num_waiting_for_kv + pod.num_running == len(PROMPTS)
        # KV accounting while the KV lands: each rank holds exactly its DCP share, rounded up to blocks.
        used = [0] * tp
        for i, prompt in enumerate(PROMPTS):
            tables = pod.block_tables_of(f"r{i}")
            assert len(tables) == tp
            for r in range(tp):
                local = dcp_local_count(len(prompt), dcp, interleave, r % dcp)
                assert local <= interleave * math.ceil(len(prompt) / (interleave * dcp))
                assert len(tables[r]) == math.ceil(local / BLOCK)
                used[r] += len(tables[r])
        assert pod.used_blocks_per_rank() == used
        drain_pod(pod, results, finished)
        assert finished == {"r0": "length", "r1": "length"}
        for i in range(len(PROMPTS)):
            assert results[f"r{i}"] == want[i], f"prompt {i} diverges from transformers"
        assert pod.free_blocks_per_rank() == [total] * tp
        assert pod.idle()
    finally:
        pod.shutdown()
