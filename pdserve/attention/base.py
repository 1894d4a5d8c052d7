"""The attention-backend interface: paged attention that also returns each head's log-sum-exp.

The LSE is what lets partial attentions over disjoint token subsets be merged exactly (merge.py), the primitive
Decode Context Parallelism rests on."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable, Protocol

import torch

if TYPE_CHECKING:
    from pdserve.engine.kv_quant import KVQuant


@dataclass
class AttentionMetadata:
    """Per-step batch description, built by the model runner.

    Tokens of all sequences are flattened: query tokens of sequence i are rows cu_seqlens_q[i]:cu_seqlens_q[i+1].
    context_lens are counts of KV tokens *stored on this rank* for each sequence after this step's writes."""

    is_prefill: bool
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot per new token, -1 where this rank does not store it
    cu_seqlens_q: list[int]  # [B+1]
    query_start_pos: list[int]  # [B] absolute position of each sequence's first query token
    context_lens: torch.Tensor  # [B] int64, local KV tokens per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    sliding_window: int | None = None
    # Decode Context Parallelism: this rank stores tokens t with (t // interleave) % dcp_size == dcp_rank.
    dcp_size: int = 1
    dcp_rank: int = 0
    dcp_interleave: int = 1
    # A prefill step's leading sequences that decode one token each (vLLM's decode-first order in mixed batches).
    num_decodes: int = 0
    # Prefill attention through torch's SDPA kernel, as transformers computes it (EngineConfig.exact_prefill).
    exact: bool = False
    # fp8 KV cache: the step's scale bookkeeping (pdserve/engine/kv_quant.py); None for a model-dtype cache.
    kv_quant: KVQuant | None = None
    # Tensors derived from the fields above, built once per step by the backend and reused by every layer.
    derived: dict = field(default_factory=dict, repr=False)

    def key_positions(self, num_local: int) -> torch.Tensor:
        """Absolute positions of this rank's first num_local cached tokens (identity without DCP)."""
        li = torch.arange(num_local)
        if self.dcp_size == 1:
            return li
        i = self.dcp_interleave
        return (li // i) * i * self.dcp_size + self.dcp_rank * i + li % i

    @property
    def all_slots_local(self) -> bool:
        """Whether this rank stores every new token of the step (no -1 slots); computed once, asked by every layer."""
        got = self.derived.get("all_slots_local")
        if got is None:
            got = self.derived["all_slots_local"] = bool((self.slot_mapping >= 0).all())
        return got

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens_q) - 1

    def split_decodes(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """A mixed step as (its decode rows, one query each; its prompt chunks), built once and asked by every
        layer: a backend runs the decodes as one batched decode instead of as one-token prefills."""
        got = self.derived.get("split")
        if got is None:
            d, cu = self.num_decodes, self.cu_seqlens_q
            dec = replace(
                self,
                is_prefill=False,
                num_decodes=0,
                slot_mapping=self.slot_mapping[: cu[d]],
                cu_seqlens_q=cu[: d + 1],
                query_start_pos=self.query_start_pos[:d],
                context_lens=self.context_lens[:d],
                block_tables=self.block_tables[:d],
                derived={},
            )  # kv_quant stays whole: writes happen before the split, reads need only its scales
            pre = replace(
                self,
                num_decodes=0,
                slot_mapping=self.slot_mapping[cu[d] :],
                cu_seqlens_q=[c - cu[d] for c in cu[d:]],
                query_start_pos=self.query_start_pos[d:],
                context_lens=self.context_lens[d:],
                block_tables=self.block_tables[d:],
                derived={},
            )
            got = self.derived["split"] = (dec, pre)
        return got


class AttentionBackend(Protocol):
    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D], post-rope
        kv_layer: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D] (K already written)
        meta: AttentionMetadata,
        scale: float,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this step's K, V rows [T, Hkv, D], as written
        kv_scales: torch.Tensor | None = None,  # fp8 cache: the layer's scales [2, blocks, Hkv] (kv_quant.py)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (out [T, Hq, D], lse [T, Hq]) with natural-log LSE; a sequence with no local KV gives out 0,
        lse -inf.

        new_kv lets a backend attend a prompt's first chunk straight from the step's K/V instead of gathering the same
        rows back out of the paged cache; a backend may ignore it."""
        ...


def write_kv(
    kv_layer: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, all_local: bool | None = None
) -> None:
    """Store this step's K/V rows in their slots; rows with slot -1 belong to another DCP rank. all_local: whether no
    slot is -1, when the caller knows (AttentionMetadata.all_slots_local)."""
    kvh, d = kv_layer.shape[-2], kv_layer.shape[-1]
    k_flat = kv_layer[0].view(-1, kvh, d)
    v_flat = kv_layer[1].view(-1, kvh, d)
    if all_local if all_local is not None else bool((slot_mapping >= 0).all()):
        k_flat.index_copy_(0, slot_mapping, k)
        v_flat.index_copy_(0, slot_mapping, v)
        return
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    if keep.numel():
        k_flat.index_copy_(0, slot_mapping[keep], k[keep])
        v_flat.index_copy_(0, slot_mapping[keep], v[keep])


class MLAAttentionBackend(Protocol):
    """Multi-head latent attention over a paged latent cache [num_blocks, block_size, kv_lora_rank + rope_dim] per
    layer: one row per token shared by every head. Both phases return natural-log LSE, so DCP merges them as GQA's."""

    name: str

    def forward_prefill(
        self,
        q: torch.Tensor,  # [T, H, Dqk], rope part applied
        latent_layer: torch.Tensor,  # this step's rows already written
        meta: AttentionMetadata,
        scale: float,
        expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],  # latent rows [N, C] -> K, V [N, H, D]
        new_latent: torch.Tensor | None = None,  # this step's latent rows [T, C], as written
        kv_scales: torch.Tensor | None = None,  # fp8 cache: the layer's scales [1, blocks, 2] (kv_quant.py)
        kv_lora_rank: int = 0,  # fp8 cache: where a latent row's rope part (its second scale group) starts
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expanded form: every head's K/V built from the latent, (out [T, H, D], lse [T, H]); D = expand's width."""
        ...

    def forward_decode(
        self,
        q: torch.Tensor,  # [B, H, C]: the absorbed query (q_nope @ W_UK, then q_pe) against whole latent rows
        latent_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        v_dim: int,  # the leading v_dim values of a latent row are the value (kv_lora_rank)
        kv_scales: torch.Tensor | None = None,  # fp8 cache: the layer's scales [1, blocks, 2] (kv_quant.py)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Absorbed form, one shared head: (out [B, H, v_dim] in latent space, lse [B, H])."""
        ...


def write_latent(
    latent_layer: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor, all_local: bool | None = None
) -> None:
    """Store this step's latent rows [T, C] in their slots; rows with slot -1 belong to another DCP rank."""
    flat = latent_layer.view(-1, latent_layer.shape[-1])
    if all_local if all_local is not None else bool((slot_mapping >= 0).all()):
        flat.index_copy_(0, slot_mapping, rows)
        return
    keep = (slot_mapping >= 0).nonzero().squeeze(1)
    if keep.numel():
        flat.index_copy_(0, slot_mapping[keep], rows[keep])
