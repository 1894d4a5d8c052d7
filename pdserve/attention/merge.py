"""Exact combination of attention computed over disjoint subsets of the keys (online-softmax correction)."""

from __future__ import annotations

import torch


def merge_attn_states(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """outs [N, ..., D] and lses [N, ...]: N partial results over disjoint key sets -> (out [..., D], lse [...]).

    A partial with no keys has lse -inf and contributes nothing; if every partial is empty the result is 0 / -inf."""
    lse = torch.logsumexp(lses, dim=0)
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lses - safe.unsqueeze(0))  # exp(-inf) = 0 for empty partials
    out = (outs * weights.unsqueeze(-1)).sum(dim=0)
    return out, lse
