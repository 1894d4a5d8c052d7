"""decode_svc/kv_loads.py's verdict on a load from its ranks' shares: a rank that found the lease freed (what the
prefill pod does once another rank gave up) never names the request's status while that other rank's cause may still
come in."""

from __future__ import annotations

from types import SimpleNamespace

import grpc

from decode_svc.kv_loads import KVLoads, Load
from decode_svc.kv_source import KVDeliveryError


def _loads(tp: int) -> KVLoads:
    loads = KVLoads.__new__(KVLoads)  # the verdict reads only the group size and the shares
    loads.tp_size = tp
    return loads


def _load() -> Load:
    return Load("r#0", "r", None, SimpleNamespace(checksums=()), [], [], 0.0)  # type: ignore[arg-type]


def test_a_freed_lease_waits_for_the_rank_whose_failure_freed_it():
    loads, ld = _loads(2), _load()
    echo = KVDeliveryError("rank 1: lease freed (aborted)", grpc.StatusCode.FAILED_PRECONDITION)
    cause = KVDeliveryError("rank 0: prefill stuck at 0 layers", grpc.StatusCode.UNAVAILABLE)
    ld.shares[1] = echo
    assert loads._error_of(ld) is None, "rank 0 is still receiving: its failure may be the cause"
    ld.shares[0] = cause
    assert loads._error_of(ld) is cause


def test_a_cause_decides_at_once_and_echoes_alone_decide_once_every_rank_is_in():
    loads = _loads(2)
    ld = _load()
    cause = KVDeliveryError("rank 1: deadline", grpc.StatusCode.DEADLINE_EXCEEDED)
    ld.shares[1] = cause
    assert loads._error_of(ld) is cause
    ld = _load()
    echo = KVDeliveryError("rank 1: lease expired", grpc.StatusCode.FAILED_PRECONDITION)
    ld.shares[1] = echo
    ld.shares[0] = 4096  # rank 0 landed its share: the lease really was gone for rank 1
    assert loads._error_of(ld) is echo
    ld = _load()
    ld.shares.update({0: 4096, 1: 4096})
    assert loads._error_of(ld) is None
