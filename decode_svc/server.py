"""The DecodeWorker gRPC service (proto/pdserve_api/v1/decode.proto) on grpc.aio, with grpc.health.v1, Prometheus
metrics and a graceful drain on SIGTERM.

AllocateKV reserves blocks on every rank and returns the per-rank block tables; Decode delivers the prompt KV into
them (KVSource on every rank), then streams each token as soon as it is sampled; CancelDecode (or closing the stream)
frees the blocks at once. All pod work happens on the EngineLoop thread."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from decode_svc.config import DecodeConfig
from decode_svc.engine_loop import EngineLoop, EngineStopped
from decode_svc.kv_source import KVDeliveryError, KVSource, PullerFactory, TransferKVSource
from decode_svc.metrics import DecodeCollector, start_metrics_server
from decode_svc.pod import DecodePod, Failure, RequestExists
from pdserve.engine.block_manager import dcp_local_count
from pdserve.engine.llm_engine import RequestOutput
from pdserve.engine.sequence import FinishReason
from pdserve.errors import (
    KV_LOAD_FAILED_METADATA,
    InvalidArgument,
    ResourceExhausted,
    ServiceError,
    Unavailable,
    grpc_errors,
)
from pdserve.heap import freeze_startup_heap
from pdserve.parallel_config import kv_dtype_mismatch
from pdserve.pod import step_profile
from pdserve.pod.convert import (
    kv_handle_to_handoff,
    kv_layout_for_model,
    layout_to_proto,
    model_shape_to_proto,
    parallel_to_proto,
)
from pdserve.pod.lifecycle import id_problem, on_stop_signals, set_health, version
from pdserve.pod.registrar import Registrar
from pdserve.pod.sampling import engine_params, num_sequences
from pdserve.sampling_params import SamplingParams
from pdserve.security import bind, grpc_options
from pdserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, registry_pb2

log = logging.getLogger("decode_svc")

SERVICE_NAME = "pdserve.v1.DecodeWorker"
_FINISH = {
    FinishReason.STOP: common_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: common_pb2.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: common_pb2.FINISH_REASON_CANCELLED,
    FinishReason.ERROR: common_pb2.FINISH_REASON_ERROR,
}


def sampling_params_from_proto(p: common_pb2.SamplingParams, max_model_len: int) -> SamplingParams:
    """Decode applies EOS, stop_token_ids and max_tokens; stop strings belong to whoever detokenizes (the router).
    Raises SamplingParamsError for a value out of range (pdserve/sampling_params.py's rules and messages)."""
    return engine_params(
        p,
        max_tokens=p.max_tokens if p.HasField("max_tokens") else max_model_len,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs or p.top_logprobs > 0,
    )


class DecodeServer:
    def __init__(self, config: DecodeConfig, pod_factory: Callable[[DecodeConfig], DecodePod] = DecodePod) -> None:
        self.config = config
        self.engine = EngineLoop(config, pod_factory)
        self.draining = False
        self._drain_started = False
        self.active_streams = 0
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._metrics_http: Any = None
        self._layout: common_pb2.KVLayout | None = None
        self.max_model_len = 0
        self._puller_factory: PullerFactory | None = None
        self.registrar: Registrar | None = None
        self._unhealthy = False
        self._model_shape: common_pb2.ModelShape | None = None
        self._last_rate = (time.monotonic(), 0)
        self._rate = 0.0
        self.transfer_modes: list[common_pb2.TransferMode] = []
        self._stopped = asyncio.Event()
        self._step_profile: step_profile.StepProfile | None = None  # measured at start (pdserve/pod/step_profile.py)

    # --- lifecycle ---
    async def start(self) -> None:
        aloop = asyncio.get_running_loop()
        self.engine.on_failure = lambda e: aloop.call_soon_threadsafe(self._engine_failed, e)
        await asyncio.to_thread(self.engine.start)
        if step_profile.wanted(self.config.serving):  # before serving: the engine is idle, its times are its own
            self._step_profile = await self.call(lambda pod: step_profile.measure(pod.engine))
            log.info("step profile: %s", self._step_profile.describe() if self._step_profile else "cache too small")
        self._layout = await self.call(self._layout_of)
        self.max_model_len = await self.call(lambda pod: pod.max_model_len)
        backend, token, tls = self.config.kv_transfer_backend, self.config.serving.cluster_token, self.config.tls
        # the factory is pickled to every rank: token and TLS reach the pullers with it
        ucx = self.config.ucx_transports
        self._puller_factory = await self.call(
            lambda pod: PullerFactory.for_engine(pod.engine, backend, token, tls, ucx)
        )
        self.transfer_modes = await asyncio.to_thread(_transfer_modes, backend)
        self._server = grpc.aio.server(options=grpc_options())
        decode_pb2_grpc.add_DecodeWorkerServicer_to_server(DecodeWorkerServicer(self), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self.port = bind(self._server, f"{self.config.serving.host}:{self.config.serving.port}", self.config.tls)
        if not self.port:
            raise OSError(f"cannot bind {self.config.serving.host}:{self.config.serving.port}")
        await self._server.start()
        if self.config.serving.metrics_port is not None:  # 0: any free port
            pod_id, model = self.config.serving.pod_id, self.config.engine.model
            assert pod_id is not None and model is not None  # decode-0 unless set; DecodeConfig resolved the model
            collector = DecodeCollector(lambda: self.engine.stats, pod_id, lambda: self.draining)
            self.engine.observer, self._metrics_http = start_metrics_server(
                self.config.serving.metrics_port,
                self.config.serving.host,
                collector,
                self.config.serving.served_model_name or Path(model).name,
            )
            self.metrics_port = self._metrics_http.server_port
        await set_health(self._health, SERVICE_NAME, serving=True)
        self._model_shape = await self.call(self._model_shape_of)
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

    async def drain(self) -> None:
        """Stop taking new work (UNAVAILABLE, health NOT_SERVING) and wait for in-flight streams and reservations
        (a reservation is a Decode call on its way) to finish, at most drain_timeout_s."""
        if self._drain_started:
            return
        self._drain_started = True
        self.draining = True
        if self.registrar is not None:
            self.registrar.poke()  # the router stops placing requests here at once
        await set_health(self._health, SERVICE_NAME, serving=False)
        deadline = time.monotonic() + self.config.serving.drain_timeout_s
        while time.monotonic() < deadline:
            idle = self.active_streams == 0 and (not self.engine.alive or await self.call(lambda pod: pod.idle()))
            if idle:
                break
            await asyncio.sleep(0.05)
        else:
            log.warning("drain timed out with %d streams in flight", self.active_streams)

    async def stop(self, grace_s: float = 2.0) -> None:
        if self.registrar is not None:
            assert self.config.serving.pod_id is not None  # the id it registered under
            await self.registrar.close(self.config.serving.pod_id)
        if self._server is not None:
            await self._server.stop(grace_s)
        await asyncio.to_thread(self.engine.stop)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        self._stopped.set()

    def _engine_failed(self, error: BaseException) -> None:
        """The engine thread died (e.g. a TP rank was killed): this pod can serve nothing more. Health says
        NOT_SERVING and the next heartbeat (sent now) says UNHEALTHY, so the router stops placing requests here;
        the process stays up so an operator / orchestrator sees why (the log and the health status)."""
        log.error("decode pod %s is unhealthy: %s", self.config.serving.pod_id, error)
        asyncio.ensure_future(self._report_unhealthy())

    async def _report_unhealthy(self) -> None:
        await set_health(self._health, SERVICE_NAME, serving=False)
        self._unhealthy = True  # heartbeats say UNHEALTHY only once health says NOT_SERVING
        if self.registrar is not None:
            self.registrar.poke()

    def unavailable_reason(self) -> str | None:
        """Why this pod takes no new work (draining, engine failed), or None."""
        if self.engine.error is not None:
            return f"decode pod {self.config.serving.pod_id} is unhealthy: {self.engine.error}"
        if self.draining:
            return "decode pod is draining"
        return None

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    # --- helpers ---
    async def call(self, fn: Callable[[DecodePod], Any]) -> Any:
        return await asyncio.wrap_future(self.engine.call(fn))

    def _layout_of(self, pod: DecodePod) -> common_pb2.KVLayout:
        layout = kv_layout_for_model(
            pod.engine.model_config,
            str(pod.engine.executor.kv_cache.dtype),
            pod.block_size,
            tp_size=pod.tp,
            dcp_size=pod.dcp,
            interleave=pod.interleave,
            num_blocks=pod.num_blocks,
        )
        return layout_to_proto(layout)

    # --- registry messages (router) ---
    def _model_shape_of(self, pod: DecodePod) -> common_pb2.ModelShape:
        assert self._layout is not None  # start() sets it first
        return model_shape_to_proto(pod.engine.model_config, pod.max_model_len, self._layout.dtype)

    @property
    def address(self) -> str:
        return f"{self.config.serving.advertise_host or self.config.serving.host}:{self.port}"

    def _kv_stats(self) -> list[common_pb2.RankKVStats]:
        st = self.engine.stats
        assert self._layout is not None  # set by start()
        total = self._layout.num_blocks
        return [common_pb2.RankKVStats(rank=r, free_blocks=f, total_blocks=total) for r, f in enumerate(st.blocks_free)]

    def register_request(self) -> registry_pb2.RegisterWorkerRequest | None:
        if self.draining or self.engine.error is not None:  # a pod going away / broken does not (re-)register
            return None
        cfg = self.config
        assert cfg.engine.model is not None  # DecodeConfig resolved it
        return registry_pb2.RegisterWorkerRequest(
            pod_id=cfg.serving.pod_id,
            role=common_pb2.ROLE_UNIFIED if cfg.unified else common_pb2.ROLE_DECODE,
            address=self.address,
            kv_transfer_address="",
            model=cfg.serving.served_model_name or Path(cfg.engine.model).name,
            model_shape=self._model_shape,
            parallel=parallel_to_proto(
                cfg.engine.tensor_parallel_size,
                cfg.engine.decode_context_parallel_size,
                cfg.engine.dcp_kv_cache_interleave_size,
            ),
            kv_layout=self._layout,
            capacity=common_pb2.WorkerCapacity(
                max_num_seqs=cfg.engine.max_num_seqs,
                max_num_batched_tokens=cfg.engine.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                max_concurrent_transfers=cfg.engine.max_num_seqs,
                transfer_modes=self.transfer_modes,
            ),
            cluster_token=cfg.serving.cluster_token,
            version=version(),
            state=common_pb2.POD_STATE_READY,
            kv=self._kv_stats(),
            step_profile=self._step_profile.to_proto() if self._step_profile else None,
        )

    def heartbeat_request(self) -> registry_pb2.HeartbeatRequest:
        st = self.engine.stats
        now = time.monotonic()
        t0, n0 = self._last_rate
        if now - t0 > 0.5:
            self._rate = (st.generated_tokens - n0) / (now - t0)
            self._last_rate = (now, st.generated_tokens)
        return registry_pb2.HeartbeatRequest(
            pod_id=self.config.serving.pod_id,
            cluster_token=self.config.serving.cluster_token,
            state=(
                common_pb2.POD_STATE_UNHEALTHY
                if self._unhealthy
                else common_pb2.POD_STATE_DRAINING
                if self.draining
                else common_pb2.POD_STATE_READY
            ),
            load=common_pb2.LoadStats(
                num_running_seqs=st.running,
                num_waiting_seqs=st.waiting,
                num_active_leases=st.reserved,
                generation_tokens_per_s=self._rate,
            ),
            kv=self._kv_stats(),
        )

    def _on_desired_state(self, state: int) -> None:
        if state == common_pb2.POD_STATE_DRAINING and not self.draining:
            log.info("router asks this pod to drain: refusing new requests")
            self.draining = True
            asyncio.get_running_loop().create_task(
                self._health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
            )

    def make_source(self, req: decode_pb2.DecodeRequest) -> KVSource | None:
        """Where the prompt KV comes from; None for a request without a KV handle: this pod computes the prompt
        itself (a unified pod always; a decode pod when the router chose local prefill, conditional
        disaggregation), in chunks between its decode steps."""
        if req.kv_handle.ByteSize() == 0:  # no handle, or an empty one
            return None
        addr = req.kv_handle.kv_transfer_address
        if not addr:
            raise InvalidArgument("kv_handle.kv_transfer_address is empty")
        try:
            handoff = kv_handle_to_handoff(req.kv_handle, req.request_id)
        except (ValueError, KeyError) as e:
            raise InvalidArgument(f"bad kv_handle: {e}") from e
        if handoff.num_tokens != len(req.prompt_token_ids):
            raise InvalidArgument(
                f"kv_handle covers {handoff.num_tokens} tokens but the prompt has {len(req.prompt_token_ids)}"
            )
        checksums = tuple(req.kv_handle.block_checksums)
        if checksums and len(checksums) != -(-handoff.num_tokens // handoff.layout.block_size):
            raise InvalidArgument(
                f"kv_handle has {len(checksums)} block checksums for {handoff.num_tokens} tokens in "
                f"blocks of {handoff.layout.block_size}"
            )
        assert self._puller_factory is not None  # set by start()
        return TransferKVSource(
            handoff.to_json(),
            handoff.num_tokens,
            self._puller_factory,
            self.config.kv_transfer_timeout_s,
            checksums,
            handoff.layout.block_size,
            req.kv_handle.prefill_pod_id,
        )


def _transfer_modes(backend: str) -> list[common_pb2.TransferMode]:
    nixl = backend == "nixl"
    if backend == "auto":
        from kv_transfer.factory import nixl_available

        nixl = nixl_available()[0]
    tcp = [common_pb2.TRANSFER_MODE_TCP]  # kv_transfer's TCP path (every publisher serves it)
    return ([common_pb2.TRANSFER_MODE_NIXL_PULL] if nixl else []) + tcp


MAX_TTL_S = 86400.0  # a reservation held longer than a day is a mistake (and keeps expires_at_unix_ms in int64)


def _request_id_problem(rid: str) -> str | None:
    if not rid:
        return "request_id is empty"
    return id_problem("request_id", rid)


def allocate_request_problem(req: decode_pb2.AllocateKVRequest) -> str | None:
    """Field checks of AllocateKV before any block is touched (num_tokens against max_model_len: DecodePod.reserve)."""
    problem = _request_id_problem(req.request_id)
    if problem:
        return problem
    if not math.isfinite(req.ttl_s) or not 0 <= req.ttl_s <= MAX_TTL_S:
        return f"ttl_s must be in [0, {MAX_TTL_S:.0f}] seconds (0: the pod's default), got {req.ttl_s}"
    if req.num_reserved_output_tokens < 0:
        return f"num_reserved_output_tokens must be >= 0, got {req.num_reserved_output_tokens}"
    return None


def decode_request_problem(req: decode_pb2.DecodeRequest) -> str | None:
    """Field checks of Decode that need no pod state (prompt / first token against the model: DecodePod.submit)."""
    problem = _request_id_problem(req.request_id)
    if problem:
        return problem
    if req.kv_handle.transfer_mode not in common_pb2.TransferMode.values():
        return f"kv_handle.transfer_mode {req.kv_handle.transfer_mode} is not a TransferMode"
    if not math.isfinite(req.first_token_logprob):
        return f"first_token_logprob must be a finite number, got {req.first_token_logprob}"
    if not 0 <= req.num_cached_tokens <= len(req.prompt_token_ids):
        return (
            f"num_cached_tokens must be in [0, {len(req.prompt_token_ids)}] (the prompt's length), got "
            f"{req.num_cached_tokens}"
        )
    return None


class DecodeWorkerServicer(decode_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, server: DecodeServer) -> None:
        self.s = server

    @grpc_errors
    async def AllocateKV(self, request: decode_pb2.AllocateKVRequest, context: grpc.aio.ServicerContext):
        s = self.s
        rid = request.request_id
        reason = s.unavailable_reason()
        if reason:
            raise Unavailable(reason)
        assert s._layout is not None  # set by start()
        problem = allocate_request_problem(request) or (
            _layout_mismatch(request.prefill_layout, s._layout) if request.HasField("prefill_layout") else None
        )
        if problem:
            raise InvalidArgument(problem)

        def reserve(pod: DecodePod):
            tables = pod.reserve(rid, request.num_tokens, request.num_reserved_output_tokens, request.ttl_s or None)
            if tables is None:
                return None
            return pod.tp_tables(tables), pod.reservations[rid].expires_at_unix_ms

        got = await s.call(reserve)
        if got is None:
            raise ResourceExhausted(f"not enough free KV blocks for {request.num_tokens} tokens on this decode pod")
        tables, expires = got
        cfg = s.config
        return decode_pb2.AllocateKVResponse(
            layout=s._layout,
            block_tables=[
                common_pb2.BlockTable(
                    block_ids=t,
                    num_tokens=dcp_local_count(
                        request.num_tokens,
                        cfg.engine.decode_context_parallel_size,
                        cfg.engine.dcp_kv_cache_interleave_size,
                        r % cfg.engine.decode_context_parallel_size,
                    ),
                )
                for r, t in enumerate(tables)
            ],
            transfer_modes=s.transfer_modes,
            expires_at_unix_ms=expires,
        )

    @grpc_errors
    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        """Check -> KV source -> start on the engine thread -> stream the tokens; the blocks are freed at once if
        the stream ends early (client gone, error)."""
        s = self.s
        t_start = time.monotonic()
        params, source = self._prepare(request)
        events: asyncio.Queue[RequestOutput | Failure] = asyncio.Queue()
        s.active_streams += 1
        started = done = False
        try:
            await self._start(request, params, source, events)
            started = True
            stream = _TokenStream(params.logprobs, t_start, first_is_new=source is None)
            while not done:
                chunks, done = stream.chunks(await _drain(events))
                for chunk in chunks:
                    yield chunk
        except KVDeliveryError as e:  # the KV never landed: say so, the router may compute it again elsewhere
            prefill_pod = e.prefill_pod or request.kv_handle.prefill_pod_id
            context.set_trailing_metadata(((KV_LOAD_FAILED_METADATA, prefill_pod),))
            raise
        finally:
            s.active_streams -= 1
            if started and not done:  # the client went away (or we failed): free the blocks now
                engine = s.engine
                engine.call(lambda pod: engine.cancel(pod, request.request_id))

    def _prepare(self, request: decode_pb2.DecodeRequest) -> tuple[SamplingParams, KVSource | None]:
        """Field checks, sampling params and the KV source, before the engine is involved."""
        s = self.s
        problem = decode_request_problem(request)
        if problem:
            raise InvalidArgument(problem)
        reason = s.unavailable_reason()
        if s.engine.error is not None and reason is not None:  # reason is set whenever error is
            raise Unavailable(reason)
        try:
            return sampling_params_from_proto(request.sampling_params, s.max_model_len), s.make_source(request)
        except ValueError as e:  # SamplingParamsError, or a KV source that cannot be built from the handle
            raise InvalidArgument(str(e)) from e

    async def _start(
        self,
        request: decode_pb2.DecodeRequest,
        params: SamplingParams,
        source: KVSource | None,
        events: asyncio.Queue[RequestOutput | Failure],
    ) -> None:
        """Take the reservation over (or queue) on the engine thread, subscribed to the request's events."""
        s = self.s
        rid = request.request_id
        engine = s.engine
        aloop = asyncio.get_running_loop()
        draining = s.draining

        def sink(ev: RequestOutput | Failure) -> None:
            aloop.call_soon_threadsafe(events.put_nowait, ev)

        try:
            n = num_sequences(request.sampling_params)
        except ValueError as e:
            raise InvalidArgument(str(e)) from e
        if n == 1 or source is None:  # a pod computing the prompt samples every first token itself
            firsts, first_lps = [request.first_token_id], [request.first_token_logprob]
        elif len(request.first_token_ids) == n and len(request.first_token_logprobs) == n:
            firsts, first_lps = list(request.first_token_ids), list(request.first_token_logprobs)
        else:
            raise InvalidArgument(
                f"sampling_params asks for {n} sequences: first_token_ids and first_token_logprobs "
                f"must have {n} entries each, got {len(request.first_token_ids)} and "
                f"{len(request.first_token_logprobs)}"
            )

        def start(pod: DecodePod) -> None:
            reserved = rid in pod.reservations
            if draining and not reserved:
                raise Unavailable("decode pod is draining")
            if pod.knows(rid) and not reserved:
                raise RequestExists(f"request {rid!r} is already decoding on this pod")
            engine.subscribe(rid, sink)
            try:
                if source is None:  # local prefill: the prompt is computed here, its tokens come from step()
                    pod.submit_prompt(rid, list(request.prompt_token_ids), params, n)
                    return
                outs = pod.submit_all(rid, list(request.prompt_token_ids), params, firsts, first_lps, source)
            except BaseException:
                engine.unsubscribe(rid)
                raise
            for out in outs or ():
                engine.emit(out)

        await s.call(start)

    async def CancelDecode(self, request: decode_pb2.CancelDecodeRequest, context: grpc.aio.ServicerContext):
        engine = self.s.engine
        try:
            found = await self.s.call(lambda pod: engine.cancel(pod, request.request_id))
        except EngineStopped:  # the engine (and every block it held) is gone: nothing left to free
            found = False
        return decode_pb2.CancelDecodeResponse(found=found)


async def _drain(q: asyncio.Queue[RequestOutput | Failure]) -> list[RequestOutput | Failure]:
    """The next event and every one already queued behind it (one chunk per batch of events)."""
    evs = [await q.get()]
    while not q.empty():
        evs.append(q.get_nowait())
    return evs


class _TokenStream:
    """Turns a request's engine events into TokenChunks, one per sequence (index) with news. Each sequence's first
    output is prefill's first token (its KV landed): not repeated in the stream. A Failure before it is the call's
    gRPC status (decode.proto); after it, a final chunk with FINISH_REASON_ERROR."""

    def __init__(self, logprobs: bool, t_start: float, first_is_new: bool = False) -> None:
        self.logprobs = logprobs
        self.t_start = t_start
        # unified pod computing the prompt itself: the first output is a new token, streamed; no KV transfer
        self.first_is_new = first_is_new
        self.t_landed: float | None = t_start if first_is_new else None
        self.landed: set[int] = set()  # sequences whose first token was seen

    def chunks(self, evs: list[RequestOutput | Failure]) -> tuple[list[decode_pb2.TokenChunk], bool]:
        """(the chunks to send, whether the stream is done)."""
        by_index: dict[int, list[RequestOutput | Failure]] = {}
        for ev in evs:
            by_index.setdefault(0 if isinstance(ev, Failure) else ev.index, []).append(ev)
        out, done = [], False
        for index, group in by_index.items():
            chunk, ended = self.chunk(group, index)
            done = done or ended
            if chunk is not None:
                out.append(chunk)
        return out, done

    def chunk(self, evs: list[RequestOutput | Failure], index: int = 0) -> tuple[decode_pb2.TokenChunk | None, bool]:
        """(the chunk of sequence index to send, or None; whether the stream is done)."""
        chunk = decode_pb2.TokenChunk(index=index)
        done = ended = False
        for ev in evs:
            if isinstance(ev, Failure):
                if self.t_landed is None:
                    if ev.kv_from is not None:
                        raise KVDeliveryError(ev.message, ev.code, ev.kv_from)
                    raise ServiceError(ev.code, ev.message)
                done = True
                chunk.finish_reason = common_pb2.FINISH_REASON_ERROR
                chunk.error_message = ev.message
                break
            if ev.new_token_ids:
                if self.t_landed is None:
                    self.t_landed = time.monotonic()
                if index not in self.landed and not self.first_is_new:
                    self.landed.add(index)
                else:
                    chunk.token_ids.extend(ev.new_token_ids)
                    if self.logprobs:
                        chunk.logprobs.extend(ev.new_logprobs)
                    for top in ev.new_top_logprobs:
                        if top is not None:
                            chunk.top_logprobs.add(token_ids=top[0], logprobs=top[1])
                chunk.num_output_tokens = ev.completion_tokens
            if ev.finish_reason is not None:  # this sequence ended (ev.finished: the whole request did)
                done = ev.finished
                ended = True
                chunk.finish_reason = _FINISH[ev.finish_reason]
                break
        if ended or done:
            now = time.monotonic()
            landed = self.t_landed or now
            chunk.kv_transfer_s = landed - self.t_start
            chunk.decode_s = now - landed
        return (chunk if chunk.token_ids or done or ended else None), done


def _layout_mismatch(prefill: common_pb2.KVLayout, mine: common_pb2.KVLayout) -> str | None:
    if prefill.num_layers and prefill.use_mla != mine.use_mla:
        kind = {True: "an MLA latent cache", False: "a K/V cache"}
        return (
            f"prefill layout is {kind[prefill.use_mla]} but this decode pod has {kind[mine.use_mla]}: different models"
        )
    for name in ("num_layers", "num_kv_heads", "head_dim"):
        a, b = getattr(prefill, name), getattr(mine, name)
        if a and a != b:
            return f"prefill layout has {name}={a} but this decode pod has {b}: different models"
    return kv_dtype_mismatch(prefill.dtype, mine.dtype, decode_name="this decode pod")


async def serve(config: DecodeConfig, ready: Callable[[DecodeServer], None] | None = None) -> None:
    """Run until SIGTERM/SIGINT, then drain and stop."""
    server = DecodeServer(config)
    await server.start()

    async def _shutdown(signame: str) -> None:
        log.info("%s: draining", signame)
        await server.drain()
        await server.stop()

    on_stop_signals(_shutdown)
    freeze_startup_heap("decode pod")
    if ready is not None:
        ready(server)
    await server.wait_stopped()
