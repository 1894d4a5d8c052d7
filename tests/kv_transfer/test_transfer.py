"""End-to-end KV transfer between real processes, over NIXL (UCX) and over the TCP fallback.

Prefill runs in spawned worker processes (prefill TP 2 = one process per rank); decode ranks run as
pullers in this process (one thread, region and NIXL agent each).
"""

from __future__ import annotations

import random
import socket
import threading
import time

import pytest
import torch
from kv_reference import empty_region, full_kv, random_tables, write_rank
from kv_worker import PrefillWorker

from kv_transfer.control import ControlClient
from kv_transfer.factory import make_puller, nixl_available
from kv_transfer.layout import KVLayout
from kv_transfer.lease import new_lease_id
from kv_transfer.plan import plan_reshard
from kv_transfer.transport import (
    Endpoint,
    HandshakeTimeout,
    KVHandoff,
    LeaseExpired,
    TransferUnavailable,
)
from pdserve.net import free_port

# slow: publisher and puller processes per layout (the planner's tests stay quick)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

BACKENDS = ["nixl", "tcp"]
NUM_LAYERS, HEAD_DIM, BLOCK, NUM_BLOCKS, NUM_TOKENS = 4, 8, 16, 24, 70
SRC_CONFIGS = [(2, 1), (2, 2), (1, 1), (1, 2)]  # (kv heads, prefill tp)
DST_CONFIGS = {2: [(1, 1), (4, 2)], 1: [(1, 1), (2, 2), (4, 2)]}  # kv heads -> decode (tp, dcp)
# (TP 2, DCP 2) with 2 kv heads is not a valid layout: a DCP group would hold two different heads.


def _layout(kvh: int, tp: int, dcp: int = 1, block: int = BLOCK) -> KVLayout:
    return KVLayout(NUM_LAYERS, kvh, HEAD_DIM, "float32", block, tp_size=tp, dcp_size=dcp, num_blocks=NUM_BLOCKS)


def _seed(kvh: int, src_tp: int) -> int:
    return 10 * kvh + src_tp


if not nixl_available()[0]:  # CI has NIXL; say so loudly if a box does not
    BACKENDS = [pytest.param("nixl", marks=pytest.mark.skip(reason=f"NIXL unusable: {nixl_available()[1]}")), "tcp"]


# ---- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def workers():
    ws = [PrefillWorker(), PrefillWorker()]  # rank 0 of every config / rank 1 of the TP 2 configs
    yield ws
    for w in ws:
        w.close()


class PrefillSide:
    """Publishers of one (backend, kv heads, prefill tp) config spread over the worker processes."""

    def __init__(self, workers, backend: str, kvh: int, src_tp: int, layout: KVLayout | None = None, **opts) -> None:
        self.workers, self.backend, self.kvh = workers, backend, kvh
        self.layout = layout or _layout(kvh, src_tp)
        self.seed = _seed(kvh, src_tp) + (1000 if self.layout.use_mla else 0)
        self.tables = random_tables(self.layout, NUM_TOKENS, random.Random(self.seed))
        self.key = f"{backend}-kvh{kvh}-tp{src_tp}-mla{int(self.layout.use_mla)}-{opts.get('tag', '')}"
        for r in range(src_tp):
            name = workers[r].call(
                "start",
                key=self.key,
                layout=self.layout.to_dict(),
                ranks=[r],
                tables=self.tables,
                num_tokens=NUM_TOKENS,
                seed=self.seed,
                backend=backend,
                **{k: v for k, v in opts.items() if k != "tag"},
            )
            assert name == backend

    def publish(self, layers_ready: int = NUM_LAYERS) -> KVHandoff:
        lease = new_lease_id()  # one id for the request across all prefill ranks
        parts = [
            KVHandoff.from_json(
                self.workers[r].call(
                    "publish",
                    key=self.key,
                    request_id=f"req-{lease[:6]}",
                    tables=self.tables,
                    num_tokens=NUM_TOKENS,
                    lease_id=lease,
                    layers_ready=layers_ready,
                )
            )
            for r in range(self.layout.tp_size)
        ]
        return KVHandoff.merge(parts)

    def freed(self) -> list[tuple[str, str]]:
        out = []
        for r in range(self.layout.tp_size):
            out += self.workers[r].call("freed")[self.key]
        return out

    def full(self) -> torch.Tensor:
        return full_kv(self.layout, NUM_TOKENS, self.seed)


class DecodeSide:
    """All ranks of one decode pod: regions, block tables and one puller per rank."""

    def __init__(
        self, backend: str, kvh: int, tp: int, dcp: int, layout: KVLayout | None = None, **puller_opts
    ) -> None:
        self.layout = layout or _layout(kvh, tp, dcp, block=32 if dcp == 2 else BLOCK)  # mixed block sizes too
        self.tables = random_tables(self.layout, NUM_TOKENS, random.Random(7 * tp + dcp))
        self.regions = [empty_region(self.layout, 500 + r) for r in range(tp)]
        opts = {"handshake_timeout_s": 5.0, "io_timeout_s": 5.0, **puller_opts}
        if backend == "nixl":
            opts.setdefault("min_segment_bytes", 0)  # tiny test heads (32 B): force NIXL reads anyway
        self.pullers = [make_puller(self.layout, r, self.regions[r], backend=backend, **opts) for r in range(tp)]

    def pull_all(self, handoff: KVHandoff) -> list:
        results: list = [None] * len(self.pullers)

        def run(r: int) -> None:
            try:
                results[r] = self.pullers[r].pull(handoff, self.tables[r], timeout_s=30)
            except BaseException as e:  # surfaced below
                results[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(len(self.pullers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return results

    def close(self) -> None:
        for p in self.pullers:
            p.close()


@pytest.fixture(scope="module")
def sides(workers):
    prefill: dict = {}
    decode: dict = {}

    def get_prefill(backend, kvh, src_tp):
        k = (backend, kvh, src_tp)
        if k not in prefill:
            prefill[k] = PrefillSide(workers, backend, kvh, src_tp)
        return prefill[k]

    def get_decode(backend, kvh, tp, dcp):
        k = (backend, kvh, tp, dcp)
        if k not in decode:
            decode[k] = DecodeSide(backend, kvh, tp, dcp)
        return decode[k]

    yield get_prefill, get_decode
    for d in decode.values():
        d.close()


def _wait_for(pred, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


# ---- byte-exact re-shard between processes ------------------------------------------------------
CASES = [
    (backend, kvh, src_tp, tp, dcp)
    for backend in BACKENDS
    for kvh, src_tp in SRC_CONFIGS
    for tp, dcp in DST_CONFIGS[kvh]
]


@pytest.mark.parametrize("backend,kvh,src_tp,tp,dcp", CASES, ids=lambda v: str(getattr(v, "values", [v])[0]))
def test_reshard_byte_identical(sides, backend, kvh, src_tp, tp, dcp):
    get_prefill, get_decode = sides
    pre = get_prefill(backend, kvh, src_tp)
    dec = get_decode(backend, kvh, tp, dcp)
    handoff = pre.publish()
    full = pre.full()
    want = []
    for r in range(tp):
        w = dec.regions[r].clone()
        write_rank(dec.layout, r, full, dec.tables[r], w)
        want.append(w)
    results = dec.pull_all(handoff)
    for r in range(tp):
        assert torch.equal(dec.regions[r], want[r]), f"decode rank {r} differs"
        assert results[r].transport == backend
    # every decode rank reported done -> each prefill rank freed the lease ("done"), nothing else
    freed = _wait_for(
        lambda: (
            [x for x in pre.freed() if x[0] == handoff.lease_id]
            if len([x for x in pre.freed() if x[0] == handoff.lease_id]) == src_tp
            else None
        ),
        5.0,
        "prefill to free the lease",
    )
    assert {why for _, why in freed} == {"done"}


# ---- streaming ------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_streaming_layers_pulled_as_they_finish(workers, backend):
    pre = PrefillSide(workers, backend, 2, 2, tag="stream")
    dec = DecodeSide(backend, 2, 4, 2)
    try:
        delay = 0.4
        handoff = pre.publish(layers_ready=0)
        landed: dict[int, list[float]] = {r: [] for r in range(4)}
        done_at: dict[int, float] = {}
        results: dict = {}

        def run(r):
            def on_landed(n, r=r):
                landed[r].append((n, time.monotonic()))

            try:
                results[r] = dec.pullers[r].pull(handoff, dec.tables[r], on_layers_landed=on_landed, timeout_s=30)
            except BaseException as e:
                results[r] = e
            done_at[r] = time.monotonic()

        threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for w in workers:  # both prefill ranks produce layers on their own clocks
            w.call("stream", key=pre.key, lease_id=handoff.lease_id, delay=delay)
        for t in threads:
            t.join(30)
        ready_by_src = [w.call("ready_times", lease_id=handoff.lease_id) for w in workers]
        plan = plan_reshard(pre.layout, pre.tables, dec.layout, dec.tables, NUM_TOKENS)
        full = pre.full()
        for r in range(4):
            # a decode rank waits only for the prefill ranks it reads from
            ready = [max(ts) for ts in zip(*(ready_by_src[s] for s in plan.ranks[r].src_ranks()))]
            assert not isinstance(results[r], BaseException), results[r]
            want = empty_region(dec.layout, 500 + r)
            write_rank(dec.layout, r, full, dec.tables[r], want)
            assert torch.equal(dec.regions[r], want)
            got = dict(landed[r])
            assert sorted(got) == list(range(1, NUM_LAYERS + 1)), landed[r]  # one layer at a time
            for n in range(1, NUM_LAYERS + 1):
                assert got[n] >= ready[n - 1], f"rank {r} layer {n} landed before prefill finished it"
            # Overlap with prefill: the first layer is in place long before the last one exists (a
            # non-streaming transfer could only start after ready[-1]). Loose on purpose: shared 2-core box.
            assert got[1] < ready[-2], f"rank {r}: layer 1 landed {got[1] - ready[0]:.3f}s after it was ready"
            lat = [got[n] - ready[n - 1] for n in range(1, NUM_LAYERS + 1)]
            print(f"{backend} rank {r}: per-layer ready->landed latency (ms): {[round(x * 1e3, 1) for x in lat]}")
            assert done_at[r] >= ready[-1], "decode finished before the last layer existed"
    finally:
        dec.close()


# ---- MLA latent caches ---------------------------------------------------------------------------
MLA_DIM = 24  # kv_lora_rank + qk_rope_head_dim of a tiny model


def _mla(tp: int, dcp: int = 1, interleave: int = 1, block: int = BLOCK) -> KVLayout:
    return KVLayout.mla(
        NUM_LAYERS, MLA_DIM, "float32", block, tp_size=tp, dcp_size=dcp, interleave=interleave, num_blocks=NUM_BLOCKS
    )


MLA_CASES = [  # (prefill tp, decode tp, dcp, interleave): dcp == tp, dcp < tp, prefill TP != decode TP
    (backend, src_tp, tp, dcp, inter)
    for backend in BACKENDS
    for src_tp, tp, dcp, inter in ((1, 2, 2, 1), (2, 4, 2, 4), (2, 8, 8, 1), (1, 4, 4, 4), (2, 1, 1, 1))
]


@pytest.mark.parametrize("backend,src_tp,tp,dcp,inter", MLA_CASES, ids=lambda v: str(getattr(v, "values", [v])[0]))
def test_mla_reshard_byte_identical(workers, backend, src_tp, tp, dcp, inter):
    """Each decode rank's latent cache ends up holding exactly its DCP shard's tokens, written as it would have
    computed them itself; ranks of different DCP groups with the same dcp_rank hold the same bytes."""
    pre = PrefillSide(workers, backend, 1, src_tp, layout=_mla(src_tp), tag=f"{tp}x{dcp}i{inter}")
    dec = DecodeSide(backend, 1, tp, dcp, layout=_mla(tp, dcp, inter, block=32 if dcp == 2 else BLOCK))
    try:
        for r in range(dcp, tp):  # same tables per dcp_rank, as a decode pod allocates them
            dec.tables[r] = dec.tables[r % dcp]
        handoff = pre.publish()
        full = pre.full()
        results = dec.pull_all(handoff)
        for r in range(tp):
            want = empty_region(dec.layout, 500 + r)
            write_rank(dec.layout, r, full, dec.tables[r], want)
            assert dec.regions[r].shape == (NUM_LAYERS, NUM_BLOCKS, dec.layout.block_size, MLA_DIM)
            assert torch.equal(dec.regions[r], want), f"decode rank {r} differs"
            assert results[r].transport == backend
            assert results[r].nbytes == dec.layout.local_token_count(NUM_TOKENS, r % dcp) * MLA_DIM * 4 * NUM_LAYERS
            if r >= dcp:
                assert _shard_equal(dec, r, r % dcp), f"decode ranks {r} and {r % dcp} hold different latents"
        freed = _wait_for(lambda: [x for x in pre.freed() if x[0] == handoff.lease_id] or None, 5.0, "lease freed")
        assert {why for _, why in freed} == {"done"}
    finally:
        dec.close()


def _shard_equal(dec: "DecodeSide", a: int, b: int) -> bool:
    """The slots holding the request are equal on ranks a and b (the rest is each rank's own garbage)."""
    lay = dec.layout
    li = torch.arange(lay.local_token_count(NUM_TOKENS, lay.dcp_rank(a)))

    def rows(r: int) -> torch.Tensor:
        return dec.regions[r][:, torch.tensor(dec.tables[r])[li // lay.block_size], li % lay.block_size]

    return torch.equal(rows(a), rows(b))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mla_streaming_layer_by_layer(workers, backend):
    """Latent KV streams as GQA's does: every layer lands after prefill finished it, the first well before the last
    exists."""
    pre = PrefillSide(workers, backend, 1, 2, layout=_mla(2), tag="stream")
    dec = DecodeSide(backend, 1, 4, 4, layout=_mla(4, 4, 4))
    try:
        handoff = pre.publish(layers_ready=0)
        landed: dict[int, list[tuple[int, float]]] = {r: [] for r in range(4)}
        results: dict = {}

        def run(r):
            def on_landed(n, r=r):
                landed[r].append((n, time.monotonic()))

            try:
                results[r] = dec.pullers[r].pull(handoff, dec.tables[r], timeout_s=30, on_layers_landed=on_landed)
            except BaseException as e:
                results[r] = e

        threads = [threading.Thread(target=run, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for w in workers:
            w.call("stream", key=pre.key, lease_id=handoff.lease_id, delay=0.4)
        for t in threads:
            t.join(30)
        ready_by_src = [w.call("ready_times", lease_id=handoff.lease_id) for w in workers]
        plan = plan_reshard(pre.layout, pre.tables, dec.layout, dec.tables, NUM_TOKENS)
        full = pre.full()
        for r in range(4):
            ready = [max(ts) for ts in zip(*(ready_by_src[s] for s in plan.ranks[r].src_ranks()))]
            assert not isinstance(results[r], BaseException), results[r]
            want = empty_region(dec.layout, 500 + r)
            write_rank(dec.layout, r, full, dec.tables[r], want)
            assert torch.equal(dec.regions[r], want)
            got = dict(landed[r])
            assert sorted(got) == list(range(1, NUM_LAYERS + 1))
            for n in range(1, NUM_LAYERS + 1):
                assert got[n] >= ready[n - 1], f"rank {r} layer {n} landed before prefill finished it"
            assert got[1] < ready[-2], "layer 1 landed only at the end: no streaming"
    finally:
        dec.close()


# ---- faults ---------------------------------------------------------------------------------------
def test_prefill_killed_mid_transfer_raises_unavailable():
    w = PrefillWorker()
    try:
        pres = {b: PrefillSide([w], b, 2, 1, tag="kill") for b in BACKENDS if not hasattr(b, "values")}
        decs = {b: DecodeSide(b, 2, 1, 1, io_timeout_s=3.0) for b in pres}
        outcome: dict = {}
        landed_one = {b: threading.Event() for b in pres}
        handoffs = {b: pres[b].publish(layers_ready=0) for b in pres}

        def run(b):
            t0 = time.monotonic()
            try:
                decs[b].pullers[0].pull(
                    handoffs[b],
                    decs[b].tables[0],
                    timeout_s=30,
                    on_layers_landed=lambda n, b=b: landed_one[b].set(),
                )
                outcome[b] = ("returned", None)
            except BaseException as e:
                outcome[b] = (e, time.monotonic())
            del t0

        threads = {b: threading.Thread(target=run, args=(b,)) for b in pres}
        for t in threads.values():
            t.start()
        for b in pres:
            w.call("stream", key=pres[b].key, lease_id=handoffs[b].lease_id, delay=0.4)
        for b in pres:
            assert landed_one[b].wait(10), f"{b}: no layer landed before the kill"
        killed_at = time.monotonic()
        w.kill()
        for t in threads.values():
            t.join(15)
        for b in pres:
            exc, at = outcome[b]
            assert isinstance(exc, TransferUnavailable), f"{b}: {exc!r}"
            assert at - killed_at < 5.0, f"{b}: took {at - killed_at:.1f}s to notice"
        for d in decs.values():
            d.close()
    finally:
        w.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_unpulled_lease_expires_and_late_reads_are_refused(workers, backend):
    pre = PrefillSide(workers, backend, 1, 1, tag="expire", lease_timeout_s=0.5)
    dec = DecodeSide(backend, 1, 2, 2)
    try:
        handoff = pre.publish()
        dec.pullers[0].renew(handoff)  # handshake now, so what follows is a plain late read
        time.sleep(0.3)
        dec.pullers[0].renew(handoff)  # renewal keeps it (0.3 + 0.3 s > 0.5 s timeout)
        time.sleep(0.3)
        assert pre.freed() == [], "renewed lease must not expire"
        freed = _wait_for(pre.freed, 3.0, "lease to expire")
        assert freed == [(handoff.lease_id, "expired")]
        assert workers[0].call("counts")[pre.key]["expired"] == 1
        before = [t.clone() for t in dec.regions]
        for r in range(2):
            with pytest.raises(LeaseExpired):
                dec.pullers[r].pull(handoff, dec.tables[r], timeout_s=5)
            assert torch.equal(dec.regions[r], before[r]), "a refused read wrote into the destination"
        # The read ops themselves refuse too (not only the progress poll in front of them).
        c = ControlClient(handoff.endpoints[0])
        c.connect(2.0)
        base = {"lease": handoff.lease_id, "dst_rank": 0, "dst_world": 2}
        with pytest.raises(LeaseExpired):
            c.call({"op": "pin", **base, "layers_needed": 1})
        with pytest.raises(LeaseExpired):
            c.stream({"op": "read", **base, "layers": [0, 1]}, b"", lambda *a: pytest.fail("data sent"))
        with pytest.raises(LeaseExpired):  # a made-up lease id is refused the same way
            c.call({"op": "pin", **base, "lease": new_lease_id(), "layers_needed": 1})
        c.close()
    finally:
        dec.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_handshake_timeouts_are_bounded(backend):
    """A publisher that accepts and never answers costs the handshake timeout (DEADLINE_EXCEEDED); nobody listening
    (the prefill pod died or restarted elsewhere) fails at once as UNAVAILABLE, so a decode pod handed KV from a dead
    pod is not held up."""
    dec = DecodeSide(backend, 2, 1, 1, handshake_timeout_s=1.0)
    silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog), never answers
    try:
        for ep, error, bound in (
            (Endpoint("127.0.0.1", free_port()), TransferUnavailable, 0.5),
            (Endpoint("127.0.0.1", silent.getsockname()[1]), HandshakeTimeout, 1.0 + 1.5),
        ):
            handoff = KVHandoff(new_lease_id(), "r", NUM_TOKENS, _layout(2, 1), [list(range(5))], [ep], backend)
            t0 = time.monotonic()
            with pytest.raises(error):
                dec.pullers[0].pull(handoff, dec.tables[0], timeout_s=30)
            assert time.monotonic() - t0 < bound, "handshake bound not respected"
    finally:
        silent.close()
        dec.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_concurrent_pulls_on_one_puller(workers, backend):
    """A decode rank pulls a slow (streaming) request and a ready one at once: the ready one is not held up."""
    pre = PrefillSide(workers, backend, 2, 1, tag="concurrent")
    dec = DecodeSide(backend, 2, 1, 1)
    try:
        slow, fast = pre.publish(layers_ready=0), pre.publish()
        table_b = [b for b in range(NUM_BLOCKS) if b not in dec.tables[0]][: len(dec.tables[0])]
        out = {}
        th = threading.Thread(
            target=lambda: out.setdefault("slow", dec.pullers[0].pull(slow, dec.tables[0], timeout_s=30))
        )
        th.start()
        workers[0].call("stream", key=pre.key, lease_id=slow.lease_id, delay=0.5)
        time.sleep(0.3)  # the slow pull is now long-polling for layer 1
        t0 = time.monotonic()
        dec.pullers[0].pull(fast, table_b, timeout_s=30)
        fast_s = time.monotonic() - t0
        th.join(30)
        assert "slow" in out and fast_s < 1.5, f"ready request took {fast_s:.2f}s next to a streaming one"
        full = pre.full()
        want = empty_region(dec.layout, 500)
        write_rank(dec.layout, 0, full, dec.tables[0], want)
        write_rank(dec.layout, 0, full, table_b, want)
        assert torch.equal(dec.regions[0], want)
    finally:
        dec.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_first_pulls_from_threads_at_once_share_one_handshake(workers, backend):
    """A decode pod receives on several transfer threads: four pulls that start together from a publisher this
    puller never met all land right (a second, duplicate handshake used to drop the peer's NIXL agent under the
    first one's reads: NIXL_ERR_NOT_FOUND)."""
    pre = PrefillSide(workers, backend, 2, 1, tag="handshake-race")
    dec = DecodeSide(backend, 2, 1, 1)
    try:
        n = 4
        handoffs = [pre.publish() for _ in range(n)]
        free = [b for b in range(NUM_BLOCKS) if b not in dec.tables[0]]
        per = len(dec.tables[0])
        tables = [dec.tables[0]] + [free[i * per : (i + 1) * per] for i in range(n - 1)]
        assert all(len(t) == per for t in tables), "the test's region is too small for its tables"
        results: list = [None] * n
        go = threading.Barrier(n)

        def run(i: int) -> None:
            go.wait()
            try:
                results[i] = dec.pullers[0].pull(handoffs[i], tables[i], timeout_s=30)
            except BaseException as e:  # surfaced below
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        full = pre.full()
        want = empty_region(dec.layout, 500)
        for t in tables:
            write_rank(dec.layout, 0, full, t, want)
        assert torch.equal(dec.regions[0], want)
    finally:
        dec.close()


def test_tcp_puller_reads_a_nixl_publisher(workers):
    """Interop: every publisher also serves the TCP path (e.g. a decode pod without NIXL)."""
    if not nixl_available()[0]:
        pytest.skip("needs NIXL")
    pre = PrefillSide(workers, "nixl", 2, 1, tag="interop")
    dec = DecodeSide("tcp", 2, 1, 1)
    try:
        handoff = pre.publish()
        res = dec.pull_all(handoff)
        want = empty_region(dec.layout, 500)
        write_rank(dec.layout, 0, pre.full(), dec.tables[0], want)
        assert torch.equal(dec.regions[0], want) and res[0].transport == "tcp"
    finally:
        dec.close()


@pytest.mark.parametrize("split", [False, True], ids=["one_read", "split_read"])
def test_late_nixl_read_is_refused_not_served(workers, split):
    """A decode rank that stalls between its read pin and its one-sided NIXL READ (pin TTL and lease run
    out, prefill frees the blocks and they are reused for other data) really does READ the reused bytes,
    and the pull fails with LeaseExpired instead of returning them; a prompt reader of the same kind still
    gets byte-exact KV. Proves the after-READ lease check, not a timeout. split_read: the same with the READ
    split into two parts posted from two threads (both stall, both read the reused bytes, one refusal)."""
    if not nixl_available()[0]:
        pytest.skip("needs NIXL")
    from kv_transfer.nixl_transport import NixlPuller

    pre = PrefillSide(workers, "nixl", 2, 1, tag=f"late{int(split)}", lease_timeout_s=0.6, pin_ttl_s=0.3)
    scribble = 12345.0
    stalled: dict = {}

    class StallingAgent:
        """The puller's real NIXL agent, descheduled just before it posts the READ (the stall a busy box can
        cause); the READ itself then runs for real."""

        def __init__(self, agent):
            self._agent = agent
            self._lock = threading.Lock()

        def __getattr__(self, name):
            return getattr(self._agent, name)

        def initialize_xfer(self, *args, **kwargs):
            lease_id = stalled["lease"]
            with self._lock:  # one worker pipe: one caller at a time
                _wait_for(lambda: [x for x in pre.freed() if x[0] == lease_id], 10.0, "prefill to free the lease")
                workers[0].call("scribble", key=pre.key, value=scribble)
                stalled["freed_before_read"] = True
                stalled["posts"] = stalled.get("posts", 0) + 1
            return self._agent.initialize_xfer(*args, **kwargs)

    dec = DecodeSide("nixl", 2, 1, 1)
    late = NixlPuller(
        dec.layout,
        0,
        dec.regions[0],
        min_segment_bytes=0,
        handshake_timeout_s=5.0,
        io_timeout_s=5.0,
        **({"split_min_bytes": 0, "parallel_reads": 2} if split else {}),
    )
    try:
        handoff = pre.publish()
        res = dec.pull_all(handoff)  # a prompt reader: fine
        want = empty_region(dec.layout, 500)
        write_rank(dec.layout, 0, pre.full(), dec.tables[0], want)
        assert torch.equal(dec.regions[0], want) and res[0].transport == "nixl"
        with pytest.raises(LeaseExpired):  # that lease is done: what counts is the handshake it makes first
            late.renew(handoff)  # (the handshake prepares, never posts, a READ per lane): only READs stall below
        late._agent = StallingAgent(late._agent)

        handoff = pre.publish()
        stalled["lease"] = handoff.lease_id
        with pytest.raises(LeaseExpired, match="discarded"):
            late.pull(handoff, dec.tables[0], timeout_s=30)
        assert stalled.get("freed_before_read")
        assert stalled["posts"] == (2 if split else 1)
        assert [x for x in pre.freed() if x[0] == handoff.lease_id] == [(handoff.lease_id, "expired")]
        # The READ did run after the reuse: the destination blocks hold the reused bytes. Only the
        # refusal keeps them from becoming this request's KV (the caller frees those blocks).
        blocks = dec.regions[0][:, :, dec.tables[0][0]]
        assert torch.all(blocks == scribble), "the late READ did not actually read the reused blocks"
    finally:
        late.close()
        dec.close()


# ---- split READs (parts of equal bytes from several threads) ---------------------------------------
class TracingAgent:
    """A puller's real NIXL agent, recording which thread posted each READ part and which handles are still
    unreleased; ``on_post(n)`` runs before the n-th post, ``state(n, real)`` may replace part n's state."""

    def __init__(self, agent, on_post=None, state=None):
        self._agent, self.on_post, self.state = agent, on_post, state
        self._lock = threading.Lock()
        self.posts: list[int] = []  # thread ident per post
        self.live: set[int] = set()
        self._n = 0

    def __getattr__(self, name):
        return getattr(self._agent, name)

    def initialize_xfer(self, *args, **kwargs):
        h = _Traced(self._agent.initialize_xfer(*args, **kwargs), self)
        with self._lock:
            self.live.add(id(h))
        return h

    def transfer(self, h, *args):
        with self._lock:
            h.n, self._n = self._n, self._n + 1
            self.posts.append(threading.get_ident())
        if self.on_post is not None:
            self.on_post(h.n)
        real = self._agent.transfer(h.h, *args)
        return real if self.state is None else self.state(h.n, real)

    def check_xfer_state(self, h):
        real = self._agent.check_xfer_state(h.h)
        return real if self.state is None else self.state(h.n, real)


class _Traced:
    def __init__(self, h, tracer):
        self.h, self.tracer, self.n = h, tracer, -1

    def release(self):
        self.h.release()
        with self.tracer._lock:
            self.tracer.live.discard(id(self))


def _nixl_only():
    if not nixl_available()[0]:
        pytest.skip("needs NIXL")


@pytest.mark.parametrize(
    "kvh,src_tp,tp,dcp,parts", [(2, 2, 1, 1, 2), (2, 2, 1, 1, 3), (2, 2, 4, 2, 2), (1, 1, 2, 2, 2)]
)
def test_split_read_byte_identical(sides, kvh, src_tp, tp, dcp, parts):
    """A READ split into parts of equal bytes (forced: split_min_bytes=0), posted from as many threads,
    lands exactly the bytes of an unsplit one; every part's handle is released."""
    _nixl_only()
    get_prefill, _ = sides
    pre = get_prefill("nixl", kvh, src_tp)
    dec = DecodeSide("nixl", kvh, tp, dcp, split_min_bytes=0, parallel_reads=parts)
    try:
        tracers = [TracingAgent(p._agent) for p in dec.pullers]
        for p, t in zip(dec.pullers, tracers):
            p._agent = t
        handoff = pre.publish()
        full = pre.full()
        results = dec.pull_all(handoff)
        for r in range(tp):
            want = empty_region(dec.layout, 500 + r)
            write_rank(dec.layout, r, full, dec.tables[r], want)
            assert torch.equal(dec.regions[r], want), f"decode rank {r} differs"
            assert results[r].transport == "nixl"
            t = tracers[r]
            # one READ per prefill endpoint this rank reads from, each in `parts` parts
            assert len(t.posts) >= parts and len(t.posts) % parts == 0, f"rank {r}: {len(t.posts)} posts"
            assert len(set(t.posts)) == parts, "the parts were not posted from separate threads"
            assert not t.live, "a READ handle was left unreleased"
    finally:
        dec.close()


def test_split_read_one_part_failing_cancels_the_other(workers):
    """One part fails while the other is still in flight: the other is cancelled and released before the pull
    raises (TransferUnavailable naming the failure, not the cancellation), well before any READ timeout."""
    _nixl_only()
    pre = PrefillSide(workers, "nixl", 2, 1, tag="splitfail", pin_ttl_s=1.0)  # an abort frees after the pin
    dec = DecodeSide("nixl", 2, 1, 1, split_min_bytes=0, parallel_reads=2)
    try:
        posted_1 = threading.Event()

        def state(n, real):  # part 1 never ends by itself; part 0 fails once part 1 is in flight
            if n == 1:
                posted_1.set()
                return "PROC"
            posted_1.wait(5.0)
            return "ERR"

        t = TracingAgent(dec.pullers[0]._agent, state=state)
        dec.pullers[0]._agent = t
        t0 = time.monotonic()
        with pytest.raises(TransferUnavailable, match=r"failed \(ERR\)"):
            dec.pullers[0].pull(pre.publish(), dec.tables[0], timeout_s=30)
        assert time.monotonic() - t0 < 3.0
        assert len(t.posts) == 2 and not t.live, "a READ part was left in flight"
        freed = _wait_for(pre.freed, 5.0, "prefill to free the lease")
        assert [why for _, why in freed] == ["aborted"], freed
    finally:
        dec.close()


def test_split_read_prefill_killed_mid_read():
    """The prefill process dies between the two parts' posts: the pull fails with TransferUnavailable, with
    both parts ended and released, promptly."""
    _nixl_only()
    w = PrefillWorker()
    try:
        pre = PrefillSide([w], "nixl", 2, 1, tag="splitkill")
        dec = DecodeSide("nixl", 2, 1, 1, split_min_bytes=0, parallel_reads=2, io_timeout_s=3.0)
        try:
            handoff = pre.publish()
            dec.pullers[0].renew(handoff)  # handshake and connect first: the kill then hits the READ itself
            t = TracingAgent(dec.pullers[0]._agent, on_post=lambda n: w.kill() if n == 1 else None)
            dec.pullers[0]._agent = t
            t0 = time.monotonic()
            with pytest.raises(TransferUnavailable):
                dec.pullers[0].pull(handoff, dec.tables[0], timeout_s=30)
            assert time.monotonic() - t0 < 10.0
            assert len(t.posts) == 2 and not t.live, "a READ part was left in flight"
        finally:
            dec.close()
    finally:
        w.close()
