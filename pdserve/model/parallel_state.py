"""Which slice of the model this process runs: its tensor-parallel rank and its decode-context-parallel group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup, None when tp_size == 1
    dcp_group: Any = None  # ProcessGroup of the consecutive TP ranks that share KV heads

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def dcp_all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate x from every DCP rank along dim, in DCP-rank order."""
        if self.dcp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.dcp_size)]
        dist.all_gather(parts, x.contiguous(), group=self.dcp_group)
        return torch.cat(parts, dim=dim)

    def dcp_reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Sum x over the DCP group and keep this rank's 1/dcp slice along dim.

        gloo has no reduce_scatter, so on CPU this is an all_reduce followed by a local slice: same result."""
        if self.dcp_size == 1:
            return x
        x = x.contiguous()
        if dist.get_backend(self.dcp_group) == "nccl":
            chunks = list(x.chunk(self.dcp_size, dim=dim))
            out = torch.empty_like(chunks[self.dcp_rank].contiguous())
            dist.reduce_scatter(out, [c.contiguous() for c in chunks], group=self.dcp_group)
            return out
        dist.all_reduce(x, group=self.dcp_group)
        return x.chunk(self.dcp_size, dim=dim)[self.dcp_rank].contiguous()
