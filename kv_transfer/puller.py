"""Decode side, transport-independent part: handshakes, the layer-streaming loop, completion.

One puller per decode tp rank. ``pull`` plans this rank's share of the re-shard, then repeatedly
long-polls each prefill endpoint it reads from for layer progress and reads every newly finished
layer (group) straight away, so the transfer overlaps prefill compute. It returns only once the last
layer has landed, then reports done to every prefill endpoint of the request (a prefill rank frees
its blocks once every decode rank did). On failure it tells prefill it gave up (best effort) and
raises; the caller frees its own blocks.

Subclasses provide ``_read`` (move one layer group from one endpoint) and may hook the handshake.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kv_transfer.control import ControlClient
from kv_transfer.layout import KVLayout
from kv_transfer.plan import RankPlan, Segments, plan_reshard, plan_scales
from kv_transfer.region import RegionBytes, check_region
from kv_transfer.transport import (
    PROTOCOL_VERSION,
    BadTransferRequest,
    Endpoint,
    HandshakeTimeout,
    KVHandoff,
    KVPuller,
    KVTransferError,
    LeaseExpired,
    PullResult,
    TransferCancelled,
    TransferUnavailable,
)

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

log = logging.getLogger(__name__)


@dataclass
class Session:
    """What we know about one prefill endpoint (cached across requests): its handshake answer, the
    transport-specific peer (e.g. its NIXL agent), and a small pool of idle control connections, so
    that concurrent pulls each get their own connection (a long-poll does not block another pull)."""

    endpoint: Endpoint
    hello: dict[str, Any]
    blob: bytes
    connect_timeout_s: float
    io_timeout_s: float
    auth_token: str = ""  # the pod's cluster token, presented on every connection
    tls: "TLSConfig | None" = None
    peer: Any = None
    _idle: list[ControlClient] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def borrow(self) -> ControlClient:
        with self._lock:
            while self._idle:
                c = self._idle.pop()
                if c.alive():
                    return c
                c.close()
        c = ControlClient(self.endpoint, io_timeout_s=self.io_timeout_s, auth_token=self.auth_token, tls=self.tls)
        c.connect(self.connect_timeout_s)
        return c

    def give_back(self, c: ControlClient) -> None:
        with self._lock:
            if c.connected and len(self._idle) < 4:
                self._idle.append(c)
                return
        c.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()


@dataclass
class _Source:
    """What this rank reads from one endpoint for the current request."""

    session: Session
    client: ControlClient  # this pull's own connection to the endpoint
    base: Segments  # (layer 0, K) plane segments served by this endpoint, in destination order
    wire: bytes  # base as the TCP read request's payload
    path: str = ""  # data path actually used ("nixl" / "tcp"), set by _read
    transport_state: Any = None  # a transport's per-request cache (NIXL: its staged plan), set by _read


class BasePuller(KVPuller):
    name = "base"

    def __init__(
        self,
        layout: KVLayout,
        rank: int,
        region: torch.Tensor,
        *,
        handshake_timeout_s: float = 5.0,
        io_timeout_s: float = 10.0,
        wait_poll_s: float = 1.0,
        max_layers_per_read: int = 64,
        transfer_timeout_s: float = 300.0,
        auth_token: str = "",
        tls: "TLSConfig | None" = None,
        scales: torch.Tensor | None = None,
    ) -> None:
        if layout.num_blocks <= 0:
            raise ValueError("puller layout needs num_blocks")
        layout.kv_heads_of_rank(rank)  # rank in range
        check_region(layout, region, f"decode rank {rank}")
        if layout.has_scales and (
            scales is None or tuple(scales.shape) != layout.scales_shape() or scales.dtype != torch.float32
        ):
            raise ValueError(
                f"decode rank {rank}: an fp8 ({layout.dtype}) region needs its float32 scales {layout.scales_shape()}"
            )
        self.scales = scales  # fp8: written for the request's blocks once its KV landed
        self.layout = layout
        self.rank = rank
        self.region = region
        self.region_bytes = RegionBytes(region)
        self.handshake_timeout_s = handshake_timeout_s
        self.io_timeout_s = io_timeout_s
        self.wait_poll_s = wait_poll_s
        self.max_layers_per_read = max(1, max_layers_per_read)
        self.transfer_timeout_s = transfer_timeout_s
        self.auth_token = auth_token  # the pod's cluster token ("" = none), presented to every publisher
        self.tls = tls  # the pod's TLS settings; None: plain TCP
        self._sessions: dict[Endpoint, Session] = {}
        self._sessions_lock = threading.Lock()
        # One handshake per endpoint at a time: pulls run on several threads, and a second handshake's session,
        # dropped as a duplicate, would forget the peer (its NIXL agent) under the first one's reads.
        self._handshakes: dict[Endpoint, threading.Lock] = {}

    # ---- KVPuller -----------------------------------------------------------------------------
    def pull(
        self,
        handoff: KVHandoff,
        block_table: Sequence[int],
        *,
        on_layers_landed: Callable[[int], None] | None = None,
        timeout_s: float | None = None,
        cancelled: threading.Event | None = None,
    ) -> PullResult:
        t0 = time.monotonic()
        deadline = t0 + (self.transfer_timeout_s if timeout_s is None else timeout_s)
        rp = self._plan(handoff, block_table)
        eps: list[Endpoint] = list(dict.fromkeys(handoff.endpoints))  # type: ignore[arg-type]  # unique, rank order
        conns: dict[Endpoint, tuple[Session, ControlClient]] = {}
        try:
            for ep in eps:  # handshake every endpoint: all of them get our "done"
                session = self._session(ep)
                conns[ep] = (session, session.borrow())
            sources = self._sources(handoff, rp, conns)
            # Wait on the endpoints we read from; a rank with nothing to read still waits for the last layer.
            waits = [(s.session, s.client) for s in sources.values()] or list(conns.values())
            landed, times, nbytes = 0, [], 0
            num_layers = self.layout.num_layers
            got_scales: dict[int, list] = {}  # prefill rank -> its lease scales [layer][plane][group]
            while landed < num_layers:
                ready = min(self._wait(s, c, handoff, landed, deadline, cancelled, got_scales) for s, c in waits)
                # Everything ready goes in one read (up to max_layers_per_read): one layer at a time while
                # streaming behind prefill, all at once when prefill is already done.
                for a in range(landed, ready, self.max_layers_per_read):
                    group = range(a, min(a + self.max_layers_per_read, ready))
                    _check_cancelled(cancelled, handoff)
                    for src in sources.values():
                        nbytes += self._read(src, handoff, rp, group, deadline)
                    now = time.monotonic()
                    times += [now] * len(group)
                    if on_layers_landed is not None:
                        for n in range(group.start + 1, group.stop + 1):
                            on_layers_landed(n)
                landed = ready
            if self.layout.has_scales:
                self._write_scales(handoff, block_table, got_scales)
            for session, client in conns.values():
                self._report_done(session, client, handoff)
        except KVTransferError as e:
            log.warning("kv pull of lease %s by decode rank %d failed: %r", handoff.lease_id, self.rank, e)
            if not isinstance(e, LeaseExpired):
                self._abort_live(handoff, conns, f"{type(e).__name__}: {e}")
            if isinstance(e, (TransferUnavailable, HandshakeTimeout)):
                for ep in eps:  # re-handshake next time: the peer may have restarted
                    self._drop_session(ep)
            raise
        finally:
            for session, client in conns.values():
                session.give_back(client)
        paths = sorted({src.path for src in sources.values() if src.path})
        return PullResult(handoff.lease_id, nbytes, time.monotonic() - t0, times, "+".join(paths) or self.name)

    def renew(self, handoff: KVHandoff) -> None:
        for ep in dict.fromkeys(handoff.endpoints):
            if ep is None:  # a rank without an endpoint holds no lease to renew
                continue
            session = self._session(ep)
            client = session.borrow()
            try:
                client.call({"op": "renew", "lease": handoff.lease_id})
            finally:
                session.give_back(client)

    def abort(self, handoff: KVHandoff, reason: str = "aborted") -> None:
        msg = {
            "op": "done",
            "ok": False,
            "reason": reason[:500],
            "lease": handoff.lease_id,
            "dst_rank": self.rank,
            "dst_world": self.layout.tp_size,
        }
        for ep in dict.fromkeys(handoff.endpoints):
            if ep is None:
                continue
            c = ControlClient(ep, io_timeout_s=1.0, auth_token=self.auth_token, tls=self.tls)
            try:  # a fresh short-lived connection, and short bounds: this runs on error paths
                c.connect(timeout_s=0.5)
                c.call(msg)
            except KVTransferError:
                pass  # prefill gone or lease already freed: its timeout covers the rest
            finally:
                c.close()

    def _abort_live(
        self, handoff: KVHandoff, conns: dict[Endpoint, tuple[Session, ControlClient]], reason: str
    ) -> None:
        """After a failed pull: tell the prefill endpoints we still have a working connection to."""
        for _session, client in conns.values():
            if not client.connected:
                continue  # unreachable: its lease timeout frees its blocks
            try:
                client.call(self._msg("done", handoff, ok=False, reason=reason[:500]), timeout_s=1.0)
            except KVTransferError:
                pass

    def close(self) -> None:
        with self._sessions_lock:
            eps = list(self._sessions)
        for ep in eps:
            self._drop_session(ep)

    def _write_scales(self, handoff: KVHandoff, block_table: Sequence[int], got: dict[int, list]) -> None:
        """Every block of the request here takes its groups' scales from the prefill ranks plan_scales names."""
        assert self.scales is not None
        try:
            sources = plan_scales(handoff.layout, self.layout, self.rank)
        except ValueError as e:
            raise BadTransferRequest(str(e)) from e
        n = self.layout.blocks_needed(handoff.num_tokens, self.rank)
        if n == 0:
            return  # no token of this prompt lives here; the first one decoded here opens a block with its own
        cols = []
        for cands in sources:
            r, g = next(((r, g) for r, g in cands if r in got), cands[0])
            if r not in got:
                raise BadTransferRequest(f"lease {handoff.lease_id}: prefill rank {r} sent no fp8 scales")
            vals = torch.tensor(got[r], dtype=torch.float32)  # [layers, planes, groups]
            if tuple(vals.shape[:2]) != (self.layout.num_layers, self.layout.kv_planes) or not 0 <= g < vals.shape[2]:
                raise BadTransferRequest(f"lease {handoff.lease_id}: prefill rank {r} sent scales {tuple(vals.shape)}")
            if not bool(torch.isfinite(vals).all() and (vals > 0).all()):
                raise BadTransferRequest(f"lease {handoff.lease_id}: prefill rank {r} sent non-positive scales")
            cols.append(vals[:, :, g])
        per_group = torch.stack(cols, dim=-1).to(self.scales.device)  # [layers, planes, groups]
        blocks = torch.as_tensor(list(block_table[:n]), dtype=torch.int64, device=self.scales.device)
        self.scales[:, :, blocks] = per_group.unsqueeze(2).expand(-1, -1, n, -1)

    # ---- for subclasses -----------------------------------------------------------------------
    def _read(self, src: _Source, handoff: KVHandoff, rp: RankPlan, layers: range, deadline: float) -> int:
        """Move layers ``layers`` of ``src.base`` into the region; returns bytes written."""
        raise NotImplementedError

    def _on_hello(self, session: Session) -> None:
        """Transport-specific handshake step (e.g. load the peer's NIXL metadata)."""

    def _forget_peer(self, session: Session) -> None:
        """Undo _on_hello when a session is dropped."""

    def _report_done(self, session: Session, client: ControlClient, handoff: KVHandoff) -> None:
        try:
            client.call(self._msg("done", handoff, ok=True))
        except KVTransferError as e:  # the KV is in place; prefill's lease timeout frees its side
            log.warning("kv lease %s: could not report done to %s: %r", handoff.lease_id, session.endpoint, e)

    # ---- helpers ------------------------------------------------------------------------------
    def _msg(self, op: str, handoff: KVHandoff, **kw: Any) -> dict[str, Any]:
        return {"op": op, "lease": handoff.lease_id, "dst_rank": self.rank, "dst_world": self.layout.tp_size, **kw}

    def _plan(self, handoff: KVHandoff, block_table: Sequence[int]) -> RankPlan:
        if not handoff.complete:
            raise BadTransferRequest("handoff misses some prefill ranks' endpoints (merge the partial handoffs)")
        try:
            plan_scales(handoff.layout, self.layout, self.rank)  # an fp8 source it cannot take is refused up front
            plan = plan_reshard(
                handoff.layout,
                handoff.block_tables,
                self.layout,
                {self.rank: block_table},
                handoff.num_tokens,
                dst_ranks=[self.rank],
            )
        except ValueError as e:
            raise BadTransferRequest(str(e)) from e
        return plan.ranks[self.rank]

    def _sources(
        self, handoff: KVHandoff, rp: RankPlan, conns: dict[Endpoint, tuple[Session, ControlClient]]
    ) -> dict[Endpoint, _Source]:
        out = {}
        for ep, (session, client) in conns.items():
            ranks = [r for r, e in enumerate(handoff.endpoints) if e == ep]
            m = np.isin(rp.base.src_rank, ranks)
            if not m.any():
                continue
            base = Segments(rp.base.src_rank[m], rp.base.src_offset[m], rp.base.dst_offset[m], rp.base.nbytes[m])
            wire = np.stack([base.src_rank.astype(np.int64), base.src_offset, base.nbytes]).tobytes()
            out[ep] = _Source(session, client, base, wire)
        return out

    def _session(self, ep: Endpoint) -> Session:
        with self._sessions_lock:
            s = self._sessions.get(ep)
            handshake = self._handshakes.setdefault(ep, threading.Lock())
        if s is not None:
            return s
        with handshake:
            with self._sessions_lock:
                s = self._sessions.get(ep)
            return s if s is not None else self._handshake(ep)

    def _handshake(self, ep: Endpoint) -> Session:
        deadline = time.monotonic() + self.handshake_timeout_s
        client = ControlClient(ep, io_timeout_s=self.io_timeout_s, auth_token=self.auth_token, tls=self.tls)
        client.connect(self.handshake_timeout_s)
        try:
            hello, blob = client.call(
                {"op": "hello", "version": PROTOCOL_VERSION, "transport": self.name},
                timeout_s=max(deadline - time.monotonic(), 0.05),
                handshake=True,
            )
            if hello.get("version") != PROTOCOL_VERSION:
                raise BadTransferRequest(f"{ep} speaks kv protocol {hello.get('version')}, we speak {PROTOCOL_VERSION}")
            s = Session(ep, hello, bytes(blob), self.handshake_timeout_s, self.io_timeout_s, self.auth_token, self.tls)
            self._on_hello(s)
        except Exception:
            client.close()
            raise
        s.give_back(client)
        with self._sessions_lock:
            self._sessions[ep] = s
        return s

    def _drop_session(self, ep: Endpoint) -> None:
        with self._sessions_lock:
            s = self._sessions.pop(ep, None)
        if s is not None:
            s.close()
            try:
                self._forget_peer(s)
            except Exception:
                log.debug("forgetting peer %s failed", ep, exc_info=True)

    def _wait(
        self,
        session: Session,
        client: ControlClient,
        handoff: KVHandoff,
        after: int,
        deadline: float,
        cancelled: threading.Event | None = None,
        scales: dict[int, list] | None = None,
    ) -> int:
        """Long-poll until more than ``after`` layers are ready at this endpoint; an fp8 lease's scales of the
        ready layers go into ``scales`` (by prefill rank)."""
        while True:
            _check_cancelled(cancelled, handoff)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferUnavailable(
                    f"lease {handoff.lease_id}: prefill at {session.endpoint} stuck at {after} layers"
                )
            wait_s = min(self.wait_poll_s, left)
            reply, _ = client.call(
                self._msg("wait", handoff, after=after, wait_s=wait_s), timeout_s=wait_s + self.io_timeout_s
            )
            if reply["ready"] > after:
                if scales is not None:
                    scales.update({int(r): v for r, v in reply.get("scales", {}).items()})
                return int(reply["ready"])


def _check_cancelled(cancelled: threading.Event | None, handoff: KVHandoff) -> None:
    if cancelled is not None and cancelled.is_set():
        raise TransferCancelled(f"lease {handoff.lease_id}: the decode pod gave the pull up")
