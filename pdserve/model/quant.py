"""--quantization int8 (W8A8): the decoder layers' linear weights quantised at load group-wise, as llama.cpp's Q8_0:
symmetric int8 with one float32 scale per block of GROUP input columns of each output row; activations are quantised
per block of GROUP columns of each token at run time (kernels.int8_linear_grouped). Per-token activation scales
cost too much accuracy (docs/performance.md, "int8"); a K not a multiple of GROUP ends in a shorter block.

Each weight is quantised whole, before tensor-parallel slicing (weights.py): a scale belongs to a block of an output
row of the full weight, so column-parallel shards (rows) and row-parallel shards (columns, cut on block boundaries;
shard_groups refuses other cuts) hold exactly the int8 values and scales of the unsharded model's. The LM head is
quantised the same way, per rank's vocab shard, as llama.cpp's Q8_0 files hold it (quantize_lm_head); embeddings,
norms, the MoE router and MLA's kv_b_proj (absorbed into the attention as a matrix) stay in the model dtype.

A compressed-tensors W8A8 checkpoint (config.json quantization_config, format "int-quantized" or "naive-quantized":
symmetric 8-bit int weights per channel or per tensor, dynamic per-token activations) loads its int8 weights and
weight_scale as they are (checkpoint_int8), per channel with per-token activations (kernels.int8_linear). A GGUF
file's Q8_0 tensors are this module's blocks already and load as they are (gguf_file.py)."""

from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels
from pdserve.model.config import ModelConfig, ModelConfigError
from pdserve.model.deepseek import DeepseekCausalLM, MLAttention
from pdserve.model.linear import INT8_GROUP, Int8Weight
from pdserve.model.llama import MLP, CausalLM
from pdserve.model.moe import MoE

# vLLM's --quantization values that pdserve implements (EngineConfig.quantization)
NONE, INT8 = "none", "int8"
GROUP = INT8_GROUP  # the kernels' block of input columns (linear.py)


def quantize_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 rows of w [..., N, K]: (q int8, scale float32 [..., N]) with scale = amax / 127 and
    q = round(w / scale) (an all-zero row: scale 1, q 0)."""
    w32 = w.float()
    amax = w32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w32 / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_per_group(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 blocks of `group` columns of w [..., N, K]: (q int8 [..., N, K], scale float32
    [..., N, ceil(K / group)]), each block as quantize_per_channel quantises a row (a short last block included)."""
    k = w.shape[-1]
    groups = -(-k // group)
    padded = torch.nn.functional.pad(w.float(), (0, groups * group - k))  # zeros change no block's amax
    q, scale = quantize_per_channel(padded.unflatten(-1, (groups, group)))
    return q.flatten(-2)[..., :k].contiguous(), scale


def shard_groups(name: str, k: int, full_k: int, group: int = GROUP) -> None:
    """Refuse a row-parallel shard of k of full_k columns that cuts a block: its activation blocks would span
    ranks, so no split could give the unsharded model's values."""
    if k != full_k and k % group:
        raise ModelConfigError(
            f"--quantization int8 quantises in blocks of {group} input columns, and {name!r} splits its {full_k} "
            f"columns into shards of {k}, which cut a block; use a tensor-parallel size whose shards hold whole "
            "blocks, or --quantization none"
        )


def checkpoint_int8(cfg: ModelConfig) -> bool:
    """Whether the checkpoint holds compressed-tensors W8A8 weights (loaded as int8 whatever --quantization says:
    there is no full-precision weight to keep); other quantised checkpoints are refused with what pdserve reads."""
    qc = cfg.raw.get("quantization_config")
    if not qc:
        return False
    method, fmt = qc.get("quant_method"), qc.get("format")
    why = None
    if method != "compressed-tensors" or fmt not in ("int-quantized", "naive-quantized"):
        why = f"quant_method {method!r}, format {fmt!r}"
    for name, group in (qc.get("config_groups") or {}).items():
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        if why is None and not (
            w.get("num_bits") == 8
            and w.get("type", "int") == "int"
            and w.get("symmetric", True)
            and w.get("strategy") in ("channel", "tensor")
        ):
            why = f"{name}: weights {w}"
        if why is None and a and not (a.get("num_bits") == 8 and a.get("dynamic") and a.get("strategy") == "token"):
            why = f"{name}: input_activations {a}"
    if why is not None:
        raise ModelConfigError(
            f"unsupported quantization_config ({why}): pdserve loads compressed-tensors W8A8 checkpoints (format "
            "int-quantized, symmetric 8-bit int weights per channel or tensor, dynamic per-token activations); "
            "for others use the full-precision checkpoint with --quantization int8"
        )
    return True


def quantized_linears(model: CausalLM | DeepseekCausalLM) -> list[tuple[nn.Module, str]]:
    """(module, weight attribute) of every linear layer that int8 quantises."""
    out: list[tuple[nn.Module, str]] = []
    for layer in model.layers:
        a = layer.self_attn
        if isinstance(a, MLAttention):
            out += [(lin, "weight") for lin in a.linears()]
        else:
            out += [(a, "qkv_weight"), (a, "o_weight")]
        mlp = layer.mlp
        out += [(mlp, "gate_up_weight"), (mlp, "down_weight")]
        if isinstance(mlp, MoE) and mlp.shared_experts is not None:
            se: MLP = mlp.shared_experts
            out += [(se, "gate_up_weight"), (se, "down_weight")]
    return out


def make_int8(model: CausalLM | DeepseekCausalLM, group: int = GROUP) -> None:
    """Turn the model's quantised linears into int8 weights with a float32 `<name>_scale` each, for load_weights to
    fill (call after the model is built and cast, before loading): [..., N, ceil(K / group)] block scales, or with
    group 0 one per output row [..., N] (a compressed-tensors checkpoint's per-channel scales)."""
    if not kernels.available():
        raise ModelConfigError(
            "--quantization int8 runs on pdserve's CPU kernels, which are unavailable here (see the log for why; a "
            "C++ compiler and torch's headers are needed); use --quantization none"
        )
    for module, name in quantized_linears(model):
        w = getattr(module, name)
        if w.device.type != "cpu":
            raise ModelConfigError("--quantization int8 runs on CPU only; use --quantization none with --device cuda")
        setattr(module, name, nn.Parameter(torch.empty(w.shape, dtype=torch.int8), requires_grad=False))
        shape = w.shape[:-1] + ((-(-w.shape[-1] // group),) if group else ())
        setattr(module, name + "_scale", nn.Parameter(torch.empty(shape), requires_grad=False))


def grouped(weight: torch.Tensor, scale: torch.Tensor) -> bool:
    """Whether an int8 weight's scales are per block ([..., N, groups]) rather than per row ([..., N])."""
    return scale.dim() == weight.dim()


def scales_by_storage(model: nn.Module) -> dict[int, tuple[torch.Tensor, bool]]:
    """Each int8 weight's storage address -> its scale tensor (make_int8's `<name>_scale`) and whether per block."""
    out: dict[int, tuple[torch.Tensor, bool]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            if p.dtype == torch.int8:
                scale = getattr(module, name + "_scale")
                out[p.untyped_storage().data_ptr()] = (scale, grouped(p, scale))
    return out


def scale_view(dst: torch.Tensor, scales: dict[int, tuple[torch.Tensor, bool]]) -> torch.Tensor:
    """The scales of dst, a view of whole rows of an int8 weight [..., N, K] (its rows contiguous): [..., N], or
    [..., N, groups] for block scales."""
    full, blocks = scales[dst.untyped_storage().data_ptr()]
    per_row = full.shape[-1] if blocks else 1
    scale = full.view(-1, per_row)
    k = dst.shape[-1]
    first = dst.storage_offset() // k
    rows = scale[first : first + dst.numel() // k]
    return rows.view(dst.shape[:-1] + ((per_row,) if blocks else ()))


def quantize_lm_head(model: CausalLM | DeepseekCausalLM, group: int = GROUP) -> None:
    """This rank's shard of the LM head in Q8_0 blocks, as llama.cpp's Q8_0 files hold the output matrix (call after
    pack_weights; replaces its packed copy). The embedding keeps the model dtype: a lookup reads a few rows."""
    first, n = model.ps.vocab_shard(model.lm_head.shape[0])
    model.lm_head_packed = Int8Weight(*quantize_per_group(model.lm_head[first : first + n].detach(), group))
