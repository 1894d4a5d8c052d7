"""One side's KV cache layout (docs/DESIGN.md "KV cache layout"), as byte arithmetic.

Every rank holds one contiguous region shaped
``[num_layers, 2, num_blocks, block_size, kv_heads_local, head_dim]`` (GQA), or
``[num_layers, num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]`` (MLA: one latent row per
token, shared by all query heads, whole on every TP rank). The transfer code only ever sees that
region as bytes, so everything here answers "which bytes": which kv heads a TP rank holds, which
tokens a DCP rank holds (and at which local index), and the byte offset of one
(layer, plane, block, slot, local head) row. A plane is one layer's K or V (GQA) or its latent
(MLA); every plane of a region has the same geometry, which is what the planner relies on.

MLA is described as a single KV "head" of ``head_dim = kv_lora_rank + qk_rope_head_dim`` that every
TP rank replicates, with one plane per layer: all of GQA's head/token rules then hold unchanged.

Scalar rules come from ``pdserve.parallel_config`` (the one module that owns vLLM's layout rules);
the per-token helpers here are the same formulas written to also take numpy arrays, so the planner
can vectorise them (tests check they agree with parallel_config's scalar versions).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import numpy as np

from pdserve.parallel_config import dcp_local_count, dcp_rank_of, kv_heads_for_tp_rank, num_local_kv_heads

# Why strings, not torch dtypes: the layout travels inside a JSON handoff between pods.
_ITEMSIZE = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

IntOrArray = TypeVar("IntOrArray", int, np.ndarray)


def dtype_name(dtype: Any) -> str:
    """'float32' for torch.float32, np.float32 or 'float32' alike."""
    name = str(dtype).removeprefix("torch.")
    if name not in _ITEMSIZE:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in _ITEMSIZE:
        raise ValueError(f"unsupported KV dtype {dtype!r}")
    return name


@dataclass(frozen=True)
class KVLayout:
    """KV layout of one side (a prefill pod or a decode pod).

    ``num_blocks`` is the block count of each rank's region (all ranks of a pod allocate the same
    cache size); 0 means "not known", which is fine for everything except byte offsets.
    """

    num_layers: int
    num_kv_heads: int  # total over the model, not per rank
    head_dim: int
    dtype: str
    block_size: int
    tp_size: int = 1
    dcp_size: int = 1
    interleave: int = 1
    num_blocks: int = 0
    use_mla: bool = False  # latent cache: one plane per layer, num_kv_heads 1, head_dim = the latent width

    @classmethod
    def mla(
        cls,
        num_layers: int,
        latent_dim: int,
        dtype: Any,
        block_size: int,
        tp_size: int = 1,
        dcp_size: int = 1,
        interleave: int = 1,
        num_blocks: int = 0,
    ) -> "KVLayout":
        """An MLA cache: ``latent_dim`` = kv_lora_rank + qk_rope_head_dim values per token and layer."""
        return cls(
            num_layers=num_layers,
            num_kv_heads=1,
            head_dim=latent_dim,
            dtype=dtype,
            block_size=block_size,
            tp_size=tp_size,
            dcp_size=dcp_size,
            interleave=interleave,
            num_blocks=num_blocks,
            use_mla=True,
        )

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size", "dcp_size", "interleave"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {getattr(self, name)}")
        if self.num_blocks < 0:
            raise ValueError("KVLayout.num_blocks must be >= 0")
        object.__setattr__(self, "use_mla", bool(self.use_mla))
        if self.use_mla and self.num_kv_heads != 1:
            raise ValueError(f"an MLA layout has one latent kv head, got num_kv_heads={self.num_kv_heads}")
        tp, kvh = self.tp_size, self.num_kv_heads
        if (tp <= kvh and kvh % tp) or (tp > kvh and tp % kvh):
            raise ValueError(f"tp_size {tp} and num_kv_heads {kvh}: one must divide the other")
        if tp % self.dcp_size:
            raise ValueError(f"dcp_size {self.dcp_size} must divide tp_size {tp}")
        # Why: a DCP group shards tokens of the SAME heads; a group mixing heads would drop KV.
        # (vLLM's condition: tp // kvh must be a multiple of dcp.)
        for r in range(tp):
            if self.kv_heads_of_rank(r) != self.kv_heads_of_rank(r - self.dcp_rank(r)):
                raise ValueError(
                    f"tp={tp}, dcp={self.dcp_size}, kv_heads={kvh}: DCP group of rank {r} mixes kv heads "
                    f"(need tp // kv_heads to be a multiple of dcp)"
                )

    # ---- heads (TP) -------------------------------------------------------------------------
    @property
    def kv_heads_per_rank(self) -> int:
        return num_local_kv_heads(self.num_kv_heads, self.tp_size)

    def kv_heads_of_rank(self, tp_rank: int) -> range:
        """Global kv heads held by ``tp_rank`` (vLLM rule: contiguous range, or one replicated head)."""
        heads = kv_heads_for_tp_rank(self.num_kv_heads, self.tp_size, tp_rank)
        return range(heads[0], heads[-1] + 1)

    def ranks_holding_head(self, head: int) -> list[int]:
        return [r for r in range(self.tp_size) if head in self.kv_heads_of_rank(r)]

    # ---- tokens (DCP) -----------------------------------------------------------------------
    def dcp_rank(self, tp_rank: int) -> int:
        self._check_rank(tp_rank)
        return dcp_rank_of(tp_rank, self.dcp_size)

    def token_dcp_rank(self, token: IntOrArray) -> IntOrArray:
        """DCP rank that stores absolute position ``token``."""
        return (token // self.interleave) % self.dcp_size

    def token_local_index(self, token: IntOrArray) -> IntOrArray:
        """Index of ``token`` among the tokens its DCP rank stores."""
        i = self.interleave
        return (token // (i * self.dcp_size)) * i + token % i

    def local_token_count(self, num_tokens: int, dcp_rank: int) -> int:
        """How many of the first ``num_tokens`` positions DCP rank ``dcp_rank`` stores."""
        return dcp_local_count(num_tokens, self.dcp_size, self.interleave, dcp_rank)

    def blocks_needed(self, num_tokens: int, tp_rank: int) -> int:
        """Blocks rank ``tp_rank`` needs for a sequence of ``num_tokens`` tokens."""
        return -(-self.local_token_count(num_tokens, self.dcp_rank(tp_rank)) // self.block_size)

    # ---- bytes ------------------------------------------------------------------------------
    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def kv_planes(self) -> int:
        """Planes per layer: K and V (GQA), or the latent alone (MLA)."""
        return 1 if self.use_mla else 2

    @property
    def head_nbytes(self) -> int:
        """One token's K (or V, or MLA latent) for one head."""
        return self.head_dim * self.itemsize

    @property
    def token_nbytes(self) -> int:
        """One token's K (or V) for all local heads of a rank, for one layer: one slot."""
        return self.kv_heads_per_rank * self.head_nbytes

    @property
    def block_nbytes(self) -> int:
        return self.block_size * self.token_nbytes

    def region_shape(self, num_blocks: int | None = None) -> tuple[int, ...]:
        nb = self._num_blocks(num_blocks)
        if self.use_mla:
            return (self.num_layers, nb, self.block_size, self.head_dim)
        return (self.num_layers, 2, nb, self.block_size, self.kv_heads_per_rank, self.head_dim)

    def plane_nbytes(self, num_blocks: int | None = None) -> int:
        """Bytes of one plane (a layer's K, V or latent) of a rank's region: the stride between planes."""
        return self._num_blocks(num_blocks) * self.block_nbytes

    def region_nbytes(self, num_blocks: int | None = None) -> int:
        return self.num_layers * self.kv_planes * self.plane_nbytes(num_blocks)

    def byte_offset(
        self,
        layer: IntOrArray,
        kv: IntOrArray,
        block: IntOrArray,
        slot: IntOrArray,
        local_head: int | IntOrArray = 0,
        num_blocks: int | None = None,
    ) -> IntOrArray:
        """Offset of row (layer, k/v, block, slot-in-block, local head) inside a rank's region (MLA: kv 0)."""
        plane = layer * self.kv_planes + kv
        return (
            plane * self.plane_nbytes(num_blocks)
            + block * self.block_nbytes
            + slot * self.token_nbytes
            + local_head * self.head_nbytes
        )

    # ---- fp8 scales ---------------------------------------------------------------------------
    @property
    def has_scales(self) -> bool:
        """fp8 caches keep float32 scales beside the region (pdserve/engine/kv_quant.py), which travel with the KV."""
        return self.dtype.startswith("float8")

    @property
    def scale_groups(self) -> int:
        """Scales per (layer, plane, block) of a rank: one per local KV head, or the latent and its rope part."""
        return 2 if self.use_mla else self.kv_heads_per_rank

    def scales_shape(self, num_blocks: int | None = None) -> tuple[int, ...]:
        """A rank's scale tensor: [layers, planes, blocks, groups] float32."""
        return (self.num_layers, self.kv_planes, self._num_blocks(num_blocks), self.scale_groups)

    # ---- misc -------------------------------------------------------------------------------
    def same_model(self, other: "KVLayout") -> bool:
        """Both sides describe the same KV tensor (the only thing a re-shard cannot change)."""
        return (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.use_mla) == (
            other.num_layers,
            other.num_kv_heads,
            other.head_dim,
            other.dtype,
            other.use_mla,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        return cls(**d)

    def _num_blocks(self, num_blocks: int | None) -> int:
        nb = self.num_blocks if num_blocks is None else num_blocks
        if nb <= 0:
            raise ValueError("num_blocks is needed for byte offsets (set KVLayout.num_blocks)")
        return nb

    def _check_rank(self, tp_rank: int) -> None:
        if not 0 <= tp_rank < self.tp_size:
            raise ValueError(f"tp rank {tp_rank} out of range for tp_size {self.tp_size}")
