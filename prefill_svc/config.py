"""PrefillConfig: everything a prefill pod is started with, validated when constructed.

Composed of the engine's config (``engine``), the serving part every pod shares (``serving``) and the KV hand-off
settings of a prefill pod; ``pdserve.cli_config`` makes every field a flag of ``python -m prefill_svc``."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.config import EngineConfig
from pdserve.pod.config import PodConfigError, PodServing

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

KV_TRANSPORTS = ("auto", "nixl", "tcp", "none")


class PrefillConfigError(PodConfigError):
    """A setting this pod cannot start with; the message says which and what to change."""


@dataclass
class PrefillConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    serving: PodServing = field(default_factory=PodServing)
    # --- KV hand-off ---
    kv_transport: str = field(
        default="auto",
        metadata={
            "choices": KV_TRANSPORTS,
            "help": "KV data path; none: hold KV for ReleaseKV / TTL only (tests, benchmarks)",
        },
    )
    kv_host: str | None = field(
        default=None, metadata={"help": "listen host of the per-rank KV endpoints (default: the advertise host)"}
    )
    lease_ttl_s: float = field(default=30.0, metadata={"help": "KV held this long without decode contact is freed"})
    kv_checksum: bool = field(
        default=False,
        metadata={
            "help": "send a checksum of each KV block with the hand-off; decode pods check what they read against it "
            "(costs a pass over the prompt's KV on both sides: docs/performance.md)"
        },
    )
    ucx_transports: str | None = field(
        default=None,
        metadata={
            "help": "UCX transports of the NIXL data path (UCX_TLS), e.g. tcp between nodes without RDMA, "
            "rc,cuda_copy,cuda_ipc on InfiniBand; unset: UCX picks from what the host has"
        },
    )
    max_leases: int = field(
        default=1024, metadata={"help": "KV leases held at once; beyond that Prefill answers RESOURCE_EXHAUSTED"}
    )

    def __post_init__(self) -> None:
        e = self.engine
        for name in (
            "tensor_parallel_size",
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
            "prefill_chunk_size",
        ):
            v = getattr(e, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PrefillConfigError(f"{name} must be a positive integer, got {v!r}")
        if e.decode_context_parallel_size != 1:  # a decode-side layout
            raise PrefillConfigError(
                f"decode_context_parallel_size must be 1 on a prefill pod, got {e.decode_context_parallel_size!r}"
            )
        if not isinstance(self.max_leases, int) or isinstance(self.max_leases, bool) or self.max_leases < 1:
            raise PrefillConfigError(f"max_leases must be a positive integer, got {self.max_leases!r}")
        v = self.lease_ttl_s
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
            raise PrefillConfigError(f"lease_ttl_s must be a positive number of seconds, got {v!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise PrefillConfigError(
                f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got {self.kv_transport!r}"
            )
        if (
            e.model is not None
            and not os.path.isdir(e.model)
            and not (e.model.endswith(".gguf") and os.path.isfile(e.model))
        ):
            raise PrefillConfigError(
                f"model {e.model!r} is not a directory (expected an HF checkpoint) nor a GGUF file"
            )

    @property
    def tls(self) -> "TLSConfig | None":
        return self.serving.tls

    @property
    def public_host(self) -> str:
        s = self.serving
        if s.advertise_host:
            return s.advertise_host
        if s.host in ("0.0.0.0", "::", "[::]"):
            return socket.gethostname()
        return s.host

    def resolved_pod_id(self) -> str:
        return self.serving.pod_id or f"prefill-{socket.gethostname()}-{os.getpid()}"
