"""Per-block checksums of a request's prompt KV, computed by the prefill pod over what it publishes and by the decode
pod over what it read, so a read of freed, reused or damaged bytes fails the request instead of decoding garbage.

The two pods hold the KV in different layouts (TP heads and DCP tokens split differently), so a checksum is defined
on the layout-free content: logical block ``i`` (tokens ``[i * B, (i + 1) * B)``, ``B`` the prefill block size) sums,
modulo 2**32, one CRC-32 per (token, KV head) row (the head's K and V of every layer), seeded with the row's
position so that bytes landing at the wrong token or head change the sum. Every rank of a pod adds the rows it is
the designated holder of (the first rank holding that head among the ranks holding that token), so each row is
counted once per pod; the pod adds its ranks' partial sums. CRC-32 is zlib's (the standard library's).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from kv_transfer.layout import KVLayout

MASK = 0xFFFFFFFF


def _designated_heads(layout: KVLayout, rank: int) -> list[int]:
    """Heads of ``rank`` that it, and no lower rank of its DCP group, is counted for."""
    dcp = layout.dcp_rank(rank)
    return [
        h
        for h in layout.kv_heads_of_rank(rank)
        if min(r for r in layout.ranks_holding_head(h) if layout.dcp_rank(r) == dcp) == rank
    ]


def partial_checksums(
    layout: KVLayout,
    rank: int,
    region: torch.Tensor,
    block_table: Sequence[int],
    num_tokens: int,
    block_tokens: int,
    scales: torch.Tensor | None = None,
) -> list[int]:
    """This rank's share of the checksum of each logical block of ``block_tokens`` tokens (of ``num_tokens``), read
    from its KV ``region`` (shape ``[layers, 2, blocks, block_size, local heads, head_dim]``) at ``block_table``.
    An fp8 region's rows are its 8-bit bytes followed by the scales of the row's block and head (``scales``,
    [layers, planes, blocks, groups]), so a scale that did not arrive fails the checksum as a wrong byte does."""
    n_blocks = -(-num_tokens // block_tokens)
    sums = [0] * n_blocks
    heads = _designated_heads(layout, rank)
    if not heads or num_tokens == 0:
        return sums
    toks = np.arange(num_tokens, dtype=np.int64)
    toks = toks[layout.token_dcp_rank(toks) == layout.dcp_rank(rank)]
    li = layout.token_local_index(toks)
    table = np.asarray(block_table, dtype=np.int64)
    slots = table[li // layout.block_size] * layout.block_size + li % layout.block_size
    first = layout.kv_heads_of_rank(rank).start
    # gathered in the cache's own dtype (a byte-wise gather is several times slower), bytes taken after
    n_planes = layout.kv_planes * layout.num_layers
    planes = region.reshape(n_planes, -1, layout.kv_heads_per_rank, region.shape[-1])
    if layout.has_scales:  # index_select has no fp8 kernel everywhere: the same bytes as uint8
        planes = planes.view(torch.uint8)
    idx = torch.as_tensor(slots, device=region.device)
    local = torch.as_tensor([h - first for h in heads], device=region.device)
    # [planes, tokens, heads, dim] -> one contiguous row of every layer's K and V per (token, head)
    gathered = planes.index_select(1, idx).index_select(2, local).permute(1, 2, 0, 3).contiguous().cpu()
    rows: np.ndarray = gathered.view(torch.uint8).reshape(len(toks), len(heads), -1).numpy()
    if layout.has_scales:
        if scales is None:
            raise ValueError(f"an fp8 ({layout.dtype}) region's checksums need its scales")
        blocks = torch.as_tensor(slots // layout.block_size, device=scales.device)
        sc = scales.reshape(n_planes, layout.num_blocks, -1).index_select(1, blocks)  # [planes, tokens, groups]
        # GQA: the row's head; MLA: both parts of the one latent "head"
        sc = sc.index_select(2, local.to(scales.device)).unsqueeze(-1) if not layout.use_mla else sc.unsqueeze(2)
        sc_rows = sc.permute(1, 2, 0, 3).contiguous().cpu().view(torch.uint8).reshape(len(toks), len(heads), -1)
        rows = np.concatenate([rows, sc_rows.numpy()], axis=2)
    for i, t in enumerate(toks.tolist()):
        b = t // block_tokens
        for j, h in enumerate(heads):
            sums[b] = (sums[b] + zlib.crc32(rows[i, j], row_seed(t, h))) & MASK
    return sums


def row_seed(token: int, head: int) -> int:
    return (token * 0x9E3779B1 + head * 0x85EBCA77 + 1) & MASK


def combine(parts: Sequence[Sequence[int]]) -> list[int]:
    """A pod's checksums from its ranks' partial sums."""
    out = [0] * (len(parts[0]) if parts else 0)
    for p in parts:
        out = [(a + b) & MASK for a, b in zip(out, p)]
    return out


def first_mismatch(expected: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first logical block whose checksums differ (None: all equal)."""
    if len(expected) != len(got):
        return 0
    return next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
