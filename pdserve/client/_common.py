"""Pieces shared by the sync and asyncio clients."""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Iterable, Sequence, cast

from pdserve.client.types import Message, Prompt, build_generate_request, sampling_params
from pdserve.security import TLSConfig, grpc_options
from pdserve_api.v1 import common_pb2, router_pb2

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_CHANNEL_OPTIONS: list[tuple[str, Any]] = grpc_options(
    extra=[
        # The SDK does its own retries (with backoff, on UNAVAILABLE only, never after tokens): no hidden ones.
        ("grpc.enable_retries", 0),
    ]
)


SUSPECT_S = 2.0  # a router that just failed is tried last for this long


def router_addresses(address: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` or a list -> the routers' addresses (order kept, duplicates dropped)."""
    items = address.split(",") if isinstance(address, str) else list(address)
    out = [a.strip() for a in items if a.strip()]
    if not out:
        raise ValueError("no router address given")
    return list(dict.fromkeys(out))


class RouterSet:
    """Which router a call goes to: round robin over the routers (spreads the load), a router that just failed
    last; each retry of a call moves to the next router, so a dead router costs a call one retry, not the call."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._next = itertools.count()
        self._suspect_until = [0.0] * n
        self._lock = threading.Lock()

    def order(self) -> list[int]:
        """The routers to try for one call, in order."""
        with self._lock:
            start = next(self._next) % self.n
        ring = [(start + k) % self.n for k in range(self.n)]
        now = time.monotonic()
        return sorted(ring, key=lambda i: self._suspect_until[i] > now)  # stable: round robin among the healthy

    def failed(self, i: int) -> None:
        self._suspect_until[i] = time.monotonic() + SUSPECT_S

    def ok(self, i: int) -> None:
        self._suspect_until[i] = 0.0


def client_security(
    *,
    api_key: str | None,
    tls: TLSConfig | None,
    root_ca: str | None,
    client_cert: str | None,
    client_key: str | None,
    server_name: str | None,
    metadata: Sequence[tuple[str, str]] | None,
) -> tuple[tuple[tuple[str, str], ...], TLSConfig | None]:
    """(metadata with the API key added, TLS config) from the client's keyword arguments."""
    md = tuple(metadata or ())
    if api_key:
        md = (*md, ("authorization", f"Bearer {api_key}"))
    if tls is None and (root_ca or client_cert or client_key or server_name):
        tls = TLSConfig(cert_file=client_cert, key_file=client_key, ca_file=root_ca, server_name=server_name)
    return md, tls


def secure_options(tls: TLSConfig | None, options: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    return options + (tls.channel_options() if tls is not None else [])


class _Default:
    def __repr__(self) -> str:
        return "DEFAULT"


DEFAULT: Any = _Default()  # "use the client's default" for timeout=


def make_request(
    *,
    prompt: Prompt | None,
    messages: Iterable[Message] | None,
    add_generation_prompt: bool | None,
    model: str | None,
    default_model: str,
    request_id: str | None,
    return_prompt_token_ids: bool,
    sampling: dict[str, Any],
    tools: Any = None,
) -> router_pb2.GenerateRequest:
    return build_generate_request(
        prompt=prompt,
        messages=list(messages) if messages is not None else None,
        add_generation_prompt=add_generation_prompt,
        model=model if model is not None else default_model,
        request_id=request_id,
        return_prompt_token_ids=return_prompt_token_ids,
        params=sampling_params(**sampling),
        tools=tools,
    )


def role_value(role: str | int | None) -> common_pb2.Role:
    if role is None or role == "":
        return common_pb2.ROLE_UNSPECIFIED
    if isinstance(role, int):
        return cast("common_pb2.Role", role)  # a Role number, passed through as given
    name = role.upper()
    if not name.startswith("ROLE_"):
        name = "ROLE_" + name
    return common_pb2.Role.Value(name)


def validate_request(
    *,
    model_path: str | None = None,
    num_attention_heads: int | None = None,
    num_kv_heads: int | None = None,
    tensor_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    dcp_kv_cache_interleave_size: int = 1,
    block_size: int = 0,
    role: str | int | None = None,
    **shape: Any,
) -> router_pb2.ValidateConfigRequest:
    req = router_pb2.ValidateConfigRequest(
        parallel=common_pb2.ParallelConfig(
            tensor_parallel_size=tensor_parallel_size,
            decode_context_parallel_size=decode_context_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            dcp_kv_cache_interleave_size=dcp_kv_cache_interleave_size,
        ),
        block_size=block_size,
        role=role_value(role),
    )
    if model_path is not None:
        req.model_path = str(model_path)
    else:
        if num_attention_heads is None:
            raise TypeError("give model_path or num_attention_heads")
        req.shape.CopyFrom(
            common_pb2.ModelShape(
                num_attention_heads=num_attention_heads, num_kv_heads=num_kv_heads or num_attention_heads, **shape
            )
        )
    return req
