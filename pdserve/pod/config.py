"""PodServing: the serving part every pod config holds (where it listens, how it joins the router, TLS, shutdown),
so prefill and decode pods take the same flags with the same meaning. Validated when built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.security import tls_field

if TYPE_CHECKING:
    from pdserve.security import TLSConfig

CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"


class PodConfigError(ValueError):
    """A serving setting this pod cannot start with; the message says which and what to change."""


def _port(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 65536


def _seconds(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@dataclass
class PodServing:
    host: str = field(default="127.0.0.1", metadata={"help": "listen address of the gRPC server"})
    port: int = field(default=0, metadata={"help": "gRPC port (0: pick a free one)"})
    advertise_host: str | None = field(
        default=None, metadata={"help": "host the router and other pods reach this pod at (default: --host)"}
    )
    # One meaning on every service: unset = no endpoint, 0 = any free port.
    metrics_port: int | None = field(
        default=None,
        metadata={"help": "serve Prometheus /metrics over HTTP on this port (0: any free port; unset: not served)"},
    )
    pod_id: str | None = field(default=None, metadata={"help": "this pod's name in the router (default: per pod)"})
    served_model_name: str | None = field(
        default=None,
        metadata={"help": "model name clients use (default: the checkpoint directory's name)", "metavar": "NAME"},
    )
    router_address: str | None = field(
        default=None,
        metadata={
            "flag": "router",
            "aliases": ("--router-address",),
            "metavar": "HOST:PORT[,HOST:PORT...]",
            "help": "the routers' Registry: register with and heartbeat load to each; a name resolving to several "
            "addresses (a headless Service) means every one, re-resolved (omitted: run standalone)",
        },
    )
    cluster_token: str = field(
        default="",
        metadata={
            "env": CLUSTER_TOKEN_ENV,
            "secret": True,
            "help": "shared secret of the router's Registry and the KV peers",
        },
    )
    heartbeat_interval_s: float = field(default=2.0, metadata={"help": "until the router says otherwise"})
    drain_timeout_s: float = field(
        default=60.0, metadata={"help": "SIGTERM: longest wait for in-flight work before the pod stops anyway"}
    )
    step_profile: bool = field(
        default=True,
        metadata={
            "help": "decode pods with a router: time a few prefills and decode steps at start (a second or two on a "
            "small CPU model) and send them with the registration, for the router's --local-prefill-max-tokens auto "
            "(pdserve/pod/step_profile.py); off: nothing sent, and auto never prefills on this pod. pdserve up turns "
            "it off unless its routers run auto; prefill pods never measure (the rule reads only decode pods')"
        },
    )
    # --- security (pdserve.security): all unset = plaintext ---
    tls_cert_file: str | None = tls_field("cert_file")
    tls_key_file: str | None = tls_field("key_file")
    tls_ca_file: str | None = tls_field("ca_file")
    tls_require_client_cert: bool = tls_field("require_client_cert", False)
    tls_server_name: str | None = tls_field("server_name")

    def __post_init__(self) -> None:
        if not self.host:
            raise PodConfigError("host must not be empty")
        for name in ("port",) + (("metrics_port",) if self.metrics_port is not None else ()):
            v = getattr(self, name)
            if not _port(v):
                raise PodConfigError(f"{name} must be a port number in [0, 65535], got {v!r}")
        if self.router_address is not None:
            try:
                _ = self.router_addresses
            except ValueError as e:
                raise PodConfigError(f"router_address: {e} (several: host:port,host:port)") from None
        for name in ("heartbeat_interval_s", "drain_timeout_s"):
            v = getattr(self, name)
            if not _seconds(v):
                raise PodConfigError(f"{name} must be a positive number of seconds, got {v!r}")
        try:
            _ = self.tls
        except ValueError as e:  # pdserve.security.TLSConfigError names the flag to fix
            raise PodConfigError(str(e)) from None

    @property
    def router_addresses(self) -> list[str]:
        """Every router this pod registers with (the comma-separated router_address), [] when standalone."""
        from pdserve.pod.registrar import parse_router_addresses

        return [] if self.router_address is None else parse_router_addresses(self.router_address)

    @property
    def tls(self) -> "TLSConfig | None":
        """TLS settings (checked when the config is built), or None for plaintext."""
        from pdserve.security import TLSConfig

        tls = TLSConfig(
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            ca_file=self.tls_ca_file,
            require_client_cert=self.tls_require_client_cert,
            server_name=self.tls_server_name,
        )
        return tls if tls.enabled or tls.require_client_cert else None
