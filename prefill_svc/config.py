"""PrefillConfig: everything a prefill pod is started with, validated when constructed."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.engine.llm_engine import EngineConfig

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

KV_TRANSPORTS = ("auto", "nixl", "tcp", "none")


class PrefillConfigError(ValueError):
    """A setting this pod cannot start with; the message says which and what to change."""


def _host_port(addr: str, what: str) -> None:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PrefillConfigError(f"{what} must be host:port, got {addr!r}")


@dataclass
class PrefillConfig:
    # --- model and engine ---
    model: str | None = None  # HF checkpoint directory; None: the default SmolLM2 model
    served_model_name: str | None = None  # name clients use; default: the checkpoint directory's name
    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int = 2048  # per rank
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    prefill_chunk_size: int = 1024
    enable_prefix_caching: bool = True
    device: str = "cpu"
    attention_backend: str | None = None
    exact_prefill: bool = False  # EngineConfig.exact_prefill: transformers-exact logits, slower CPU prefill
    cpu_collectives: str = "auto"  # EngineConfig.cpu_collectives
    cpu_pinning: str = "auto"  # EngineConfig.cpu_pinning
    # --- serving ---
    host: str = "127.0.0.1"  # where the gRPC server listens
    port: int = 0  # 0: pick a free port
    advertise_host: str | None = None  # host the router and decode pods use to reach us; default: host
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: not served, 0: any free port
    pod_id: str | None = None  # default: prefill-<hostname>-<pid>
    # --- KV hand-off ---
    kv_transport: str = "auto"  # auto | nixl | tcp | none (hold KV for ReleaseKV / TTL only: tests, benchmarks)
    kv_host: str | None = None  # where each rank's KV control endpoint listens; default: advertise host
    lease_ttl_s: float = 30.0  # KV held this long without decode contact is freed
    max_leases: int = 1024  # KV leases held at once; beyond that Prefill answers RESOURCE_EXHAUSTED
    # --- router ---
    router_address: str | None = None  # host:port of the router's Registry service; None: standalone
    cluster_token: str = ""
    heartbeat_interval_s: float = 2.0  # until the router says otherwise
    # --- security (pdserve.security): None = plaintext ---
    tls_cert_file: str | None = None  # serve TLS with this certificate; also our client certificate under mTLS
    tls_key_file: str | None = None
    tls_ca_file: str | None = None  # CA of the router's / peers' certificates (and of clients' under mTLS)
    tls_require_client_cert: bool = False  # mutual TLS
    tls_server_name: str | None = None  # name expected in the router's certificate; None = the host dialed
    # --- shutdown ---
    drain_timeout_s: float = 60.0  # SIGTERM: longest wait for held work (prefills and leases) to finish

    def __post_init__(self) -> None:
        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PrefillConfigError(f"{name} must be a positive integer, got {v!r}")

        for name in ("tensor_parallel_size", "block_size", "num_kv_blocks", "max_num_seqs", "max_num_batched_tokens",
                     "prefill_chunk_size", "max_leases"):
            positive_int(name)
        if self.max_model_len is not None:
            positive_int("max_model_len")
        if self.prefill_chunk_size > self.max_num_batched_tokens:
            raise PrefillConfigError(
                f"prefill_chunk_size ({self.prefill_chunk_size}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): raise max_num_batched_tokens or lower the chunk size")
        for name in ("port",) + (("metrics_port",) if self.metrics_port is not None else ()):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 65536:
                raise PrefillConfigError(f"{name} must be a port number in [0, 65535], got {v!r}")
        for name in ("lease_ttl_s", "heartbeat_interval_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise PrefillConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        if self.kv_transport not in KV_TRANSPORTS:
            raise PrefillConfigError(f"kv_transport must be one of {', '.join(KV_TRANSPORTS)}, got "
                                     f"{self.kv_transport!r}")
        if self.router_address is not None:
            _host_port(self.router_address, "router_address")
        if self.model is not None and not os.path.isdir(self.model):
            raise PrefillConfigError(f"model {self.model!r} is not a directory (expected an HF checkpoint)")
        if not self.host:
            raise PrefillConfigError("host must not be empty")
        try:
            self.tls
        except ValueError as e:  # pdserve.security.TLSConfigError names the flag to fix
            raise PrefillConfigError(str(e)) from None

    @property
    def tls(self) -> "TLSConfig | None":
        """TLS settings (checked when the config is built), or None for plaintext."""
        from pdserve.security import TLSConfig

        tls = TLSConfig(cert_file=self.tls_cert_file, key_file=self.tls_key_file, ca_file=self.tls_ca_file,
                        require_client_cert=self.tls_require_client_cert, server_name=self.tls_server_name)
        return tls if tls.enabled or tls.require_client_cert else None

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", "[::]"):
            return socket.gethostname()
        return self.host

    def resolved_pod_id(self) -> str:
        return self.pod_id or f"prefill-{socket.gethostname()}-{os.getpid()}"

    def engine_config(self) -> EngineConfig:
        # Prefill pods never use DCP (that is a decode-side layout); TP only.
        return EngineConfig(model=self.model, max_model_len=self.max_model_len, block_size=self.block_size,
                            num_kv_blocks=self.num_kv_blocks, max_num_seqs=self.max_num_seqs,
                            max_num_batched_tokens=self.max_num_batched_tokens,
                            prefill_chunk_size=self.prefill_chunk_size,
                            enable_prefix_caching=self.enable_prefix_caching,
                            tensor_parallel_size=self.tensor_parallel_size, device=self.device,
                            attention_backend=self.attention_backend, exact_prefill=self.exact_prefill,
                            cpu_collectives=self.cpu_collectives, cpu_pinning=self.cpu_pinning)
