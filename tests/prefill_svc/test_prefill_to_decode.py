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

from pdserve.net import free_port
from pdserve_api.v1 import common_pb2 as pb
from pdserve_api.v1 import decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def pods(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("p2d")
    ready_file = tmp / "prefill.json"
    prefill = Proc(
        [
            sys.executable,
            "-m",
            "prefill_svc",
            "--model",
            str(tiny_model),
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--kv-transport",
            "tcp",
            "--num-kv-blocks",
            "800",
            "--prefill-chunk-size",
            "512",
            "--max-num-batched-tokens",
            "4096",
            "--pod-id",
            "prefill-e2e",
            "--kv-checksum",
            "--ready-file",
            str(ready_file),
            "--log-level",
            "WARNING",
        ],
        tmp / "prefill.log",
        lambda p: ready_file.exists(),
    )
    decode_metrics = free_port()
    decode = Proc(
        [
            sys.executable,
            "-m",
            "decode_svc",
            "--kv-transfer-backend",
            "tcp",
            "--metrics-port",
            str(decode_metrics),
            "--kv-transfer-timeout-s",
            "60",
            "--model",
            str(tiny_model),
            "--port",
            "0",
            "--num-kv-blocks",
            "800",
            "--pod-id",
            "decode-e2e",
            "--log-level",
            "WARNING",
        ],
        tmp / "decode.log",
        lambda p: "decode_svc ready" in p.output(),
    )
    info = json.loads(ready_file.read_text())
    info["decode_metrics_port"] = decode_metrics
    port = int(re.search(r"DecodeWorker on [^:]+:(\d+)", decode.output()).group(1))
    pch, dch = grpc.insecure_channel(info["address"]), grpc.insecure_channel(f"127.0.0.1:{port}")
    yield prefill_pb2_grpc.PrefillWorkerStub(pch), decode_pb2_grpc.DecodeWorkerStub(dch), info, prefill, decode
    for p in (prefill, decode):
        p.kill()


def metric(info, name: str, port_key: str = "metrics_port") -> float:
    """A metric's value (summed over its label sets) on the prefill pod, or the decode pod's with port_key."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{info[port_key]}/metrics", timeout=5).read().decode()
    values = re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert values, f"{name} not exported"
    return sum(float(v) for v in values)


def generate(pstub, dstub, rid: str, ids: list[int]) -> tuple[list[int], prefill_pb2.PrefillResponse]:
    """The router's journey: AllocateKV on decode -> Prefill -> Decode stream."""
    sp = pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    alloc = dstub.AllocateKV(decode_pb2.AllocateKVRequest(request_id=rid, num_tokens=len(ids)), timeout=30)
    pre = pstub.Prefill(
        prefill_pb2.PrefillRequest(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=sp,
            decode_target=prefill_pb2.DecodeTarget(
                decode_pod_id="decode-e2e",
                layout=alloc.layout,
                transfer_modes=alloc.transfer_modes,
            ),
        ),
        timeout=120,
    )
    tokens = [pre.first_token_id]
    for chunk in dstub.Decode(
        decode_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=ids,
            first_token_id=pre.first_token_id,
            first_token_logprob=pre.first_token_logprob,
            sampling_params=sp,
            kv_handle=pre.kv_handle,
            num_cached_tokens=pre.num_cached_tokens,
        ),
        timeout=120,
    ):
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


def test_kv_read_in_the_wrong_order_is_refused_with_data_loss(pods, tiny_model):
    """The hand-off reaches decode with the lease's block table reordered (as a stale or damaged table would): every
    read stays inside the lease, so kv_transfer's bounds checks pass, but the bytes land at the wrong tokens. Decode
    checks them against the prefill pod's block checksums and refuses the request (DATA_LOSS naming the pod and the
    block) instead of streaming garbage; its KV blocks and the prefill lease are freed, and the same request with the
    hand-off as sent decodes normally."""
    pstub, dstub, info, *_ = pods
    sp = pb.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    free_before = metric(info, "pdserve_decode_kv_blocks_free", "decode_metrics_port")
    ids = random_prompt(40, seed=51)
    alloc = dstub.AllocateKV(decode_pb2.AllocateKVRequest(request_id="victim", num_tokens=len(ids)), timeout=30)
    pre = pstub.Prefill(
        prefill_pb2.PrefillRequest(
            request_id="victim",
            prompt_token_ids=ids,
            sampling_params=sp,
            decode_target=prefill_pb2.DecodeTarget(
                decode_pod_id="decode-e2e",
                layout=alloc.layout,
                transfer_modes=alloc.transfer_modes,
            ),
        ),
        timeout=120,
    )
    handle = pb.KVHandle()
    handle.CopyFrom(pre.kv_handle)
    assert len(handle.block_checksums) == 3  # 40 tokens in blocks of 16
    for t in handle.block_tables:
        t.block_ids.reverse()
    with pytest.raises(grpc.RpcError) as err:
        for _ in dstub.Decode(
            decode_pb2.DecodeRequest(
                request_id="victim",
                prompt_token_ids=ids,
                first_token_id=pre.first_token_id,
                first_token_logprob=pre.first_token_logprob,
                sampling_params=sp,
                kv_handle=handle,
            ),
            timeout=60,
        ):
            pass
    assert err.value.code() == grpc.StatusCode.DATA_LOSS, err.value.details()
    assert "prefill pod prefill-e2e failed its checksum at block 0 (tokens 0..15)" in err.value.details()
    wait_leases_freed(info)
    deadline = time.monotonic() + 20
    while metric(info, "pdserve_decode_kv_blocks_free", "decode_metrics_port") != free_before:
        assert time.monotonic() < deadline, "the refused request's decode KV was not freed"
        time.sleep(0.1)
    tokens, _ = generate(pstub, dstub, "victim-again", ids)
    assert tokens == hf_greedy(tiny_model, ids, NEW_TOKENS)
    wait_leases_freed(info)
