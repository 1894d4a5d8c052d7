"""Collectives among the ranks of one pod: one interface, two implementations.

- ``ShmComm``: ranks on one host (CPU), through a shared region (pdserve/engine/shm.py). Each rank writes its input
  into its own slot, one barrier, then every rank reads what it needs: a reduction sums the slots in rank order, so
  results are bit-identical on every rank and from run to run. Two slot sets alternate (by barrier phase), so a rank
  may write the next collective while a slower one still reads the last.
- ``TorchComm``: a torch.distributed group (gloo on CPU, NCCL on GPU).

Tensors larger than a slot go through in slot-sized pieces."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from pdserve import kernels
from pdserve.engine.shm import LINE, Barrier, ShmRegion, spin_for


class Communicator(Protocol):
    size: int
    rank: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group; every rank gets the same tensor (x may be reused as the output)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[size, *x.shape]: x from every rank, in rank order."""
        ...

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum over the group, keeping this rank's 1/size slice of dim."""
        ...

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[size, *x.shape] on group rank 0 (x from every rank, in rank order); None on the others."""
        ...

    def native(self) -> list[int] | None:
        """The group as pdserve's C++ decode step takes it (its collectives run there); None: not shared memory."""
        ...

    def set_native_seq(self, seq: int) -> None:
        """After a native call: the barrier waits it made, returned by it."""
        ...


class TorchComm:
    def __init__(self, group, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if dist.get_backend(self.group) == "nccl":
            chunks = [c.contiguous() for c in x.chunk(self.size, dim=dim)]
            out = torch.empty_like(chunks[self.rank])
            dist.reduce_scatter(out, chunks, group=self.group)
            return out
        # gloo has no reduce_scatter
        dist.all_reduce(x := x.contiguous(), group=self.group)
        return x.chunk(self.size, dim=dim)[self.rank].contiguous()

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        x = x.contiguous()
        if self.rank != 0:
            dist.gather(x, None, dst=dist.get_global_rank(self.group, 0), group=self.group)
            return None
        out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
        dist.gather(x, list(out.unbind(0)), dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def native(self) -> list[int] | None:
        return None

    def set_native_seq(self, seq: int) -> None:
        raise RuntimeError("a torch.distributed group has no native collectives")


@dataclass(frozen=True)
class ShmGroupSpec:
    """Where one group lives in the pod's region (picklable, part of the rank spec)."""

    offset: int
    ranks: tuple[int, ...]  # TP ranks of the members, in group-rank order
    slot_bytes: int

    @property
    def nbytes(self) -> int:
        return _round(Barrier.nbytes(len(self.ranks))) + 2 * len(self.ranks) * self.slot_bytes


def _round(n: int) -> int:
    return -(-n // LINE) * LINE


def plan_groups(tp: int, dcp: int, world_slot: int, dcp_slot: int) -> tuple[ShmGroupSpec, list[ShmGroupSpec], int]:
    """The world group and the DCP groups (runs of dcp consecutive TP ranks) laid out in one region."""
    world = ShmGroupSpec(0, tuple(range(tp)), _round(world_slot))
    off = world.nbytes
    dcps = []
    if dcp > 1:
        for first in range(0, tp, dcp):
            g = ShmGroupSpec(off, tuple(range(first, first + dcp)), _round(dcp_slot))
            dcps.append(g)
            off += g.nbytes
    return world, dcps, off


def _sum_in_order(rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = rows[0] + rows[1] + ... left to right: the same bits on every rank and in every run."""
    if kernels.available():  # one pass, the same bits (a torch op per rank otherwise)
        return kernels.sum_in_order(rows, out)
    out.copy_(rows[0])
    for r in range(1, rows.shape[0]):
        out.add_(rows[r])
    return out


def init_groups(region: ShmRegion, groups: list[ShmGroupSpec]) -> None:
    """Once, by the driver, before it spawns the ranks."""
    for g in groups:
        Barrier(region, g.offset, len(g.ranks), 0, list(g.ranks)).init()


class ShmComm:
    def __init__(self, region: ShmRegion, spec: ShmGroupSpec, tp_rank: int, timeout_s: float) -> None:
        self.size = len(spec.ranks)
        self.rank = spec.ranks.index(tp_rank)
        self.timeout_s = timeout_s
        self.slot_bytes = spec.slot_bytes
        self.barrier = Barrier(region, spec.offset, self.size, self.rank, list(spec.ranks), spin=spin_for(self.size))
        self.barrier.register()
        data = spec.offset + _round(Barrier.nbytes(self.size))
        self._mm, self._data = region.mm, data
        buf = torch.frombuffer(region.mm, dtype=torch.uint8)
        # [parity, rank, slot byte]
        self._slots = buf[data : data + 2 * self.size * self.slot_bytes].view(2, self.size, self.slot_bytes)
        self._views: dict[tuple[int, torch.dtype, int], torch.Tensor] = {}

    def _next(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """[size, numel] views of every rank's slot for the next barrier's phase (cached: decode repeats shapes)."""
        key = (self.barrier.next_phase, dtype, numel)
        view = self._views.get(key)
        if view is None:
            if len(self._views) > 256:
                self._views.clear()
            view = self._views[key] = self._slots[key[0], :, : numel * dtype.itemsize].view(dtype)
        return view

    def _exchange(self, flat: torch.Tensor, what: str) -> torch.Tensor:
        slots = self._next(flat.dtype, flat.numel())
        slots[self.rank].copy_(flat)
        self.barrier.wait(self.timeout_s, what)
        return slots

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        n, piece = flat.numel(), self.slot_bytes // x.dtype.itemsize
        if n <= piece:
            return _sum_in_order(self._exchange(flat, "an all-reduce"), torch.empty_like(flat)).view(x.shape)
        out = torch.empty_like(flat)
        for a in range(0, n, piece):
            _sum_in_order(self._exchange(flat[a : a + piece], "an all-reduce"), out[a : a + piece])
        return out.view(x.shape)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1)
        n, piece = flat.numel(), self.slot_bytes // x.dtype.itemsize
        if n <= piece:
            return self._exchange(flat, "an all-gather").clone().view(self.size, *x.shape)
        out = torch.empty((self.size, n), dtype=x.dtype)
        for a in range(0, n, piece):
            out[:, a : a + piece].copy_(self._exchange(flat[a : a + piece], "an all-gather"))
        return out.view(self.size, *x.shape)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        flat = x.reshape(-1)
        n, piece = flat.numel(), self.slot_bytes // x.dtype.itemsize
        out = torch.empty((self.size, n), dtype=x.dtype) if self.rank == 0 else None
        for a in range(0, max(n, 1), piece):  # one barrier even for nothing: every rank takes part
            slots = self._exchange(flat[a : a + piece], "a gather")
            if out is not None:
                out[:, a : a + piece].copy_(slots)
        return None if out is None else out.view(self.size, *x.shape)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if x.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split into {self.size}")
        rows = x.movedim(dim, 0).contiguous()
        part = rows.view(self.size, -1)  # rank r's share is part[r]
        m, piece = part.shape[1], self.slot_bytes // x.dtype.itemsize
        if part.numel() <= piece:
            slots = self._exchange(part.view(-1), "a reduce-scatter")
            out = _sum_in_order(slots[:, self.rank * m : (self.rank + 1) * m], torch.empty(m, dtype=x.dtype))
        else:  # the whole input does not fit a slot: send each destination its share in turn
            out = torch.empty(m, dtype=x.dtype)
            for dst in range(self.size):
                for a in range(0, m, piece):
                    slots = self._exchange(part[dst, a : a + piece], "a reduce-scatter")
                    if dst == self.rank:
                        _sum_in_order(slots, out[a : a + piece])
        return out.view(rows.shape[0] // self.size, *rows.shape[1:]).movedim(0, dim).contiguous()

    def native(self) -> list[int]:
        handle = self.barrier.native()
        handle[3:5] = [self._slots.data_ptr(), self.slot_bytes]
        handle[7] = int(self.timeout_s * 1000)
        return handle + list(self.barrier.ranks)

    def set_native_seq(self, seq: int) -> None:
        self.barrier.seq = seq

    # --- the driver's channel to the other ranks (world group only): bytes with a length header ---
    def _slot_at(self, rank: int) -> int:
        return self._data + (self.barrier.next_phase * self.size + rank) * self.slot_bytes

    def broadcast_bytes(self, data: bytes | None, what: str, timeout_s: float | None) -> bytes:
        """Rank 0 passes data, the others None; everyone returns rank 0's bytes. timeout_s: of the first piece;
        None: wait as long as rank 0 lives (idle ranks waiting for the driver's next message)."""
        piece = self.slot_bytes - _LEN.size
        mm, sent, total = self._mm, 0, 0
        out: list[bytes] = []
        while True:
            at = self._slot_at(0)
            if self.rank == 0:
                assert data is not None
                chunk = data[sent : sent + piece]
                _LEN.pack_into(mm, at, len(data))
                mm[at + _LEN.size : at + _LEN.size + len(chunk)] = chunk
            if sent == 0:
                self.barrier.wait(timeout_s, what, watch=(0,) if timeout_s is None else None)
            else:
                self.barrier.wait(self.timeout_s, what)
            total = _LEN.unpack_from(mm, at)[0]
            take = min(piece, total - sent)
            if self.rank != 0:
                out.append(bytes(mm[at + _LEN.size : at + _LEN.size + take]))
            sent += take
            if sent >= total:
                return data if data is not None else b"".join(out)

    def gather_bytes(self, data: bytes, what: str) -> list[bytes] | None:
        """Every rank passes its bytes; rank 0 gets all of them in rank order, the others None."""
        piece = self.slot_bytes - _LEN.size
        mm, sent = self._mm, 0
        parts: list[list[bytes]] = [[] for _ in range(self.size)]
        while True:
            ats = [self._slot_at(r) for r in range(self.size)]
            chunk = data[sent : sent + piece]
            _LEN.pack_into(mm, ats[self.rank], len(data))
            mm[ats[self.rank] + _LEN.size : ats[self.rank] + _LEN.size + len(chunk)] = chunk
            self.barrier.wait(self.timeout_s, what)
            longest = 0
            for r, at in enumerate(ats):
                total = _LEN.unpack_from(mm, at)[0]
                longest = max(longest, total)
                if self.rank == 0 and total > sent:
                    parts[r].append(bytes(mm[at + _LEN.size : at + _LEN.size + min(piece, total - sent)]))
            sent += piece
            if sent >= longest:
                return [b"".join(p) for p in parts] if self.rank == 0 else None


_LEN = struct.Struct("<q")
