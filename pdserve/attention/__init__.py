"""Attention backends: pick flashinfer on CUDA when installed, else the torch backend (CPU, or CUDA as fallback)."""

from __future__ import annotations

import logging

import torch

from pdserve.attention.base import AttentionBackend, AttentionMetadata, MLAAttentionBackend, write_kv, write_latent
from pdserve.attention.merge import merge_attn_states

log = logging.getLogger("pdserve.attention")

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "MLAAttentionBackend",
    "merge_attn_states",
    "select_backend",
    "select_mla_backend",
    "write_kv",
    "write_latent",
]


def select_backend(device: torch.device | str = "cpu", prefer: str | None = None) -> AttentionBackend:
    device = torch.device(device)
    want = prefer or ("flashinfer" if device.type == "cuda" else "torch")
    if want == "flashinfer":
        try:
            from pdserve.attention.flashinfer_backend import FlashInferAttentionBackend

            backend: AttentionBackend = FlashInferAttentionBackend(device)
        except (ImportError, OSError, RuntimeError) as e:  # absent, or built for another CUDA / driver
            log.warning(
                "flashinfer requested but not usable (%s: %s); using the torch backend on %s",
                type(e).__name__,
                e,
                device,
            )
            from pdserve.attention.torch_backend import TorchAttentionBackend

            backend = TorchAttentionBackend(device)
    else:
        from pdserve.attention.torch_backend import TorchAttentionBackend

        backend = TorchAttentionBackend(device)
    log.info("attention backend: %s on %s", backend.name, device)
    return backend


def select_mla_backend(backend: AttentionBackend) -> MLAAttentionBackend:
    """The MLA kernels to pair with the chosen attention backend: flashinfer's MLA decode next to its GQA kernels
    (CUDA), the torch ones everywhere else."""
    from pdserve.attention.torch_mla import TorchMLABackend

    mla: MLAAttentionBackend
    if backend.name == "flashinfer":
        try:
            from pdserve.attention.flashinfer_mla import FlashInferMLABackend

            mla = FlashInferMLABackend(getattr(backend, "device", torch.device("cuda")))
        except (ImportError, AttributeError) as e:  # a flashinfer without the MLA wrapper
            log.warning("flashinfer has no usable MLA wrapper (%s); MLA layers use the torch kernels", e)
            mla = TorchMLABackend()
    else:
        if backend.name != "torch":
            log.warning("attention backend %s has no MLA kernels; MLA layers use the torch ones", backend.name)
        mla = TorchMLABackend()
    log.info("MLA attention backend: %s", mla.name)
    return mla
