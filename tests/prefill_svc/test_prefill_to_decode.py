"""Prefill -> decode in separate processes, token-identical to transformers (greedy): a prefill pod
(python -m prefill_svc) computes the prompt in chunks and hands its KV over kv_transfer (TCP) to a decode pod
(python -m decode_svc, pulling over the same TCP path), which streams the rest.
Covered: a prompt in one chunk, a 4,096-token prompt in 8 chunks of 512, and a prefix-cache hit (fewer tokens
computed, same tokens out)."""
from __future__ import annotations

import json
import re
import sys
import time
import urllib.request

import grpc
import pytest

from prefill_ref import Proc, hf_greedy, random_prompt
from pdserve_api.v1 import common_pb2 as pb
from pdserve_api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def pods(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("p2d")
    ready_file = tmp / "prefill.json"
    prefill = Proc([sys.executable, "-m", "prefill_svc", "--model", str(tiny_model), "--port", "0",
                    "--metrics-port", "0", "--kv-transport", "tcp", "--num-kv-blocks", "800",
                    "--prefill-chunk-size", "512", "--max-num-batched-tokens", "4096", "--pod-id", "prefill-e2e",
                    "--ready-file", str(ready_file), "--log-level", "WARNING"],
                   tmp / "prefill.log", lambda p: ready_file.exists())
    decode = Proc([sys.executable, "-m", "decode_svc", "--kv-transfer-backend", "tcp",
                   "--kv-transfer-timeout-s", "60", "--model", str(tiny_model),
                   "--port", "0", "--num-kv-blocks", "800", "--pod-id", "decode-e2e", "--log-level", "WARNING"],
                  tmp / "decode.log", lambda p: "decode_svc ready" in p.output())
    info = json.loads(ready_file.read_text())
    port = int(re.search(r"DecodeWorker on [^:]+:(\d+)", decode.output()).group(1))
    pch, dch = grpc.insecure_channel(info["address"]), grpc.insecure_channel(f"127.0.0.1:{port}")
    yield prefill_pb2_grpc.PrefillWorkerStub(pch), decode_pb2_grpc.DecodeWorkerStub(dch), info, prefill, decode
    for p in (prefill, decode):
        p.kill()


def metric(info, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{info['metrics_port']}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1))


def generate(pstub, dstub, rid: str, ids: list[int]) -> tuple[list[int], prefill_pb2.PrefillResponse]:
    """The router's journey: AllocateKV on decode -> Prefill -> Decode stream."""
    sp = pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alloc = dstub.AllocateKV(decode_pb2.AllocateKVRequest(request_id=rid, num_tokens=len(ids)), timeout=30)
    pre = pstub.Prefill(prefill_pb2.PrefillRequest(
        request_id=rid, prompt_token_ids=ids, sampling_params=sp,
        decode_target=prefill_pb2.DecodeTarget(decode_pod_id="decode-e2e", layout=alloc.layout,
                                               block_tables=alloc.block_tables,
                                               transfer_modes=alloc.transfer_modes)), timeout=120)
    tokens = [pre.first_token_id]
    for chunk in dstub.Decode(decode_pb2.DecodeRequest(
            request_id=rid, prompt_token_ids=ids, first_token_id=pre.first_token_id,
            first_token_logprob=pre.first_token_logprob, sampling_params=sp, kv_handle=pre.kv_handle,
            num_cached_tokens=pre.num_cached_tokens), timeout=120):
        tokens += list(chunk.token_ids)
    return tokens, pre


def wait_leases_freed(info) -> None:
    deadline = time.monotonic() + 20
    while metric(info, "pdserve_prefill_kv_leases") != 0:
        assert time.monotonic() < deadline, "decode never completed the transfer"
        time.sleep(0.05)


def test_prefill_then_decode_token_identical(pods, tiny_model):
    pstub, dstub, info, *_ = pods
    short = random_prompt(200, seed=31)  # one chunk
    tokens, pre = generate(pstub, dstub, "short", short)
    assert tokens == hf_greedy(tiny_model, short, NEW_TOKENS)
    wait_leases_freed(info)  # decode told prefill it has the KV: the lease (and its blocks) went away

    long = random_prompt(4096, seed=32)  # 8 chunks of 512
    tokens, pre = generate(pstub, dstub, "long", long)
    assert pre.num_cached_tokens == 0
    assert tokens == hf_greedy(tiny_model, long, NEW_TOKENS)
    wait_leases_freed(info)


def test_prefix_cache_hit_same_tokens_fewer_computed(pods, tiny_model):
    pstub, dstub, info, *_ = pods
    shared = random_prompt(4096, seed=32)[:2048]  # the long prompt above left these blocks in the prefix cache
    ids = shared + random_prompt(300, seed=33)
    before = metric(info, "pdserve_prefill_prompt_tokens_computed_total")
    tokens, pre = generate(pstub, dstub, "hit", ids)
    computed = metric(info, "pdserve_prefill_prompt_tokens_computed_total") - before
    assert pre.num_cached_tokens == 2048
    assert computed == len(ids) - 2048
    assert tokens == hf_greedy(tiny_model, ids, NEW_TOKENS)
    wait_leases_freed(info)
