"""DecodeConfig: everything a decode pod is started with, validated when it is built.

Composed of the engine's config (``engine``), the serving part every pod shares (``serving``) and the decode pod's
own admission and KV-pull settings; ``pdserve.cli_config`` makes every field a flag of ``python -m decode_svc``.
The parallel part is checked by pdserve.parallel_config (the module the router uses too), so a pod refuses exactly
the configs the router refuses, with the same message."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.engine.config import EngineConfig
from pdserve.parallel_config import ModelParallelInfo, ParallelConfig, validate_parallel_config
from pdserve.pod.config import PodConfigError, PodServing

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

KV_TRANSFER_BACKENDS = ("auto", "nixl", "tcp")
KV_LOAD_MODES = ("async", "sync")


class DecodeConfigError(PodConfigError):
    """A setting that is not a parallel-config rule (those raise ParallelConfigError) is out of range."""


def _engine() -> EngineConfig:
    # KV arrives from prefill pods, so no prefix cache (only preempted sequences are recomputed); more sequences
    # fit than on a prefill pod since none of them computes its prompt here.
    return EngineConfig(max_num_seqs=256, enable_prefix_caching=False)


def _serving() -> PodServing:
    return PodServing(port=50061, pod_id="decode-0", drain_timeout_s=120.0)


@dataclass
class DecodeConfig:
    engine: EngineConfig = field(default_factory=_engine)
    serving: PodServing = field(default_factory=_serving)
    reservation_ttl_s: float = field(
        default=30.0, metadata={"help": "AllocateKV reservations without a Decode call are freed after this"}
    )
    admission_timeout_s: float = field(
        default=60.0, metadata={"help": "a Decode without reservation waits this long for free blocks"}
    )
    kv_transfer_backend: str = field(
        default="auto",
        metadata={
            "choices": KV_TRANSFER_BACKENDS,
            "help": "KV data path for pulls from prefill pods (auto: NIXL when usable, else TCP)",
        },
    )
    kv_transfer_timeout_s: float = field(default=120.0, metadata={"help": "one request's KV pull, every layer"})
    kv_load: str = field(
        default="async",
        metadata={
            "choices": KV_LOAD_MODES,
            "help": "async: ranks receive a request's KV on transfer threads while the running batch keeps "
            "decoding, and the request joins once every rank has its share; sync: the engine thread waits for "
            "each transfer (every running stream stalls meanwhile; kept for comparison)",
        },
    )
    ucx_transports: str | None = field(
        default=None,
        metadata={
            "help": "UCX transports of the NIXL data path (UCX_TLS), e.g. tcp between nodes without RDMA, "
            "rc,cuda_copy,cuda_ipc on InfiniBand; unset: UCX picks from what the host has"
        },
    )
    unified: bool = field(
        default=False,
        metadata={
            "help": "colocated pod: register as ROLE_UNIFIED and compute the prompts of requests sent without a KV "
            "handle itself (chunked prefill between decode steps), besides decoding KV from prefill pods"
        },
    )

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise DecodeConfigError(msg)

        e = self.engine
        for name in (
            "tensor_parallel_size",
            "decode_context_parallel_size",
            "dcp_kv_cache_interleave_size",
            "block_size",
            "num_kv_blocks",
            "max_num_seqs",
            "max_num_batched_tokens",
        ):
            v = getattr(e, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(f"{name} must be an integer, got {v!r}")
        if e.max_model_len is not None and (not isinstance(e.max_model_len, int) or e.max_model_len < 2):
            bad(f"max_model_len must be an integer >= 2, got {e.max_model_len!r}")
        if self.kv_transfer_backend not in KV_TRANSFER_BACKENDS:
            bad(f"kv_transfer_backend must be 'auto', 'nixl' or 'tcp', got {self.kv_transfer_backend!r}")
        if self.kv_load not in KV_LOAD_MODES:
            bad(f"kv_load must be 'async' or 'sync', got {self.kv_load!r}")
        for name in ("reservation_ttl_s", "admission_timeout_s", "kv_transfer_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(f"{name} must be a positive number of seconds, got {v!r}")
        if e.model is None:
            from pdserve.default_model import ensure_default_model

            e.model = str(ensure_default_model())
        e.model = os.fspath(e.model)
        if not os.path.isfile(os.path.join(e.model, "config.json")) and not (
            e.model.endswith(".gguf") and os.path.isfile(e.model)
        ):
            bad(f"model {e.model!r} is not a checkpoint directory (no config.json) nor a GGUF file")
        # Sizes <= 0 are reported by the parallel rules themselves, in vLLM's words.
        validate_parallel_config(ModelParallelInfo.from_model_path(e.model), self.parallel)

    @property
    def tls(self) -> "TLSConfig | None":
        return self.serving.tls

    @property
    def parallel(self) -> ParallelConfig:
        return self.engine.parallel
