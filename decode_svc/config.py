"""DecodeConfig: everything a decode pod is started with, validated when it is built.

The parallel part is checked by pdserve.parallel_config (the module the router uses too), so a pod refuses exactly
the configs the router refuses, with the same message."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from pdserve.engine.llm_engine import EngineConfig
from pdserve.parallel_config import ModelParallelInfo, ParallelConfig, validate_parallel_config

if TYPE_CHECKING:
    from pdserve.security import TLSConfig


class DecodeConfigError(ValueError):
    """A setting that is not a parallel-config rule (those raise ParallelConfigError) is out of range."""


@dataclass
class DecodeConfig:
    model: str | None = None  # HF checkpoint directory; None = the default SmolLM2 model
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1
    block_size: int = 16
    num_kv_blocks: int = 2048  # per rank
    max_num_seqs: int = 256  # running + KV-awaiting sequences
    max_model_len: int | None = None
    max_num_batched_tokens: int = 4096  # only used to recompute preempted sequences
    device: str = "cpu"
    attention_backend: str | None = None
    exact_prefill: bool = False  # EngineConfig.exact_prefill (this pod recomputes preempted sequences' prompts)
    cpu_collectives: str = "auto"  # EngineConfig.cpu_collectives
    cpu_pinning: str = "auto"  # EngineConfig.cpu_pinning
    host: str = "127.0.0.1"
    port: int = 50061
    metrics_port: int = 0  # Prometheus HTTP endpoint; 0: no endpoint
    reservation_ttl_s: float = 30.0  # AllocateKV reservations without a Decode call are freed after this
    admission_timeout_s: float = 60.0  # a Decode without reservation waits this long for free blocks
    drain_timeout_s: float = 120.0  # SIGTERM: how long in-flight streams may take before the pod stops anyway
    allow_file_kv: bool = False  # accept kv_handle.kv_transfer_address "file://..." (tests, offline use)
    kv_transfer_backend: str = "auto"  # kv_transfer data path: "auto" (NIXL if usable, else TCP), "nixl", "tcp"
    kv_transfer_timeout_s: float = 120.0  # one request's KV pull, every layer included
    pod_id: str = "decode-0"
    served_model_name: str | None = None  # name the router serves; default: the checkpoint directory's name
    advertise_host: str | None = None  # host the router reaches this pod at; default: host
    router_address: str | None = None  # host:port of the router's Registry; None: standalone
    cluster_token: str = ""
    heartbeat_interval_s: float = 2.0  # until the router says otherwise
    # --- security (pdserve.security): None = plaintext ---
    tls_cert_file: str | None = None  # serve TLS with this certificate; also our client certificate under mTLS
    tls_key_file: str | None = None
    tls_ca_file: str | None = None  # CA of the router's / peers' certificates (and of clients' under mTLS)
    tls_require_client_cert: bool = False  # mutual TLS
    tls_server_name: str | None = None  # name expected in the router's certificate; None = the host dialed

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise DecodeConfigError(msg)

        for name in ("tensor_parallel_size", "decode_context_parallel_size", "dcp_kv_cache_interleave_size",
                     "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(f"{name} must be an integer, got {v!r}")
        for name in ("num_kv_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                bad(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            bad(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        for name in ("port", "metrics_port"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 65536:
                bad(f"{name} must be in [0, 65535], got {v!r}")
        if self.kv_transfer_backend not in ("auto", "nixl", "tcp"):
            bad(f"kv_transfer_backend must be 'auto', 'nixl' or 'tcp', got {self.kv_transfer_backend!r}")
        if self.router_address is not None:
            host, _, port = self.router_address.rpartition(":")
            if not host or not port.isdigit():
                bad(f"router_address must be host:port, got {self.router_address!r}")
        for name in ("reservation_ttl_s", "admission_timeout_s", "drain_timeout_s", "kv_transfer_timeout_s",
                     "heartbeat_interval_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                bad(f"{name} must be a positive number of seconds, got {v!r}")
        try:
            self.tls
        except ValueError as e:  # pdserve.security.TLSConfigError names the flag to fix
            bad(str(e))
        if self.model is None:
            from pdserve.default_model import ensure_default_model

            self.model = str(ensure_default_model())
        self.model = os.fspath(self.model)
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            bad(f"model {self.model!r} is not a checkpoint directory (no config.json)")
        # Sizes <= 0 are reported by the parallel rules themselves, in vLLM's words.
        validate_parallel_config(ModelParallelInfo.from_model_path(self.model), self.parallel)

    @property
    def tls(self) -> "TLSConfig | None":
        """TLS settings (checked when the config is built), or None for plaintext."""
        from pdserve.security import TLSConfig

        tls = TLSConfig(cert_file=self.tls_cert_file, key_file=self.tls_key_file, ca_file=self.tls_ca_file,
                        require_client_cert=self.tls_require_client_cert, server_name=self.tls_server_name)
        return tls if tls.enabled or tls.require_client_cert else None

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                              decode_context_parallel_size=self.decode_context_parallel_size,
                              dcp_kv_cache_interleave_size=self.dcp_kv_cache_interleave_size,
                              block_size=self.block_size)

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, max_model_len=self.max_model_len, block_size=self.block_size,
            num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            prefill_chunk_size=min(1024, self.max_num_batched_tokens),
            enable_prefix_caching=False,  # KV arrives from prefill pods; only preempted sequences are recomputed
            tensor_parallel_size=self.tensor_parallel_size,
            decode_context_parallel_size=self.decode_context_parallel_size,
            dcp_kv_cache_interleave_size=self.dcp_kv_cache_interleave_size,
            device=self.device, attention_backend=self.attention_backend, exact_prefill=self.exact_prefill,
            cpu_collectives=self.cpu_collectives, cpu_pinning=self.cpu_pinning)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
