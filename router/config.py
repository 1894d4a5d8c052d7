"""RouterConfig: every knob of the router in one dataclass, validated when it is built.

A bad value raises ``ValueError`` naming the field, the value and what would be accepted, so ``python -m router``
fails at startup instead of misbehaving under load.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.pod.config import CLUSTER_TOKEN_ENV
from pdserve.security import API_KEY_ENV, ENV, HTTP_ENV, tls_field
from router.local_prefill import max_tokens_problem, parse_max_tokens

if TYPE_CHECKING:
    from pdserve.security import TLSConfig


@dataclass(frozen=True)
class RouterConfig:
    # --- network ---
    host: str = "127.0.0.1"
    port: int = 50051  # Router + Registry + grpc.health.v1 on one port; 0 picks a free one
    # Prometheus /metrics over HTTP; None = not served (metrics still exposed via registry), 0 = any free port
    metrics_port: int | None = field(
        default=None,
        metadata={"help": "serve Prometheus /metrics over HTTP on this port (0: any free port; unset: not served)"},
    )

    # --- model (the router tokenizes and detokenizes) ---
    model: str | None = None  # model directory with tokenizer.json; None = the default SmolLM2 checkpoint
    served_model_name: str | None = None  # name clients / workers use; None = the model directory's name

    # --- registry ---
    cluster_token: str = field(
        default="",
        metadata={  # shared secret workers present; "" = no check
            "env": CLUSTER_TOKEN_ENV,
            "secret": True,
            "help": "shared secret pods present to the Registry",
        },
    )

    # --- security (pdserve.security) ---
    # clients of the Router service must send it (authorization: Bearer / x-api-key); "" = open
    api_key: str = field(
        default="",
        metadata={"env": API_KEY_ENV, "secret": True, "help": "API key clients of the Router service must send"},
    )
    tls_cert_file: str = tls_field("cert_file", "")  # "" = plaintext
    tls_key_file: str = tls_field("key_file", "")
    tls_ca_file: str = tls_field("ca_file", "")
    tls_require_client_cert: bool = tls_field("require_client_cert", False)
    tls_server_name: str = tls_field("server_name", "")  # "" = the host dialed
    heartbeat_interval_s: float = 1.0  # told to workers at registration
    missed_heartbeats_unhealthy: int = 3  # a pod silent this many intervals gets no new traffic
    eviction_timeout_s: float = 10.0  # ... and is dropped from the registry after this long

    # --- placement ---
    prefix_block_size: int = 16  # tokens per block of the router's prefix-affinity index
    prefix_index_capacity: int = 200_000  # block hashes remembered (LRU)
    affinity_max_imbalance_tokens: int = 4096  # affinity loses when its pod has this many more queued tokens
    # A prompt this index has not seen goes to the rendezvous-hash pod of its first blocks (at most this many),
    # so every router replica sends a prefix to the same prefill pod without talking; 0: least loaded instead
    affinity_hash_blocks: int = 4
    reserve_output_tokens: int = 16  # decode KV reserved per request beyond the prompt (AllocateKV)
    # Conditional disaggregation (NVIDIA Dynamo's rule): prefill on the decode pod itself (chunked between its decode
    # steps, no KV transfer) when the prompt is this short (auto: per decode pod, from its step times), or when the
    # prefill pods are this busy; 0: never.
    local_prefill_max_tokens: int | str = field(
        default=0,
        metadata={
            "parse": parse_max_tokens,
            "metavar": "N|auto",
            "help": "prefill a request on its decode pod (chunked, no KV transfer) when its prompt has at most this "
            "many tokens (decode pods keep no prefix cache: the whole prompt is computed); auto: each decode pod's "
            "own threshold, derived from the step times it measured at start and logged (router/local_prefill.py); "
            "0: always on a prefill pod",
        },
    )
    kv_load_failure_policy: str = field(
        default="fail",
        metadata={
            "choices": ("fail", "recompute"),
            "help": "when a decode pod cannot load a request's prompt KV (its prefill pod died, the lease expired, "
            "the bytes failed their checksums): fail the request with that status, or compute the prompt again on "
            "a prefill pod (once) and decode on, with no token lost or repeated (vLLM's kv_load_failure_policy)",
        },
    )
    local_prefill_queue_tokens: int = field(
        default=0,
        metadata={
            "help": "with local_prefill_max_tokens > 0 or auto, also prefill on the decode pod when every prefill pod "
            "has at least this many prompt tokens queued; 0: the prefill queue is not considered"
        },
    )

    # --- admission queue ---
    max_queue_len: int = 256  # requests waiting for decode KV; beyond it: RESOURCE_EXHAUSTED
    max_queue_wait_s: float = 30.0  # a request waiting longer: RESOURCE_EXHAUSTED
    max_inflight_requests: int = 4096  # dispatched and unfinished; beyond it requests queue

    # --- per-call limits towards pods ---
    pod_rpc_timeout_s: float = 60.0  # AllocateKV / Prefill / cancel calls, when the client set no deadline
    cleanup_timeout_s: float = 5.0  # CancelPrefill / CancelDecode / ReleaseKV during cleanup
    lease_ttl_s: float = 0.0  # asked of prefill for KV leases; 0 = the pod's default

    # --- lifecycle ---
    drain_timeout_s: float = 30.0  # on SIGTERM: finish in-flight requests for at most this long
    # auto = uvloop when importable, else asyncio's loop; uvloop cuts the loop's own cost per gRPC call
    event_loop: str = field(default="auto", metadata={"choices": ("auto", "uvloop", "asyncio")})
    # batch = gRPC's helper threads under SCHED_BATCH (Linux), so they stop preempting the loop (pdserve/sched.py)
    helper_threads: str = field(default="batch", metadata={"choices": ("batch", "normal")})

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> None:
            raise ValueError(f"RouterConfig.{name} {want}, got {getattr(self, name)!r}")

        for name in ("port",) + (("metrics_port",) if self.metrics_port is not None else ()):
            v = getattr(self, name)
            if not _is_int(v) or not 0 <= v <= 65535:
                bad(name, "must be a port number in [0, 65535] (0 = pick a free one / off)")
        if not isinstance(self.host, str) or not self.host:
            bad("host", "must be a non-empty host name or address")
        for name in (
            "heartbeat_interval_s",
            "eviction_timeout_s",
            "max_queue_wait_s",
            "pod_rpc_timeout_s",
            "cleanup_timeout_s",
            "drain_timeout_s",
        ):
            v = getattr(self, name)
            if not _is_num(v) or v <= 0:
                bad(name, "must be a positive number of seconds")
        if not _is_num(self.lease_ttl_s) or self.lease_ttl_s < 0:
            bad("lease_ttl_s", "must be >= 0 seconds (0 = the prefill pod's default)")
        for name in (
            "missed_heartbeats_unhealthy",
            "prefix_block_size",
            "prefix_index_capacity",
            "max_inflight_requests",
        ):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                bad(name, "must be a positive integer")
        for name in (
            "affinity_max_imbalance_tokens",
            "affinity_hash_blocks",
            "reserve_output_tokens",
            "max_queue_len",
            "local_prefill_queue_tokens",
        ):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                bad(name, "must be an integer >= 0")
        problem = max_tokens_problem(self.local_prefill_max_tokens)
        if problem:
            bad("local_prefill_max_tokens", problem)
        if self.eviction_timeout_s <= self.heartbeat_interval_s * self.missed_heartbeats_unhealthy:
            bad(
                "eviction_timeout_s",
                f"must exceed heartbeat_interval_s * missed_heartbeats_unhealthy "
                f"({self.heartbeat_interval_s} * {self.missed_heartbeats_unhealthy}) so a pod is marked unhealthy "
                "before it is dropped",
            )
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            bad("model", "must be a model directory path or None (the default model)")
        if self.model is not None and not (Path(self.model) / "tokenizer.json").is_file():
            if not (self.model.endswith(".gguf") and Path(self.model).is_file()):
                bad("model", "must be a model directory containing tokenizer.json, or a GGUF file")
        if self.served_model_name is not None and (
            not isinstance(self.served_model_name, str) or not self.served_model_name
        ):
            bad("served_model_name", "must be a non-empty string or None")
        for name in ("cluster_token", "api_key", "tls_cert_file", "tls_key_file", "tls_ca_file", "tls_server_name"):
            if not isinstance(getattr(self, name), str):
                bad(name, "must be a string")
        _ = self.tls  # builds (and so checks) the TLS config: a bad file fails here, naming its flag
        if self.event_loop not in ("auto", "uvloop", "asyncio"):
            bad("event_loop", "must be auto (uvloop when installed), uvloop or asyncio")
        if self.helper_threads not in ("batch", "normal"):
            bad("helper_threads", "must be batch (gRPC's helper threads under SCHED_BATCH) or normal")
        if self.event_loop == "uvloop" and not _uvloop_installed():
            bad("event_loop", "is uvloop but uvloop is not installed: pip install uvloop, or use auto / asyncio")

    @property
    def tls(self) -> "TLSConfig | None":
        """The TLS settings, or None for plaintext."""
        from pdserve.security import TLSConfig

        tls = TLSConfig(
            cert_file=self.tls_cert_file or None,
            key_file=self.tls_key_file or None,
            ca_file=self.tls_ca_file or None,
            require_client_cert=self.tls_require_client_cert,
            server_name=self.tls_server_name or None,
        )
        return tls if tls.enabled or tls.require_client_cert else None

    @property
    def local_prefill(self) -> bool:
        """Conditional disaggregation is on (a fixed threshold > 0, or auto)."""
        return self.local_prefill_max_tokens != 0

    @property
    def uses_uvloop(self) -> bool:
        return self.event_loop == "uvloop" or (self.event_loop == "auto" and _uvloop_installed())

    @property
    def unhealthy_after_s(self) -> float:
        return self.heartbeat_interval_s * self.missed_heartbeats_unhealthy

    def model_name_for(self, model_path: str | os.PathLike[str]) -> str:
        """The name the cluster serves: served_model_name, else the model directory's base name."""
        return self.served_model_name or Path(model_path).name


def _uvloop_installed() -> bool:
    return importlib.util.find_spec("uvloop") is not None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _client_tls(part: str, help: str) -> Any:
    return field(
        default=None, metadata={"help": help, "env": ENV[part], "metavar": "NAME" if part == "server_name" else "PEM"}
    )


def _http_tls(part: str, help: str, default: Any = None) -> Any:
    meta: dict[str, Any] = {"help": help, "env": HTTP_ENV[part]}
    if part != "require_client_cert":
        meta["metavar"] = "PEM"
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class OpenAIHttpConfig:
    """``python -m router.openai_http``: the OpenAI-compatible HTTP front, a client of one router or several."""

    router: str = field(
        default="127.0.0.1:50051",
        metadata={
            "help": "router gRPC address; several (comma-separated): requests go round them, and one that failed "
            "before its first token is retried on the next",
            "metavar": "HOST:PORT[,HOST:PORT...]",
        },
    )
    host: str = field(default="127.0.0.1", metadata={"help": "listen address of the HTTP server"})
    port: int = field(default=8000, metadata={"help": "HTTP port (0: pick a free one)"})
    api_key: str | None = field(
        default=None,
        metadata={
            "env": API_KEY_ENV,
            "secret": True,
            "help": "require 'Authorization: Bearer KEY'; also sent to the router",
        },
    )
    # how to reach a router that serves TLS / mutual TLS (the client side of --tls-*)
    tls_ca_file: str | None = _client_tls("ca_file", "CA certificate to trust: connect to the router with TLS")
    tls_cert_file: str | None = _client_tls("cert_file", "client certificate, for a router that requires mutual TLS")
    tls_key_file: str | None = _client_tls("key_file", "private key of the client certificate")
    tls_server_name: str | None = _client_tls(
        "server_name", "name expected in the router's certificate (default: the host dialed)"
    )
    # this server's own certificate: serve HTTPS
    http_tls_cert_file: str | None = _http_tls("cert_file", "serve HTTPS with this certificate (default: plain HTTP)")
    http_tls_key_file: str | None = _http_tls("key_file", "private key of --http-tls-cert-file")
    http_tls_ca_file: str | None = _http_tls(
        "ca_file", "CA that signs client certificates, for --http-tls-require-client-cert"
    )
    http_tls_require_client_cert: bool = _http_tls(
        "require_client_cert",
        "mutual TLS: refuse HTTPS clients without a certificate signed by --http-tls-ca-file",
        False,
    )
    tool_call_parser: str = field(
        default="hermes",
        metadata={
            "help": "how the model writes tool calls (vLLM's --tool-call-parser): "
            "hermes = <tool_call>{json}</tool_call> (Hermes, Qwen2.5, SmolLM / ChatML models)"
        },
    )

    def __post_init__(self) -> None:
        if not _is_int(self.port) or not 0 <= self.port <= 65535:
            raise ValueError(f"OpenAIHttpConfig.port must be a port number in [0, 65535], got {self.port!r}")
        from router.tool_parsers import tool_parser

        tool_parser(self.tool_call_parser)  # an unknown name fails now, listing the known ones
        _ = self.http_tls  # every certificate file is read now: a bad one fails here, naming its flag
        _ = self.router_tls

    @property
    def router_tls(self) -> "TLSConfig | None":
        """How this front dials the router (None: plaintext)."""
        from pdserve.security import TLSConfig

        tls = TLSConfig(
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            ca_file=self.tls_ca_file,
            server_name=self.tls_server_name,
        )
        return tls if tls.enabled else None

    @property
    def http_tls(self) -> "TLSConfig | None":
        """The checked certificate this front serves HTTPS with (None: plain HTTP); errors name --http-tls-*."""
        from pdserve.security import http_server_tls

        return http_server_tls(
            self.http_tls_cert_file, self.http_tls_key_file, self.http_tls_ca_file, self.http_tls_require_client_cert
        )
