"""Loading HF safetensors into the (possibly TP-sliced) model, with errors that name the file and key; int8 layers
(quant.make_int8) are quantised (per block of columns, or per row) from the whole tensor before it is sliced, or
taken as they are with their weight_scale from a compressed-tensors W8A8 checkpoint. A GGUF file goes to
gguf_file.py, which stores through the same helpers (store, store_blocks)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfigError
from pdserve.model.deepseek import DeepseekCausalLM
from pdserve.model.llama import MLP, CausalLM
from pdserve.model.moe import MoE
from pdserve.model.quant import (
    GROUP,
    quantize_per_channel,
    quantize_per_group,
    scale_view,
    scales_by_storage,
    shard_groups,
)


class WeightLoadError(ModelConfigError):
    pass


def _rows(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


Slicer = Callable[[torch.Tensor], torch.Tensor]


Targets = dict[str, tuple[torch.Tensor, tuple[int, ...], Slicer]]
ScaleMap = dict[int, tuple[torch.Tensor, bool]]


def _take_rows(rows: torch.Tensor) -> Slicer:
    return lambda t: t[rows]


def _take_cols(cols: torch.Tensor) -> Slicer:
    return lambda t: t[:, cols]


def _mlp_targets(p: str, mlp: MLP, h: int) -> Targets:
    """A gated MLP's keys under prefix p, column-parallel gate/up and row-parallel down (intermediate split)."""
    inter, r0, full = mlp.inter, mlp.inter_start, mlp.intermediate_size
    sl = slice(r0, r0 + inter)
    out: Targets = {
        p + "gate_proj.weight": (mlp.gate_up_weight[:inter], (full, h), lambda t: t[sl]),
        p + "up_proj.weight": (mlp.gate_up_weight[inter:], (full, h), lambda t: t[sl]),
        p + "down_proj.weight": (mlp.down_weight, (h, full), lambda t: t[:, sl]),
    }
    if mlp.gate_up_bias is not None:
        assert mlp.down_bias is not None
        out[p + "gate_proj.bias"] = (mlp.gate_up_bias[:inter], (full,), lambda t: t[sl])
        out[p + "up_proj.bias"] = (mlp.gate_up_bias[inter:], (full,), lambda t: t[sl])
        out[p + "down_proj.bias"] = (mlp.down_bias, (h,), lambda t: t)
    return out


def targets_of(model: CausalLM | DeepseekCausalLM) -> Targets:
    """HF key -> (destination view, full shape expected in the file, slicer taking the full tensor to this rank's
    part)."""
    if isinstance(model, DeepseekCausalLM):
        return _deepseek_targets(model)
    cfg = model.cfg
    d, h = cfg.head_dim, cfg.hidden_size
    whole = lambda t: t  # noqa: E731
    out: dict = {
        "model.embed_tokens.weight": (model.embed_tokens, (cfg.vocab_size, h), whole),
        "model.norm.weight": (model.norm.weight, (h,), whole),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, (cfg.vocab_size, h), whole)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows, o_cols = _rows(attn.q_heads, d), _rows(attn.kv_heads, d), _rows(attn.q_heads, d)
        qs, ks = attn.q_size, attn.kv_size
        out[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, (h,), whole)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, (h,), whole)
        shapes = {"q": cfg.num_heads * d, "k": cfg.num_kv_heads * d, "v": cfg.num_kv_heads * d}
        spans = {"q": (0, qs, q_rows), "k": (qs, qs + ks, kv_rows), "v": (qs + ks, qs + 2 * ks, kv_rows)}
        for name, (a, b, rows) in spans.items():
            out[p + f"self_attn.{name}_proj.weight"] = (attn.qkv_weight[a:b], (shapes[name], h), lambda t, r=rows: t[r])
            if attn.qkv_bias is not None:
                out[p + f"self_attn.{name}_proj.bias"] = (attn.qkv_bias[a:b], (shapes[name],), lambda t, r=rows: t[r])
        out[p + "self_attn.o_proj.weight"] = (attn.o_weight, (h, cfg.num_heads * d), lambda t, r=o_cols: t[:, r])
        if attn.o_bias is not None:
            out[p + "self_attn.o_proj.bias"] = (attn.o_bias, (h,), whole)
        out.update(_mlp_targets(p + "mlp.", mlp, h))
    return out


def _deepseek_targets(model: DeepseekCausalLM) -> Targets:
    cfg = model.cfg
    assert cfg.mla is not None
    m, h = cfg.mla, cfg.hidden_size
    whole = lambda t: t  # noqa: E731
    out: Targets = {
        "model.embed_tokens.weight": (model.embed_tokens, (cfg.vocab_size, h), whole),
        "model.norm.weight": (model.norm.weight, (h,), whole),
    }
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, (cfg.vocab_size, h), whole)
    nh = cfg.num_heads
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        a = layer.self_attn
        out[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, (h,), whole)
        out[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, (h,), whole)
        q_rows = _rows(a.q_group_heads, m.qk_head_dim)
        kv_rows = _rows(a.q_group_heads, m.qk_nope_head_dim + m.v_head_dim)
        o_cols = _rows(a.q_heads, m.v_head_dim)
        sa = p + "self_attn."
        if a.q_proj is not None:
            out[sa + "q_proj.weight"] = (a.q_proj.weight, (nh * m.qk_head_dim, h), _take_rows(q_rows))
        else:
            assert a.q_a_proj is not None and a.q_a_layernorm is not None and a.q_b_proj is not None
            assert m.q_lora_rank is not None
            out[sa + "q_a_proj.weight"] = (a.q_a_proj.weight, (m.q_lora_rank, h), whole)
            if a.q_a_proj.bias is not None:
                out[sa + "q_a_proj.bias"] = (a.q_a_proj.bias, (m.q_lora_rank,), whole)
            out[sa + "q_a_layernorm.weight"] = (a.q_a_layernorm.weight, (m.q_lora_rank,), whole)
            out[sa + "q_b_proj.weight"] = (
                a.q_b_proj.weight,
                (nh * m.qk_head_dim, m.q_lora_rank),
                _take_rows(q_rows),
            )
        out[sa + "kv_a_proj_with_mqa.weight"] = (a.kv_a_proj_with_mqa.weight, (m.latent_dim, h), whole)
        if a.kv_a_proj_with_mqa.bias is not None:
            out[sa + "kv_a_proj_with_mqa.bias"] = (a.kv_a_proj_with_mqa.bias, (m.latent_dim,), whole)
        out[sa + "kv_a_layernorm.weight"] = (a.kv_a_layernorm.weight, (m.kv_lora_rank,), whole)
        out[sa + "kv_b_proj.weight"] = (
            a.kv_b_proj.weight,
            (nh * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
            _take_rows(kv_rows),
        )
        out[sa + "o_proj.weight"] = (a.o_proj.weight, (h, nh * m.v_head_dim), _take_cols(o_cols))
        if a.o_proj.bias is not None:
            out[sa + "o_proj.bias"] = (a.o_proj.bias, (h,), whole)
        mlp = layer.mlp
        if isinstance(mlp, MLP):
            out.update(_mlp_targets(p + "mlp.", mlp, h))
            continue
        assert cfg.moe is not None
        e, full = cfg.moe.n_routed_experts, cfg.moe.moe_intermediate_size
        out[p + "mlp.gate.weight"] = (mlp.gate.weight, (e, h), whole)
        if mlp.gate.e_score_correction_bias is not None:
            out[p + "mlp.gate.e_score_correction_bias"] = (mlp.gate.e_score_correction_bias, (e,), whole)
        out.update(_expert_targets(p + "mlp.experts.", mlp, h, full))
        if mlp.shared_experts is not None:
            out.update(_mlp_targets(p + "mlp.shared_experts.", mlp.shared_experts, h))
    return out


def _expert_targets(p: str, moe: MoE, h: int, full: int) -> Targets:
    """Routed experts as checkpoints store them (one gate/up/down per expert), each sliced like a TP MLP."""
    inter, r0 = moe.inter, moe.inter_start
    sl = slice(r0, r0 + inter)
    out: Targets = {}
    for e in range(moe.gate_up_weight.shape[0]):
        gu = moe.gate_up_weight[e]
        out[f"{p}{e}.gate_proj.weight"] = (gu[:inter], (full, h), lambda t: t[sl])
        out[f"{p}{e}.up_proj.weight"] = (gu[inter:], (full, h), lambda t: t[sl])
        out[f"{p}{e}.down_proj.weight"] = (moe.down_weight[e], (h, full), lambda t: t[:, sl])
    return out


def _load_scale(
    files: list[Path], key: str, near: Path, dst: torch.Tensor, full_k: int, slicer: Slicer, scales: ScaleMap
) -> None:
    """A compressed-tensors weight_scale ([N, 1] per channel, or one value per tensor) into dst's scales, sliced
    as its weight's rows (full_k: the whole weight's columns, which a row-parallel slicer indexes)."""
    for f in [near, *(g for g in files if g != near)]:  # almost always in the weight's own file
        with safe_open(str(f), framework="pt") as st:
            if key not in st.keys():
                continue
            s = st.get_tensor(key).float().reshape(-1)
            view = scale_view(dst, scales)
            if s.numel() == 1:
                view.fill_(s.item())
            else:
                view.copy_(slicer(s.unsqueeze(-1).expand(-1, full_k))[..., 0])
            return
    raise WeightLoadError(f"{near.name}: int8 {key.removesuffix('_scale')!r} without its {key!r}")


def store_blocks(
    key: str,
    dst: torch.Tensor,
    shape: tuple[int, ...],
    slicer: Slicer,
    q: torch.Tensor,
    s: torch.Tensor,
    scales: ScaleMap,
) -> None:
    """The whole weight's int8 blocks q [N, K] and block scales s [N, ceil(K / GROUP)] into dst, an int8 layer with
    block scales, sliced to this rank's part."""
    shard_groups(key, dst.shape[-1], shape[-1])
    dst.copy_(slicer(q))
    # each block's scale repeated over its columns, sliced as the weight, then one per block:
    # a shard cut on block boundaries keeps exactly the blocks of the columns it keeps
    per_col = slicer(s.repeat_interleave(GROUP, dim=-1)[..., : shape[-1]])
    scale_view(dst, scales).copy_(per_col[..., ::GROUP])


def store(
    key: str, dst: torch.Tensor, shape: tuple[int, ...], slicer: Slicer, full: torch.Tensor, scales: ScaleMap
) -> None:
    """The whole full-precision tensor into dst, sliced to this rank's part: quantised first where dst is int8
    (quant.make_int8), per block or per row as its scales are."""
    if dst.dtype == torch.int8 and scales[dst.untyped_storage().data_ptr()][1]:
        store_blocks(key, dst, shape, slicer, *quantize_per_group(full), scales)
    elif dst.dtype == torch.int8:
        q, s = quantize_per_channel(full)
        dst.copy_(slicer(q))
        # the slicer picks rows (column parallel) or columns (row parallel): applied to each
        # row's scale repeated along the row, it keeps the scales of the rows it keeps
        scale_view(dst, scales).copy_(slicer(s.unsqueeze(-1).expand(q.shape))[..., 0])
    else:
        dst.copy_(slicer(full).to(dst.dtype))


def load_weights(model: CausalLM | DeepseekCausalLM, path: str | Path) -> None:
    path = Path(path)
    if path.suffix == ".gguf":
        from pdserve.model import gguf_file  # it builds on this module

        gguf_file.load_weights(model, path)
        return
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{path}: no *.safetensors files found")
    targets = targets_of(model)
    scales = scales_by_storage(model)
    prequantised: dict[str, tuple[Path, torch.Tensor, int, Slicer]] = {}
    seen: set[str] = set()
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    if key not in targets:
                        continue  # e.g. rotary inv_freq buffers, or lm_head when embeddings are tied
                    dst, shape, slicer = targets[key]
                    got = tuple(st.get_slice(key).get_shape())
                    if got != shape:
                        raise WeightLoadError(f"{f.name}: tensor {key!r} has shape {list(got)}, expected {list(shape)}")
                    full = st.get_tensor(key)
                    if full.dtype == torch.int8:  # compressed-tensors W8A8: its scales come as <key>_scale
                        if dst.dtype != torch.int8:
                            raise WeightLoadError(f"{f.name}: {key!r} is int8 where pdserve keeps {dst.dtype}")
                        dst.copy_(slicer(full))
                        prequantised[key] = (f, dst, shape[-1], slicer)
                    else:
                        store(key, dst, shape, slicer, full, scales)
                    seen.add(key)
    for key, (f, dst, full_k, slicer) in prequantised.items():
        _load_scale(files, key + "_scale", f, dst, full_k, slicer, scales)
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightLoadError(
            f"{path}: missing tensor(s) {', '.join(repr(k) for k in missing[:3])}{more} "
            f"in {', '.join(f.name for f in files)}"
        )
