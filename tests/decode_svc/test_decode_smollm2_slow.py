"""SmolLM2-135M (9 query / 3 KV heads) on a decode pod at TP 9, DCP 3: greedy output token-identical to
transformers, each rank holding its DCP third of the KV. Nine rank processes on a small CPU: few tokens."""

from __future__ import annotations

import math

import pytest
from dsvc_helpers import Handed, PrefillStandIn, drain_pod, greedy, record
from hf_helpers import hf_greedy

NEW_TOKENS = 12


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_smollm2_tp9_dcp3_matches_transformers():
    from decode_svc.config import DecodeConfig
    from decode_svc.pod import DecodePod
    from pdserve.cli_config import build
    from pdserve.default_model import ensure_default_model
    from pdserve.engine.block_manager import dcp_local_count
    from pdserve.tokenizer import Tokenizer

    path = ensure_default_model()
    prompts = [
        Tokenizer(str(path)).encode("The capital of France is"),
        Tokenizer(str(path)).encode("def fibonacci(n):\n    "),
    ]
    want = hf_greedy(path, prompts, NEW_TOKENS)
    ref = PrefillStandIn(path, num_kv_blocks=64)
    cfg = build(
        DecodeConfig,
        model=str(path),
        tensor_parallel_size=9,
        decode_context_parallel_size=3,
        dcp_kv_cache_interleave_size=1,
        block_size=4,
        num_kv_blocks=32,
        max_model_len=256,
    )
    pod = DecodePod(cfg)
    try:
        res, fin = {}, {}
        for i, (p, (src, first, lp)) in enumerate(zip(prompts, Handed(ref, pod, prompts))):
            assert first == want[i][0]
            record([pod.submit(f"s{i}", p, greedy(NEW_TOKENS), first, lp, src)], res, fin)
            tables = pod.block_tables_of(f"s{i}")
            for r in range(9):
                assert len(tables[r]) == math.ceil(dcp_local_count(len(p), 3, 1, r % 3) / 4)
        drain_pod(pod, res, fin)
        for i in range(len(prompts)):
            assert res[f"s{i}"] == want[i]
        assert pod.free_blocks_per_rank() == [32] * 9
    finally:
        pod.shutdown()
        ref.close()
