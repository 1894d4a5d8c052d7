"""DeepSeek-V2/V3 mixture of experts, tensor-parallel without expert parallelism: every rank holds every expert's
1/TP slice of the intermediate dimension (as vLLM's TP-only MoE), so routing is replicated and one all-reduce sums
the routed and shared experts' partials."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import linear as plinear
from pdserve.model.config import ModelConfig
from pdserve.model.llama import MLP
from pdserve.model.parallel_state import ParallelState


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Router(nn.Module):
    """Top-k expert choice per token: (weights [T, k] float32, expert ids [T, k]), as transformers computes them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.moe = m = cfg.moe
        # Plain float32 tensors, not parameters: the model's .to(dtype) must leave routing in float32 (transformers
        # keeps gate.weight and e_score_correction_bias in fp32), or bf16 ties would pick other experts.
        self.weight = torch.empty(m.n_routed_experts, cfg.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = (
            torch.empty(m.n_routed_experts, dtype=torch.float32) if m.topk_method == "noaux_tc" else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.moe
        logits = F.linear(x.float(), self.weight)  # routing in float32 whatever the model's dtype
        e, g, k = m.n_routed_experts, m.n_group, m.num_experts_per_tok
        if m.scoring_func == "softmax":
            scores = logits.softmax(dim=-1, dtype=torch.float32)
            if m.topk_method == "group_limited_greedy":
                group_scores = scores.view(-1, g, e // g).max(dim=-1).values
                scores = scores.masked_fill(~self._group_mask(group_scores), 0.0)
            weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
        else:  # sigmoid + correction bias (noaux_tc): the bias steers the choice, not the weights
            assert self.e_score_correction_bias is not None
            scores = logits.sigmoid()
            choice = scores + self.e_score_correction_bias
            group_scores = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(dim=-1)
            choice = choice.masked_fill(~self._group_mask(group_scores), float("-inf"))
            ids = torch.topk(choice, k=k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if m.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.routed_scaling_factor, ids

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, E] bool: the experts of each token's topk_group best groups."""
        m = self.moe
        idx = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, idx, True)
        return mask.unsqueeze(-1).expand(-1, m.n_group, m.n_routed_experts // m.n_group).reshape(mask.shape[0], -1)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState) -> None:
        super().__init__()
        assert cfg.moe is not None
        m = cfg.moe
        self.ps = ps
        self.gate = Router(cfg)
        base, rem = divmod(m.moe_intermediate_size, ps.tp_size)  # as MLP: the first `rem` ranks take one more
        self.inter = base + (1 if ps.tp_rank < rem else 0)
        self.inter_start = ps.tp_rank * base + min(ps.tp_rank, rem)
        self.gate_up_weight = _param(m.n_routed_experts, 2 * self.inter, cfg.hidden_size)  # experts' gate, then up
        self.down_weight = _param(m.n_routed_experts, cfg.hidden_size, self.inter)
        self.shared_experts = (
            MLP(cfg, ps, m.moe_intermediate_size * m.n_shared_experts, reduce=False) if m.n_shared_experts else None
        )

    def forward(self, x: torch.Tensor, packed: bool) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = torch.zeros_like(x)
        # Tokens grouped by expert: one GEMM per expert that any token chose.
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.gate_up_weight.shape[0]).tolist()
        k = ids.shape[1]
        at = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            sel = order[at : at + n]
            at += n
            tok = sel // k
            gate, up = self._expert_linear(x[tok], "gate_up_weight", e).chunk(2, dim=-1)
            y = self._expert_linear(F.silu(gate) * up, "down_weight", e)
            out.index_add_(0, tok, (y * weights.reshape(-1)[sel, None]).to(out.dtype))
        if self.shared_experts is not None:
            out += self.shared_experts(x, packed)
        out = self.ps.all_reduce(out)
        se = self.shared_experts
        return out if se is None or se.down_bias is None else out + se.down_bias

    def _expert_linear(self, x: torch.Tensor, name: str, e: int) -> torch.Tensor:
        """Expert e's layer `name` on x: F.linear, or W8A8 where quant.py made the experts int8."""
        w = getattr(self, name)[e]
        if w.dtype == torch.int8:
            return plinear.int8_linear(x, plinear.Int8Weight(w, getattr(self, name + "_scale")[e]))
        return F.linear(x, w)

    def pack_weights(self) -> None:
        if self.shared_experts is not None:
            se = self.shared_experts
            se.gate_up_packed, se.down_packed = (
                plinear.pack_of(se, "gate_up_weight"),
                plinear.pack_of(se, "down_weight"),
            )


__all__ = ["MoE", "Router"]
