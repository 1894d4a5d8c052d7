"""Which slice of the model this process runs: its tensor-parallel rank and its decode-context-parallel group."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve import kernels
from pdserve.attention.merge import merge_attn_states
from pdserve.engine.comm import Communicator
from pdserve.engine.shm import RankFailure

_NATIVE_FAILURE = re.compile(r"RankFailure\[(-?\d+)\]: ([^\n]*)")


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    tp_comm: Communicator | None = None  # None when tp_size == 1
    dcp_comm: Communicator | None = None  # the consecutive TP ranks that share KV heads

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        assert self.tp_comm is not None
        return self.tp_comm.all_reduce(x)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[tp_size, *x.shape] on TP rank 0, None on the others."""
        if self.tp_size == 1:
            return x.unsqueeze(0)
        assert self.tp_comm is not None
        return self.tp_comm.gather(x)

    def vocab_shard(self, vocab: int) -> tuple[int, int]:
        """(first row, rows) of a vocab-parallel LM head on this TP rank: contiguous shards in rank order, the first
        vocab % tp_size ranks one row more."""
        base, rem = divmod(vocab, self.tp_size)
        return self.tp_rank * base + min(self.tp_rank, rem), base + (1 if self.tp_rank < rem else 0)

    def vocab_parallel_logits(self, x: torch.Tensor, logits: Callable[[int, int], torch.Tensor], vocab: int):
        """The LM head split over TP ranks, as vLLM's ParallelLMHead: logits(first, rows) computes this rank's
        shard of x's rows, and TP rank 0 gets the whole float32 [rows, vocab] (None on the others). Each rank then
        streams 1/tp of the head instead of rank 0 all of it while its peers wait."""
        first, n = self.vocab_shard(vocab)
        part = logits(first, n).float()
        if self.tp_size == 1:
            return part
        widest = -(-vocab // self.tp_size)
        if n < widest:  # equal shapes for the gather
            part = torch.nn.functional.pad(part, (0, widest - n))
        parts = self.gather(part)
        if parts is None:
            return None
        base, rem = divmod(vocab, self.tp_size)
        return torch.cat([parts[r, :, : base + (1 if r < rem else 0)] for r in range(self.tp_size)], dim=1)

    def dcp_gather_heads(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, h, D] of this rank's heads -> [T, dcp_size * h, D], the DCP group's heads in group-rank order."""
        assert self.dcp_comm is not None
        t, h, d = q.shape
        parts = self.dcp_comm.all_gather(q.contiguous())  # [dcp, T, h, D]
        return parts.permute(1, 0, 2, 3).reshape(t, self.dcp_size * h, d)

    def dcp_merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """Exact attention for this rank's heads from every DCP rank's partial over its own tokens.

        out [T, H, D] and lse [T, H] cover the whole group's H query heads (this rank's are the dcp_rank-th
        1/dcp of them). One all-gather of (out, lse) and a local log-sum-exp merge: every rank reads only its
        heads' partials, where AG(lse) + reduce-scatter(out * weight) would take two collectives."""
        t, h, d = out.shape
        mine = slice(self.dcp_rank * h // self.dcp_size, (self.dcp_rank + 1) * h // self.dcp_size)
        assert self.dcp_comm is not None
        parts = self.dcp_comm.all_gather(torch.cat([out.reshape(-1), lse.reshape(-1)]))
        outs = parts[:, : t * h * d].view(-1, t, h, d)[:, :, mine]
        lses = parts[:, t * h * d :].view(-1, t, h)[:, :, mine]
        # The gather promoted a 16-bit out to the LSE's fp32: merge in fp32, go on in out's dtype.
        if outs.device.type == "cpu" and outs.dtype == torch.float32 and kernels.available():  # one pass, not ~8 ops
            return kernels.merge_partials(outs, lses)[0].to(out.dtype)
        return merge_attn_states(outs, lses)[0].to(out.dtype)

    def native_groups(self) -> tuple[list[int], list[int]] | None:
        """The TP and DCP groups as pdserve's C++ decode step takes them, or None where one is not shared memory."""
        if self.tp_size == 1:
            return [], []  # a single rank: no collectives
        if self.tp_comm is None:
            return None
        tp = self.tp_comm.native()
        if self.dcp_size == 1:
            return None if tp is None else (tp, [])
        dcp = None if self.dcp_comm is None else self.dcp_comm.native()
        return None if tp is None or dcp is None else (tp, dcp)

    def native_done(self, tp_seq: int, dcp_seq: int) -> None:
        """The barrier counts a native step returned: the groups' Python side goes on from them."""
        if self.tp_size == 1:
            return
        assert self.tp_comm is not None
        self.tp_comm.set_native_seq(tp_seq)
        if self.dcp_size > 1:
            assert self.dcp_comm is not None
            self.dcp_comm.set_native_seq(dcp_seq)

    @staticmethod
    def native_failure(e: RuntimeError) -> Exception:
        """A native step's error: RankFailure where a group broke (as the Python collectives raise), else e."""
        m = _NATIVE_FAILURE.search(str(e))
        if m is None:
            return e
        rank = int(m.group(1))
        return RankFailure(m.group(2), None if rank < 0 else rank)
