"""pdserve/pod: the sampling check every service shares, the proto conversions both pods use, id checks."""
from __future__ import annotations

import pytest

from decode_svc.server import sampling_params_from_proto
from kv_transfer.layout import KVLayout
from kv_transfer.transport import Endpoint, KVHandoff
from pdserve.pod.convert import handoff_to_kv_handle, kv_handle_to_handoff, layout_from_proto, layout_to_proto
from pdserve.pod.lifecycle import MAX_ID_LEN, id_problem
from pdserve.errors import ServiceError
from pdserve.pod.sampling import refuse_unsupported, unsupported_fields
from pdserve.sampling import SamplingParamsError
from pdserve_api.v1 import common_pb2 as pb
from prefill_svc.sampling import sampling_from_proto
from router.core import _check_sampling

UNSUPPORTED = [
    ("top_logprobs", pb.SamplingParams(top_logprobs=2)),
    ("min_tokens", pb.SamplingParams(min_tokens=1, max_tokens=5)),
    ("repetition_penalty", pb.SamplingParams(repetition_penalty=1.2)),
    ("presence_penalty", pb.SamplingParams(presence_penalty=0.5)),
    ("frequency_penalty", pb.SamplingParams(frequency_penalty=-0.5)),
]
NEUTRAL = pb.SamplingParams(repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, temperature=0.0)


@pytest.mark.parametrize("name,sp", UNSUPPORTED, ids=[n for n, _ in UNSUPPORTED])
def test_router_prefill_and_decode_refuse_the_same_fields(name, sp):
    assert unsupported_fields(sp) == [name]
    with pytest.raises(ServiceError, match=name):
        _check_sampling(sp)
    with pytest.raises(SamplingParamsError, match=f"{name} is not implemented by this prefill pod"):
        sampling_from_proto(sp)
    with pytest.raises(SamplingParamsError, match=f"{name} is not implemented by this decode pod"):
        sampling_params_from_proto(sp, max_model_len=64)


def test_neutral_values_are_accepted_everywhere():
    assert unsupported_fields(NEUTRAL) == []
    _check_sampling(NEUTRAL)
    params, client = sampling_from_proto(NEUTRAL)
    assert params.max_tokens == 1 and params.greedy and client.max_tokens is None
    assert sampling_params_from_proto(NEUTRAL, max_model_len=64).max_tokens == 64


def test_refusal_names_every_field():
    sp = pb.SamplingParams(top_logprobs=1, presence_penalty=1.0)
    with pytest.raises(SamplingParamsError, match="top_logprobs, presence_penalty are not implemented by X"):
        refuse_unsupported(sp, "X")


def test_kv_handle_round_trip():
    layout = KVLayout(num_layers=3, num_kv_heads=4, head_dim=8, dtype="float32", block_size=16, tp_size=2,
                      dcp_size=1, interleave=1, num_blocks=64)
    h = KVHandoff("lease-1", "req-1", 20, layout, [[1, 2], [3, 4]],
                  [Endpoint.parse("127.0.0.1:7001"), Endpoint.parse("127.0.0.1:7002")], "tcp")
    kh = handoff_to_kv_handle(h, "p0", ttl_s=5.0)
    assert kh.kv_transfer_address == "127.0.0.1:7001,127.0.0.1:7002" and kh.transfer_mode == pb.TRANSFER_MODE_GRPC
    back = kv_handle_to_handoff(kh, "req-1")
    assert (back.lease_id, back.num_tokens, back.block_tables, back.transport) == ("lease-1", 20, [[1, 2], [3, 4]],
                                                                                   "tcp")
    assert [str(e) for e in back.endpoints] == ["127.0.0.1:7001", "127.0.0.1:7002"]
    assert layout_from_proto(layout_to_proto(layout)) == layout


def test_kv_handle_with_wrong_endpoint_count_is_refused():
    layout = KVLayout(num_layers=1, num_kv_heads=3, head_dim=8, dtype="float32", block_size=16, tp_size=3,
                      dcp_size=1, interleave=1, num_blocks=8)
    kh = pb.KVHandle(kv_transfer_address="h:1,h:2", layout=layout_to_proto(layout))
    with pytest.raises(ValueError, match="names 2 endpoints for a tp_size 3 pod"):
        kv_handle_to_handoff(kh, "r")


def test_id_problem():
    assert id_problem("request_id", "x" * MAX_ID_LEN) is None
    assert "at most 256 printable" in id_problem("request_id", "x" * (MAX_ID_LEN + 1))
    assert id_problem("lease_id", "a\nb").startswith("lease_id must be")
