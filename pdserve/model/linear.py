"""Linear layers on CPU from oneDNN-prepacked weights instead of F.linear (MKL, the weight as stored).

Decode multiplies a few rows by every weight once, so it is bound by how fast the weights stream from memory. Measured
on SmolLM2-135M fp32, 2 threads (AMD EPYC, a [8,576]x[576,N] step): F.linear streams ~5-9 GB/s, the LM head as low as
5 GB/s; the same weights prepacked by oneDNN for a small batch stream ~14-19 GB/s. Prefill is compute-bound, and MKL's
sgemm on this CPU reaches 93-160 GFLOP/s on SmolLM2's shapes (93 for the [128,576]x[576,3072] gate/up) where oneDNN's
packed kernel reaches 180-210 at 128 to 2,048 rows: 1.4-1.7x the GEMM throughput, measured in a full 128-token
prefill as linear time 210 -> 156 ms. So both phases use the packed weights (one copy, packed for a small batch: the
same copy serves prefill as fast as one packed for its row count).

The cost: the packed kernel sums in another order than MKL, so fp32 logits differ from transformers' by rounding
(measured on SmolLM2: up to 1.2e-4 on logits of magnitude ~40, a relative 3e-6; greedy choices change only at exact
ties, e.g. a 1.1e-5 gap among 400 random-token positions). EngineConfig.exact_prefill keeps prefill on F.linear, whose
logits are bit-identical to transformers' (the reference tests check both modes). The packed copy is extra memory
(one more copy of the linear weights), paid only by CPU float32/bfloat16 runners."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The batch size oneDNN tunes the packed layout for; measured best for batches 1..16 on SmolLM2 shapes.
_PACK_HINT = 8

_linear_pointwise = torch.ops.mkldnn._linear_pointwise


def packing_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of an [out, in] weight, or None where the runtime cannot pack it."""
    if not packing_supported(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed from the packed weight when one is given."""
    if packed is not None and x.dim() == 2:
        return _linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
    return F.linear(x, weight, bias)
