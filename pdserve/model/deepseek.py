"""DeepSeek-V2/V3 decoders (multi-head latent attention + mixture of experts) over a paged latent cache; Kimi K2
checkpoints take the V3 path. Tensor-parallel by heads (q/kv_b column-, o row-parallel; the latent projections are
replicated, so every rank caches the whole latent) and decode-context-parallel (each rank caches 1/dcp of the tokens
and partials merge by LSE, as for GQA).

Prefill attends in the expanded form (per-head K/V from the latent); decode in the absorbed form (q_nope @ W_UK
against the cached latent as one shared head, then W_UV), which reads each cached row once per step."""

from __future__ import annotations

import math
from typing import Callable, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.attention import AttentionMetadata, MLAAttentionBackend, write_latent
from pdserve.engine.kv_quant import write_latent_fp8
from pdserve.model import linear as plinear
from pdserve.model.config import ModelConfig
from pdserve.model.llama import MLP, RMSNorm
from pdserve.model.moe import MoE
from pdserve.model.parallel_state import ParallelState
from pdserve.model.rope import RotaryEmbedding, apply_rope, apply_rope_interleaved
from pdserve.parallel_config import q_heads_for_tp_rank


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Linear(nn.Module):
    """A weight (and optional bias) with its oneDNN-packed copy (linear.py), set by pack()."""

    def __init__(self, out_features: int, in_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = _param(out_features, in_features)
        self.bias = _param(out_features) if bias else None
        self.packed: plinear.Packed = None

    def pack(self) -> None:
        self.packed = plinear.pack_of(self, "weight")

    def forward(self, x: torch.Tensor, packed: bool) -> torch.Tensor:
        return plinear.linear(x, self.weight, self.packed if packed else None, self.bias)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times DeepSeek's YaRN mscale(factor, mscale_all_dim)^2 (as transformers applies it)."""
    assert cfg.mla is not None
    scale = cfg.mla.qk_head_dim**-0.5
    s = cfg.rope_scaling or {}
    m_all = s.get("mscale_all_dim")
    factor = float(s.get("factor") or 1.0)
    if s and m_all and factor > 1:
        m = 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= m * m
    return scale


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, backend: MLAAttentionBackend, layer: int = 0) -> None:
        super().__init__()
        assert cfg.mla is not None
        self.cfg, self.ps, self.backend = cfg, ps, backend
        self.layer = layer  # an fp8 cache's scales are per layer (AttentionMetadata.kv_quant)
        m = self.mla = cfg.mla
        self.q_heads = q_heads_for_tp_rank(cfg.num_heads, ps.tp_size, ps.tp_rank)
        # Under DCP every rank of a group attends with the whole group's heads over its own tokens (as GQA's
        # Attention), and dcp_merge hands each rank its own heads back.
        first = ps.tp_rank - ps.dcp_rank
        self.q_group_heads = [
            h for r in range(first, first + ps.dcp_size) for h in q_heads_for_tp_rank(cfg.num_heads, ps.tp_size, r)
        ]
        nq, h, bias = len(self.q_group_heads), cfg.hidden_size, bool(cfg.raw.get("attention_bias", False))
        if m.q_lora_rank is None:
            self.q_proj: Linear | None = Linear(nq * m.qk_head_dim, h)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(m.q_lora_rank, h, bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, 1e-6)  # transformers builds both latent norms with 1e-6
            self.q_b_proj = Linear(nq * m.qk_head_dim, m.q_lora_rank)
        self.kv_a_proj_with_mqa = Linear(m.latent_dim, h, bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, 1e-6)
        self.kv_b_proj = Linear(nq * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
        self.o_proj = Linear(h, len(self.q_heads) * m.v_head_dim, bias)
        self.scale = softmax_scale(cfg)
        # transformers' V2 rotates complex pairs, V3 pairs unless rope_interleave is false.
        interleave = cfg.family == "deepseek_v2" or m.rope_interleave
        self.rope: Callable = apply_rope_interleaved if interleave else apply_rope

    def linears(self) -> list[Linear]:
        return [
            x
            for x in (self.q_proj, self.q_a_proj, self.q_b_proj, self.kv_a_proj_with_mqa, self.o_proj)
            if x is not None
        ]

    def _w_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [nq, nope, L], W_UV [nq, v, L]): kv_b_proj's key and value rows per head, as views."""
        m = self.mla
        w = self.kv_b_proj.weight.view(len(self.q_group_heads), m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        latent_layer: torch.Tensor,
        meta: AttentionMetadata,
        packed: bool,
    ) -> torch.Tensor:
        m, t, nq = self.mla, x.shape[0], len(self.q_group_heads)
        if self.q_proj is not None:
            q = self.q_proj(x, packed)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, packed)), packed)
        q = q.view(t, nq, m.qk_head_dim)
        q_nope, q_pe = q[..., : m.qk_nope_head_dim], q[..., m.qk_nope_head_dim :]
        kv = self.kv_a_proj_with_mqa(x, packed)
        kv_c = self.kv_a_layernorm(kv[:, : m.kv_lora_rank])
        # One rope call for the query heads and the shared key (as GQA's q and k side by side).
        pe = self.rope(cos_sin, torch.cat([q_pe, kv[:, None, m.kv_lora_rank :]], dim=1))
        q_pe, k_pe = pe[:, :nq], pe[:, nq]
        latent = torch.cat([kv_c, k_pe], dim=-1)
        quant = meta.kv_quant
        if quant is not None:
            write_latent_fp8(latent_layer, self.layer, latent, meta.slot_mapping, quant, m.kv_lora_rank)
        else:
            write_latent(latent_layer, latent, meta.slot_mapping, meta.all_slots_local)
        scales = None if quant is None else quant.scales[self.layer]
        w_uk, w_uv = self._w_kv_b()
        if meta.is_prefill:
            out, lse = self.backend.forward_prefill(
                torch.cat([q_nope, q_pe], dim=-1),
                latent_layer,
                meta,
                self.scale,
                self._expand,
                latent if meta.dcp_size == 1 else None,
                kv_scales=scales,
                kv_lora_rank=m.kv_lora_rank,
            )
            if self.ps.dcp_size > 1:
                out = self.ps.dcp_merge(out, lse)
        else:
            q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, nq, L]
            o_lat, lse = self.backend.forward_decode(
                torch.cat([q_lat, q_pe], dim=-1), latent_layer, meta, self.scale, m.kv_lora_rank, kv_scales=scales
            )
            if self.ps.dcp_size > 1:
                o_lat = self.ps.dcp_merge(o_lat, lse)
                mine = len(self.q_heads)
                w_uv = w_uv[self.ps.dcp_rank * mine : (self.ps.dcp_rank + 1) * mine]
            out = torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, heads, v]
        o = self.o_proj  # row-parallel: its bias goes on once, after the all-reduce
        out = self.ps.all_reduce(plinear.linear(out.reshape(t, -1), o.weight, o.packed if packed else None))
        return out if o.bias is None else out + o.bias

    def _expand(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows [N, L + R] -> every group head's K [N, nq, nope + R] and V [N, nq, v]."""
        m, nq = self.mla, len(self.q_group_heads)
        kv = F.linear(rows[:, : m.kv_lora_rank], self.kv_b_proj.weight).view(-1, nq, m.qk_nope_head_dim + m.v_head_dim)
        k_pe = rows[:, None, m.kv_lora_rank :].expand(-1, nq, -1)
        return torch.cat([kv[..., : m.qk_nope_head_dim], k_pe], dim=-1), kv[..., m.qk_nope_head_dim :]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, backend: MLAAttentionBackend, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg, ps, backend, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: MLP | MoE = MoE(cfg, ps) if cfg.moe is not None and cfg.moe.is_moe_layer(index) else MLP(cfg, ps)

    def forward(self, x, cos_sin, latent_layer, meta, packed: bool):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, latent_layer, meta, packed)
        return x + self.mlp(self.post_attention_layernorm(x), packed)


class DeepseekCausalLM(nn.Module):
    """Decoder stack + LM head, with llama.CausalLM's interface. forward() returns logits only for logits_indices."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, backend: MLAAttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        # The ModuleList registers the layers; typed as what it holds (torch types its items as Module)
        self.layers = cast(
            "Sequence[DecoderLayer]", nn.ModuleList(DecoderLayer(cfg, ps, backend, i) for i in range(cfg.num_layers))
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg, max_positions)  # cfg.head_dim is qk_rope_head_dim for these models
        self.lm_head_packed: plinear.Packed = None
        self.exact_prefill = False  # as llama.CausalLM: prefill on F.linear when set

    def pack_weights(self) -> None:
        for layer in self.layers:
            for lin in layer.self_attn.linears():
                lin.pack()
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                mlp.pack_weights()
            else:
                mlp.gate_up_packed, mlp.down_packed = (
                    plinear.pack_of(mlp, "gate_up_weight"),
                    plinear.pack_of(mlp, "down_weight"),
                )
        first, n = self.ps.vocab_shard(self.lm_head.shape[0])
        self.lm_head_packed = plinear.pack(self.lm_head[first : first + n])  # this rank's shard only

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None,
        on_layer_done: Callable[[int], None] | None = None,
    ) -> torch.Tensor | None:
        packed = not (meta.is_prefill and self.exact_prefill)
        x = F.embedding(input_ids, self.embed_tokens)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos_sin, kv_cache[i], meta, packed)
            if on_layer_done is not None:
                on_layer_done(i)
        if logits_indices is None:
            return None
        x = self.norm(x[logits_indices])
        head, head_packed = self.lm_head, self.lm_head_packed if packed else None
        return self.ps.vocab_parallel_logits(
            x, lambda first, n: plinear.linear(x, head[first : first + n], head_packed), head.shape[0]
        )
