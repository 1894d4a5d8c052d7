"""Loading HF safetensors into the (possibly TP-sliced) model, with errors that name the file and key."""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from pdserve.model.config import ModelConfigError
from pdserve.model.llama import CausalLM


class WeightLoadError(ModelConfigError):
    pass


def _rows(heads: list[int], head_dim: int) -> torch.Tensor:
    return torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in heads])


Slicer = Callable[[torch.Tensor], torch.Tensor]


def _targets(model: CausalLM) -> dict[str, tuple[torch.Tensor, tuple[int, ...], Slicer]]:
    """HF key -> (destination view, full shape expected in the file, slicer taking the full tensor to this rank's
    part)."""
    cfg = model.cfg
    d, h = cfg.head_dim, cfg.hidden_size
    whole = lambda t: t  # noqa: E731
    out: dict = {"model.embed_tokens.weight": (model.embed_tokens, (cfg.vocab_size, h), whole),
                 "model.norm.weight": (model.norm.weight, (h,), whole)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (model.lm_head, (cfg.vocab_size, h), whole)
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        q_rows, kv_rows, o_cols = _rows(attn.q_group_heads, d), _rows(attn.kv_heads, d), _rows(attn.q_heads, d)
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
        inter, r0 = mlp.inter, mlp.inter_start
        sl = slice(r0, r0 + inter)
        out[p + "mlp.gate_proj.weight"] = (mlp.gate_up_weight[:inter], (cfg.intermediate_size, h), lambda t: t[sl])
        out[p + "mlp.up_proj.weight"] = (mlp.gate_up_weight[inter:], (cfg.intermediate_size, h), lambda t: t[sl])
        out[p + "mlp.down_proj.weight"] = (mlp.down_weight, (h, cfg.intermediate_size), lambda t: t[:, sl])
        if mlp.gate_up_bias is not None:
            out[p + "mlp.gate_proj.bias"] = (mlp.gate_up_bias[:inter], (cfg.intermediate_size,), lambda t: t[sl])
            out[p + "mlp.up_proj.bias"] = (mlp.gate_up_bias[inter:], (cfg.intermediate_size,), lambda t: t[sl])
            out[p + "mlp.down_proj.bias"] = (mlp.down_bias, (h,), whole)
    return out


def load_weights(model: CausalLM, path: str | Path) -> None:
    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{path}: no *.safetensors files found")
    targets = _targets(model)
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
                    dst.copy_(slicer(st.get_tensor(key)).to(dst.dtype))
                    seen.add(key)
    missing = sorted(set(targets) - seen)
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise WeightLoadError(f"{path}: missing tensor(s) {', '.join(repr(k) for k in missing[:3])}{more} "
                              f"in {', '.join(f.name for f in files)}")
