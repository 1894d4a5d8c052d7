"""pdserve/pod: the sampling check every service shares, the proto conversions both pods use, id checks."""

from __future__ import annotations

import re

import pytest

from decode_svc.server import sampling_params_from_proto
from kv_transfer.layout import KVLayout
from kv_transfer.transport import Endpoint, KVHandoff
from pdserve.errors import ServiceError
from pdserve.pod.convert import handoff_to_kv_handle, kv_handle_to_handoff, layout_from_proto, layout_to_proto
from pdserve.pod.lifecycle import MAX_ID_LEN, id_problem
from pdserve.pod.sampling import num_sequences
from pdserve.sampling_params import SamplingParamsError
from pdserve_api.v1 import common_pb2 as pb
from prefill_svc.sampling import sampling_from_proto
from router.core import _check_sampling

IMPLEMENTED = [
    pb.SamplingParams(top_logprobs=2),
    pb.SamplingParams(min_tokens=1, max_tokens=5),
    pb.SamplingParams(repetition_penalty=1.2),
    pb.SamplingParams(presence_penalty=0.5),
    pb.SamplingParams(frequency_penalty=-0.5),
    pb.SamplingParams(min_p=0.1),
    pb.SamplingParams(logit_bias={5: 3.0}),
]
NEUTRAL = pb.SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, temperature=0.0)


@pytest.mark.parametrize("sp", IMPLEMENTED, ids=lambda sp: str(sp).split(":")[0])
def test_router_prefill_and_decode_accept_the_same_fields(sp):
    _check_sampling(sp, vocab=256)
    params, _ = sampling_from_proto(sp)
    decode = sampling_params_from_proto(sp, max_model_len=64)
    for name in ("top_logprobs", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"):
        assert getattr(params, name) == getattr(decode, name), name
    assert params.min_tokens == min(sp.min_tokens, 1) and decode.min_tokens == sp.min_tokens


OUT_OF_RANGE = [
    (pb.SamplingParams(top_logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (pb.SamplingParams(min_tokens=6, max_tokens=5), "min_tokens must be less than or equal to max_tokens=5, got 6."),
    (pb.SamplingParams(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (pb.SamplingParams(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5."),
    (pb.SamplingParams(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0."),
    (pb.SamplingParams(min_p=1.5), "min_p must be in [0, 1], got 1.5."),
    (pb.SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    (pb.SamplingParams(temperature=-1), "temperature must be a finite number >= 0 (0 = greedy), got -1.0"),
    (
        pb.SamplingParams(repetition_penalty=float("inf")),
        "repetition_penalty must be a finite number greater than zero, got inf.",
    ),
    (pb.SamplingParams(stop_token_ids=[-1]), "stop_token_ids must be non-negative integers"),
]


@pytest.mark.parametrize("sp,msg", OUT_OF_RANGE, ids=[m.split()[0] for _, m in OUT_OF_RANGE])
def test_router_prefill_and_decode_refuse_the_same_values_with_vllms_message(sp, msg):
    with pytest.raises(ServiceError, match=re.escape(msg)):
        _check_sampling(sp, vocab=256)
    with pytest.raises(SamplingParamsError, match=re.escape(msg)):
        sampling_from_proto(sp)
    with pytest.raises(SamplingParamsError, match=re.escape(msg)):
        sampling_params_from_proto(sp, max_model_len=64)


def test_router_and_pods_refuse_best_of_below_n_with_one_message():
    sp, msg = pb.SamplingParams(n=3, best_of=2), "best_of must be greater than or equal to n, got n=3 and best_of=2."
    with pytest.raises(ServiceError, match=re.escape(msg)):
        _check_sampling(sp, vocab=256)
    with pytest.raises(SamplingParamsError, match=re.escape(msg)):
        sampling_from_proto(sp)
    with pytest.raises(SamplingParamsError, match=re.escape(msg)):
        num_sequences(sp)  # the decode pod's check


def test_logit_bias_outside_the_vocabulary_is_refused_by_the_router():
    msg = "logit_bias has token ids out of the model's vocabulary [0, 256): [300]"
    with pytest.raises(ServiceError, match=re.escape(msg)):
        _check_sampling(pb.SamplingParams(logit_bias={300: 1.0}), vocab=256)


def test_neutral_values_are_accepted_everywhere():
    _check_sampling(NEUTRAL, vocab=256)
    params, client = sampling_from_proto(NEUTRAL)
    assert params.max_tokens == 1 and params.greedy and client.max_tokens is None
    assert sampling_params_from_proto(NEUTRAL, max_model_len=64).max_tokens == 64


def test_kv_handle_round_trip():
    layout = KVLayout(
        num_layers=3,
        num_kv_heads=4,
        head_dim=8,
        dtype="float32",
        block_size=16,
        tp_size=2,
        dcp_size=1,
        interleave=1,
        num_blocks=64,
    )
    h = KVHandoff(
        "lease-1",
        "req-1",
        20,
        layout,
        [[1, 2], [3, 4]],
        [Endpoint.parse("127.0.0.1:7001"), Endpoint.parse("127.0.0.1:7002")],
        "tcp",
    )
    kh = handoff_to_kv_handle(h, "p0", ttl_s=5.0)
    assert kh.kv_transfer_address == "127.0.0.1:7001,127.0.0.1:7002" and kh.transfer_mode == pb.TRANSFER_MODE_TCP
    back = kv_handle_to_handoff(kh, "req-1")
    assert (back.lease_id, back.num_tokens, back.block_tables, back.transport) == (
        "lease-1",
        20,
        [[1, 2], [3, 4]],
        "tcp",
    )
    assert [str(e) for e in back.endpoints] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_kv_handle_with_wrong_endpoint_count_is_refused():
    layout = KVLayout(
        num_layers=1,
        num_kv_heads=3,
        head_dim=8,
        dtype="float32",
        block_size=16,
        tp_size=3,
        dcp_size=1,
        interleave=1,
        num_blocks=8,
    )
    kh = pb.KVHandle(kv_transfer_address="h:1,h:2", layout=layout_to_proto(layout))
    with pytest.raises(ValueError, match="names 2 endpoints for a tp_size 3 pod"):
        kv_handle_to_handoff(kh, "r")


def test_id_problem():
    assert id_problem("request_id", "x" * MAX_ID_LEN) is None
    assert "at most 256 printable" in id_problem("request_id", "x" * (MAX_ID_LEN + 1))
    assert id_problem("lease_id", "a\nb").startswith("lease_id must be")


def test_mla_pod_layout_and_shape_reach_the_router_as_mla(tiny_factory):
    """An MLA pod's kv_transfer layout survives the proto round trip, its model shape tells the router it is MLA (so
    TP 8 x DCP 8 is valid), and the router's own layout for that config is the pod's; a decode pod refuses a K/V
    prefill layout for it."""
    from decode_svc.server import _layout_mismatch
    from pdserve.model.config import ModelConfig
    from pdserve.parallel_config import ParallelConfig
    from pdserve.pod.convert import kv_layout_for_model, model_shape_to_proto
    from router.validation import check_for_role, facts_from_shape, kv_layout_for

    mc = ModelConfig.from_path(tiny_factory("deepseek_v3", num_heads=8))
    lay = kv_layout_for_model(mc, "float32", 16, tp_size=8, dcp_size=8, interleave=4, num_blocks=64)
    assert lay.use_mla and lay.region_shape() == (mc.num_layers, 64, 16, mc.mla.latent_dim)
    proto = layout_to_proto(lay)
    assert proto.use_mla and proto.num_kv_heads_per_rank == 1 and layout_from_proto(proto) == lay
    shape = model_shape_to_proto(mc, 4096, "float32")
    assert (shape.use_mla, shape.kv_lora_rank, shape.qk_rope_head_dim) == (
        True,
        mc.mla.kv_lora_rank,
        mc.mla.qk_rope_head_dim,
    )
    facts = facts_from_shape(shape)
    cfg = ParallelConfig(
        tensor_parallel_size=8, decode_context_parallel_size=8, dcp_kv_cache_interleave_size=4, block_size=16
    )
    assert check_for_role(facts.info, cfg, pb.ROLE_DECODE).valid
    routed = kv_layout_for(facts, cfg, pb.ROLE_DECODE)
    for name in ("num_kv_heads", "head_dim", "use_mla", "num_kv_heads_per_rank", "dcp_size"):
        assert getattr(routed, name) == getattr(proto, name), name
    gqa = pb.KVLayout(num_layers=mc.num_layers, num_kv_heads=8, head_dim=mc.mla.latent_dim, dtype="float32")
    assert "MLA" in (_layout_mismatch(gqa, proto) or "")
    assert (
        _layout_mismatch(layout_to_proto(kv_layout_for_model(mc, "float32", 16, tp_size=2, num_blocks=8)), proto)
        is None
    )
