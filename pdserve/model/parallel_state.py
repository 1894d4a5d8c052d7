"""Which slice of the model this process runs: its tensor-parallel rank and its decode-context-parallel group."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve import kernels
from pdserve.attention.merge import merge_attn_states
from pdserve.engine.comm import Communicator


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
