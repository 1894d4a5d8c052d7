"""The Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, tensor- and context-parallel.

Tokens of a step are flattened ([T]) as in nano-vllm; each rank holds its TP slice of the weights (column-parallel
QKV and gate/up, row-parallel o and down followed by an all-reduce) and, under DCP, 1/dcp of every sequence's KV."""

from __future__ import annotations

import os
from typing import Callable, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from pdserve import kernels
from pdserve.attention import AttentionBackend, AttentionMetadata, write_kv
from pdserve.engine.kv_quant import write_kv_fp8
from pdserve.model import linear as plinear
from pdserve.model.config import ModelConfig
from pdserve.model.parallel_state import ParallelState
from pdserve.model.rope import RotaryEmbedding, apply_rope
from pdserve.parallel_config import kv_heads_for_tp_rank, q_heads_for_tp_rank


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' numbers (normalise in fp32, cast, then scale) in one fused kernel instead of six small ops.
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)

    def add_norm(self, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """residual += delta in place (the residual stream), then its norm: one pass (pdserve.kernels)."""
        return kernels.add_rms_norm(residual, delta, self.weight, self.eps)[1]


def _param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, backend: AttentionBackend, layer: int = 0) -> None:
        super().__init__()
        self.ps, self.backend = ps, backend
        self.layer = layer  # an fp8 cache's scales are per layer (AttentionMetadata.kv_quant)
        self.q_heads = q_heads_for_tp_rank(cfg.num_heads, ps.tp_size, ps.tp_rank)
        # Under DCP every rank of a group attends with the whole group's queries over its share of the tokens: it
        # projects its own heads and gathers its peers' (ParallelState.dcp_gather_heads), rather than streaming
        # the group's query weights once per rank.
        first = ps.tp_rank - ps.dcp_rank
        self.q_group_heads = [
            h for r in range(first, first + ps.dcp_size) for h in q_heads_for_tp_rank(cfg.num_heads, ps.tp_size, r)
        ]
        self.kv_heads = kv_heads_for_tp_rank(cfg.num_kv_heads, ps.tp_size, ps.tp_rank)
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window
        nq, nkv, d = len(self.q_heads), len(self.kv_heads), cfg.head_dim
        self.q_size, self.kv_size = nq * d, nkv * d
        self.o_size = len(self.q_heads) * d
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, cfg.hidden_size)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size) if cfg.qkv_bias else None
        self.o_weight = _param(cfg.hidden_size, self.o_size)
        self.o_bias = _param(cfg.hidden_size) if cfg.o_bias else None
        self.qkv_packed: plinear.Packed = None  # set by CausalLM.pack_weights()
        self.o_packed: plinear.Packed = None

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        packed: bool,
        fused: bool = False,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rows: only these rows' outputs are wanted (every row's K/V is still written)."""
        t, d = x.shape[0], self.head_dim
        one = self.ps.tp_size > 1  # a TP rank's one-row steps through kernels.gemv (plinear.rank_linear)
        qkv = plinear.rank_linear(x, self.qkv_weight, self.qkv_packed if packed else None, self.qkv_bias, one)
        nq, qk_size = self.q_size // d, self.q_size + self.kv_size
        if fused:  # rotated in place: no copies of q and k
            kernels.rope_(qkv, cos_sin[0], cos_sin[1], qk_size // d, d)
            q, k = qkv[:, : self.q_size].view(t, nq, d), qkv[:, self.q_size : qk_size].view(t, -1, d)
        else:
            qk = apply_rope(cos_sin, qkv[:, :qk_size].view(t, -1, d))
            q, k = qk[:, :nq], qk[:, nq:]
        v = qkv[:, qk_size:].view(t, -1, d)
        if meta.kv_quant is not None:
            write_kv_fp8(kv_layer, self.layer, k, v, meta.slot_mapping, meta.kv_quant)
        else:
            write_kv(kv_layer, k, v, meta.slot_mapping, meta.all_slots_local)
        if self.ps.dcp_size > 1:
            q = self.ps.dcp_gather_heads(q)
        out = self._attend(q, k, v, kv_layer, meta)
        if rows is not None:
            out, t = out[rows], rows.numel()
        o_packed = self.o_packed if packed else None
        out = plinear.rank_linear(out.reshape(t, self.o_size), self.o_weight, o_packed, None, one)
        out = self.ps.all_reduce(out)
        return out if self.o_bias is None else out + self.o_bias

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        ps = self.ps
        quant = meta.kv_quant
        scales = None if quant is None else quant.scales[self.layer]
        if ps.dcp_size == 1:
            return self.backend.forward(q, kv_layer, meta, self.scale, new_kv=(k, v), kv_scales=scales)[0]
        # DCP: every rank of the group shares this KV head but holds 1/dcp of the tokens. Attend with the group's
        # queries over the local tokens, then merge the partials of this rank's heads by their LSE.
        out, lse = self.backend.forward(q, kv_layer, meta, self.scale, kv_scales=scales)
        return ps.dcp_merge(out, lse)


class MLP(nn.Module):
    def __init__(
        self, cfg: ModelConfig, ps: ParallelState, intermediate_size: int | None = None, reduce: bool = True
    ) -> None:
        """intermediate_size: a width other than the config's (MoE shared experts); reduce False leaves the
        all-reduce (and the down bias) to the caller, which sums this rank's partial with others first."""
        super().__init__()
        self.ps, self.reduce = ps, reduce
        self.intermediate_size = full = intermediate_size or cfg.intermediate_size
        # intermediate_size need not divide by TP (SmolLM2: 1536 at TP 9): the first `rem` ranks take one more column.
        base, rem = divmod(full, ps.tp_size)
        self.inter = base + (1 if ps.tp_rank < rem else 0)
        self.inter_start = ps.tp_rank * base + min(ps.tp_rank, rem)
        self.gate_up_weight = _param(2 * self.inter, cfg.hidden_size)
        self.gate_up_bias = _param(2 * self.inter) if cfg.mlp_bias else None
        self.down_weight = _param(cfg.hidden_size, self.inter)
        self.down_bias = _param(cfg.hidden_size) if cfg.mlp_bias else None
        self.gate_up_packed: plinear.Packed = None  # set by CausalLM.pack_weights()
        self.down_packed: plinear.Packed = None

    def forward(self, x: torch.Tensor, packed: bool, fused: bool = False) -> torch.Tensor:
        gu_p, down_p = (self.gate_up_packed, self.down_packed) if packed else (None, None)
        one = self.ps.tp_size > 1
        gate_up = plinear.rank_linear(x, self.gate_up_weight, gu_p, self.gate_up_bias, one)
        if fused:
            h = kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = F.silu(gate, inplace=True).mul_(up)  # in place: the [T, 2*inter] buffer is the largest activation
        out = plinear.rank_linear(h, self.down_weight, down_p, None, one)
        if not self.reduce:
            return out
        out = self.ps.all_reduce(out)
        return out if self.down_bias is None else out + self.down_bias


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, backend: AttentionBackend, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, ps, backend, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, ps)

    def forward(self, x, cos_sin, kv_layer, meta, packed: bool):
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, kv_layer, meta, packed)
        return x + self.mlp(self.post_attention_layernorm(x), packed)

    def forward_fused(self, residual, delta, cos_sin, kv_layer, meta, rows=None) -> tuple[torch.Tensor, torch.Tensor]:
        """The same layer with pdserve's fused CPU kernels, vLLM-style: the residual stream is updated in place and
        each add happens inside the norm after it; returns (the residual stream, the MLP's output, which the next
        norm adds). rows: past attention, only these rows go on (the stream returned holds just them)."""
        h = self.input_layernorm.add_norm(residual, delta)
        attn = self.self_attn(h, cos_sin, kv_layer, meta, packed=True, fused=True, rows=rows)
        if rows is not None:
            residual = residual[rows]
        h = self.post_attention_layernorm.add_norm(residual, attn)
        return residual, self.mlp(h, packed=True, fused=True)


class CausalLM(nn.Module):
    """Decoder stack + LM head. forward() returns logits only for the rows in logits_indices."""

    def __init__(self, cfg: ModelConfig, ps: ParallelState, backend: AttentionBackend, max_positions: int) -> None:
        super().__init__()
        self.cfg, self.ps = cfg, ps
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size)
        # The ModuleList registers the layers; typed as what it holds (torch types its items as Module)
        self.layers = cast(
            "Sequence[DecoderLayer]",
            nn.ModuleList(DecoderLayer(cfg, ps, backend, i) for i in range(cfg.num_layers)),
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else _param(cfg.vocab_size, cfg.hidden_size)
        self.rope = RotaryEmbedding(cfg, max_positions)
        self.lm_head_packed: plinear.Packed = None
        # Prefill runs on the packed weights too unless this is set: then prefill keeps F.linear, whose logits are
        # bit-identical to transformers' (linear.py: what the packed path gains and costs).
        self.exact_prefill = False
        # A CPU decode step's layers in one C++ call, a TP rank's shared-memory collectives too (kernels.decode_layers),
        # and a single rank's prefill of whole prompts (kernels.prefill_layers); PDSERVE_NATIVE_LAYERS=0 keeps them
        # op by op.
        self.native_layers = os.environ.get("PDSERVE_NATIVE_LAYERS", "1") != "0"
        self._native_args: tuple[list[torch.Tensor], list[torch.Tensor | None]] | None = None

    @property
    def num_local_kv_heads(self) -> int:
        return len(self.layers[0].self_attn.kv_heads)

    def pack_weights(self) -> None:
        """Prepack every linear weight for oneDNN (see linear.py); call after the weights are loaded."""
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            a.qkv_packed, a.o_packed = plinear.pack_of(a, "qkv_weight"), plinear.pack_of(a, "o_weight")
            m.gate_up_packed, m.down_packed = plinear.pack_of(m, "gate_up_weight"), plinear.pack_of(m, "down_weight")
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
        """on_layer_done(i), when given, runs right after layer i wrote its KV (prefill pods publish it).
        logits_indices None: no logits. Under TP every rank computes its shard of the LM head and TP rank 0 alone
        returns the logits (None on the others)."""
        packed = not (meta.is_prefill and self.exact_prefill)
        x = F.embedding(input_ids, self.embed_tokens)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        fused = packed and x.device.type == "cpu" and kernels.available()  # exact_prefill keeps torch's ops
        delta = None  # fused: the last MLP output, not yet added to the residual stream x
        # The last layer's K/V come from its input, so past its attention only the rows that give logits go on (a
        # prompt's last token; none for a chunk before the last). One rank only: TP ranks reduce whole rows.
        rows = logits_indices if fused and meta.is_prefill and self.ps.tp_size == 1 else None
        last = len(self.layers) - 1
        # the one-call layers write and read a model-dtype cache; an fp8 cache goes op by op (kv_quant.py)
        native = fused and on_layer_done is None and meta.kv_quant is None
        groups = self._native_groups(x) if native and not meta.is_prefill else None
        layers = self.layers  # op by op, unless one C++ call runs them all
        if groups is not None:
            x, delta = self._decode_native(x, cos_sin, kv_cache, meta, groups)
            layers = ()
        elif native and self._whole_prompts_on_one_rank(meta) and self._native_weights(x):
            x, delta = self._prefill_native(x, cos_sin, kv_cache, meta, rows)
            layers = ()
        for i, layer in enumerate(layers):
            if fused:
                x, delta = layer.forward_fused(x, delta, cos_sin, kv_cache[i], meta, rows if i == last else None)
            else:
                x = layer(x, cos_sin, kv_cache[i], meta, packed)
            if on_layer_done is not None:
                on_layer_done(i)
        if logits_indices is None:
            return None
        if rows is not None:  # x and delta hold just the logits rows
            x = self.norm.add_norm(x, delta)
        elif fused:
            x = self.norm.add_norm(x[logits_indices], None if delta is None else delta[logits_indices])
        else:
            x = self.norm(x[logits_indices])
        head, head_packed = self.lm_head, self.lm_head_packed if packed else None
        return self.ps.vocab_parallel_logits(
            x, lambda first, n: plinear.linear(x, head[first : first + n], head_packed), head.shape[0]
        )

    def _native_weights(self, x: torch.Tensor) -> bool:
        """Whether the native calls can run this model on x's dtype (every linear packed in it, or int8); gathers their
        weight and bias lists once."""
        if not self.native_layers:
            return False
        if self._native_args is None:
            weights: list[torch.Tensor] = []
            biases: list[torch.Tensor | None] = []
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                # an int8 layer passes its scales where a float layer passes oneDNN's copy (csrc/decode_step.cpp)
                packed = [
                    p.scale if isinstance(p, plinear.Int8Weight) else p
                    for p in (a.qkv_packed, a.o_packed, m.gate_up_packed, m.down_packed)
                    if isinstance(p, plinear.Int8Weight) or (isinstance(p, torch.Tensor) and p.dtype == x.dtype)
                ]
                if len(packed) < 4:
                    self.native_layers = False
                    return False
                qkv_packed, o_packed, gate_up_packed, down_packed = packed
                norms = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
                weights += [norms[0], qkv_packed, o_packed, norms[1], gate_up_packed, down_packed]
                weights += [a.qkv_weight, a.o_weight, m.gate_up_weight, m.down_weight]
                biases += [a.qkv_bias, a.o_bias, m.gate_up_bias, m.down_bias]
            self._native_args = weights, biases
        return True

    def _native_groups(self, x: torch.Tensor) -> tuple[list[int], list[int]] | None:
        """The groups for kernels.decode_layers (both empty on a single rank), or None where this step goes op by
        op (gloo, no packed weight in x's dtype)."""
        return self.ps.native_groups() if self._native_weights(x) else None

    def _whole_prompts_on_one_rank(self, meta: AttentionMetadata) -> bool:
        """A prefill step that kernels.prefill_layers computes as the op path does: one rank, no decodes, every
        sequence's keys exactly its new rows (a whole prompt or its first chunk), the C++ prefill attention."""
        a = self.layers[0].self_attn
        if not (meta.is_prefill and self.ps.tp_size == 1 and meta.num_decodes == 0) or any(meta.query_start_pos):
            return False
        applies = getattr(a.backend, "prefill_kernel_applies", None)
        if applies is None or not applies(meta, a.head_dim):
            return False
        cu = meta.cu_seqlens_q
        return meta.context_lens.tolist() == [b - a for a, b in zip(cu, cu[1:])]

    def _prefill_native(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._native_args is not None
        a = self.layers[0].self_attn
        dims = [len(self.layers), a.head_dim, a.q_size, a.kv_size, plinear.INT8_GROUP]
        eps = self.layers[0].input_layernorm.eps
        return kernels.prefill_layers(
            x,
            cos_sin[0],
            cos_sin[1],
            kv_cache,
            meta.slot_mapping,
            list(meta.cu_seqlens_q),
            *self._native_args,
            dims,
            [eps, a.scale],
            rows,
        )

    def _decode_native(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        groups: tuple[list[int], list[int]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        assert self._native_args is not None
        a = self.layers[0].self_attn
        window = -1 if meta.sliding_window is None else meta.sliding_window
        dims = [len(self.layers), a.head_dim, a.q_size, a.kv_size, window, self.ps.dcp_size, plinear.INT8_GROUP]
        eps = self.layers[0].input_layernorm.eps
        try:
            x, delta, tp_seq, dcp_seq = kernels.decode_layers(
                x,
                cos_sin[0],
                cos_sin[1],
                kv_cache,
                meta.slot_mapping,
                meta.block_tables,
                meta.context_lens,
                *self._native_args,
                dims,
                [eps, a.scale],
                *groups,
            )
        except RuntimeError as e:
            raise self.ps.native_failure(e) from None
        self.ps.native_done(tp_seq, dcp_seq)
        return x, delta
