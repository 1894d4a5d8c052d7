"""DecodePod: one decode pod's state machine, single-threaded and synchronous (the server runs it on its engine
thread; tests drive it step by step).

Life of a request on a decode pod:
  reserve(id, n)                      AllocateKV: blocks for n prompt tokens on every DCP rank, kept until a TTL
  submit(id, prompt, params, first, source)
                                      Decode: take over the reservation (or reserve now, or queue until blocks free
                                      up) and have every rank write its share of the prompt KV (KVSource). With
                                      --kv-load async (the default) the ranks receive it on their transfer threads
                                      while the batch keeps stepping (decode_svc/kv_loads.py), and the first token's
                                      output comes out of the step() after every rank's share landed; with sync the
                                      engine thread waits for the transfer and submit returns that output
  step()                              admit queued requests, admit the ones whose KV landed on every rank, then one
                                      decode step of every running sequence (continuous batching); finished
                                      sequences free their blocks
  cancel(id)                          frees its reservation / queue slot at once; a request still receiving its KV
                                      ends at once, its blocks come back as soon as no rank writes into them

States of a request on the pod (docs/DESIGN.md draws them):
  reserved -> (Decode) -> queued for blocks -> receiving KV -> running -> finished
                                        +-> receiving KV fails / is cancelled -> draining (blocks held) -> freed

When blocks run out mid-decode the engine's scheduler preempts the youngest sequence, which re-queues and is
recomputed from its tokens on this pod (nothing is lost); queued new requests wait behind it."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import grpc

from decode_svc.config import DecodeConfig
from decode_svc.kv_loads import KVLoads, LoadOutcome
from decode_svc.kv_source import KVDeliveryError, KVSource, decode_connector, deliver
from pdserve.engine.block_manager import dcp_local_count
from pdserve.engine.llm_engine import LLMEngine, RequestError, RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.errors import AlreadyExists
from pdserve.sampling_params import SamplingParams

log = logging.getLogger("decode_svc.pod")


class RequestExists(AlreadyExists):
    """The request id is already reserved, queued or decoding here."""


@dataclass
class Failure:
    """A request that could not start or go on (reported instead of a RequestOutput)."""

    request_id: str
    code: grpc.StatusCode
    message: str
    finished: bool = True
    kv_from: str | None = None  # set when the prompt KV could not be loaded: the prefill pod it came from


def _kv_load_failed(request_id: str, error: KVDeliveryError, source: KVSource) -> Failure:
    """The request ends because its prompt KV could not be loaded from the prefill pod ``source`` names."""
    return Failure(request_id, error.code, error.message, kv_from=getattr(source, "prefill_pod", ""))


@dataclass
class Reservation:
    seq: Sequence  # placeholder holding the blocks; its prompt ids are not known yet
    num_tokens: int
    expires_at: float  # pod clock
    expires_at_unix_ms: int


@dataclass
class _Queued:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    first_tokens: list[int]  # one per sequence (n of them for parallel sampling)
    first_logprobs: list[float]
    source: KVSource
    deadline: float
    renewed_at: float = 0.0


class DecodePod:
    def __init__(self, config: DecodeConfig, engine: LLMEngine | None = None, clock=time.monotonic) -> None:
        self.config = config
        self.engine = engine or LLMEngine(config.engine)
        self.clock = clock
        self.tp = config.engine.tensor_parallel_size
        self.dcp = config.engine.decode_context_parallel_size
        self.interleave = config.engine.dcp_kv_cache_interleave_size
        self.block_size = config.engine.block_size
        self.reservations: dict[str, Reservation] = {}
        self.queue: deque[_Queued] = deque()
        self.kv_bytes_received = 0
        self.kv_seconds: dict[str, float] = {}  # request id -> seconds its KV delivery took
        self.loads = KVLoads(self.engine) if config.kv_load == "async" else None
        self.kv_outcomes: list[LoadOutcome] = []  # transfers ended since the engine loop last took them (metrics)

    # --- layout and accounting ---
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def tp_tables(self, dcp_tables: list[list[int]]) -> list[list[int]]:
        """Block table of every TP rank (ranks of one DCP group position share the allocator of that DCP rank)."""
        return [list(dcp_tables[r % self.dcp]) for r in range(self.tp)]

    def local_tokens(self, num_tokens: int, tp_rank: int) -> int:
        return dcp_local_count(num_tokens, self.dcp, self.interleave, tp_rank % self.dcp)

    def free_blocks_per_rank(self) -> list[int]:
        free = self.engine.blocks.free_per_rank()
        return [free[r % self.dcp] for r in range(self.tp)]

    def used_blocks_per_rank(self) -> list[int]:
        total = self.engine.blocks.num_blocks
        return [total - f for f in self.free_blocks_per_rank()]

    @property
    def num_blocks(self) -> int:
        return self.engine.blocks.num_blocks

    def block_tables_of(self, request_id: str) -> list[list[int]] | None:
        """Current block table per TP rank of a reserved or tracked request (None if unknown)."""
        res = self.reservations.get(request_id)
        if res is not None:
            return self.tp_tables(res.seq.block_tables)
        tables = self.engine.block_tables_of(request_id)
        return None if tables is None else self.tp_tables(tables)

    def knows(self, request_id: str) -> bool:
        return (
            request_id in self.reservations
            or self.engine.knows(request_id)
            or any(q.request_id == request_id for q in self.queue)
        )

    @property
    def num_running(self) -> int:
        return len(self.engine.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Queued for blocks (new or preempted) or waiting for their KV to land."""
        s = self.engine.scheduler
        return len(self.queue) + len(s.waiting) + len(s.awaiting_kv)

    @property
    def num_waiting_for_kv(self) -> int:
        """Requests whose KV is still arriving (their blocks are held, the batch steps without them)."""
        return len(self.loads.active) if self.loads is not None else 0

    @property
    def num_generated_tokens(self) -> int:
        return self.engine.num_generated_tokens

    def has_work(self) -> bool:
        s = self.engine.scheduler
        return bool(self.queue or s.running or s.waiting or self.loads)

    def only_receiving(self) -> bool:
        """Nothing to compute, only KV transfers to wait for (the engine loop polls them without spinning)."""
        s = self.engine.scheduler
        return bool(self.loads) and not (self.queue or s.running or s.waiting)

    def idle(self) -> bool:
        """Nothing reserved, queued, receiving or decoding (and no given-up transfer still holding blocks)."""
        return not (self.reservations or self.engine.has_unfinished() or self.queue or self.loads)

    # --- AllocateKV ---
    def reserve(
        self, request_id: str, num_tokens: int, extra_tokens: int = 0, ttl_s: float | None = None
    ) -> list[list[int]] | None:
        """Reserve blocks for num_tokens prompt tokens (+ extra_tokens); block table per DCP rank, or None when the
        pod has no room now."""
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or not 1 <= num_tokens < self.max_model_len:
            raise RequestError(
                f"num_tokens must be in [1, {self.max_model_len - 1}] (max_model_len "
                f"{self.max_model_len}), got {num_tokens!r}"
            )
        if extra_tokens < 0:
            raise RequestError(f"num_reserved_output_tokens must be >= 0, got {extra_tokens}")
        if self.knows(request_id):
            raise RequestExists(f"request {request_id!r} already has a reservation or is decoding on this pod")
        if self._num_admitted() >= self.config.engine.max_num_seqs:
            return None
        seq = self.engine.reserve(request_id, num_tokens, min(num_tokens + extra_tokens, self.max_model_len))
        if seq is None:
            return None
        ttl = ttl_s if ttl_s and ttl_s > 0 else self.config.reservation_ttl_s
        self.reservations[request_id] = Reservation(
            seq, num_tokens, self.clock() + ttl, int((time.time() + ttl) * 1000)
        )
        return [list(t) for t in seq.block_tables]

    def _num_admitted(self) -> int:
        s = self.engine.scheduler
        return len(s.running) + len(s.awaiting_kv) + len(self.reservations)

    def expire_reservations(self) -> list[str]:
        now = self.clock()
        gone = [rid for rid, r in self.reservations.items() if r.expires_at <= now]
        for rid in gone:
            self._release_reservation(rid)
        return gone

    def _release_reservation(self, request_id: str) -> Reservation | None:
        res = self.reservations.pop(request_id, None)
        if res is not None:
            self.engine.free_reserved(res.seq)
        return res

    # --- Decode ---
    def submit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        first_token: int,
        first_logprob: float,
        source: KVSource,
        wait_s: float | None = None,
    ) -> RequestOutput | None:
        """Start decoding request_id. Returns the first token's output once its KV landed (sync; finished already
        when that token ends the request), or None when the request was queued for blocks or its KV is being
        received (it then starts in a later step(), or ends with a Failure: RESOURCE_EXHAUSTED after wait_s, the
        transfer's status). Raises RequestError (bad request), RequestExists, KVDeliveryError (sync; nothing is
        kept then)."""
        outs = self.submit_all(request_id, prompt_ids, params, [first_token], [first_logprob], source, wait_s)
        return outs[0] if outs else None

    def submit_all(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        first_tokens: list[int],
        first_logprobs: list[float],
        source: KVSource,
        wait_s: float | None = None,
    ) -> list[RequestOutput] | None:
        """submit for a request of n = len(first_tokens) sequences sharing the prompt's KV (the engine forks it when
        it lands): one first output per sequence, in index order; [] when the KV is being received (async), the
        outputs then come out of step()."""
        eng = self.engine
        prompt_ids = list(prompt_ids)
        eng.validate_prompt(prompt_ids, params)
        vocab = eng.model_config.vocab_size
        if not first_tokens or len(first_tokens) != len(first_logprobs):
            raise RequestError(
                f"{len(first_tokens)} first tokens but {len(first_logprobs)} logprobs: give one of each per sequence"
            )
        bad = next(
            (t for t in first_tokens if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab), None
        )
        if bad is not None:
            raise RequestError(f"first_token_id {bad!r} is out of range [0, {vocab})")
        if source.num_tokens != len(prompt_ids):
            raise RequestError(f"the KV handle covers {source.num_tokens} tokens but the prompt has {len(prompt_ids)}")
        res = self.reservations.get(request_id)
        if res is not None:
            if res.num_tokens != len(prompt_ids):
                raise RequestError(
                    f"request {request_id!r} reserved KV for {res.num_tokens} tokens but the prompt "
                    f"has {len(prompt_ids)}"
                )
            seq = eng.adopt(res.seq, prompt_ids, params, len(first_tokens))
            del self.reservations[request_id]
            return self._receive(seq, first_tokens, first_logprobs, source)
        if self.knows(request_id):
            raise RequestExists(f"request {request_id!r} is already decoding on this pod")
        q = _Queued(
            request_id,
            prompt_ids,
            params,
            list(first_tokens),
            list(first_logprobs),
            source,
            self.clock() + (self.config.admission_timeout_s if wait_s is None else wait_s),
        )
        # FIFO: nobody overtakes queued or preempted requests.
        if not self.queue and not eng.scheduler.waiting:
            out = self._try_admit(q)
            if out is not None:
                return out
        self.queue.append(q)
        return None

    def submit_prompt(self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """Unified pod: the engine computes the prompt itself (its chunked prefill steps alternate with decode
        steps) and waits in the engine's queue for blocks; every token, the first included, comes out of step().
        Raises RequestError (bad request), RequestExists."""
        if self.knows(request_id):
            raise RequestExists(f"request {request_id!r} is already decoding on this pod")
        self.engine.add_request(list(prompt_ids), params, request_id=request_id, n=n)

    def _try_admit(self, q: _Queued) -> list[RequestOutput] | None:
        eng = self.engine
        if self._num_admitted() >= self.config.engine.max_num_seqs:
            return None
        # Keep a block per rank in hand for the running sequences, as the scheduler does for new prompts.
        seq = eng.add_awaiting_kv(
            q.prompt_ids, q.params, q.request_id, headroom=1 if eng.scheduler.running else 0, n=len(q.first_tokens)
        )
        if seq is None:
            return None
        return self._receive(seq, q.first_tokens, q.first_logprobs, q.source)

    def _receive(
        self, seq: Sequence, first_tokens: list[int], first_logprobs: list[float], source: KVSource
    ) -> list[RequestOutput]:
        """Have every rank write seq's prompt KV: started here and landed by a later step (async, []), or
        written before this returns the first outputs (sync)."""
        if self.loads is not None:
            self.loads.start(seq, source, first_tokens, first_logprobs)
            return []
        eng = self.engine
        try:
            nbytes, secs = deliver(eng.executor, source, seq.block_tables)
        except KVDeliveryError as e:
            eng.abort(seq.request_id)
            self.kv_outcomes.append(LoadOutcome(seq.request_id, 0.0, 0, e.code.name))
            raise
        return self._land(seq, first_tokens, first_logprobs, sum(nbytes), secs)

    def _land(
        self, seq: Sequence, first_tokens: list[int], first_logprobs: list[float], nbytes: int, secs: float
    ) -> list[RequestOutput]:
        self.kv_bytes_received += nbytes
        self.kv_seconds[seq.request_id] = secs
        self.kv_outcomes.append(LoadOutcome(seq.request_id, secs, nbytes))
        outs = self.engine.start_decoding_all(seq, first_tokens, first_logprobs)
        if any(o.finished for o in outs):
            self.kv_seconds.pop(seq.request_id, None)
        return outs

    def _poll_loads(self) -> list[RequestOutput | Failure]:
        """Requests whose KV landed on every rank join the batch; failed transfers end their request."""
        events: list[RequestOutput | Failure] = []
        if self.loads is None:
            return events
        landed, failed = self.loads.poll()
        for ld in landed:
            events.extend(self._land(ld.seq, ld.first_tokens, ld.first_logprobs, ld.nbytes, ld.seconds))
        for ld in failed:
            assert ld.error is not None
            self.kv_outcomes.append(LoadOutcome(ld.request_id, ld.seconds, ld.nbytes, ld.error.code.name))
            events.append(_kv_load_failed(ld.request_id, ld.error, ld.source))
        return events

    # --- the loop ---
    def step(self) -> list[RequestOutput | Failure]:
        """Admit queued requests that fit and those whose KV landed, then one engine step (every running sequence
        gets a token)."""
        events: list[RequestOutput | Failure] = self._admit_queued()
        events.extend(self._poll_loads())
        events.extend(self.engine.step())
        for ev in events:
            if ev.finished:  # per-request state must not outlive the request (the soak serves thousands)
                self.kv_seconds.pop(ev.request_id, None)
        return events

    def _admit_queued(self) -> list[RequestOutput | Failure]:
        events: list[RequestOutput | Failure] = []
        now = self.clock()
        while self.queue:
            q = self.queue[0]
            if q.deadline <= now:
                self.queue.popleft()
                events.append(
                    Failure(
                        q.request_id,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        "no free KV blocks on this decode pod within the admission timeout",
                    )
                )
                continue
            if self.engine.scheduler.waiting:
                break  # preempted sequences get their blocks back first
            try:
                out = self._try_admit(q)
            except KVDeliveryError as e:
                self.queue.popleft()
                events.append(_kv_load_failed(q.request_id, e, q.source))
                continue
            except RequestError as e:
                self.queue.popleft()
                events.append(Failure(q.request_id, grpc.StatusCode.INVALID_ARGUMENT, str(e)))
                continue
            if out is None:
                break
            self.queue.popleft()
            events.extend(out)
        return events

    KEEPALIVE_S = 5.0

    def keep_queued_alive(self) -> None:
        """Renew the prefill leases of requests queued for blocks (sources that support it), every KEEPALIVE_S."""
        now = self.clock()
        for q in self.queue:
            keepalive = getattr(q.source, "keepalive", None)
            if keepalive is None or now - q.renewed_at < self.KEEPALIVE_S:
                continue
            q.renewed_at = now
            try:
                keepalive(decode_connector(self.engine.executor))
            except Exception as e:  # the pull itself will report a lease that is really gone
                log.warning("renewing the KV lease of queued request %s failed: %s", q.request_id, e)

    def cancel(self, request_id: str) -> bool:
        """Drop a reservation, a queued request or a decoding one; its blocks are free when this returns (those of
        a request still receiving its KV once every rank stopped writing, at its next layer group)."""
        if self._release_reservation(request_id) is not None:
            return True
        if self.loads is not None and self.loads.give_up(request_id, "cancelled while receiving its KV") is not None:
            return True
        for q in self.queue:
            if q.request_id == request_id:
                self.queue.remove(q)
                return True
        self.kv_seconds.pop(request_id, None)
        return self.engine.abort(request_id)

    def shutdown(self) -> None:
        try:  # kv_transfer pullers live in the rank processes: close their connections first
            ex = self.engine.executor
            if ex.runner.kv_connector is not None and ex.workers_alive():  # a dead rank (RankDied) cannot take it
                ex.connector_call("close")
        finally:
            self.engine.shutdown()
