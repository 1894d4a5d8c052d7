"""The shape of one rank's KV cache, by layout kind: GQA keeps K and V per local KV head, MLA one latent row per token.

Blocks are counted the same way for both (the block manager hands out block ids per DCP rank); only what a block
holds differs, so this is where the cache is sized and allocated."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.hugepages import empty_kv
from pdserve.model.config import ModelConfig
from pdserve.parallel_config import num_local_kv_heads

GQA, MLA = "gqa", "mla"


@dataclass(frozen=True)
class KVCacheLayout:
    kind: str  # GQA: [layers, 2, blocks, block_size, kv_heads, head_dim]; MLA: [layers, blocks, block_size, latent]
    num_layers: int
    block_size: int
    kv_heads: int = 0  # per rank (GQA)
    head_dim: int = 0  # GQA
    latent_dim: int = 0  # kv_lora_rank + qk_rope_head_dim (MLA), whole on every rank

    @classmethod
    def for_model(cls, cfg: ModelConfig, tp_size: int, block_size: int) -> "KVCacheLayout":
        if cfg.mla is not None:
            return cls(MLA, cfg.num_layers, block_size, latent_dim=cfg.mla.latent_dim)
        return cls(
            GQA,
            cfg.num_layers,
            block_size,
            kv_heads=num_local_kv_heads(cfg.num_kv_heads, tp_size),
            head_dim=cfg.head_dim,
        )

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        if self.kind == MLA:
            return (self.num_layers, num_blocks, self.block_size, self.latent_dim)
        return (self.num_layers, 2, num_blocks, self.block_size, self.kv_heads, self.head_dim)

    @property
    def values_per_token(self) -> int:
        """Cache values one token takes on one rank, over all layers."""
        per_layer = self.latent_dim if self.kind == MLA else 2 * self.kv_heads * self.head_dim
        return self.num_layers * per_layer

    def bytes_per_block(self, dtype: torch.dtype) -> int:
        return self.values_per_token * self.block_size * torch.empty((), dtype=dtype).element_size()

    def scales_shape(self, num_blocks: int) -> tuple[int, ...]:
        """fp8 caches' scales (kv_quant.py): [layers, planes, blocks, groups], groups = local KV heads or the two
        parts of an MLA latent row."""
        if self.kind == MLA:
            return (self.num_layers, 1, num_blocks, 2)
        return (self.num_layers, 2, num_blocks, self.kv_heads)

    def allocate(self, num_blocks: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """One contiguous zeroed region (on huge pages where the OS allows, see hugepages.py)."""
        return empty_kv(*self.shape(num_blocks), dtype=dtype, device=device)
