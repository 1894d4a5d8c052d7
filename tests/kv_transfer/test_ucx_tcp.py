"""NIXL with UCX held to TCP (``ucx_transports="tcp"``, UCX_TLS), as between two nodes without RDMA: no CMA and no
shared memory on either side. Re-shards are byte-identical as over the default transports, and the setting is shown
to hold: restricted to a transport this host lacks (rc, InfiniBand verbs), the same read fails. Both sides run in
processes of their own, since UCX takes the setting per process."""

from __future__ import annotations

import random

import pytest
import torch
from kv_reference import empty_region, full_kv, random_tables, write_rank
from kv_worker import PrefillWorker, pull_in_own_process

from kv_transfer.factory import nixl_available
from kv_transfer.layout import KVLayout
from kv_transfer.lease import new_lease_id
from kv_transfer.transport import KVHandoff

# slow: UCX endpoints per case
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not nixl_available()[0], reason=f"NIXL unusable: {nixl_available()[1]}"),
]

NUM_LAYERS, HEAD_DIM, BLOCK, NUM_BLOCKS, NUM_TOKENS = 4, 8, 16, 24, 70
LOOPBACK = {"UCX_NET_DEVICES": "lo"}  # UCX's TCP would otherwise also dial the host's other interfaces


def _layout(kvh: int, tp: int, dcp: int = 1) -> KVLayout:
    return KVLayout(NUM_LAYERS, kvh, HEAD_DIM, "float32", BLOCK, tp_size=tp, dcp_size=dcp, num_blocks=NUM_BLOCKS)


@pytest.fixture(scope="module")
def tcp_workers():
    ws = [PrefillWorker(LOOPBACK), PrefillWorker(LOOPBACK)]  # fresh processes: their UCX is held to TCP
    yield ws
    for w in ws:
        w.close()


def _publish(workers, kvh: int, src_tp: int, seed: int) -> tuple[KVLayout, KVHandoff]:
    layout = _layout(kvh, src_tp)
    tables = random_tables(layout, NUM_TOKENS, random.Random(seed))
    key = f"ucx-tcp-{kvh}-{src_tp}-{seed}"
    for r in range(src_tp):
        assert (
            workers[r].call(
                "start",
                key=key,
                layout=layout.to_dict(),
                ranks=[r],
                tables=tables,
                num_tokens=NUM_TOKENS,
                seed=seed,
                backend="nixl",
                ucx_transports="tcp",
            )
            == "nixl"
        )
    lease = new_lease_id()
    parts = [
        KVHandoff.from_json(
            workers[r].call(
                "publish",
                key=key,
                request_id=f"req-{lease[:6]}",
                tables=tables,
                num_tokens=NUM_TOKENS,
                lease_id=lease,
                layers_ready=NUM_LAYERS,
            )
        )
        for r in range(src_tp)
    ]
    return layout, KVHandoff.merge(parts)


@pytest.mark.parametrize("kvh,src_tp,tp,dcp", [(2, 1, 1, 1), (2, 2, 1, 1), (1, 2, 4, 2), (1, 1, 2, 2)])
def test_reshard_over_ucx_tcp_is_byte_identical(tcp_workers, kvh, src_tp, tp, dcp):
    seed = 100 + 10 * kvh + src_tp + tp + dcp
    src, handoff = _publish(tcp_workers, kvh, src_tp, seed)
    dst = _layout(kvh, tp, dcp)
    tables = random_tables(dst, NUM_TOKENS, random.Random(seed + 1))
    status, value = pull_in_own_process(dst, tables, handoff, "tcp", env=LOOPBACK, min_segment_bytes=0)
    assert status == "ok", value
    regions, transports = value
    full = full_kv(src, NUM_TOKENS, seed)
    for r in range(tp):
        got = torch.from_numpy(regions[r])
        want = empty_region(dst, 500 + r)  # what the decode process started from, with this rank's KV written
        write_rank(dst, r, full, tables[r], want)
        assert torch.equal(got, want), f"decode rank {r} differs"
    assert transports == ["nixl"] * tp


def test_the_transport_setting_holds(tcp_workers):
    """The same read with the decode side held to InfiniBand verbs, which this host lacks, fails: the restriction
    is applied, not ignored."""
    _, handoff = _publish(tcp_workers, 2, 1, seed=7)
    dst = _layout(2, 1)
    status, value = pull_in_own_process(
        dst,
        random_tables(dst, NUM_TOKENS, random.Random(8)),
        handoff,
        "rc",
        env=LOOPBACK,
        min_segment_bytes=0,
        handshake_timeout_s=5.0,
        io_timeout_s=5.0,
    )
    assert status == "err", "a read over a transport this host lacks succeeded: UCX_TLS was not applied"
