"""Linear layers on CPU from oneDNN-prepacked weights instead of F.linear (MKL, the weight as stored).

Decode is bound by weight streaming and prefill by GEMM throughput; the packed weights are faster at both, so both
phases use one copy packed for a small batch (figures: docs/performance.md, "Linear layers").

The cost: the packed kernel sums in another order than MKL, so fp32 logits differ from transformers' by rounding
(greedy choices change only at exact ties). EngineConfig.exact_prefill keeps prefill on F.linear, whose logits are
bit-identical to transformers' (the reference tests check both modes). The packed copy is extra memory (one more
copy of the linear weights), paid only by CPU float32/bfloat16 runners.

bfloat16 on a CPU without bf16 instructions (no AVX512_BF16 / AMX): oneDNN cannot pack bf16 there and torch's
bf16 GEMM falls back to a slow generic loop (an 8x576 step 7x slower than fp32). The packed copy is then fp32, and
rows go through it upcast: bf16 -> fp32 is exact and so is every bf16 x bf16 product, so this is a bf16 GEMM with
fp32 accumulation, as oneDNN's bf16 kernels compute, rounded back to bf16. A single row (batch-1 decode) stays on
the bf16 weights, where streaming half the bytes wins (figures: docs/performance.md, "Linear layers").

Under --quantization int8 (quant.py) a layer's "packed" slot holds an Int8Weight instead: int8 rows with a scale per
block of columns (or per row), computed by pdserve's W8A8 kernels, and no oneDNN copy."""

from __future__ import annotations

from typing import NamedTuple, Union

import torch
import torch.nn.functional as F

from pdserve import kernels

# The batch size oneDNN tunes the packed layout for; best for batches 1..16 (docs/performance.md).
_PACK_HINT = 8

_linear_pointwise = torch.ops.mkldnn._linear_pointwise

# --quantization int8's block: 32 input columns per scale as llama.cpp's Q8_0, 4 bytes of scale per 32 weight bytes
INT8_GROUP = 32


class Int8Weight(NamedTuple):
    """A W8A8 layer's weight: int8 [..., N, K] and float32 scales, [..., N, ceil(K / INT8_GROUP)] one per block of
    an output row (quantised at load), or [..., N] one per row (a compressed-tensors checkpoint's)."""

    qweight: torch.Tensor
    scale: torch.Tensor


# What a layer keeps beside its weight: oneDNN's copy, the int8 weight and scales, or nothing.
Packed = Union[torch.Tensor, Int8Weight, None]


def packing_supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype in (torch.float32, torch.bfloat16)


def pack(weight: torch.Tensor, scale: torch.Tensor | None = None) -> Packed:
    """oneDNN's blocked copy of an [out, in] weight (fp32 for a bf16 weight where the CPU has no bf16 kernels), or
    None where the runtime cannot pack it; an int8 weight with its scales as an Int8Weight."""
    if weight.dtype == torch.int8:
        assert scale is not None, "an int8 weight needs its scales"
        return Int8Weight(weight, scale)
    if not packing_supported(weight):
        return None
    w = weight.detach().contiguous()
    if w.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        w = w.float()
    return torch.ops.mkldnn._reorder_linear_weight(w, _PACK_HINT)


def pack_of(module: torch.nn.Module, name: str) -> Packed:
    """pack() of module's weight attribute `name`, with its `name`_scale when the weight is int8 (quant.py)."""
    return pack(getattr(module, name), getattr(module, name + "_scale", None))


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 F.linear of x [..., K]: activations quantised per block like the weight (kernels.int8_linear_grouped),
    or per row for per-row weight scales (kernels.int8_linear)."""
    rows = x.reshape(-1, x.shape[-1])
    if w.scale.dim() == w.qweight.dim():
        y = kernels.int8_linear_grouped(rows, w.qweight, w.scale, INT8_GROUP, bias)
    else:
        y = kernels.int8_linear(rows, w.qweight, w.scale, bias)
    return y.view(*x.shape[:-1], w.qweight.shape[0])


def linear(x: torch.Tensor, weight: torch.Tensor, packed: Packed, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed from the packed weight when one is given."""
    if isinstance(packed, Int8Weight):
        return int8_linear(x, packed, bias)
    if packed is not None and x.dim() == 2:
        if packed.dtype == x.dtype:
            return _linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
        if x.shape[0] > 1:  # bf16 rows through the fp32 copy (module docstring)
            b = None if bias is None else bias.float()
            return _linear_pointwise(x.float(), packed, b, "none", [None], "").to(x.dtype)
    return F.linear(x, weight, bias)


def rank_linear(
    x: torch.Tensor, weight: torch.Tensor, packed: Packed, bias: torch.Tensor | None, shard: bool
) -> torch.Tensor:
    """linear(), except that one row on a tensor-parallel shard (shard True) goes through pdserve's gemv kernel
    from the weight as stored: on a shard of a few hundred rows oneDNN's per-call setup costs more than streaming
    the weight (docs/performance.md, "Shared-memory collectives"). The native decode step (kernels.decode_layers)
    makes the same choice, so both give the same bits."""
    one_row = x.dim() == 2 and x.shape[0] == 1 and x.dtype == weight.dtype
    if shard and isinstance(packed, torch.Tensor) and one_row and kernels.available():
        return kernels.gemv(x, weight, bias)
    return linear(x, weight, packed, bias)
