"""Linear layers for small-batch decode on CPU: oneDNN-prepacked weights instead of F.linear.

A decode step multiplies a few rows by every weight once, so it is bound by how fast the weights stream from memory.
Measured on SmolLM2-135M fp32, 2 threads (AMD EPYC, a [8,576]x[576,N] step): F.linear (MKL, weight as stored) streams
~5-9 GB/s, the LM head as low as 5 GB/s; the same weights prepacked by oneDNN for a small batch stream ~14-19 GB/s.
Only decode steps use it (CausalLM.forward): the packed kernel sums in another order, so its fp32 logits differ from
transformers' F.linear by rounding (measured up to 1.25e-4 on SmolLM2 logits, a 31-token prompt forced through it),
while prefill keeps F.linear and so stays bit-identical to transformers (what test_model_reference's 1e-4 bar checks);
decode is checked token-exact (greedy) against transformers. Measured why prefill does not take it even though oneDNN
also wins there (~200 GFLOP/s vs MKL's 115-165 at 128-2,048 rows): with every prefill linear packed SmolLM2's logits
differ from transformers' by up to 1.07e-4, and with only the gate/up projection packed by 8.8e-5 on the chat prompt but
1.05e-4 on a 400-token one; exact prefill logits are worth more than ~7% of prefill time. The packed copy is extra
memory (one more copy of the linear weights), paid only by CPU float32/bfloat16 runners that enable it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows up to this take the packed path: a decode batch (one row per sequence). Larger inputs are prefill: F.linear.
PACKED_MAX_ROWS = 32
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
    """F.linear(x, weight, bias), taking the packed weight for decode-sized inputs when one exists."""
    if packed is not None and x.dim() == 2 and x.shape[0] <= PACKED_MAX_ROWS:
        return _linear_pointwise(x.contiguous(), packed, bias, "none", [None], "")
    return F.linear(x, weight, bias)
