"""Publisher/puller edge cases, in one process (the cross-process paths are in test_transfer.py)."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import torch
from kv_reference import empty_region, full_kv, random_tables, write_rank

from kv_transfer.control import ControlClient
from kv_transfer.factory import make_publisher, make_puller, nixl_available
from kv_transfer.layout import KVLayout
from kv_transfer.plan import apply_segments, plan_reshard
from kv_transfer.transport import BadTransferRequest, LeaseExpired

BACKENDS = ["nixl", "tcp"] if nixl_available()[0] else ["tcp"]
T = 50


def _setup(backend, **kw):
    lay = KVLayout(3, 2, 8, "float32", 16, tp_size=1, num_blocks=12)
    tables = random_tables(lay, T, random.Random(1))
    region = empty_region(lay, 1)
    write_rank(lay, 0, full_kv(lay, T, 2), tables[0], region)
    freed = []
    pub = make_publisher(lay, {0: region}, backend=backend, on_free=lambda *a: freed.append(a), **kw)
    return lay, tables, pub, freed


def test_tcp_read_outside_the_lease_blocks_is_refused():
    lay, tables, pub, _ = _setup("tcp")
    try:
        lid = pub.publish("r", {0: tables[0]}, T, layers_ready=3)
        other = next(b for b in range(lay.num_blocks) if b not in tables[0])  # another request's block
        c = ControlClient(pub.endpoint)
        c.connect(2)
        seg = np.array([[0], [other * lay.block_nbytes], [lay.block_nbytes]], dtype=np.int64).tobytes()
        msg = {"op": "read", "lease": lid, "dst_rank": 0, "dst_world": 1, "layers": [0, 1]}
        with pytest.raises(BadTransferRequest):
            c.stream(msg, seg, lambda *a: pytest.fail("bytes sent"))
        ok = np.array([[0], [tables[0][0] * lay.block_nbytes], [lay.block_nbytes]], dtype=np.int64).tobytes()
        got = []
        c.stream(msg, ok, lambda m, sock, n, dl: got.append(sock.recv(n, 0x100)))  # MSG_WAITALL
        assert sum(len(g) for g in got) == 2 * lay.block_nbytes  # K and V planes of layer 0
        c.close()
    finally:
        pub.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_abort_frees_at_once_and_done_leaves_nothing_pinned(backend):
    lay, tables, pub, freed = _setup(backend)
    dst = KVLayout(3, 2, 8, "float32", 16, tp_size=1, num_blocks=12)
    region = torch.zeros(dst.region_shape())
    puller = make_puller(dst, 0, region, backend=backend, **({"min_segment_bytes": 0} if backend == "nixl" else {}))
    try:
        lid = pub.publish("r1", {0: tables[0]}, T, layers_ready=3)
        puller.abort(pub.handoff(lid), "decode cancelled the request")
        assert freed == [(lid, "r1", "aborted")]
        with pytest.raises(LeaseExpired):
            pub.handoff(lid)
        lid2 = pub.publish("r2", {0: tables[0]}, T, layers_ready=3)
        puller.pull(pub.handoff(lid2), list(range(4)))
        end = time.monotonic() + 5
        while len(freed) < 2 and time.monotonic() < end:  # the free callback may run on a publisher thread
            time.sleep(0.01)
        assert freed[1] == (lid2, "r2", "done")
        assert len(pub.leases) == 0 and not pub.leases.has_pins()
    finally:
        puller.close()
        pub.close()


def test_publish_validates_and_close_frees_everything():
    lay, tables, pub, freed = _setup("tcp")
    with pytest.raises(BadTransferRequest):
        pub.publish("r", {1: tables[0]}, T)  # rank not hosted here
    with pytest.raises(ValueError):
        pub.publish("r", {0: tables[0][:1]}, T)  # too few blocks
    lid = pub.publish("r", {0: tables[0]}, T)
    pub.close()
    assert freed == [(lid, "r", "shutdown")]


@pytest.mark.skipif("nixl" not in BACKENDS, reason="needs NIXL")
def test_nixl_puller_stages_tiny_segment_plans_or_sends_them_over_tcp_on_cpu():
    """Whole-block plans are read directly over NIXL; head-sliced (256 B segment) plans are read staged over
    NIXL (whole blocks, scattered locally), and over TCP when staging is off; the bytes are right each way."""
    lay = KVLayout(2, 2, 64, "float32", 16, tp_size=1, num_blocks=8)
    region = empty_region(lay, 3)
    pub = make_publisher(lay, {0: region}, backend="nixl")
    same = KVLayout(2, 2, 64, "float32", 16, tp_size=1, num_blocks=8)  # whole blocks: 8 KB segments
    sliced = KVLayout(2, 2, 64, "float32", 16, tp_size=2, num_blocks=8)  # one head per slot: 256 B segments
    try:
        for dst, rank, opts, want in (
            (same, 0, {}, "nixl"),
            (sliced, 1, {}, "nixl"),
            (sliced, 1, {"stage_bytes": 0}, "tcp"),
        ):
            reg = torch.zeros(dst.region_shape())
            with make_puller(dst, rank, reg, backend="nixl", **opts) as p:
                lid = pub.publish("r", {0: [0, 1, 2]}, 40, layers_ready=2)
                assert p.pull(pub.handoff(lid), [4, 5, 6]).transport == want
                plan = plan_reshard(lay, [[0, 1, 2]], dst, {rank: [4, 5, 6]}, 40, dst_ranks=[rank])
                want_reg = torch.zeros(dst.region_shape())
                apply_segments(
                    {0: region.view(-1).view(torch.uint8).numpy()},
                    want_reg.view(-1).view(torch.uint8).numpy(),
                    plan.segments(rank),
                )
                assert torch.equal(reg, want_reg), (rank, opts)
    finally:
        pub.close()
