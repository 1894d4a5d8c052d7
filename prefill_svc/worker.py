"""The prefill engine loop: an LLMEngine on its own thread, fed prompts from asyncio, holding KV under leases.

Each prompt becomes an engine request with max_tokens=1 and hold_kv=True: the engine batches concurrent prompts and
splits long ones into chunks (EngineConfig.prefill_chunk_size; every prefilling request gets at most one chunk per
step, so short prompts run beside long ones), reuses cached prefix blocks, and samples the first token. When that token
is out, the request's blocks stay allocated under a KV lease (published layer by layer while the last chunk computed,
see prefill_svc/kv.py) until every rank's publisher has let go of it: decode done, ReleaseKV, CancelPrefill or TTL.

All engine access happens on the engine thread; the asyncio side talks to it through a command queue and gets results
back as futures. Nothing here serves gRPC; each error below names the status the server answers it with."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc

from kv_transfer.layout import KVLayout
from kv_transfer.lease import new_lease_id
from kv_transfer.transport import KVHandoff
from pdserve.engine.kv_connector import KVConnectorMetadata, KVConnectorScheduler
from pdserve.engine.llm_engine import LLMEngine, RequestError
from pdserve.engine.scheduler import ScheduledStep
from pdserve.engine.shm import RankFailure
from pdserve.errors import ServiceError
from pdserve.pod.convert import kv_layout_for_model
from pdserve.pod.engine_thread import EngineThread
from pdserve.sampling_params import SamplingParams
from prefill_svc.config import PrefillConfig
from prefill_svc.kv import KVHost, LeaseStart
from prefill_svc.sampling import ClientParams

log = logging.getLogger("prefill_svc.worker")


# --- errors: each carries the gRPC status the server answers it with (pdserve.errors) ---
class PrefillError(ServiceError):
    def __init__(self, message: object) -> None:
        super().__init__(None, str(message))


class InvalidRequest(PrefillError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(PrefillError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Exhausted(PrefillError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Cancelled(PrefillError):
    code = grpc.StatusCode.CANCELLED


class Draining(PrefillError):
    code = grpc.StatusCode.UNAVAILABLE


class RankDied(PrefillError):
    """A TP rank process of this pod exited: its collectives are broken for good (retry on another pod)."""

    code = grpc.StatusCode.UNAVAILABLE


@dataclass
class PrefillResult:
    request_id: str
    first_token_id: int
    first_token_logprob: float
    num_prompt_tokens: int
    num_cached_tokens: int
    finished: bool  # the request ended with its first token: no KV is kept
    finish_reason: str | None  # "stop" | "length" when finished
    lease_id: str | None
    handoff: KVHandoff | None  # None when finished, or when the pod runs without a KV transport
    block_table: list[int]
    queue_s: float
    compute_s: float
    ttl_s: float
    first_token_top: tuple[list[int], list[float]] | None = None  # when top_logprobs > 0
    # n > 1: every sequence's (token, logprob, top alternatives, finish reason or None), in index order.
    firsts: list[tuple[int, float, tuple[list[int], list[float]] | None, str | None]] = field(default_factory=list)
    prompt_logprobs: list[tuple[float, list[int], list[float]]] | None = None
    kv_checksums: list[int] | None = None  # per logical KV block, when the pod computes them


@dataclass
class _Job:
    request_id: str
    lease_id: str
    prompt_len: int
    client: ClientParams
    ttl_s: float
    future: Future  # concurrent.futures: set from the engine thread, awaited through asyncio.wrap_future
    arrival: float = field(default_factory=time.monotonic)
    started: float | None = None  # first step that computed any of its tokens
    lease_start: LeaseStart | None = None


@dataclass
class _Lease:
    lease_id: str
    request_id: str
    num_blocks: int
    expires_at: float  # only enforced here when the pod has no KV transport (publishers run their own TTL)
    pending_ranks: set[int]  # ranks whose publisher still holds the lease
    released: bool = False  # ReleaseKV / CancelPrefill / finished-at-first-token asked for it to go


@dataclass(frozen=True)
class Stats:
    queued_prompt_tokens: int = 0  # prompt tokens admitted but not yet computed
    num_running: int = 0
    num_waiting: int = 0
    num_inflight: int = 0  # Prefill calls not answered yet
    num_leases: int = 0
    kv_held_blocks: int = 0  # blocks held for transfer (after the first token)
    free_blocks: int = 0
    total_blocks: int = 0
    prompt_tokens_computed: int = 0  # cumulative; prefix-cache hits excluded
    prefix_hit_tokens: int = 0  # cumulative
    prefix_query_tokens: int = 0  # cumulative
    requests_finished: int = 0
    num_steps: int = 0  # engine steps run (a chunked prompt takes one per chunk)
    leases_freed: dict = field(default_factory=dict)  # reason -> count


class PrefillWorker(KVConnectorScheduler):
    def __init__(self, config: PrefillConfig, pod_id: str = "prefill-local") -> None:
        self.config = config
        self.pod_id = pod_id
        self.engine: LLMEngine | None = None
        self.kv: KVHost | None = None
        self.layout: KVLayout | None = None
        self._jobs: dict[str, _Job] = {}  # request id -> job, until its first token
        self._leases: dict[str, _Lease] = {}  # lease id -> lease
        self._lease_of_request: dict[str, str] = {}
        self._thread: EngineThread | None = None
        self._stopping = False
        self.draining = False
        self.failed: str | None = None  # why the pod can serve nothing more (a dead rank); the server turns unhealthy
        self.stats = Stats()
        self._requests_finished = 0
        self._num_steps = 0
        self._leases_freed: dict[str, int] = {}
        self._last_poll = 0.0
        self._settled: list[tuple[Future, Any, BaseException | None]] = []
        self._step_publishes = False  # the step being run publishes leases
        # lease id -> (ranks whose publish failed, what): errors seen before the request's first token is handled
        self._publish_errors: dict[str, tuple[set[int], str]] = {}
        self._early_freed: dict[str, set[int]] = {}  # lease id -> ranks that freed it before _on_output
        self.on_event: Callable[[str, str], None] | None = None  # (kind, request id), engine thread; tests

    # --- life cycle ---
    def start(self, timeout_s: float = 600.0) -> None:
        self._thread = EngineThread("prefill-engine", self._run)
        self._thread.start(timeout_s)

    def stop(self) -> None:
        """Stop the loop: requests still queued fail with UNAVAILABLE, leases are dropped, ranks shut down."""
        if self._thread is None:
            return
        self._stopping = True
        self._thread.stop(timeout_s=120)
        self._thread = None

    @property
    def _eng(self) -> LLMEngine:
        """The engine, from the engine thread once _run started it."""
        assert self.engine is not None
        return self.engine

    @property
    def idle(self) -> bool:
        """Nothing held: no prefill in flight, no KV under a lease."""
        return not self._jobs and not self._leases

    # --- asyncio-facing API (any thread) ---
    async def prefill(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        client: ClientParams,
        lease_id: str | None = None,
        ttl_s: float | None = None,
    ) -> PrefillResult:
        fut: Future = Future()
        self._call(lambda: self._submit(fut, request_id, prompt_ids, params, client, lease_id, ttl_s))
        try:
            return await asyncio.wrap_future(fut)
        except asyncio.CancelledError:  # the caller went away: drop the request and whatever it holds
            try:
                self._call(lambda: self._cancel(request_id, "caller cancelled"))
            except Draining:
                pass
            raise

    async def cancel(self, request_id: str) -> bool:
        return await self._ask(lambda: self._cancel(request_id, "CancelPrefill"))

    async def release(self, lease_id: str) -> bool:
        return await self._ask(lambda: self._release(lease_id, "aborted"))

    def begin_drain(self) -> None:
        self.draining = True

    def _call(self, fn: Callable[[], object]) -> None:
        if self._thread is None or not self._thread.alive:
            raise Draining("the prefill engine is not running")
        self._thread.put(fn)

    async def _ask(self, fn: Callable[[], Any]) -> Any:
        fut: Future = Future()

        def run() -> None:  # answered after the loop updated its stats, like prefills
            try:
                self._settle(fut, fn())
            except Exception as e:
                self._settle(fut, exc=e)

        self._call(run)
        return await asyncio.wrap_future(fut)

    # --- engine thread ---
    def _run(self, thread: EngineThread) -> None:
        try:
            self.engine = LLMEngine(self.config.engine)
            mc = self.engine.model_config
            self.layout = kv_layout_for_model(
                mc,
                str(self.engine.executor.kv_cache.dtype),
                self.config.engine.block_size,
                tp_size=self.config.engine.tensor_parallel_size,
                num_blocks=self.config.engine.num_kv_blocks,
            )
            if self.config.kv_transport != "none":
                self.kv = KVHost(
                    self.engine,
                    self.layout,
                    self.config.kv_transport,
                    self.config.kv_host or self.config.public_host,
                    self.config.lease_ttl_s,
                    wake=thread.wake,
                    auth_token=self.config.serving.cluster_token,
                    tls=self.config.tls,
                    ucx_transports=self.config.ucx_transports,
                )
            self.engine.set_kv_connector(self)  # the rank side was started by KVHost
        except BaseException:  # raised by start()
            if self.engine is not None:
                self.engine.shutdown()
            raise
        self._update_stats()
        thread.ready()
        try:
            self._loop(thread)
        finally:
            self._shutdown_engine(thread)

    def _loop(self, thread: EngineThread) -> None:
        eng = self._eng
        while True:
            thread.run_commands(0.0 if eng.has_unfinished() else 0.05)
            if thread.stopping:
                return
            if self.failed is None:
                try:
                    eng.executor.keepalive()  # idle TP ranks would otherwise hit the group's timeout and die
                    dead = not eng.executor.workers_alive()
                except Exception as e:  # the no-op broadcast failed: a rank died or hangs
                    log.error("keepalive broadcast to the TP ranks failed: %s", e)
                    dead = True
                if dead:
                    self.failed = (
                        "a TP rank process of this prefill pod exited; the pod cannot prefill until it is "
                        "restarted (retry on another pod)"
                    )
                    log.error("%s", self.failed)
                    self._fail_all(RankDied(self.failed))
            if self.failed is not None:  # nothing runs on a broken rank group; new requests get UNAVAILABLE
                self._update_stats()
                self._flush_settled()
                continue
            self._collect_freed()
            self._expire_leases()
            if eng.has_unfinished():
                self._step_publishes = False
                try:
                    outputs = eng.step()
                    self._num_steps += 1
                except RankFailure as e:  # a rank died, stopped or stopped answering: the group is broken for good
                    self.failed = f"{e}; this prefill pod cannot prefill until it is restarted (retry on another pod)"
                    log.error("%s", self.failed)
                    self._fail_all(RankDied(self.failed))
                    continue
                except Exception as e:
                    log.exception("prefill step failed; failing the requests in flight")
                    self._fail_all(e)
                    continue
                if self._step_publishes:  # learn every rank's publish errors before answering
                    self._collect_freed(force_poll=True)
                by_request: dict[str, list[Any]] = {}  # a request of n has n outputs (its first tokens)
                for out in outputs:
                    by_request.setdefault(out.request_id, []).append(out)
                for outs in by_request.values():
                    self._on_output(outs)
            self._update_stats()
            self._flush_settled()

    def _settle(self, fut: Future, result: Any = None, exc: BaseException | None = None) -> None:
        """Answer a Prefill once the stats reflect it (so a caller reading stats after the answer sees them)."""
        self._settled.append((fut, result, exc))

    def _flush_settled(self) -> None:
        settled, self._settled = self._settled, []
        for fut, result, exc in settled:
            if fut.done():
                continue
            if exc is not None:
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def _submit(
        self,
        fut: Future,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        client: ClientParams,
        lease_id: str | None,
        ttl_s: float | None,
    ) -> None:
        if fut.done():
            return
        try:
            if self.failed:
                raise RankDied(self.failed)
            if self.draining or self._stopping:
                raise Draining("this prefill pod is draining and takes no new requests; retry on another pod")
            eng = self._eng
            if not request_id:
                raise InvalidRequest("request_id must not be empty")
            if request_id in self._jobs or request_id in self._lease_of_request:
                raise AlreadyExists(f"request_id {request_id!r} is already in flight on this pod")
            if lease_id and (lease_id in self._leases or any(j.lease_id == lease_id for j in self._jobs.values())):
                raise AlreadyExists(f"lease_id {lease_id!r} is already in use on this pod")
            if len(self._leases) + len(self._jobs) >= self.config.max_leases:
                raise Exhausted(f"this pod holds its maximum of {self.config.max_leases} KV leases; retry elsewhere")
            try:
                eng.validate_prompt(prompt_ids, params)
            except RequestError as e:
                raise InvalidRequest(str(e)) from e
            need = -(-len(prompt_ids) // self.config.engine.block_size)
            if need > self.config.engine.num_kv_blocks:
                raise Exhausted(
                    f"prompt needs {need} KV blocks but this pod has {self.config.engine.num_kv_blocks} per rank"
                )
            # A requested TTL is enforced here only without a KV transport; publishers apply the pod's
            # lease_ttl_s as an idle timeout (renewed by every decode contact).
            ttl = ttl_s if (ttl_s and ttl_s > 0 and self.kv is None) else self.config.lease_ttl_s
            job = _Job(request_id, lease_id or new_lease_id(), len(prompt_ids), client, ttl, fut)
            try:
                eng.add_request(
                    prompt_ids, params, request_id, hold_kv=True, n=client.n, prompt_logprobs=client.prompt_logprobs
                )
            except RequestError as e:
                raise InvalidRequest(str(e)) from e
            self._jobs[request_id] = job
            self._emit("queued", request_id)
        except PrefillError as e:
            self._settle(fut, exc=e)

    def build_connector_meta(self, step: ScheduledStep) -> KVConnectorMetadata | None:
        """The pod's connector scheduler side, run between schedule and execute: note start times, list the leases
        whose KV completes this step."""
        now = time.monotonic()
        starts = []
        for seq, n in zip(step.seqs, step.chunk_lens):
            job = self._jobs.get(seq.request_id)
            if job is None:
                continue
            if job.started is None:
                job.started = now
            self._emit("scheduled", seq.request_id)
            # max_tokens=1 ends at its first token: no decode pod will read the KV, so none is published
            if seq.num_computed + n == seq.num_tokens and job.client.max_tokens != 1:
                job.lease_start = LeaseStart(
                    job.lease_id, job.request_id, tuple(seq.block_tables[0]), len(seq.prompt_ids)
                )
                starts.append(job.lease_start)
        if starts and self.kv is not None:
            self._step_publishes = True
            return KVConnectorMetadata(tuple(starts))
        return None

    def _first_reason(self, job: _Job, tok: int) -> str | None:
        """Why a sequence ends at its first token (None: it goes on to decode)."""
        c, eng = job.client, self._eng
        if c.min_tokens <= 1 and (tok in c.stop_token_ids or (tok in eng.eos_ids and not c.ignore_eos)):
            return "stop"
        if c.max_tokens == 1 or job.prompt_len + 1 >= eng.max_model_len:
            return "length"
        return None

    def _on_output(self, outs: list[Any]) -> None:
        """The first token(s) of one request: one output per sequence (n of them for parallel sampling)."""
        eng = self._eng
        outs = sorted(outs, key=lambda o: o.index)
        out = outs[0]
        job = self._jobs.pop(out.request_id, None)
        if job is None:
            return
        tok, lp = out.new_token_ids[0], out.new_logprobs[0]
        reasons = [self._first_reason(job, o.new_token_ids[0]) for o in outs]
        # The KV goes to decode unless every sequence already ended.
        reason = reasons[0] if all(r is not None for r in reasons) else None
        seq = eng.held.get(out.request_id)
        table = list(seq.block_tables[0]) if seq is not None and seq.block_tables else []
        now = time.monotonic()
        started = job.started if job.started is not None else now
        ls = job.lease_start
        error = self._publish_errors.pop(job.lease_id, None)
        failed = error[0] if error else set()
        let_go = self._early_freed.pop(job.lease_id, set())  # freed by a rank before this point (decode abort)
        pending = set(range(self.kv.tp_size)) - failed - let_go if (self.kv is not None and ls is not None) else set()
        lease = _Lease(job.lease_id, job.request_id, len(table), now + job.ttl_s, pending)
        self._leases[job.lease_id] = lease
        self._lease_of_request[job.request_id] = job.lease_id
        handoff = None
        checksums = None
        if error is not None:
            what = error[1]
            self._release(job.lease_id, "aborted")
            self._settle(job.future, exc=PrefillError(f"handing the KV to kv_transfer failed: {what}"))
            self._emit("failed", job.request_id)
            return
        if reason is not None:
            self._release(job.lease_id, "aborted")  # nothing to transfer: the request is complete
        elif self.kv is not None and ls is not None:
            handoff = self.kv.handoff(ls)
            if self.config.kv_checksum:
                try:
                    checksums = self.kv.checksums(ls)
                except Exception as e:
                    self._release(job.lease_id, "aborted")
                    self._settle(job.future, exc=PrefillError(f"checksumming the KV failed: {e}"))
                    self._emit("failed", job.request_id)
                    return
        self._requests_finished += 1
        res = PrefillResult(
            job.request_id,
            tok,
            lp,
            job.prompt_len,
            out.cached_tokens,
            reason is not None,
            reason,
            None if reason else job.lease_id,
            handoff,
            table,
            started - job.arrival,
            now - started,
            job.ttl_s,
            out.new_top_logprobs[0] if out.new_top_logprobs else None,
            [
                (o.new_token_ids[0], o.new_logprobs[0], o.new_top_logprobs[0] if o.new_top_logprobs else None, r)
                for o, r in zip(outs, reasons)
            ]
            if len(outs) > 1
            else [],
            out.prompt_logprobs,
            checksums,
        )
        self._settle(job.future, res)
        self._emit("first_token", job.request_id)

    def _cancel(self, request_id: str, why: str) -> bool:
        job = self._jobs.pop(request_id, None)
        if job is not None:
            self._eng.abort(request_id)  # not yet at its first token: no lease was published
            self._settle(job.future, exc=Cancelled(f"prefill of {request_id!r} cancelled ({why})"))
            self._emit("cancelled", request_id)
            return True
        lid = self._lease_of_request.get(request_id)
        return lid is not None and self._release(lid, "aborted")

    def _release(self, lease_id: str, reason: str) -> bool:
        lease = self._leases.get(lease_id)
        if lease is None or lease.released:
            return False
        lease.released = True
        if lease.pending_ranks:
            assert self.kv is not None  # ranks are pending only with a KV transport
            self.kv.abort([lease_id], reason)  # publishers free it once no read is in flight (on_free)
        else:
            self._drop_lease(lease, reason)
        return True

    def _drop_lease(self, lease: _Lease, reason: str) -> None:
        self._leases.pop(lease.lease_id, None)
        self._lease_of_request.pop(lease.request_id, None)
        self._eng.release(lease.request_id)
        self._leases_freed[reason] = self._leases_freed.get(reason, 0) + 1
        self._emit("freed", lease.request_id)

    def _collect_freed(self, force_poll: bool = False) -> None:
        if self.kv is None or not (self._leases or force_poll):
            return
        now = time.monotonic()
        others = any(r > 0 for ls in self._leases.values() for r in ls.pending_ranks)
        poll = force_poll or (others and now - self._last_poll > 0.05)
        if poll:
            self._last_poll = now
        freed, errors = self.kv.take(poll_others=poll)
        for rank, lid, layer, what in errors:
            log.error("kv lease %s: rank %d failed at layer %d: %s", lid, rank, layer, what)
            lease = self._leases.get(lid)
            if lease is None:  # failed while its last chunk ran: _on_output fails the request
                ranks, first = self._publish_errors.setdefault(lid, (set(), f"rank {rank} layer {layer}: {what}"))
                if layer == 0:
                    ranks.add(rank)
            else:
                if layer == 0:
                    lease.pending_ranks.discard(rank)
                self._release(lid, "aborted")
        for rank, lid, reason in freed:
            lease = self._leases.get(lid)
            if lease is None:
                if any(j.lease_id == lid for j in self._jobs.values()):  # before its first token was handled
                    self._early_freed.setdefault(lid, set()).add(rank)
                continue
            lease.pending_ranks.discard(rank)
            if not lease.pending_ranks:
                self._drop_lease(lease, reason)
            elif not lease.released:  # one rank let go (expired / decode gave up): the others must too
                self._release(lid, reason)

    def _expire_leases(self) -> None:
        if self.kv is not None:
            return  # publishers run the TTL (renewed by decode contact)
        now = time.monotonic()
        for lease in [ls for ls in self._leases.values() if ls.expires_at <= now]:
            log.warning(
                "kv lease %s (request %s) expired unreleased; freeing its blocks", lease.lease_id, lease.request_id
            )
            self._drop_lease(lease, "expired")

    def _fail_all(self, err: Exception) -> None:
        for rid in list(self._jobs):
            job = self._jobs.pop(rid)
            self._eng.abort(rid)
            self._settle(
                job.future, exc=err if isinstance(err, PrefillError) else PrefillError(f"prefill failed: {err!r}")
            )

    def _update_stats(self) -> None:
        eng = self._eng
        sch = eng.scheduler
        queued = sum(s.num_tokens - s.num_computed for s in list(sch.waiting) + sch.running if s.prefilling)
        held = {b for s in eng.held.values() for t in s.block_tables for b in t}
        bm = eng.blocks
        self.stats = Stats(
            queued_prompt_tokens=queued,
            num_running=len(sch.running),
            num_waiting=len(sch.waiting),
            num_inflight=len(self._jobs),
            num_leases=len(self._leases),
            kv_held_blocks=len(held),
            free_blocks=bm.num_free(0),
            total_blocks=bm.num_blocks,
            prompt_tokens_computed=eng.num_prompt_tokens_computed,
            prefix_hit_tokens=bm.prefix_hits,
            prefix_query_tokens=bm.prefix_queries,
            requests_finished=self._requests_finished,
            num_steps=self._num_steps,
            leases_freed=dict(self._leases_freed),
        )

    def _emit(self, kind: str, request_id: str) -> None:
        if self.on_event is not None:
            self.on_event(kind, request_id)

    def _shutdown_engine(self, thread: EngineThread) -> None:
        thread.run_commands()  # answer whatever was queued behind the stop (new prefills get UNAVAILABLE)
        for job in list(self._jobs.values()):
            self._settle(job.future, exc=Draining("prefill pod shutting down"))
        self._jobs.clear()
        if self.kv is not None:
            try:
                self.kv.close()
            except Exception:
                log.exception("closing the kv publishers failed")
        for lease in list(self._leases.values()):
            self._drop_lease(lease, "shutdown")
        self._update_stats()
        self._flush_settled()
        self._eng.shutdown()
