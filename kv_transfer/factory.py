"""Pick the data path: NIXL when it imports and can start a UCX agent, else the TCP fallback."""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.transport import KVPublisher, KVPuller

log = logging.getLogger(__name__)

BACKENDS = ("auto", "nixl", "tcp")


@functools.lru_cache(maxsize=1)
def nixl_available() -> tuple[bool, str]:
    """(usable, why). Cached: the probe creates (and drops) one agent."""
    try:
        from kv_transfer.nixl_transport import import_nixl

        nixl = import_nixl()
        agent = nixl.nixl_agent("pdkv-probe", nixl.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        if "UCX" not in agent.backends:
            return False, "NIXL has no UCX backend"
        del agent
        return True, "nixl with UCX"
    except Exception as e:  # ImportError, missing plugin, UCX failing to start
        return False, f"{type(e).__name__}: {e}"


def _choose(backend: str, side: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"kv transfer backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "tcp":
        log.info("kv_transfer %s: TCP fallback data path (requested)", side)
        return "tcp"
    ok, why = nixl_available()
    if ok:
        log.info("kv_transfer %s: NIXL data path (%s)", side, why)
        return "nixl"
    if backend == "nixl":
        raise RuntimeError(f"NIXL requested but not usable: {why}")
    log.warning("kv_transfer %s: NIXL not usable (%s); using the TCP fallback data path", side, why)
    return "tcp"


def make_publisher(
    layout: KVLayout,
    regions: Mapping[int, torch.Tensor],
    *,
    backend: str = "auto",
    ucx_transports: str | None = None,
    **kwargs: Any,
) -> KVPublisher:
    """Prefill side. ``kwargs``: on_free, host, port, lease_timeout_s, pin_ttl_s, auth_token, tls (see
    publisher.Publisher). ``ucx_transports``: UCX_TLS of a NIXL publisher (e.g. "tcp"; None: UCX's choice)."""
    if _choose(backend, "publisher") == "nixl":
        from kv_transfer.nixl_transport import NixlPublisher

        return NixlPublisher(layout, regions, ucx_transports=ucx_transports, **kwargs)
    from kv_transfer.fallback_transport import TcpPublisher

    return TcpPublisher(layout, regions, **kwargs)


def make_puller(
    layout: KVLayout,
    rank: int,
    region: torch.Tensor,
    *,
    backend: str = "auto",
    ucx_transports: str | None = None,
    **kwargs: Any,
) -> KVPuller:
    """Decode side, one per decode tp rank (``ucx_transports`` as for make_publisher). ``kwargs``:
    handshake_timeout_s, io_timeout_s, max_layers_per_read, transfer_timeout_s, auth_token, tls (see
    puller.BasePuller). A NIXL puller still reads TCP-only publishers over TCP."""
    if _choose(backend, "puller") == "nixl":
        from kv_transfer.nixl_transport import NixlPuller

        return NixlPuller(layout, rank, region, ucx_transports=ucx_transports, **kwargs)
    from kv_transfer.fallback_transport import TcpPuller

    return TcpPuller(layout, rank, region, **kwargs)
