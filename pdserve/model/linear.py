"""Linear layers on CPU from oneDNN-prepacked weights instead of F.linear (MKL, the weight as stored).

Decode is bound by weight streaming and prefill by GEMM throughput; the packed weights are faster at both, so both
phases use one copy packed for a small batch (figures: docs/performance.md, "Linear layers").

The cost: the packed kernel sums in another order than MKL, so fp32 logits differ from transformers' by rounding
(greedy choices change only at exact ties). EngineConfig.exact_prefill keeps prefill on F.linear, whose logits are
bit-identical to transformers' (the reference tests check both modes). The packed copy is extra memory (one more
copy of the linear weights), paid only by CPU float32/bfloat16 runners."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# The batch size oneDNN tunes the packed layout for; best for batches 1..16 (docs/performance.md).
_PACK_HINT = 8

_linear_pointwise = torch.ops.mkldnn._linear_pointwise


def packing_supported(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:  # oneDNN's bf16 kernels need AVX-512 (or AVX-NE-CONVERT); else F.linear
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of an [out, in] weight, or None where the runtime cannot pack it."""
    if not packing_supported(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT)


def linear(
    x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), computed from the packed weight when one is given."""
    if packed is not None and x.dim() == 2:
        return _linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
    return F.linear(x, weight, bias)
