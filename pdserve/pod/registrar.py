"""Registration with the router's Registry service, heartbeats, and deregistration on shutdown."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from pdserve.security import TLSConfig, aio_channel
from pdserve_api.v1 import common_pb2 as pb
from pdserve_api.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger("pdserve.pod.registrar")

RPC_TIMEOUT_S = 5.0
# gRPC's reconnect backoff grows to 120 s by default: after a long router outage a pod would then find the restarted
# router (and register again) minutes late. Capped, it retries the connection at least this often.
MAX_RECONNECT_BACKOFF_MS = 5000


class Registrar:
    """Registers the pod, heartbeats every interval (re-registering when the router forgot it), deregisters.

    ``desired_state`` from the router (e.g. an operator's DRAINING) is passed to on_desired_state."""

    def __init__(self, router_address: str, cluster_token: str, interval_s: float,
                 register_request: Callable[[], registry_pb2.RegisterWorkerRequest | None],
                 heartbeat_request: Callable[[], registry_pb2.HeartbeatRequest],
                 on_desired_state: Callable[[int], None] | None = None, tls: TLSConfig | None = None) -> None:
        self.router_address = router_address
        self.cluster_token = cluster_token
        self.interval_s = interval_s
        self._register_request = register_request
        self._heartbeat_request = heartbeat_request
        self._on_desired_state = on_desired_state
        self._channel = aio_channel(router_address, tls,  # TLS / client certificate as the pod is configured
                                    options=[("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS)])
        self._stub = registry_pb2_grpc.RegistryStub(self._channel)
        self.registered = False
        self.last_message = ""
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._warned = False
        self._closing = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="pod-registrar")

    def poke(self) -> None:
        """Send a heartbeat now (e.g. the pod started draining)."""
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
                    log.error("router %s refused this pod (UNAUTHENTICATED: %s); check --cluster-token "
                              "(PDSERVE_CLUSTER_TOKEN); retrying every %.1fs", self.router_address, e.details(),
                              self.interval_s)
                    self._warned = True
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT and not self._warned:
                    log.error("router %s refused this pod's registration as malformed (%s); retrying every %.1fs",
                              self.router_address, e.details(), self.interval_s)
                    self._warned = True
                if not self._warned:  # one warning per outage, not one per interval
                    log.warning("router %s unreachable (%s: %s); retrying every %.1fs", self.router_address,
                                e.code().name, e.details(), self.interval_s)
                    self._warned = True
            except Exception:
                log.exception("registration / heartbeat failed")
            try:
                await asyncio.wait_for(self._wake.wait(), self.interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()

    async def _register(self) -> None:
        req = self._register_request()
        if req is None:  # e.g. draining: a pod that is going away does not (re-)register
            return
        resp = await self._stub.RegisterWorker(req, timeout=RPC_TIMEOUT_S)
        self.last_message = resp.message
        if not resp.accepted:
            log.error("router %s refused registration of %s: %s", self.router_address, req.pod_id, resp.message)
            return
        self.registered = True
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        log.info("registered with router %s (%s); heartbeat every %.1fs", self.router_address, resp.message,
                 self.interval_s)

    async def _heartbeat(self) -> None:
        resp = await self._stub.Heartbeat(self._heartbeat_request(), timeout=RPC_TIMEOUT_S)
        if not resp.known:
            log.warning("router %s does not know this pod (restarted?); registering again", self.router_address)
            self.registered = False
            await self._register()
            return
        if resp.heartbeat_interval_s > 0:
            self.interval_s = resp.heartbeat_interval_s
        if resp.desired_state != pb.POD_STATE_UNSPECIFIED and self._on_desired_state is not None:
            self._on_desired_state(resp.desired_state)

    async def close(self, pod_id: str) -> None:
        """Stop heartbeating and deregister (best effort)."""
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
        if self.registered:
            try:
                await self._stub.DeregisterWorker(
                    registry_pb2.DeregisterWorkerRequest(pod_id=pod_id, cluster_token=self.cluster_token),
                    timeout=RPC_TIMEOUT_S)
            except grpc.aio.AioRpcError as e:
                log.warning("deregistering from router %s failed: %s", self.router_address, e.details())
            self.registered = False
        await self._channel.close()
