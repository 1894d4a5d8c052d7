"""The prefill pod's gRPC server: PrefillWorker (Prefill, CancelPrefill, ReleaseKV), grpc.health.v1, Prometheus
metrics, registration with the router, and a graceful drain on SIGTERM.

The KV itself is served by kv_transfer's publishers (one control endpoint per TP rank, see prefill_svc/kv.py); the
KVHandle of a Prefill answer names them (kv_transfer_address, comma-separated when TP > 1)."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.errors import InvalidArgument, ServiceError, Unavailable, grpc_errors
from pdserve.heap import freeze_startup_heap
from pdserve.parallel_config import kv_dtype_mismatch
from pdserve.pod.convert import (
    endpoints_address,
    handoff_to_kv_handle,
    layout_from_proto,
    layout_to_proto,
    model_shape_to_proto,
    parallel_to_proto,
)
from pdserve.pod.lifecycle import id_problem, on_stop_signals, run_loop, set_health, version
from pdserve.pod.registrar import Registrar
from pdserve.sampling_params import SamplingParamsError
from pdserve.security import bind, grpc_options
from pdserve_api.v1 import common_pb2 as pb
from pdserve_api.v1 import prefill_pb2, prefill_pb2_grpc, registry_pb2
from prefill_svc.config import PrefillConfig
from prefill_svc.metrics import PrefillMetrics
from prefill_svc.sampling import sampling_from_proto
from prefill_svc.worker import PrefillResult, PrefillWorker

log = logging.getLogger("prefill_svc.server")

SERVICE_NAME = "pdserve.v1.PrefillWorker"
_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}
_MODES = {"nixl": [pb.TRANSFER_MODE_NIXL_PULL, pb.TRANSFER_MODE_TCP], "tcp": [pb.TRANSFER_MODE_TCP]}


_TRANSFER_MODES = set(pb.TransferMode.values())


def prefill_request_problem(req: prefill_pb2.PrefillRequest) -> str | None:
    """Field checks of a PrefillRequest that need no engine state (the prompt is checked against the model by the
    engine, the decode layout by choose_mode). A message naming the field and the allowed values, or None."""
    if not req.request_id:
        return "request_id must not be empty"
    problem = id_problem("request_id", req.request_id) or id_problem("lease_id", req.lease_id)
    if problem:
        return problem
    if not math.isfinite(req.lease_ttl_s) or req.lease_ttl_s < 0:
        return f"lease_ttl_s must be a finite number of seconds >= 0 (0: the pod's default), got {req.lease_ttl_s}"
    if req.transfer_mode not in _TRANSFER_MODES:
        return f"transfer_mode {req.transfer_mode} is not a TransferMode (leave it unset to let the pod choose)"
    bad = [m for m in req.decode_target.transfer_modes if m not in _TRANSFER_MODES or m == 0]
    if bad:
        return f"decode_target.transfer_modes has unknown values {bad[:8]}: use TransferMode values"
    return None


class PrefillServicer(prefill_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, server: "PrefillServer") -> None:
        self.s = server

    @grpc_errors
    async def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.aio.ServicerContext):
        code = grpc.StatusCode.OK
        try:
            return await self._prefill(request)
        except ServiceError as e:
            code = e.code
            raise
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        finally:
            self.s.metrics.requests.labels(code=code.name).inc()

    async def _prefill(self, request: prefill_pb2.PrefillRequest) -> prefill_pb2.PrefillResponse:
        """Checks (pod state, fields, sampling, transfer mode), then the prefill itself on the engine thread."""
        s = self.s
        if s.worker.draining:
            raise Unavailable("this prefill pod is draining and takes no new requests; retry on another pod")
        problem = prefill_request_problem(request)
        if problem:
            raise InvalidArgument(problem)
        try:
            params, client = sampling_from_proto(request.sampling_params)
        except SamplingParamsError as e:
            raise InvalidArgument(f"sampling_params: {e}") from e
        mode, problem = s.choose_mode(request)
        if problem:
            raise InvalidArgument(problem)
        res = await s.worker.prefill(
            request.request_id,
            list(request.prompt_token_ids),
            params,
            client,
            lease_id=request.lease_id or None,
            ttl_s=request.lease_ttl_s or None,
        )
        s.metrics.observe(res)
        return s.response(res, mode)

    @grpc_errors
    async def CancelPrefill(self, request, context):
        return prefill_pb2.CancelPrefillResponse(found=await self.s.worker.cancel(request.request_id))

    @grpc_errors
    async def ReleaseKV(self, request, context):
        return prefill_pb2.ReleaseKVResponse(released=await self.s.worker.release(request.lease_id))


class PrefillServer:
    """start() -> serving; drain() refuses new work, waits for held work, then stops everything."""

    def __init__(self, config: PrefillConfig) -> None:
        self.config = config
        self.pod_id = config.resolved_pod_id()
        self.worker = PrefillWorker(config, self.pod_id)
        self.metrics = PrefillMetrics(stats_fn=lambda: self.worker.stats)
        self.health = health.aio.HealthServicer()
        self.server: grpc.aio.Server | None = None
        self.registrar: Registrar | None = None
        self.port: int | None = None
        self._stopped = asyncio.Event()
        self._drain_task: asyncio.Task | None = None
        self._metrics_task: asyncio.Task | None = None
        self.model_name = config.serving.served_model_name
        self._unhealthy = False

    @property
    def address(self) -> str:
        return f"{self.config.public_host}:{self.port}"

    # --- life cycle ---
    async def start(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.worker.start)  # loads weights, spawns ranks
        eng = self.worker.engine
        assert eng is not None and eng.config.model is not None  # started: the engine resolved its model
        if self.model_name is None:
            self.model_name = Path(eng.config.model).name
        self.metrics.enable_vllm(self.model_name)
        self.server = grpc.aio.server(options=grpc_options(extra=[("grpc.so_reuseport", 0)]))
        prefill_pb2_grpc.add_PrefillWorkerServicer_to_server(PrefillServicer(self), self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = bind(self.server, f"{self.config.serving.host}:{self.config.serving.port}", self.config.tls)
        if not self.port:
            raise RuntimeError(f"cannot listen on {self.config.serving.host}:{self.config.serving.port}")
        await self.server.start()
        if self.config.serving.metrics_port is not None:
            self.metrics.serve(self.config.serving.metrics_port, self.config.serving.host)
        self._metrics_task = asyncio.get_running_loop().create_task(self._metrics_loop())
        await set_health(self.health, SERVICE_NAME, serving=True)
        if self.config.serving.router_address:
            self.registrar = Registrar(
                self.config.serving.router_address,
                self.config.serving.cluster_token,
                self.config.serving.heartbeat_interval_s,
                self.register_request,
                self.heartbeat_request,
                self._on_desired_state,
                tls=self.config.tls,
            )
            self.registrar.start()
        log.info(
            "prefill pod %s serving %s on %s (tp=%d, kv %s%s, metrics %s)",
            self.pod_id,
            self.model_name,
            self.address,
            self.config.engine.tensor_parallel_size,
            self.worker.kv.transport if self.worker.kv else "none",
            f" at {','.join(map(str, self.worker.kv.endpoints))}" if self.worker.kv else "",
            self.metrics.http_port if self.metrics.http_port is not None else "not served",
        )

    def begin_drain(self) -> asyncio.Task:
        """Refuse new prefills (UNAVAILABLE, health NOT_SERVING, DRAINING to the router), finish what is held, stop."""
        if self._drain_task is None:
            self._drain_task = asyncio.get_running_loop().create_task(self._drain())
        return self._drain_task

    async def _drain(self) -> None:
        log.info(
            "draining: no new prefills; waiting for %d in flight and %d KV leases",
            self.worker.stats.num_inflight,
            self.worker.stats.num_leases,
        )
        self.worker.begin_drain()
        await set_health(self.health, SERVICE_NAME, serving=False)
        if self.registrar is not None:
            self.registrar.poke()
        deadline = time.monotonic() + self.config.serving.drain_timeout_s
        while not self.worker.idle and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.worker.idle:
            log.warning(
                "drain timeout (%.0fs): dropping %d prefills and %d KV leases still held",
                self.config.serving.drain_timeout_s,
                len(self.worker._jobs),
                len(self.worker._leases),
            )
        await self.stop()

    async def stop(self) -> None:
        if self._stopped.is_set():
            return
        if self.registrar is not None:
            await self.registrar.close(self.pod_id)
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self._metrics_task is not None:
            self._metrics_task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.worker.stop)
        self.metrics.close()
        self._stopped.set()
        log.info("prefill pod %s stopped", self.pod_id)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def _metrics_loop(self) -> None:
        while True:
            if self.worker.failed and not self._unhealthy:  # a dead rank: NOT_SERVING, and tell the router at once
                await set_health(self.health, SERVICE_NAME, serving=False)
                self._unhealthy = True  # heartbeats say UNHEALTHY only once health says NOT_SERVING
                if self.registrar is not None:
                    self.registrar.poke()
            self.metrics.update(self.worker.stats)
            self.metrics.draining.set(1 if self.worker.draining else 0)
            await asyncio.sleep(0.25)

    def _on_desired_state(self, state: int) -> None:
        if state == pb.POD_STATE_DRAINING and not self.worker.draining:
            log.info("router asks this pod to drain")
            self.worker.begin_drain()
            asyncio.get_running_loop().create_task(
                self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            )

    # --- requests ---
    def supported_modes(self) -> list[pb.TransferMode]:
        kv = self.worker.kv
        return list(_MODES[kv.transport]) if kv is not None else []

    def choose_mode(self, request: prefill_pb2.PrefillRequest) -> tuple[pb.TransferMode, str | None]:
        ours = self.supported_modes()
        lay = request.decode_target.layout
        if lay.num_layers:
            try:
                theirs = layout_from_proto(lay)
            except ValueError as e:
                return pb.TRANSFER_MODE_UNSPECIFIED, f"decode_target.layout is invalid: {e}"
            mine = self.worker.layout
            assert mine is not None  # set once the worker started
            dtype_problem = kv_dtype_mismatch(mine.dtype, theirs.dtype, prefill_name="this prefill pod")
            if dtype_problem:
                return pb.TRANSFER_MODE_UNSPECIFIED, dtype_problem
            if not theirs.same_model(mine):
                return pb.TRANSFER_MODE_UNSPECIFIED, (
                    f"decode_target.layout (layers {theirs.num_layers}, kv heads {theirs.num_kv_heads}, "
                    f"head_dim {theirs.head_dim}, {theirs.dtype}) does not match this pod's model (layers "
                    f"{mine.num_layers}, kv heads {mine.num_kv_heads}, head_dim {mine.head_dim}, {mine.dtype})"
                )
        if request.transfer_mode != pb.TRANSFER_MODE_UNSPECIFIED:
            if request.transfer_mode not in ours:
                return pb.TRANSFER_MODE_UNSPECIFIED, (
                    f"transfer_mode {pb.TransferMode.Name(request.transfer_mode)} is not supported by this pod "
                    f"(supports: {', '.join(pb.TransferMode.Name(m) for m in ours) or 'none'})"
                )
            return request.transfer_mode, None
        for m in request.decode_target.transfer_modes:
            if m in ours:
                return m, None
        return (ours[0] if ours else pb.TRANSFER_MODE_UNSPECIFIED), None

    def response(self, res: PrefillResult, mode: pb.TransferMode) -> prefill_pb2.PrefillResponse:
        resp = prefill_pb2.PrefillResponse(
            first_token_id=res.first_token_id,
            first_token_logprob=res.first_token_logprob,
            num_prompt_tokens=res.num_prompt_tokens,
            num_cached_tokens=res.num_cached_tokens,
            finished=res.finished,
            finish_reason=_FINISH.get(res.finish_reason or "", pb.FINISH_REASON_UNSPECIFIED),
            queue_s=res.queue_s,
            compute_s=res.compute_s,
        )
        if res.first_token_top is not None:
            resp.first_token_top_logprobs.token_ids.extend(res.first_token_top[0])
            resp.first_token_top_logprobs.logprobs.extend(res.first_token_top[1])
        for tok, lp, top, reason in res.firsts:
            ft = resp.first_tokens.add(
                token_id=tok,
                logprob=lp,
                finished=reason is not None,
                finish_reason=_FINISH.get(reason or "", pb.FINISH_REASON_UNSPECIFIED),
            )
            if top is not None:
                ft.top_logprobs.token_ids.extend(top[0])
                ft.top_logprobs.logprobs.extend(top[1])
        if res.prompt_logprobs is not None:
            resp.prompt_logprobs.SetInParent()
            for lp, ids, lps in res.prompt_logprobs:
                resp.prompt_logprobs.logprobs.append(lp)
                resp.prompt_logprobs.top_logprobs.add(token_ids=ids, logprobs=lps)
        if res.finished:
            return resp
        if res.handoff is not None:
            kh = handoff_to_kv_handle(res.handoff, self.pod_id, res.ttl_s)
            kh.transfer_mode = mode
            kh.block_checksums.extend(res.kv_checksums or ())
        else:  # no KV transport: the lease only holds the blocks (ReleaseKV / TTL)
            assert self.worker.layout is not None  # set once the worker started
            kh = pb.KVHandle(
                lease_id=res.lease_id,
                prefill_pod_id=self.pod_id,
                num_layers=self.worker.layout.num_layers,
                num_tokens=res.num_prompt_tokens,
                expires_at_unix_ms=int((time.time() + res.ttl_s) * 1000),
                ttl_s=res.ttl_s,
                layout=layout_to_proto(self.worker.layout),
                block_tables=[pb.BlockTable(block_ids=res.block_table, num_tokens=res.num_prompt_tokens)]
                * self.config.engine.tensor_parallel_size,
            )
        resp.kv_handle.CopyFrom(kh)
        return resp

    # --- registry messages ---
    def _kv_stats(self) -> list[pb.RankKVStats]:
        st = self.worker.stats
        return [
            pb.RankKVStats(rank=r, free_blocks=st.free_blocks, total_blocks=st.total_blocks)
            for r in range(self.config.engine.tensor_parallel_size)
        ]

    def register_request(self) -> registry_pb2.RegisterWorkerRequest | None:
        if self.worker.draining or self.worker.failed:  # going away / broken: no (re-)registration
            return None
        eng, cfg = self.worker.engine, self.config
        kv = self.worker.kv
        assert eng is not None and self.worker.layout is not None  # registers once the worker started
        return registry_pb2.RegisterWorkerRequest(
            pod_id=self.pod_id,
            role=pb.ROLE_PREFILL,
            address=self.address,
            kv_transfer_address=endpoints_address(kv.endpoints) if kv else "",
            model=self.model_name,
            model_shape=model_shape_to_proto(eng.model_config, eng.max_model_len, self.worker.layout.dtype),
            parallel=parallel_to_proto(cfg.engine.tensor_parallel_size),
            kv_layout=layout_to_proto(self.worker.layout),
            capacity=pb.WorkerCapacity(
                max_num_seqs=cfg.engine.max_num_seqs,
                max_num_batched_tokens=cfg.engine.max_num_batched_tokens,
                max_model_len=eng.max_model_len,
                max_concurrent_transfers=cfg.max_leases,
                transfer_modes=self.supported_modes(),
            ),
            cluster_token=cfg.serving.cluster_token,
            version=version(),
            state=pb.POD_STATE_READY,
            kv=self._kv_stats(),
        )

    def heartbeat_request(self) -> registry_pb2.HeartbeatRequest:
        st = self.worker.stats
        return registry_pb2.HeartbeatRequest(
            pod_id=self.pod_id,
            cluster_token=self.config.serving.cluster_token,
            state=(
                pb.POD_STATE_UNHEALTHY
                if self._unhealthy
                else pb.POD_STATE_DRAINING
                if self.worker.draining
                else pb.POD_STATE_READY
            ),
            load=pb.LoadStats(
                queued_prompt_tokens=st.queued_prompt_tokens,
                num_running_seqs=st.num_running,
                num_waiting_seqs=st.num_waiting,
                num_active_leases=st.num_leases,
                prompt_tokens_per_s=self.metrics.last_tokens_per_s,
            ),
            kv=self._kv_stats(),
        )


async def serve(config: PrefillConfig, on_ready=None) -> None:
    """Run a prefill pod until SIGTERM / SIGINT (graceful drain) finishes it."""
    server = PrefillServer(config)
    await server.start()
    on_stop_signals(lambda _name: server.begin_drain())
    freeze_startup_heap("prefill pod")
    if on_ready is not None:
        on_ready(server)
    await server.wait_stopped()


def run(config: PrefillConfig, on_ready=None) -> None:
    """Blocking entry point; uses uvloop when it is installed."""
    run_loop(serve(config, on_ready))
