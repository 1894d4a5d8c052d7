"""Straightforward per-token reference for what each rank's KV region holds (test helper).

Deliberately written as plain loops over tokens, independent of kv_transfer.plan.
"""

from __future__ import annotations

import random

import torch

from kv_transfer.layout import KVLayout

_TORCH_DTYPE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def full_kv(layout: KVLayout, num_tokens: int, seed: int) -> torch.Tensor:
    """The whole request's KV: [layers, planes, tokens, kv_heads, head_dim] (MLA: one plane, one latent head)."""
    g = torch.Generator().manual_seed(seed)
    shape = (layout.num_layers, layout.kv_planes, num_tokens, layout.num_kv_heads, layout.head_dim)
    return torch.randn(shape, generator=g).to(_TORCH_DTYPE[layout.dtype])


def empty_region(layout: KVLayout, seed: int) -> torch.Tensor:
    """A rank's region filled with garbage, so untouched bytes are detectable."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layout.region_shape(), generator=g).to(_TORCH_DTYPE[layout.dtype])


def write_rank(layout: KVLayout, rank: int, full: torch.Tensor, table: list[int], region: torch.Tensor) -> None:
    """Store into ``region`` the KV rank ``rank`` would hold had it computed the request itself."""
    heads = list(layout.kv_heads_of_rank(rank))
    my_dcp = layout.dcp_rank(rank)
    # Why a view: an MLA region [layers, blocks, block_size, latent] is the GQA one with one plane and one head.
    region = region.view(layout.num_layers, layout.kv_planes, -1, layout.block_size, len(heads), layout.head_dim)
    for t in range(full.shape[2]):
        if (t // layout.interleave) % layout.dcp_size != my_dcp:
            continue
        li = (t // (layout.interleave * layout.dcp_size)) * layout.interleave + t % layout.interleave
        block, slot = table[li // layout.block_size], li % layout.block_size
        region[:, :, block, slot, :, :] = full[:, :, t, heads, :]


def random_tables(layout: KVLayout, num_tokens: int, rng: random.Random) -> list[list[int]]:
    """A block table per rank: a random choice of distinct blocks, sometimes consecutive runs."""
    tables = []
    for r in range(layout.tp_size):
        need = layout.blocks_needed(num_tokens, r)
        if rng.random() < 0.3:
            start = rng.randrange(0, layout.num_blocks - need + 1)
            tables.append(list(range(start, start + need)))
        else:
            tables.append(rng.sample(range(layout.num_blocks), need))
    return tables


def as_bytes(t: torch.Tensor):
    """uint8 numpy view of a contiguous CPU tensor (shares memory)."""
    return t.view(-1).view(torch.uint8).numpy()
