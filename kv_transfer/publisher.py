"""Prefill side, transport-independent part: regions, leases, and the control-channel operations.

Every publisher serves the plain-TCP read path (so any puller can always fall back to it); the NIXL
publisher adds its handshake data and notification polling on top (nixl_transport.NixlPublisher).

Control operations (JSON ``op``):
  hello   handshake: layout, hosted ranks, transports (+ NIXL metadata for NIXL publishers)
  wait    long-poll until more than ``after`` layers are ready (layer-progress notification)
  pin     lease check before a one-sided (NIXL) read: grants a read of layers [0, n) for a TTL
  unpin   the read landed; with ``verify`` (NIXL reads) refused with LeaseExpired unless the pin was still
          live, i.e. the blocks were held throughout the one-sided read
  read    TCP data path: lease checked + pinned, then the bytes streamed in chunks
  done    a decode rank has all its KV (ok=false: it gave up); the lease frees when all ranks are done
  renew   keep the lease while decode still queues the request
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kv_transfer.control import ControlServer, ServerConn
from kv_transfer.layout import KVLayout
from kv_transfer.lease import Lease, LeaseTable
from kv_transfer.plan import checked_block_table
from kv_transfer.region import RegionBytes, check_region
from kv_transfer.transport import (
    PROTOCOL_VERSION,
    BadTransferRequest,
    Endpoint,
    FreeCallback,
    KVHandoff,
    KVPublisher,
    LeaseExpired,
)

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

log = logging.getLogger(__name__)

MAX_WAIT_S = 30.0  # longest long-poll a client may ask for
DIRECT_SEND_BYTES = 256 << 10  # segments at least this big are sent straight from the region (no staging)


@dataclass
class _Published:
    block_tables: dict[int, np.ndarray]  # hosted tp rank -> block table
    num_tokens: int
    allowed: dict[int, np.ndarray] | None = None  # rank -> cumsum of "block belongs to the lease", lazily


class Publisher(KVPublisher):
    """Serves the KV regions of the prefill tp ranks hosted in this process, over the TCP data path."""

    name = "tcp"

    def __init__(
        self,
        layout: KVLayout,
        regions: Mapping[int, torch.Tensor],
        *,
        on_free: FreeCallback | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        lease_timeout_s: float = 30.0,
        pin_ttl_s: float = 10.0,
        tick_s: float = 0.05,
        chunk_bytes: int = 4 << 20,
        auth_token: str = "",
        tls: "TLSConfig | None" = None,
        scales: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        if layout.num_blocks <= 0:
            raise ValueError("publisher layout needs num_blocks")
        if not regions:
            raise ValueError("publisher needs at least one region")
        for r, t in regions.items():
            layout.kv_heads_of_rank(r)  # rank in range
            check_region(layout, t, f"prefill rank {r}")
        self.layout = layout
        self.regions = dict(sorted(regions.items()))
        # fp8: each hosted rank's scale tensor [layers, planes, blocks, groups]; the "wait" replies carry a lease's
        # scales for its ready layers, so they reach decode whichever data path moves the bytes
        self.scales = dict(scales or {})
        if layout.has_scales:
            for r in self.regions:
                got = self.scales.get(r)
                if got is None or tuple(got.shape) != layout.scales_shape() or got.dtype != torch.float32:
                    raise ValueError(
                        f"prefill rank {r}: an fp8 ({layout.dtype}) region needs its float32 scales "
                        f"{layout.scales_shape()}, got {None if got is None else (tuple(got.shape), got.dtype)}"
                    )
        self._bytes = {r: RegionBytes(t) for r, t in self.regions.items()}
        self._user_on_free = on_free
        self.chunk_bytes = max(chunk_bytes, DIRECT_SEND_BYTES)
        self.leases = LeaseTable(timeout_s=lease_timeout_s, pin_ttl_s=pin_ttl_s, on_free=self._freed)
        self._tick_s = tick_s
        self._stop = threading.Event()
        self._wake = threading.Event()  # cuts a housekeeping sleep short (see _on_activity)
        self._server = ControlServer(
            self._handle, host, port, io_timeout_s=max(pin_ttl_s / 2, 0.5), auth_token=auth_token, tls=tls
        )
        self._server.start()
        self._house = threading.Thread(target=self._housekeeping, name="kv-publisher-tick", daemon=True)
        self._house.start()
        log.info("kv publisher (%s) for prefill ranks %s listening on %s", self.name, list(self.regions), self.endpoint)

    # ---- KVPublisher --------------------------------------------------------------------------
    @property
    def endpoint(self) -> Endpoint:
        return self._server.endpoint

    def publish(
        self,
        request_id: str,
        block_tables: Mapping[int, Sequence[int]],
        num_tokens: int,
        *,
        lease_id: str | None = None,
        layers_ready: int = 0,
    ) -> str:
        if set(block_tables) != set(self.regions):
            raise BadTransferRequest(f"block tables for ranks {sorted(block_tables)}, hosting {list(self.regions)}")
        try:
            tables = {r: checked_block_table(self.layout, r, t, num_tokens, "prefill") for r, t in block_tables.items()}
        except ValueError as e:
            raise BadTransferRequest(str(e)) from e
        lease = self.leases.create(
            request_id, self.layout.num_layers, _Published(tables, num_tokens), lease_id, layers_ready
        )
        return lease.lease_id

    def set_layers_ready(self, lease_id: str, num_layers_ready: int) -> None:
        self.leases.set_layers_ready(lease_id, num_layers_ready)

    def handoff(self, lease_id: str) -> KVHandoff:
        lease = self.leases.get(lease_id)
        if lease is None:
            raise LeaseExpired(f"lease {lease_id} is not live")
        pub: _Published = lease.data
        tables = [pub.block_tables[r].tolist() if r in pub.block_tables else [] for r in range(self.layout.tp_size)]
        eps = [self.endpoint if r in self.regions else None for r in range(self.layout.tp_size)]
        return KVHandoff(lease_id, lease.request_id, pub.num_tokens, self.layout, tables, eps, self.name)

    def abort(self, lease_id: str, reason: str = "aborted") -> None:
        self.leases.abort(lease_id, reason)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._server.close()
        self._house.join(timeout=2)
        self.leases.close()

    # ---- hooks for subclasses -----------------------------------------------------------------
    def _hello_extra(self) -> tuple[dict[str, Any], bytes]:
        return {}, b""

    def _tick(self) -> None:
        self.leases.sweep()

    def _tick_interval(self) -> float:
        return self._tick_s

    def _on_activity(self, op: str) -> None:
        """Called after a handshake or a read pin was granted."""

    # ---- internals ----------------------------------------------------------------------------
    def _freed(self, lease: Lease, reason: str) -> None:
        log.log(
            logging.INFO if reason == "done" else logging.WARNING,
            "kv lease %s (request %s) freed: %s",
            lease.lease_id,
            lease.request_id,
            reason,
        )
        if self._user_on_free is not None:
            self._user_on_free(lease.lease_id, lease.request_id, reason)

    def _housekeeping(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._tick_interval())
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._tick()
            except Exception:
                log.exception("kv publisher housekeeping failed")

    def _handle(self, conn: ServerConn, msg: dict[str, Any], payload: bytearray) -> None:
        op = msg.get("op")
        lease_id = msg.get("lease", "")
        rank: Any = msg.get("dst_rank")  # wire data: checked by the lease table
        world: Any = msg.get("dst_world")
        if op == "hello":
            extra, blob = self._hello_extra()
            conn.send(
                {
                    "ok": True,
                    "version": PROTOCOL_VERSION,
                    "layout": self.layout.to_dict(),
                    "ranks": list(self.regions),
                    "transport": self.name,
                    **extra,
                },
                blob,
            )
            self._on_activity(op)
        elif op == "wait":
            wait_s = min(float(msg.get("wait_s", 1.0)), MAX_WAIT_S)
            ready = self.leases.wait_layers(lease_id, int(msg.get("after", 0)), wait_s, rank, world)
            reply: dict[str, Any] = {"ok": True, "ready": ready}
            if self.layout.has_scales and ready > 0:
                reply["scales"] = self._lease_scales(self.leases.check(lease_id, rank, world), ready)
            conn.send(reply)
        elif op == "pin":
            self.leases.check(lease_id, rank, world)
            pin = self.leases.pin(lease_id, int(rank), int(msg["layers_needed"]))
            self._on_activity(op)
            conn.send({"ok": True, "pin": pin, "ttl_s": self.leases.pin_ttl_s})
        elif op == "unpin":
            if not msg.get("verify"):
                self.leases.unpin(lease_id, int(msg["pin"]))
            elif not self.leases.release_pin(lease_id, int(msg["pin"])):
                # Why: a one-sided read is only known to have read this lease's KV if its pin held the
                # blocks until now; otherwise they may have been freed and reused mid-read.
                raise LeaseExpired(
                    f"lease {lease_id}: read pin {msg['pin']} lapsed before the read was confirmed "
                    f"(prefill may have freed/reused the blocks); the data read must be discarded"
                )
            conn.send({"ok": True})
        elif op == "read":
            self._serve_read(conn, msg, payload)
        elif op == "done":
            if msg.get("ok", True):
                freed = self.leases.complete(lease_id, int(rank), int(world))
            else:
                log.warning("kv lease %s: decode rank %s gave up: %s", lease_id, rank, msg.get("reason", ""))
                self.leases.abort(lease_id, "aborted")
                freed = True
            conn.send({"ok": True, "freed": freed})
        elif op == "renew":
            conn.send({"ok": True, "expires_in_s": self.leases.renew(lease_id)})
        else:
            raise BadTransferRequest(f"unknown control op {op!r}")

    def _lease_scales(self, lease: Lease, ready: int) -> dict[str, list]:
        """Per hosted rank, the lease's scales of layers [0, ready) as [layer][plane][group]: those of its first
        block, which every block of the request on that rank shares (pdserve/engine/kv_quant.py)."""
        pub: _Published = lease.data
        out = {}
        for r, table in pub.block_tables.items():
            if len(table):
                out[str(r)] = self.scales[r][:ready, :, int(table[0])].tolist()
        return out

    def _serve_read(self, conn: ServerConn, msg: dict[str, Any], payload: bytearray) -> None:
        """TCP data path: stream the requested base-plane segments for planes of layers [a, b)."""
        a, b = (int(x) for x in msg["layers"])
        if not 0 <= a < b <= self.layout.num_layers:
            raise BadTransferRequest(f"bad layer range [{a}, {b})")
        lease_id, rank = msg["lease"], int(msg["dst_rank"])
        seg = np.frombuffer(payload, dtype=np.int64).reshape(3, -1) if payload else np.zeros((3, 0), np.int64)
        ranks, offs, nbs = seg
        lease = self.leases.check(lease_id, rank, int(msg["dst_world"]))
        self._check_inside_lease(lease, ranks, offs, nbs)
        pin = self.leases.pin(lease_id, rank, b)  # refused (LeaseExpired) before a single byte moves
        try:
            self._stream(conn, lease_id, pin, range(a, b), ranks, offs, nbs)
        finally:
            self.leases.unpin(lease_id, pin)

    def _stream(self, conn: ServerConn, lease_id: str, pin: int, layers: range, ranks, offs, nbs) -> None:
        plane_nbytes, planes = self.layout.plane_nbytes(), self.layout.kv_planes
        buf = np.empty(self.chunk_bytes, np.uint8)
        fill = 0

        def flush() -> None:
            nonlocal fill
            if fill:
                # Why check here: the bytes were copied while the pin held; if the pin is gone now,
                # the blocks may already be reused, so nothing more is sent.
                if not self.leases.touch_pin(lease_id, pin):
                    raise LeaseExpired(f"lease {lease_id}: read pin lost mid-stream")
                conn.send({"n": fill}, buf.data[:fill])
                fill = 0

        rank_list, nb_list = ranks.tolist(), nbs.tolist()
        for layer in layers:
            for kv in range(planes):
                base = (planes * layer + kv) * plane_nbytes
                for r, o, n in zip(rank_list, (offs + base).tolist(), nb_list):
                    src = self._bytes[r]
                    if n >= DIRECT_SEND_BYTES and not src.is_cuda:
                        flush()
                        if not self.leases.touch_pin(lease_id, pin):
                            raise LeaseExpired(f"lease {lease_id}: read pin lost mid-stream")
                        conn.send({"n": n}, src.view(o, n))
                        continue
                    if fill + n > len(buf):
                        flush()
                    src.read_into(o, n, buf[fill : fill + n])
                    fill += n
        flush()
        conn.send({"end": True})

    def _check_inside_lease(self, lease: Lease, ranks: np.ndarray, offs: np.ndarray, nbs: np.ndarray) -> None:
        """A TCP read may only touch blocks of this lease (else it could read another request's KV)."""
        if len(ranks) == 0:
            return
        pub: _Published = lease.data
        if pub.allowed is None:  # built once; concurrent readers may both build it, both results are equal
            allowed = {}
            for r, t in pub.block_tables.items():
                mask = np.zeros(self.layout.num_blocks + 1, np.int64)
                mask[t + 1] = 1
                allowed[r] = np.cumsum(mask)  # allowed[b+1] - allowed[a] = allowed blocks in [a, b]
            pub.allowed = allowed
        bn = self.layout.block_nbytes
        if np.any(offs < 0) or np.any(nbs <= 0) or np.any(offs + nbs > self.layout.plane_nbytes()):
            raise BadTransferRequest("read segment outside the (layer 0, K) plane")
        first, last = offs // bn, (offs + nbs - 1) // bn
        for r in np.unique(ranks).tolist():
            if r not in pub.allowed:
                raise BadTransferRequest(f"prefill rank {r} is not hosted by this publisher")
            m = ranks == r
            cs = pub.allowed[r]
            if np.any(cs[last[m] + 1] - cs[first[m]] != last[m] - first[m] + 1):
                raise BadTransferRequest("read segment touches blocks outside the lease's block table")
