"""The router process: grpc.aio Router + Registry servicers on one port, grpc.health.v1, Prometheus metrics, the
registry's heartbeat watchdog, and graceful drain on SIGTERM (stop taking requests, finish the ones in flight for
up to ``drain_timeout_s``, then stop)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from pdserve.errors import grpc_errors
from pdserve.heap import freeze_startup_heap
from pdserve.sched import batch_helper_threads
from pdserve.security import ApiKeyInterceptor, bind, grpc_options
from pdserve_api.v1 import common_pb2, registry_pb2_grpc, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.core import RouterCore
from router.journey import generate
from router.validation import validate_config_rpc

log = logging.getLogger("router.server")

ROUTER_SERVICE = "pdserve.v1.Router"
REGISTRY_SERVICE = "pdserve.v1.Registry"


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    async def Generate(
        self, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        async for msg in generate(self.core, request, context):
            yield msg

    @grpc_errors
    async def ValidateConfig(
        self, request: router_pb2.ValidateConfigRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ValidateConfigResponse:
        return validate_config_rpc(request)

    async def ClusterStatus(
        self, request: router_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ClusterStatusResponse:
        if request.role not in common_pb2.Role.values():
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"role {request.role} is not a Role: use ROLE_PREFILL, ROLE_DECODE or leave it unset",
            )
        reg = self.core.registry
        resp = router_pb2.ClusterStatusResponse(
            router_queue_depth=self.core.admission.depth,
            num_inflight_requests=max(0, len(self.core.flights) - self.core.admission.depth),
            ready_models=reg.ready_models(),
        )
        if request.model and request.model not in reg.model_aliases:
            return resp
        for e in sorted(reg.pods.values(), key=lambda e: (e.role, e.pod_id)):
            if request.role and e.role != request.role:
                continue
            resp.pods.append(reg.pod_status(e))
        return resp

    async def Cancel(
        self, request: router_pb2.CancelRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.CancelResponse:
        flight = self.core.flights.get(request.request_id)
        if flight is None or flight.cancelled:
            return router_pb2.CancelResponse(found=False)
        flight.cancel()
        return router_pb2.CancelResponse(found=True)


class RegistryServicer(registry_pb2_grpc.RegistryServicer):
    def __init__(self, core: RouterCore) -> None:
        self.core = core

    @grpc_errors
    async def RegisterWorker(self, request, context):
        return self.core.registry.register(request)

    @grpc_errors
    async def Heartbeat(self, request, context):
        return self.core.registry.heartbeat(request)

    @grpc_errors
    async def DeregisterWorker(self, request, context):
        return self.core.registry.deregister(request)


class RouterServer:
    """One router: ``await start()`` -> port; ``await drain()`` on SIGTERM; ``await stop()``."""

    def __init__(self, config: RouterConfig, core: RouterCore | None = None) -> None:
        self.config = config
        self.core = core or RouterCore(config)
        self.health = HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self._watchdog: asyncio.Task | None = None
        self._metrics_http: Any = None  # prometheus_client's (server, thread)
        self._stopped = asyncio.Event()

    async def start(self) -> int:
        # Why an interceptor: the key guards every Router method (present and future) but not Registry / health.
        interceptors = [ApiKeyInterceptor(self.config.api_key)] if self.config.api_key else []
        self.server = grpc.aio.server(options=grpc_options(extra=[("grpc.so_reuseport", 0)]), interceptors=interceptors)
        router_pb2_grpc.add_RouterServicer_to_server(RouterServicer(self.core), self.server)
        registry_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(self.core), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = bind(self.server, f"{self.config.host}:{self.config.port}", self.config.tls)
        if self.port == 0:
            raise OSError(f"cannot bind {self.config.host}:{self.config.port}")
        await self.server.start()
        for svc in ("", ROUTER_SERVICE, REGISTRY_SERVICE):
            await self.health.set(svc, health_pb2.HealthCheckResponse.SERVING)
        if self.config.metrics_port is not None:  # 0: any free port
            from prometheus_client import start_http_server

            self._metrics_http = start_http_server(
                self.config.metrics_port, addr=self.config.host, registry=self.core.metrics.registry
            )
        self._watchdog = asyncio.create_task(self._watch())
        log.info(
            "router %s listening on %s:%d (model %r, %s%s)",
            self.core.registry.router_id,
            self.config.host,
            self.port,
            self.core.model_name,
            "plaintext"
            if self.config.tls is None
            else ("mutual TLS" if self.config.tls_require_client_cert else "TLS"),
            ", API key required" if self.config.api_key else "",
        )
        return self.port

    async def _watch(self) -> None:
        """Heartbeat watchdog + gauges."""
        period = max(0.05, self.config.heartbeat_interval_s / 2)
        while True:
            await asyncio.sleep(period)
            try:
                self.core.registry.tick()
                self._update_gauges()
            except Exception:  # never let the watchdog die
                log.exception("registry watchdog failed")

    def _update_gauges(self) -> None:
        m = self.core.metrics
        m.queue_depth.set(self.core.admission.depth)
        counts: dict[tuple[str, str], int] = {}
        for role in ("ROLE_PREFILL", "ROLE_DECODE", "ROLE_UNIFIED"):
            for state in ("POD_STATE_STARTING", "POD_STATE_READY", "POD_STATE_DRAINING", "POD_STATE_UNHEALTHY"):
                counts[(role, state)] = 0
        for e in self.core.registry.pods.values():
            key = (common_pb2.Role.Name(e.role), common_pb2.PodState.Name(e.state))
            counts[key] = counts.get(key, 0) + 1
        for (role, state), n in counts.items():
            m.pods.labels(role, state).set(n)

    async def drain(self) -> None:
        """Graceful shutdown: NOT_SERVING, refuse new requests, wait for in-flight ones (bounded), stop."""
        if self.core.draining:
            return
        self.core.draining = True
        await self.health.enter_graceful_shutdown()
        t0 = time.monotonic()
        log.info("draining: %d requests in flight", len(self.core.flights))
        while self.core.flights and time.monotonic() - t0 < self.config.drain_timeout_s:
            await asyncio.sleep(0.05)
        await self.stop(grace=max(0.1, self.config.drain_timeout_s - (time.monotonic() - t0)))

    async def stop(self, grace: float | None = 0.5) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        await self.core.close()
        if self._metrics_http is not None:
            srv, _thread = self._metrics_http
            srv.shutdown()
            self._metrics_http = None
        self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(config: RouterConfig) -> None:
    """Run a router until SIGTERM / SIGINT (then drain)."""
    server = RouterServer(config)
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: asyncio.ensure_future(server.drain()))
    log.info("event loop: %s", type(loop).__module__.split(".")[0])  # "uvloop" or "asyncio"
    freeze_startup_heap("router")
    if config.helper_threads == "batch":
        batch_helper_threads("router")
    print(f"pdserve router listening on {config.host}:{server.port}", flush=True)
    await server.wait_stopped()
