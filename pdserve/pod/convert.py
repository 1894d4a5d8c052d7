"""Between the pdserve.v1 protos and the engine / kv_transfer objects both pods work with."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kv_transfer.layout import KVLayout
from kv_transfer.transport import Endpoint, KVHandoff
from pdserve_api.v1 import common_pb2 as pb

if TYPE_CHECKING:
    from pdserve.model.config import ModelConfig

TRANSFER_MODE_OF = {"nixl": pb.TRANSFER_MODE_NIXL_PULL, "tcp": pb.TRANSFER_MODE_TCP}
TRANSPORT_OF_MODE = {pb.TRANSFER_MODE_NIXL_PULL: "nixl", pb.TRANSFER_MODE_TCP: "tcp"}


def kv_layout_for_model(
    mc: ModelConfig,
    dtype: str,
    block_size: int,
    tp_size: int = 1,
    dcp_size: int = 1,
    interleave: int = 1,
    num_blocks: int = 0,
) -> KVLayout:
    """The kv_transfer layout of an engine's cache: MLA models keep one latent row per token on every rank."""
    if mc.mla is not None:
        return KVLayout.mla(
            mc.num_layers,
            mc.mla.latent_dim,
            dtype,
            block_size,
            tp_size=tp_size,
            dcp_size=dcp_size,
            interleave=interleave,
            num_blocks=num_blocks,
        )
    return KVLayout(
        num_layers=mc.num_layers,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        dtype=dtype,
        block_size=block_size,
        tp_size=tp_size,
        dcp_size=dcp_size,
        interleave=interleave,
        num_blocks=num_blocks,
    )


def layout_to_proto(layout: KVLayout) -> pb.KVLayout:
    return pb.KVLayout(
        num_layers=layout.num_layers,
        block_size=layout.block_size,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        dtype=layout.dtype,
        tp_size=layout.tp_size,
        dcp_size=layout.dcp_size,
        dcp_kv_cache_interleave_size=layout.interleave,
        pipeline_parallel_size=1,
        num_blocks=layout.num_blocks,
        num_kv_heads_per_rank=layout.kv_heads_per_rank,
        use_mla=layout.use_mla,
        element_size=layout.itemsize,
    )


def layout_from_proto(p: pb.KVLayout) -> KVLayout:
    return KVLayout(
        num_layers=p.num_layers,
        num_kv_heads=p.num_kv_heads,
        head_dim=p.head_dim,
        dtype=p.dtype,
        block_size=p.block_size,
        tp_size=p.tp_size or 1,
        dcp_size=p.dcp_size or 1,
        interleave=p.dcp_kv_cache_interleave_size or 1,
        num_blocks=p.num_blocks,
        use_mla=p.use_mla,
    )


def endpoints_address(endpoints: Sequence[Endpoint | None]) -> str:
    """The per-rank kv_transfer endpoints as one address string: "host:port", or "h:p0,h:p1,..." by rank."""
    eps = [str(e) for e in endpoints]
    return eps[0] if len(set(eps)) == 1 else ",".join(eps)


def handoff_to_kv_handle(h: KVHandoff, pod_id: str, ttl_s: float) -> pb.KVHandle:
    """The proto form of a kv_transfer hand-off.

    kv_transfer serves one control endpoint per prefill rank process; the proto has one kv_transfer_address, so it
    holds the endpoints of ranks 0..tp-1 joined by commas (a single address when they coincide or tp == 1)."""
    return pb.KVHandle(
        lease_id=h.lease_id,
        prefill_pod_id=pod_id,
        kv_transfer_address=endpoints_address(h.endpoints),
        num_layers=h.layout.num_layers,
        num_tokens=h.num_tokens,
        expires_at_unix_ms=int((time.time() + ttl_s) * 1000),
        ttl_s=ttl_s,
        transfer_mode=TRANSFER_MODE_OF.get(h.transport, pb.TRANSFER_MODE_TCP),
        layout=layout_to_proto(h.layout),
        block_tables=[pb.BlockTable(block_ids=t, num_tokens=h.num_tokens) for t in h.block_tables],
    )


def kv_handle_to_handoff(kh: pb.KVHandle, request_id: str) -> KVHandoff:
    """Inverse of handoff_to_kv_handle (what a decode pod needs to pull)."""
    layout = layout_from_proto(kh.layout)
    eps: list[Endpoint | None] = [Endpoint.parse(a) for a in kh.kv_transfer_address.split(",") if a]
    if len(eps) == 1:
        eps = eps * layout.tp_size
    if len(eps) != layout.tp_size:
        raise ValueError(f"kv_transfer_address names {len(eps)} endpoints for a tp_size {layout.tp_size} pod")
    return KVHandoff(
        kh.lease_id,
        request_id,
        kh.num_tokens,
        layout,
        [list(t.block_ids) for t in kh.block_tables],
        eps,
        TRANSPORT_OF_MODE.get(kh.transfer_mode, "tcp"),
    )


def model_shape_to_proto(mc: ModelConfig, max_model_len: int, dtype: str) -> pb.ModelShape:
    """The model a pod serves, as the router compares it across pods."""
    mla = mc.mla
    return pb.ModelShape(
        architecture=mc.architecture,
        num_layers=mc.num_layers,
        hidden_size=mc.hidden_size,
        num_attention_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
        vocab_size=mc.vocab_size,
        max_model_len=max_model_len,
        sliding_window=mc.sliding_window or 0,
        dtype=dtype,
        use_mla=mla is not None,
        kv_lora_rank=mla.kv_lora_rank if mla else 0,
        qk_rope_head_dim=mla.qk_rope_head_dim if mla else 0,
    )


def parallel_to_proto(tp: int, dcp: int = 1, interleave: int = 1) -> pb.ParallelConfig:
    return pb.ParallelConfig(
        tensor_parallel_size=tp,
        pipeline_parallel_size=1,
        decode_context_parallel_size=dcp,
        dcp_kv_cache_interleave_size=interleave,
        data_parallel_size=1,
    )
