"""Registration with every router's Registry service, heartbeats, and deregistration on shutdown.

A pod is given one or more router addresses (``host:port``). Each is resolved to all its IPv4 addresses and
re-resolved every ``resolve_interval_s``: behind a Kubernetes headless Service a name resolves to one A record per
router replica, so a pod registers with (and heartbeats to) every replica, and with new ones as they appear. Each
router replica therefore sees every pod without the replicas talking to each other."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

import grpc

from pdserve.security import TLSConfig, aio_channel
from pdserve_api.v1 import common_pb2 as pb
from pdserve_api.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger("pdserve.pod.registrar")

RPC_TIMEOUT_S = 5.0
# gRPC's reconnect backoff grows to 120 s by default: after a long router outage a pod would then find the restarted
# router (and register again) minutes late. Capped, it retries the connection at least this often.
MAX_RECONNECT_BACKOFF_MS = 5000
RESOLVE_INTERVAL_S = 5.0  # how soon a new router replica behind a DNS name hears of this pod

Resolver = Callable[[str, int], Awaitable[list[str]]]


def parse_router_addresses(value: str | Sequence[str]) -> list[str]:
    """``"a:1,b:2"`` (or a list) -> ``["a:1", "b:2"]``, duplicates dropped; ValueError names a malformed entry."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out: list[str] = []
    for raw in items:
        a = raw.strip()
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"router address must be host:port, got {a!r}")
        if a not in out:
            out.append(a)
    if not out:
        raise ValueError("no router address given")
    return out


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
        return True
    except ValueError:
        return False


async def resolve_ipv4(host: str, port: int) -> list[str]:
    """Every A record of ``host`` as ``ip:port``, sorted (raises OSError when the name does not resolve)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=socket.AF_INET, type=socket.SOCK_STREAM)
    return sorted({f"{info[4][0]}:{port}" for info in infos})


class _Link:
    """Registration + heartbeats with one router replica."""

    def __init__(self, owner: "Registrar", target: str, name: str) -> None:
        self.owner = owner
        self.router_address = target  # what is dialed (an IP:port once a name was resolved)
        self.name = name  # as configured, for TLS name checks and logs
        opts: list[tuple[str, object]] = [("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)]
        tls = owner.tls
        host = name.rpartition(":")[0]
        if tls is not None and tls.enabled and not tls.server_name and target != name and not _is_ip(host):
            opts.append(("grpc.ssl_target_name_override", host))  # the certificate names the Service, not the IP
        self._channel = aio_channel(target, tls, options=opts)  # TLS / client certificate as the pod is configured
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self.registered = False
        self.last_message = ""
        self.interval_s = owner.interval_s
        self._wake = asyncio.Event()
        self._warned = False
        self._closing = False
        self._task: asyncio.Task | None = None

    @property
    def label(self) -> str:
        return self.router_address if self.router_address == self.name else f"{self.name} ({self.router_address})"

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"pod-registrar {self.router_address}")

    def poke(self) -> None:
        self._wake.set()

    async def _run(self) -> None:
        while not self._closing:
            try:
                if not self.registered:
                    await self._register()
                else:
                    await self._heartbeat()
                self._warned = False
            except asyncio.CancelledError:
                raise
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED and not self._warned:
                    log.error(
                        "router %s refused this pod (UNAUTHENTICATED: %s); check --cluster-token "
                        "(PDSERVE_CLUSTER_TOKEN); retrying every %.1fs",
                        self.label,
                        e.details(),
                        self.interval_s,
                    )
                    self._warned = True
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and not self._warned:
                    log.error(
                        "router %s refused this pod (%s); retrying every %.1fs",
                        self.label,
                        e.details(),
                        self.interval_s,
                    )
                    self._warned = True
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT and not self._warned:
                    log.error(
                        "router %s refused this pod's registration as malformed (%s); retrying every %.1fs",
                        self.label,
                        e.details(),
                        self.interval_s,
                    )
                    self._warned = True
                if not self._warned:  # one warning per outage, not one per interval
                    log.warning(
                        "router %s unreachable (%s: %s); retrying every %.1fs",
                        self.label,
                        e.code().name,
                        e.details(),
                        self.interval_s,
                    )
                    self._warned = True
            except Exception:
                log.exception("registration / heartbeat with router %s failed", self.label)
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _register(self) -> None:
        req = self.owner._register_request()
        if req is None:  # e.g. draining: a pod that is going away does not (re-)register
            return
        resp = await self._stub.RegisterWorker(req, timeout=RPC_TIMEOUT_S)
        self.last_message = resp.message
        if not resp.accepted:
            log.error("router %s refused registration of %s: %s", self.label, req.pod_id, resp.message)
            return
        self.registered = True
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        log.info("registered with router %s (%s); heartbeat every %.1fs", self.label, resp.message, self.interval_s)

    async def _heartbeat(self) -> None:
        resp = await self._stub.Heartbeat(self.owner._heartbeat_request(), timeout=RPC_TIMEOUT_S)
        if not resp.known:
            log.warning("router %s does not know this pod (restarted?); registering again", self.label)
            self.registered = False
            await self._register()
            return
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        if resp.desired_state != pb.POD_STATE_UNSPECIFIED and self.owner._on_desired_state is not None:
            self.owner._on_desired_state(resp.desired_state)

    async def close(self, pod_id: str | None) -> None:
        """Stop heartbeating and, given ``pod_id``, deregister (best effort)."""
        # Why the flag as well as cancel(): Python 3.11's wait_for drops a cancel that lands as the wake fires
        # (a drain pokes, then stops at once), and the loop would go on heartbeating.
        self._closing = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self.registered and pod_id is not None:
            try:
                await self._stub.DeregisterWorker(
                    registry_pb2.DeregisterWorkerRequest(pod_id=pod_id, cluster_token=self.owner.cluster_token),
                    timeout=RPC_TIMEOUT_S,
                )
            except grpc.aio.AioRpcError as e:
                log.warning("deregistering from router %s failed: %s", self.label, e.details())
        self.registered = False
        await self._channel.close()


class Registrar:
    """Registers the pod with every router, heartbeats every interval (re-registering with a router that forgot it),
    deregisters. ``desired_state`` from any router (e.g. an operator's DRAINING) is passed to on_desired_state."""

    def __init__(
        self,
        router_addresses: str | Sequence[str],
        cluster_token: str,
        interval_s: float,
        register_request: Callable[[], registry_pb2.RegisterWorkerRequest | None],
        heartbeat_request: Callable[[], registry_pb2.HeartbeatRequest],
        on_desired_state: Callable[[int], None] | None = None,
        tls: TLSConfig | None = None,
        resolve: Resolver = resolve_ipv4,
        resolve_interval_s: float = RESOLVE_INTERVAL_S,
    ) -> None:
        self.addresses = parse_router_addresses(router_addresses)
        self.cluster_token = cluster_token
        self.interval_s = interval_s
        self.tls = tls
        self._register_request = register_request
        self._heartbeat_request = heartbeat_request
        self._on_desired_state = on_desired_state
        self._resolve = resolve
        self.resolve_interval_s = resolve_interval_s
        self._links: dict[str, _Link] = {}  # dialed address -> link
        self._resolved: dict[str, list[str]] = {}  # configured address -> its last resolution
        self._task: asyncio.Task | None = None

    @property
    def router_address(self) -> str:
        return self.addresses[0]

    @property
    def registered(self) -> bool:
        """Registered with at least one router."""
        return any(link.registered for link in self._links.values())

    @property
    def routers(self) -> dict[str, bool]:
        """Every router dialed now -> whether this pod is registered there."""
        return {a: link.registered for a, link in self._links.items()}

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pod-registrar")

    def poke(self) -> None:
        """Send a heartbeat to every router now (e.g. the pod started draining)."""
        for link in self._links.values():
            link.poke()

    async def _targets(self, name: str) -> list[str]:
        host, _, port = name.rpartition(":")
        if _is_ip(host):
            return [name]
        try:
            found = await self._resolve(host, int(port))
        except OSError as e:
            found = []
            log.debug("cannot resolve router name %s: %s", host, e)
        if found:
            self._resolved[name] = found
        # Unresolvable now: keep what it resolved to last, or let gRPC's own resolver keep trying the name.
        return self._resolved.get(name) or [name]

    async def refresh(self) -> None:
        """Resolve every router address again; start links to new routers, close links to vanished ones."""
        want: dict[str, str] = {}
        for name in self.addresses:
            for target in await self._targets(name):
                want.setdefault(target, name)
        for target, name in want.items():
            if target not in self._links:
                link = self._links[target] = _Link(self, target, name)
                link.start()
        for target in [t for t in self._links if t not in want]:
            link = self._links.pop(target)
            log.info("router %s is no longer listed; stopped heartbeating to it", link.label)
            await link.close(None)  # gone from DNS: it evicts this pod on its own

    async def _run(self) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("resolving the router addresses failed")
            if all(_is_ip(a.rpartition(":")[0]) for a in self.addresses):
                return  # nothing to re-resolve
            await asyncio.sleep(self.resolve_interval_s)

    async def close(self, pod_id: str) -> None:
        """Stop heartbeating and deregister from every router (best effort)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        links, self._links = list(self._links.values()), {}
        await asyncio.gather(*(link.close(pod_id) for link in links))
