"""Paged-KV bookkeeping: per-DCP-rank block allocators with exact free counts, and the prefix cache.

With DCP each rank stores only its own tokens, so each rank has its own allocator and each sequence a block table
per rank sized to ceil(local tokens / block_size)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from pdserve.engine.sequence import Sequence
from pdserve.parallel_config import dcp_local_count

__all__ = ["BlockAllocator", "BlockManager", "dcp_local_count", "dcp_slot"]


def dcp_slot(pos: int, dcp: int, interleave: int) -> tuple[int, int]:
    """(owning DCP rank, local index on that rank) of absolute token position pos.

    parallel_config.dcp_owner/dcp_local_index in one unchecked call: this runs per token per step."""
    rank = (pos // interleave) % dcp
    return rank, (pos // (interleave * dcp)) * interleave + pos % interleave


class BlockAllocator:
    """Block ids 0..num_blocks-1 with reference counts. Freed blocks that carry a prefix hash stay findable until
    they are handed out again (LRU), which is what makes the prefix cache survive a request's end."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(block, None)
        if h is not None:
            self.block_of.pop(h, None)
        self.ref[block] = 1
        return block

    def take_cached(self, h: bytes) -> int | None:
        block = self.block_of.get(h)
        if block is None:
            return None
        if self.ref[block] == 0:
            del self.free[block]
        self.ref[block] += 1
        return block

    def share(self, block: int) -> None:
        """One more holder of an allocated block (a forked sequence reading the same KV)."""
        if self.ref[block] <= 0:
            raise RuntimeError(f"KV block {block} is not allocated: it cannot be shared")
        self.ref[block] += 1

    def release(self, block: int) -> None:
        if self.ref[block] <= 0:
            raise RuntimeError(f"double free of KV block {block}")
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free[block] = None

    def register(self, block: int, h: bytes) -> None:
        if h not in self.block_of:
            self.block_of[h] = block
            self.hash_of[block] = h


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        dcp_size: int = 1,
        interleave: int = 1,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.block_size = block_size
        self.dcp_size, self.interleave = dcp_size, interleave
        self.ranks = [BlockAllocator(num_blocks) for _ in range(dcp_size)]
        # Prefix sharing needs every token of a block on one rank in order; DCP pods receive KV instead.
        self.prefix_caching = enable_prefix_caching and dcp_size == 1
        self.prefix_hits = 0  # tokens served from the cache, for metrics
        self.prefix_queries = 0

    @property
    def num_blocks(self) -> int:
        return self.ranks[0].num_blocks

    def num_free(self, dcp_rank: int = 0) -> int:
        return self.ranks[dcp_rank].num_free

    def free_per_rank(self) -> list[int]:
        return [a.num_free for a in self.ranks]

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> list[int]:
        tables = seq.block_tables or [[] for _ in self.ranks]
        out = []
        for r in range(self.dcp_size):
            local = dcp_local_count(num_tokens, self.dcp_size, self.interleave, r)
            out.append(max(0, -(-local // self.block_size) - len(tables[r])))
        return out

    def can_allocate(self, seq: Sequence, num_tokens: int, reserve: int = 0) -> bool:
        return all(n + reserve <= a.num_free for n, a in zip(self.blocks_needed(seq, num_tokens), self.ranks))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow seq's tables so they hold its first num_tokens tokens (caller checked can_allocate)."""
        need = self.blocks_needed(seq, num_tokens)
        if not seq.block_tables:
            seq.block_tables = [[] for _ in self.ranks]
        for r, n in enumerate(need):
            # The n blocks LRU order picks, in ascending order: blocks freed together (free() releases tail first)
            # come back as one consecutive range, which a KV transfer moves as one segment instead of n.
            seq.block_tables[r].extend(sorted(self.ranks[r].allocate() for _ in range(n)))

    def free(self, seq: Sequence) -> None:
        for r, table in enumerate(seq.block_tables):
            for b in reversed(table):  # tail first, so a prompt's leading blocks stay cached longest
                self.ranks[r].release(b)
        seq.block_tables = []
        seq.num_computed = 0
        seq.num_cached_prefix = 0

    def fork(self, parent: Sequence, num_tokens: int) -> tuple[list[list[int]], list[tuple[int, int, int]]] | None:
        """Block tables for a sequence that continues from parent's first num_tokens tokens (parallel sampling).

        Full blocks are shared (one more reference each: nobody writes them again); a partly filled last block is
        copied into a fresh block, since the child writes its next tokens into the rest of it (copy-on-write, done
        at the fork because every child writes at once). Returns (tables per DCP rank, [(DCP rank, source block,
        destination block)] for the caller to copy), or None (nothing taken) when a rank has no free block for its
        copy."""
        bs = self.block_size
        splits = [
            divmod(dcp_local_count(num_tokens, self.dcp_size, self.interleave, r), bs) for r in range(self.dcp_size)
        ]
        if any(rem and self.ranks[r].num_free < 1 for r, (_, rem) in enumerate(splits)):
            return None
        tables: list[list[int]] = []
        copies: list[tuple[int, int, int]] = []
        for r, (full, rem) in enumerate(splits):
            alloc, src = self.ranks[r], parent.block_tables[r]
            table = list(src[:full])
            for b in table:
                alloc.share(b)
            if rem:
                dst = alloc.allocate()
                copies.append((r, src[full], dst))
                table.append(dst)
            tables.append(table)
        return tables, copies

    # --- prefix cache (DCP 1 only) ---
    def _hashes(self, ids: list[int], n_blocks: int) -> list[bytes]:
        out, prev = [], b""
        bs = self.block_size
        for i in range(n_blocks):
            prev = hashlib.blake2b(prev + repr(ids[i * bs : (i + 1) * bs]).encode(), digest_size=16).digest()
            out.append(prev)
        return out

    def match_prefix(self, seq: Sequence) -> int:
        """Attach cached full blocks of seq's prompt; returns how many tokens they cover."""
        if not self.prefix_caching or seq.block_tables or seq.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position's logits: nothing may come from the cache
        # At least one token must be computed to produce logits, so the last prompt token never comes from cache.
        n_full = (seq.num_tokens - 1) // self.block_size
        alloc, table = self.ranks[0], []
        for h in self._hashes(seq.all_ids, n_full):
            block = alloc.take_cached(h)
            if block is None:
                break
            table.append(block)
        seq.block_tables = [table]
        cached = len(table) * self.block_size
        seq.num_computed = seq.num_cached_prefix = cached
        self.prefix_hits += cached
        self.prefix_queries += seq.num_tokens
        return cached

    def register_computed(self, seq: Sequence) -> None:
        """Publish seq's fully computed blocks so later requests with the same prefix reuse them."""
        if not self.prefix_caching:
            return
        n_full = seq.num_computed // self.block_size
        alloc = self.ranks[0]
        for i, h in enumerate(self._hashes(seq.all_ids, n_full)):
            alloc.register(seq.block_tables[0][i], h)
