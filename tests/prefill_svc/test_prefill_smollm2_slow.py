"""SmolLM2-135M (the real default model): a 4,096-token prompt in chunks of 512 gives the same first token and KV as
unchunked and as transformers; and prefill -> decode in separate processes is token-identical to transformers."""

from __future__ import annotations

import asyncio
import sys

import pytest
import torch
from prefill_ref import Proc, cached_kv, greedy, hf_greedy, hf_prefill, random_prompt

from pdserve.cli_config import build
from prefill_svc.config import PrefillConfig
from prefill_svc.worker import PrefillWorker

pytestmark = pytest.mark.slow


def _prefill(model, ids, chunk):
    w = PrefillWorker(
        build(
            PrefillConfig,
            model=str(model),
            kv_transport="none",
            prefill_chunk_size=chunk,
            max_num_batched_tokens=4096,
            num_kv_blocks=4096 // 16 + 8,
            enable_prefix_caching=False,
        )
    )
    w.start()
    try:
        params, client = greedy()
        res = asyncio.run(w.prefill("r", ids, params, client))
        k, v = cached_kv(w.engine.executor.kv_cache, res.block_table, len(ids))
        return res, k, v, w.stats.num_steps
    finally:
        w.stop()


def test_smollm2_4096_chunked_512_equals_unchunked_and_transformers(smollm2):
    ids = random_prompt(4096, seed=51, vocab=49152)
    chunked, kc, vc, steps_c = _prefill(smollm2, ids, 512)
    whole, ku, vu, steps_u = _prefill(smollm2, ids, 4096)
    assert (steps_c, steps_u) == (8, 1)
    hf_tok, hk, hv = hf_prefill(smollm2, ids)
    assert chunked.first_token_id == whole.first_token_id == hf_tok
    torch.testing.assert_close(kc, ku, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(vc, vu, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(kc, hk, atol=2e-3, rtol=1e-3)
    torch.testing.assert_close(vc, hv, atol=2e-3, rtol=1e-3)


def test_smollm2_prefill_to_decode_processes_token_identical(smollm2, tmp_path):
    import json
    import re

    import grpc
    from test_prefill_to_decode import generate

    from pdserve_api.v1 import decode_pb2_grpc, prefill_pb2_grpc

    ready_file = tmp_path / "prefill.json"
    prefill = Proc(
        [
            sys.executable,
            "-m",
            "prefill_svc",
            "--model",
            str(smollm2),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--kv-transport",
            "tcp",
            "--num-kv-blocks",
            "256",
            "--prefill-chunk-size",
            "256",
            "--max-num-batched-tokens",
            "1024",
            "--ready-file",
            str(ready_file),
            "--log-level",
            "WARNING",
        ],
        tmp_path / "prefill.log",
        lambda p: ready_file.exists(),
    )
    decode = Proc(
        [
            sys.executable,
            "-m",
            "decode_svc",
            "--kv-transfer-backend",
            "tcp",
            "--kv-transfer-timeout-s",
            "60",
            "--model",
            str(smollm2),
            "--port",
            "0",
            "--num-kv-blocks",
            "256",
            "--pod-id",
            "decode-e2e",
            "--log-level",
            "WARNING",
        ],
        tmp_path / "decode.log",
        lambda p: "decode_svc ready" in p.output(),
    )
    try:
        info = json.loads(ready_file.read_text())
        port = int(re.search(r"DecodeWorker on [^:]+:(\d+)", decode.output()).group(1))
        pstub = prefill_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(info["address"]))
        dstub = decode_pb2_grpc.DecodeWorkerStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        for rid, n in (("a", 100), ("b", 900)):  # one chunk; four chunks of 256
            ids = random_prompt(n, seed=52 + n, vocab=49152)
            tokens, _ = generate(pstub, dstub, rid, ids)
            assert tokens == hf_greedy(smollm2, ids, 12)
    finally:
        prefill.kill()
        decode.kill()
