"""LeaseTable (prefill side): expiry, renewal, completion, pins, refusal; plus handoff/control basics."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from prometheus_client import REGISTRY

from kv_transfer.control import ControlClient, ControlServer, recv_frame, send_frame
from kv_transfer.layout import KVLayout
from kv_transfer.lease import LeaseTable, new_lease_id
from kv_transfer.transport import (
    BadTransferRequest,
    Endpoint,
    HandshakeTimeout,
    KVHandoff,
    LeaseExpired,
    TransferUnavailable,
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _table(clock, freed, timeout=10.0, pin_ttl=5.0):
    return LeaseTable(
        timeout_s=timeout,
        pin_ttl_s=pin_ttl,
        clock=clock,
        on_free=lambda lease, why: freed.append((lease.lease_id, why)),
    )


def _metric(reason: str) -> float:
    return REGISTRY.get_sample_value("pdserve_kv_leases_freed_total", {"reason": reason}) or 0.0


def test_expiry_frees_once_counts_and_refuses():
    clock, freed = Clock(), []
    t = _table(clock, freed)
    before = _metric("expired")
    lease = t.create("req", num_layers=4, layers_ready=4)
    clock.t += 9.9
    assert t.sweep() == 0 and not freed
    t.renew(lease.lease_id)  # decode still queued: renewed
    clock.t += 9.9
    assert t.sweep() == 0
    clock.t += 0.2
    assert t.sweep() == 1 and freed == [(lease.lease_id, "expired")]
    assert t.sweep() == 0 and len(freed) == 1  # freed exactly once
    assert t.freed_counts["expired"] == 1 and _metric("expired") == before + 1
    for call in (
        lambda: t.check(lease.lease_id),
        lambda: t.pin(lease.lease_id, 0, 1),
        lambda: t.renew(lease.lease_id),
        lambda: t.wait_layers(lease.lease_id, 0, 0.0),
    ):
        with pytest.raises(LeaseExpired, match="expired"):
            call()
    with pytest.raises(LeaseExpired, match="unknown"):
        t.check(new_lease_id())


def test_prefill_progress_renews():
    clock, freed = Clock(), []
    t = _table(clock, freed)
    lease = t.create("req", num_layers=4)
    for n in range(1, 5):
        clock.t += 8
        t.set_layers_ready(lease.lease_id, n)
        assert t.sweep() == 0
    assert not freed


def test_free_when_all_decode_ranks_done():
    clock, freed = Clock(), []
    t = _table(clock, freed)
    lid = t.create("req", 2, layers_ready=2).lease_id
    t.check(lid, dst_rank=0, dst_world=3)
    assert not t.complete(lid, 0, 3) and not t.complete(lid, 2, 3) and not t.complete(lid, 2, 3)
    assert t.complete(lid, 1, 3)
    assert freed == [(lid, "done")]
    with pytest.raises(BadTransferRequest):  # another decode world for the same lease is a bug
        lid2 = t.create("req2", 2).lease_id
        t.check(lid2, 0, 2)
        t.check(lid2, 0, 4)


def test_pins_defer_free_until_unpin_or_ttl():
    clock, freed = Clock(), []
    t = _table(clock, freed)
    lid = t.create("req", 4, layers_ready=2).lease_id
    with pytest.raises(BadTransferRequest):
        t.pin(lid, 0, layers_needed=3)  # not ready yet
    pin = t.pin(lid, 0, layers_needed=2)
    assert t.has_pins()
    t.abort(lid)  # retired: no new reads, but the running one finishes
    assert not freed
    with pytest.raises(LeaseExpired):
        t.pin(lid, 1, 1)
    t.unpin(lid, pin)
    assert freed == [(lid, "aborted")]
    # a pin whose reader vanished holds the blocks only for its TTL
    t = _table(clock, freed, timeout=10.0, pin_ttl=12.0)
    lid2 = t.create("req2", 4, layers_ready=4).lease_id
    pin2 = t.pin(lid2, 0, 4)
    clock.t += 10.5  # lease timed out, pin still live
    assert t.sweep() == 0 and not any(x[0] == lid2 for x in freed)
    assert t.touch_pin(lid2, pin2) is True  # a streaming read keeps its pin alive...
    clock.t += 12.1
    assert t.touch_pin(lid2, pin2) is False  # ...but not once it lapsed
    assert t.sweep() == 1 and (lid2, "expired") in freed


def test_wait_layers_wakes_on_progress_and_on_abort():
    t = LeaseTable(timeout_s=30)
    lid = t.create("req", 4).lease_id
    threading.Timer(0.1, t.set_layers_ready, args=(lid, 2)).start()
    t0 = time.monotonic()
    assert t.wait_layers(lid, after=0, timeout_s=5) == 2
    assert time.monotonic() - t0 < 2
    assert t.wait_layers(lid, after=2, timeout_s=0.05) == 2  # timeout: no progress
    threading.Timer(0.1, t.abort, args=(lid,)).start()
    with pytest.raises(LeaseExpired):
        t.wait_layers(lid, after=2, timeout_s=5)


def test_concurrent_completion_frees_exactly_once():
    freed = []
    t = LeaseTable(timeout_s=30, on_free=lambda lease, why: freed.append(why))
    lids = [t.create(f"r{i}", 1, layers_ready=1).lease_id for i in range(50)]

    def worker(rank):
        for lid in lids:
            t.renew(lid) if rank % 2 else None
            t.complete(lid, rank, 8)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert freed == ["done"] * 50 and len(t) == 0


def test_lease_ids_are_random_and_unique():
    ids = {new_lease_id() for _ in range(1000)}
    assert len(ids) == 1000 and min(len(i) for i in ids) >= 22


def test_handoff_json_roundtrip_and_merge():
    lay = KVLayout(4, 2, 8, "float32", 16, tp_size=2, num_blocks=24)
    a = KVHandoff("L", "r", 70, lay, [[1, 2], []], [Endpoint("127.0.0.1", 5), None], "nixl")
    b = KVHandoff("L", "r", 70, lay, [[], [3, 4]], [None, Endpoint("127.0.0.1", 6)], "tcp")
    assert KVHandoff.from_json(a.to_json()) == a and not a.complete
    m = KVHandoff.merge([a, b])
    assert m.complete and m.block_tables == [[1, 2], [3, 4]] and m.transport == "tcp"
    assert [str(e) for e in m.endpoints] == ["127.0.0.1:5", "127.0.0.1:6"]


def test_transfer_errors_are_service_errors_with_their_status():
    """Each kv_transfer error answers with its own gRPC status through the services' one error model."""
    import grpc

    from pdserve.errors import status_of

    assert status_of(TransferUnavailable("peer gone")) == (grpc.StatusCode.UNAVAILABLE, "peer gone")
    assert status_of(LeaseExpired()) == (grpc.StatusCode.FAILED_PRECONDITION, "")
    assert status_of(HandshakeTimeout("x")) == (grpc.StatusCode.DEADLINE_EXCEEDED, "x")
    assert status_of(BadTransferRequest("bad"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert isinstance(BadTransferRequest("bad"), ValueError)
    assert status_of(ValueError()) is None


def test_control_roundtrip_errors_and_timeouts():
    def handler(conn, msg, payload):
        if msg["op"] == "echo":
            conn.send({"ok": True, "n": len(payload)}, bytes(payload[::-1]))
        elif msg["op"] == "expired":
            raise LeaseExpired("gone")
        elif msg["op"] == "sleep":
            time.sleep(msg["s"])
            conn.send({"ok": True})
        else:
            raise RuntimeError("boom")

    srv = ControlServer(handler).start()
    try:
        c = ControlClient(srv.endpoint, io_timeout_s=2)
        c.connect(1.0)
        reply, data = c.call({"op": "echo"}, b"abc")
        assert reply["n"] == 3 and bytes(data) == b"cba"
        with pytest.raises(LeaseExpired, match="gone"):
            c.call({"op": "expired"})
        with pytest.raises(Exception, match="boom"):
            c.call({"op": "other"})
        assert c.call({"op": "echo"}, b"")[0]["ok"]  # connection survives handler errors
        t0 = time.monotonic()
        with pytest.raises(TransferUnavailable):
            c.call({"op": "sleep", "s": 1.0}, timeout_s=0.2)
        assert time.monotonic() - t0 < 0.6 and not c.connected
        idle = ControlClient(srv.endpoint)
        idle.connect(1.0)
        assert idle.alive()
    finally:
        srv.close()
    time.sleep(0.05)
    assert not idle.alive() and not idle.connected  # a pooled connection the server dropped is noticed
    # garbage on the wire is a broken peer, not a hang
    a, b = socket.socketpair()
    b.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
    with pytest.raises(ConnectionResetError):
        recv_frame(a, time.monotonic() + 1)
    send_frame(b, {"x": 1}, b"yz")
    a.close()
    b.close()


def test_release_pin_says_whether_the_blocks_were_held_throughout():
    """A one-sided read is confirmed only while its pin is live: a pin that timed out (blocks maybe freed and
    reused) or a lease already freed answers False, so the reader discards what it read."""
    clock, freed = Clock(), []
    t = _table(clock, freed, timeout=10.0, pin_ttl=1.0)
    lease = t.create("req", num_layers=2, layers_ready=2)
    p1 = t.pin(lease.lease_id, 0, 2)
    clock.t += 0.5
    assert t.release_pin(lease.lease_id, p1) is True  # in time
    assert t.release_pin(lease.lease_id, p1) is False  # released once only
    p2 = t.pin(lease.lease_id, 0, 2)
    clock.t += 1.5  # the pin's TTL passed (lease itself still live)
    assert t.release_pin(lease.lease_id, p2) is False
    p3 = t.pin(lease.lease_id, 0, 2)
    clock.t += 10.5  # lease expires; its pin too: the sweep frees the blocks
    assert t.sweep() == 1 and freed == [(lease.lease_id, "expired")]
    assert t.release_pin(lease.lease_id, p3) is False
    # a live pin holds a retiring lease; releasing it in time confirms the read and frees the blocks
    lease2 = t.create("req2", num_layers=2, layers_ready=2)
    p4 = t.pin(lease2.lease_id, 0, 2)
    t.abort(lease2.lease_id)
    assert (lease2.lease_id, "aborted") not in freed
    assert t.release_pin(lease2.lease_id, p4) is True
    assert (lease2.lease_id, "aborted") in freed
