"""NIXL (UCX) data path: decode ranks READ their share of the plan straight out of prefill memory.

  * prefill registers each hosted region once (DRAM on CPU, VRAM when the region is on CUDA);
  * handshake over the control channel: prefill's agent metadata and its serialized descriptor list
    (one descriptor per hosted region, in rank order) travel as bytes in the ``hello`` answer;
  * per layer group, decode asks for a read pin over the control channel (the lease check), then
    posts one NIXL READ whose descriptors are exactly its plan segments (a big READ is split into
    ``parallel_reads`` parts of equal bytes, posted and polled from as many threads over as many UCX workers;
    the pin covers them all, and a failed part fails the READ only once every part has ended);
  * once the READ is DONE, decode releases the pin with ``unpin verify=true``: prefill confirms only if the
    pin was still live, i.e. the blocks were held from the grant until after the data was read. A READ that
    ran late (stalled decode, pin TTL passed, lease freed, blocks reused) is refused with LeaseExpired and
    its data is discarded (the pull fails; the caller frees the blocks it landed in), never served;
  * "done" goes over the control channel after the last confirmed READ, as on the TCP path.
    (Older decoders sent unpin/done as READ notifications; prefill still honours those.)

A publisher without NIXL (or a peer that did not offer it) is read over TCP instead, per endpoint.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kv_transfer.control import pack_blobs, unpack_blobs
from kv_transfer.fallback_transport import TcpPuller
from kv_transfer.layout import KVLayout
from kv_transfer.plan import RankPlan
from kv_transfer.publisher import Publisher
from kv_transfer.puller import Session, _Source
from kv_transfer.staging import StagedPlan, plan_staging, scatter
from kv_transfer.transport import BadTransferRequest, KVHandoff, KVTransferError, TransferUnavailable
from pdserve.engine.hugepages import advise_hugepages

log = logging.getLogger(__name__)

__all__ = ["NixlPublisher", "NixlPuller", "import_nixl"]

_NOTIF_PREFIX = "pdkv"


def import_nixl() -> Any:
    """The nixl module (``nixl_cu12`` or ``nixl_cu13`` wheels, or a source build's ``nixl._api``). Raises
    ImportError."""
    try:
        import nixl_cu12 as nixl
    except ImportError:
        try:
            import nixl_cu13 as nixl  # type: ignore[no-redef]  # CUDA 13 machines (torch cu130)
        except ImportError:
            from nixl import _api as nixl  # type: ignore[no-redef]
    return nixl


def _new_agent(
    prefix: str,
    backends: Sequence[str],
    *,
    sync: str = "STRICT",
    ucx_workers: int = 1,
    ucx_transports: str | None = None,
) -> Any:
    nixl = import_nixl()
    if ucx_transports:
        # UCX reads its transport list (UCX_TLS) from the environment when the backend is created, so the setting
        # is the process's: every agent of one pod process shares it.
        os.environ["UCX_TLS"] = ucx_transports
    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    # Why no NIXL progress thread: the Python API runs it with no delay, and each one then burns about
    # half a core even when idle (docs/performance.md); on CPU boxes and next to a GPU worker that is waste.
    # We drive progress ourselves instead: decode by polling its transfer, prefill by polling
    # notifications often while a read may be in flight (NixlPublisher._tick_interval).
    # sync: STRICT (one agent-wide mutex around every call) on the prefill side; the puller passes RW, see
    # NixlPuller.__init__.
    extra = ucx_workers > 1 and "UCX" in backends
    conf = nixl.nixl_agent_config(
        enable_prog_thread=False,
        backends=[b for b in backends if not (extra and b == "UCX")],
        sync_mode=getattr(nixl.nixl_thread_sync_t, f"NIXL_THREAD_SYNC_{sync}"),
    )
    agent = nixl.nixl_agent(name, conf)
    if extra:  # more UCX workers: the backend must be created with its init params, not from the config
        agent.create_backend("UCX", {"num_workers": str(ucx_workers)})
    return agent


def _mem_of(t: torch.Tensor) -> tuple[str, int]:
    return ("VRAM", t.device.index or 0) if t.is_cuda else ("DRAM", 0)


class NixlPublisher(Publisher):
    name = "nixl"

    def __init__(
        self,
        layout: KVLayout,
        regions: Mapping[int, torch.Tensor],
        *,
        nixl_backends: Sequence[str] = ("UCX",),
        ucx_transports: str | None = None,  # UCX_TLS for this process's agent, e.g. "tcp" (None: UCX's choice)
        tick_s: float = 0.02,  # idle notification poll period (done/unpin latency: frees only)
        busy_tick_s: float = 0.0005,  # while a READ may be in flight: the target must progress for it
        busy_linger_s: float = 0.5,  # keep polling fast this long after a handshake or pin
        **kwargs: Any,
    ) -> None:
        self._busy_tick_s = busy_tick_s
        self._busy_linger_s = busy_linger_s
        self._busy_until = 0.0
        # The agent must exist before the control server answers its first hello.
        self._agent = _new_agent("pdkv-prefill", nixl_backends, ucx_transports=ucx_transports)
        ordered = [regions[r] for r in sorted(regions)]
        self._reg_descs = [self._agent.register_memory(t) for t in ordered]  # once, for the process lifetime
        xfer = self._agent.get_xfer_descs(ordered)
        self._nixl_hello = (
            {"agent": self._agent.name, "mem": _mem_of(ordered[0])[0]},
            [self._agent.get_agent_metadata(), self._agent.get_serialized_descs(xfer)],
        )
        super().__init__(layout, regions, tick_s=tick_s, **kwargs)

    def _hello_extra(self) -> tuple[dict[str, Any], bytes]:
        info, blobs = self._nixl_hello
        lengths, blob = pack_blobs(*blobs)
        return {"nixl": {**info, "blobs": lengths}}, blob

    def _on_activity(self, op: str) -> None:
        self._busy_until = time.monotonic() + self._busy_linger_s
        self._wake.set()

    def _tick_interval(self) -> float:
        if time.monotonic() < self._busy_until or self.leases.has_pins():
            return self._busy_tick_s
        return self._tick_s

    def _tick(self) -> None:
        # get_new_notifs also progresses the UCX worker, which serves the decode side's READs.
        for _agent, msgs in self._agent.get_new_notifs().items():
            for m in msgs:
                self._on_notif(bytes(m).decode(errors="replace"))
        super()._tick()

    def _on_notif(self, text: str) -> None:
        parts = text.split("|")
        try:
            if parts[0] != _NOTIF_PREFIX:
                raise ValueError
            if parts[1] == "unpin":
                self.leases.unpin(parts[2], int(parts[3]))
            elif parts[1] == "done":  # pdkv|done|lease|rank|world|pin: last READ of that rank landed
                self.leases.complete(parts[2], int(parts[3]), int(parts[4]))
            else:
                raise ValueError
        except (ValueError, IndexError, KVTransferError) as e:
            log.warning("kv publisher: ignoring NIXL notification %r (%r)", text[:200], e)

    def close(self) -> None:
        if self._stop.is_set():
            return
        super().close()
        for d in self._reg_descs:
            try:
                self._agent.deregister_memory(d)
            except Exception:
                log.debug("nixl deregister failed", exc_info=True)
        self._reg_descs = []


class _PartCancelled(TransferUnavailable):
    """A split READ's part stopped because another part failed: the pull raises that other part's error."""


@dataclass
class _NixlPeer:
    agent: str
    mem: str
    regions: dict[int, tuple[int, int, int]]  # prefill rank -> (address, length, device id)


class NixlPuller(TcpPuller):
    """Reads NIXL-capable endpoints with NIXL READs, others over TCP. Concurrent pulls are fine."""

    name = "nixl"

    def __init__(
        self,
        layout: KVLayout,
        rank: int,
        region: torch.Tensor,
        *,
        nixl_backends: Sequence[str] = ("UCX",),
        ucx_transports: str | None = None,  # UCX_TLS for this process's agent, e.g. "tcp" (None: UCX's choice)
        max_read_bytes: int = 256 << 20,
        min_segment_bytes: int | None = None,
        stage_bytes: int = 64 << 20,
        stage_below_segment_bytes: int = 4096,
        stage_min_fanin: int = 4,
        stage_max_amplification: float = 16.0,
        parallel_reads: int | None = None,
        split_min_bytes: int = 4 << 20,
        **kwargs: Any,
    ) -> None:
        super().__init__(layout, rank, region, **kwargs)
        self.max_read_bytes = max_read_bytes
        # Split READs: a READ of split_min_bytes or more is cut into parallel_reads equal parts, part i posted and
        # polled from lane i (a persistent thread bound to UCX worker i), because two CMA streams in parallel read
        # about twice as fast as one; lanes, not caller threads, since NIXL binds a thread to a worker on its
        # first transfer and caller threads come and go (figures: docs/performance.md, "NIXL reads").
        if parallel_reads is None:
            parallel_reads = 1 if region.is_cuda else 2
        self.parallel_reads = max(1, int(parallel_reads))
        self.split_min_bytes = split_min_bytes
        self._lanes = (
            [ThreadPoolExecutor(1, thread_name_prefix=f"pdkv-read{rank}.{i}") for i in range(self.parallel_reads)]
            if self.parallel_reads > 1
            else []
        )
        self._lanes_bound = False
        self._lanes_lock = threading.Lock()
        # Staged reads (kv_transfer.staging): whole source blocks in big runs into a registered buffer, then a
        # local scatter, for plans of small segments (mean below stage_below_segment_bytes) when that cuts the
        # descriptor count by stage_min_fanin or more at most stage_max_amplification times the bytes; for whole
        # blocks the extra copy loses (docs/performance.md). stage_bytes: buffer size (0 = never stage).
        self.stage_bytes = stage_bytes
        self.stage_below_segment_bytes = stage_below_segment_bytes
        self.stage_min_fanin = stage_min_fanin
        self.stage_max_amplification = stage_max_amplification
        self._stage: torch.Tensor | None = None
        self._stage_reg: Any = None
        self._stage_lock = threading.Lock()  # one staged READ + scatter at a time per puller (one buffer)
        # Why: UCX costs microseconds per descriptor on CPU, so plans of tiny segments move faster over TCP, where
        # prefill gathers them into big chunks (docs/performance.md); on GPUs NIXL reads VRAM directly. 0 = NIXL.
        if min_segment_bytes is None:
            min_segment_bytes = 0 if region.is_cuda else 1024
        self.min_segment_bytes = min_segment_bytes
        # RW: NIXL's agent lock is then a reader/writer lock: the data-path calls (createXferReq, postXferReq,
        # getXferStatus, releaseXferReq) take it shared, so transfers on *different* handles proceed at once,
        # while metadata changes (register/deregister memory, add/remove a remote agent, connect) take it
        # exclusively. STRICT takes one mutex around every call, and the two parts of a split READ then
        # serialize (docs/performance.md). What RW does not cover is one handle from two threads at once (per-handle
        # state is unlocked, NIXL src/core/nixl_agent.cpp): every handle here lives in one thread only.
        self._agent = _new_agent(
            f"pdkv-decode{rank}",
            nixl_backends,
            sync="RW",
            ucx_workers=self.parallel_reads,
            ucx_transports=ucx_transports,
        )
        self._reg = self._agent.register_memory(region)  # once; every read lands inside it
        self._mem, self._dev = _mem_of(region)
        self._base = region.data_ptr()

    # ---- handshake ----------------------------------------------------------------------------
    def _on_hello(self, session: Session) -> None:
        info = session.hello.get("nixl")
        if info is None:
            log.info("kv puller: %s offers no NIXL; reading it over TCP", session.endpoint)
            return
        meta, descs = unpack_blobs(info["blobs"], session.blob)
        try:
            remote = self._agent.add_remote_agent(meta)
            dl = self._agent.deserialize_descs(descs)
            ranks = session.hello["ranks"]
            regions: dict[int, tuple[int, int, int]] = {}
            for i, r in enumerate(ranks):
                addr, length, dev = (int(x) for x in dl[i])
                regions[r] = (addr, length, dev)
        except KVTransferError:
            raise
        except Exception as e:
            raise TransferUnavailable(f"NIXL handshake with {session.endpoint} failed: {e!r}") from e
        name = remote.decode() if isinstance(remote, bytes) else str(remote)
        if name != info["agent"]:
            raise BadTransferRequest(f"NIXL agent name mismatch: {name} vs {info['agent']}")
        try:  # why: UCX connects lazily; without this the first READ pays the connection setup
            self._agent.make_connection(name)
        except Exception as e:
            raise TransferUnavailable(f"NIXL connection to {session.endpoint} failed: {e!r}") from e
        session.peer = _NixlPeer(name, info["mem"], regions)
        self._bind_lanes(session.peer)

    def _bind_lanes(self, peer: _NixlPeer) -> None:
        """Once: bind each lane thread to its own UCX worker, in order (see __init__), by preparing (never
        posting) a 1-byte READ from it. Only speed depends on it: a failure is logged and ignored."""
        with self._lanes_lock:
            if self._lanes_bound or not self._lanes or not peer.regions:
                return
            addr, _length, dev = next(iter(peer.regions.values()))
            local = np.array([[self._base, 1, self._dev]], dtype=np.uint64)
            remote = np.array([[addr, 1, dev]], dtype=np.uint64)

            def bind() -> None:
                self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, self._mem),
                    self._agent.get_xfer_descs(remote, peer.mem),
                    peer.agent,
                ).release()

            try:
                for lane in self._lanes:
                    lane.submit(bind).result(timeout=10.0)
                self._lanes_bound = True
            except Exception:
                log.debug("kv puller: binding read lanes to UCX workers failed", exc_info=True)

    def _forget_peer(self, session: Session) -> None:
        if session.peer is not None:
            self._agent.remove_remote_agent(session.peer.agent)

    # ---- data ---------------------------------------------------------------------------------
    def _read(self, src: _Source, handoff: KVHandoff, rp: RankPlan, layers: range, deadline: float) -> int:
        peer: _NixlPeer | None = src.session.peer
        if len(src.base) == 0:
            return 0
        if peer is None or src.path == "tcp":
            return super()._read(src, handoff, rp, layers, deadline)
        staged = self._staged_plan(src, handoff, rp)
        if staged is None and src.base.total_nbytes < self.min_segment_bytes * len(src.base):
            return super()._read(src, handoff, rp, layers, deadline)
        src.path = "nixl"
        # One READ per at most max_read_bytes (or a staging buffer): a READ must finish well within its pin's TTL.
        per_layer = rp.planes_per_layer * (staged.stage_plane_nbytes if staged is not None else src.base.total_nbytes)
        step = max(1, (self.stage_bytes if staged is not None else self.max_read_bytes) // max(per_layer, 1))
        return sum(
            self._read_nixl(src, peer, handoff, rp, range(a, min(a + step, layers.stop)), deadline, staged)
            for a in range(layers.start, layers.stop, step)
        )

    def _staged_plan(self, src: _Source, handoff: KVHandoff, rp: RankPlan) -> StagedPlan | None:
        if src.transport_state is None:
            plan = None
            if self.stage_bytes > 0 and src.base.total_nbytes < self.stage_below_segment_bytes * len(src.base):
                plan = plan_staging(src.base, handoff.layout.block_nbytes, rp.dst_plane_nbytes)
                if plan is not None and (
                    len(src.base) < self.stage_min_fanin * len(plan)
                    or plan.stage_plane_nbytes > self.stage_max_amplification * src.base.total_nbytes
                ):
                    plan = None
            src.transport_state = ("staged", plan)
        return src.transport_state[1]

    def _staging(self, nbytes: int) -> torch.Tensor:
        """The registered staging buffer, at least ``nbytes`` (caller holds _stage_lock)."""
        if self._stage is None or self._stage.numel() < nbytes:
            if self._stage_reg is not None:
                self._agent.deregister_memory(self._stage_reg)
                self._stage_reg = None
            self._stage = torch.empty(max(nbytes, self.stage_bytes), dtype=torch.uint8, device=self.region.device)
            advise_hugepages(self._stage)  # before the first READ faults it in (CPU; a no-op elsewhere)
            self._stage_reg = self._agent.register_memory(self._stage)
        return self._stage

    def _read_nixl(
        self,
        src: _Source,
        peer: _NixlPeer,
        handoff: KVHandoff,
        rp: RankPlan,
        layers: range,
        deadline: float,
        staged: StagedPlan | None = None,
    ) -> int:
        if staged is None:
            return self._read_nixl_once(src, peer, handoff, rp, layers, deadline, None)
        with self._stage_lock:
            return self._read_nixl_once(src, peer, handoff, rp, layers, deadline, staged)

    def _read_nixl_once(
        self,
        src: _Source,
        peer: _NixlPeer,
        handoff: KVHandoff,
        rp: RankPlan,
        layers: range,
        deadline: float,
        staged: StagedPlan | None,
    ) -> int:
        base = src.base
        planes = range(rp.plane_index(layers.start, 0), rp.plane_index(layers.stop, 0))
        # Lease check + pin: prefill keeps these blocks until our verified unpin (or the pin TTL).
        reply, _ = src.client.call(self._msg("pin", handoff, layers_needed=layers.stop))
        if staged is None:
            local, remote = self._descs(base, peer, rp, layers)
        else:
            stage = self._staging(len(planes) * staged.stage_plane_nbytes)
            local, remote = self._staged_descs(staged, stage, peer, rp, planes)
        self._read_parts(self._split(local, remote), peer, handoff.lease_id, deadline, 0.8 * float(reply["ttl_s"]))
        # Lease check after the fact (a one-sided READ cannot be refused while it runs): LeaseExpired here
        # means the blocks may have been reused under the READ, and the pull fails instead of serving it.
        src.client.call(self._msg("unpin", handoff, pin=reply["pin"], verify=True))
        if staged is not None:  # only confirmed data reaches the region
            scatter(staged, stage, self.region, planes, rp.dst_plane_nbytes)
        return int(base.nbytes.sum()) * rp.planes_per_layer * len(layers)

    def _split(self, local: np.ndarray, remote: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """``parallel_reads`` parts of equal bytes (cuts on 4 KB multiples, a descriptor straddling a cut is cut
        in two), or the whole list when the READ is under split_min_bytes."""
        lens = local[:, 1].astype(np.int64)
        total = int(lens.sum())
        parts = self.parallel_reads
        if parts <= 1 or total < max(self.split_min_bytes, 1) or total < parts * 4096:
            return [(local, remote)]
        ends = np.cumsum(lens)
        starts = ends - lens
        cuts = [0] + [(total * i // parts) & ~4095 for i in range(1, parts)] + [total]
        out = []
        for a, b in zip(cuts[:-1], cuts[1:]):
            i0, i1 = int(np.searchsorted(ends, a, side="right")), int(np.searchsorted(starts, b, side="left"))
            head = np.maximum(starts[i0:i1], a) - starts[i0:i1]  # bytes of each descriptor before the cut
            n = np.minimum(ends[i0:i1], b) - starts[i0:i1] - head
            part = []
            for d in (local, remote):
                x = d[i0:i1].astype(np.int64)
                x[:, 0] += head
                x[:, 1] = n
                part.append(x.astype(np.uint64))
            out.append((part[0], part[1]))
        return out

    def _read_parts(
        self,
        parts: list[tuple[np.ndarray, np.ndarray]],
        peer: _NixlPeer,
        lease_id: str,
        deadline: float,
        max_read_s: float,
    ) -> None:
        """Post every part (one part: from this thread; more: part i from lane i) and wait for all of them.
        The first failure cancels the others; nothing is raised while any part may still be in flight."""
        abort = threading.Event()
        if len(parts) == 1:
            self._read_part(parts[0], peer, lease_id, deadline, max_read_s, abort)
            return
        futures = [
            lane.submit(self._read_part, p, peer, lease_id, deadline, max_read_s, abort)
            for lane, p in zip(self._lanes, parts)
        ]
        errors: list[BaseException] = []
        for f in futures:  # each ends by itself: DONE, failed, cancelled by `abort`, or its read deadline
            try:
                f.result()
            except BaseException as e:
                errors.append(e)
        if errors:  # the cause, not a part that was only cancelled because of it
            raise next((e for e in errors if not isinstance(e, _PartCancelled)), errors[0])

    def _read_part(
        self,
        part: tuple[np.ndarray, np.ndarray],
        peer: _NixlPeer,
        lease_id: str,
        deadline: float,
        max_read_s: float,
        abort: threading.Event,
    ) -> None:
        local, remote = part
        handle = None
        try:
            if abort.is_set():
                raise _PartCancelled(f"lease {lease_id}: NIXL READ part from {peer.agent} not posted: another failed")
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(local, self._mem),
                self._agent.get_xfer_descs(remote, peer.mem),
                peer.agent,
            )
            # Bounds a hung READ only; whether the data is good is decided by the verified unpin after it.
            read_deadline = min(deadline, time.monotonic() + max_read_s)
            state = self._agent.transfer(handle)
            spins = 0
            while state == "PROC":  # polling is what progresses our side (no progress thread)
                if abort.is_set():
                    raise _PartCancelled(
                        f"lease {lease_id}: NIXL READ part from {peer.agent} cancelled: another failed"
                    )
                if time.monotonic() > read_deadline:
                    raise TransferUnavailable(f"lease {lease_id}: NIXL READ from {peer.agent} timed out")
                spins += 1
                time.sleep(0 if spins < 20 else min(5e-5 * (spins - 19), 1e-3))
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferUnavailable(f"lease {lease_id}: NIXL READ from {peer.agent} failed ({state})")
        except KVTransferError:
            abort.set()
            raise
        except Exception as e:  # nixlRemoteDisconnectError & co: the peer is gone
            abort.set()
            raise TransferUnavailable(f"lease {lease_id}: NIXL READ from {peer.agent}: {e!r}") from e
        finally:
            if handle is not None:
                try:
                    handle.release()  # cancels a READ still in flight (timeout / abort path)
                except Exception:
                    log.warning("NIXL: could not release a transfer handle", exc_info=True)

    def _staged_descs(
        self, staged: StagedPlan, stage: torch.Tensor, peer: _NixlPeer, rp: RankPlan, planes: range
    ) -> tuple[np.ndarray, np.ndarray]:
        """Whole-block runs of every plane of the group, landing back to back in the staging buffer."""
        src_addr = np.empty(len(staged), np.int64)
        src_dev = np.empty(len(staged), np.int64)
        for r in np.unique(staged.run_rank).tolist():
            if r not in peer.regions:
                raise BadTransferRequest(f"{peer.agent} does not serve prefill rank {r}")
            addr, length, dev = peer.regions[r]
            if length < rp.src_plane_nbytes * rp.planes_per_layer * self.layout.num_layers:
                raise BadTransferRequest(f"prefill rank {r} region is smaller than its layout says")
            m = staged.run_rank == r
            src_addr[m] = addr + staged.run_src_offset[m]
            src_dev[m] = dev
        p = np.arange(len(planes), dtype=np.int64)
        rem = (src_addr[None, :] + (p[:, None] + planes.start) * rp.src_plane_nbytes).reshape(-1)
        loc = (stage.data_ptr() + staged.run_stage_offset[None, :] + p[:, None] * staged.stage_plane_nbytes).reshape(-1)
        lens = np.tile(staged.run_nbytes, len(planes))
        local = np.stack([loc, lens, np.full_like(lens, self._dev)], axis=1).astype(np.uint64)
        remote = np.stack([rem, lens, np.tile(src_dev, len(planes))], axis=1).astype(np.uint64)
        return local, remote

    def _descs(self, base, peer: _NixlPeer, rp: RankPlan, layers: range) -> tuple[np.ndarray, np.ndarray]:
        """Nx3 (address, length, device) arrays for every plane of the group's layers."""
        planes = np.array(
            [rp.plane_index(layer, kv) for layer in layers for kv in range(rp.planes_per_layer)], dtype=np.int64
        )
        n = len(base)
        src_addr = np.empty(n, np.int64)
        src_dev = np.empty(n, np.int64)
        for r in np.unique(base.src_rank).tolist():
            if r not in peer.regions:
                raise BadTransferRequest(f"{peer.agent} does not serve prefill rank {r}")
            addr, length, dev = peer.regions[r]
            if length < rp.src_plane_nbytes * rp.planes_per_layer * self.layout.num_layers:
                raise BadTransferRequest(f"prefill rank {r} region is smaller than its layout says")
            m = base.src_rank == r
            src_addr[m] = addr + base.src_offset[m]
            src_dev[m] = dev
        rem = (src_addr[None, :] + planes[:, None] * rp.src_plane_nbytes).reshape(-1)
        loc = (self._base + base.dst_offset[None, :] + planes[:, None] * rp.dst_plane_nbytes).reshape(-1)
        lens = np.tile(base.nbytes, len(planes))
        local = np.stack([loc, lens, np.full_like(lens, self._dev)], axis=1).astype(np.uint64)
        remote = np.stack([rem, lens, np.tile(src_dev, len(planes))], axis=1).astype(np.uint64)
        return local, remote

    def close(self) -> None:
        super().close()
        for lane in self._lanes:
            lane.shutdown(wait=True)
        self._lanes = []
        if self._stage_reg is not None:
            try:
                self._agent.deregister_memory(self._stage_reg)
            except Exception:
                log.debug("nixl deregister failed", exc_info=True)
            self._stage_reg = None
        if self._reg is not None:
            try:
                self._agent.deregister_memory(self._reg)
            except Exception:
                log.debug("nixl deregister failed", exc_info=True)
            self._reg = None
