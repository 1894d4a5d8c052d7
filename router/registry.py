"""Registry of prefill and decode pods: registration (with config validation), heartbeats, health, eviction.

Single-threaded: every method runs on the router's event loop, so there are no locks. Besides what pods report,
each entry carries the router's own bookkeeping (requests in flight, prompt tokens sent to a prefill pod, KV blocks
reserved on a decode pod since its last heartbeat), so placement does not wait a heartbeat to see its own choices.

Life cycle of a pod: RegisterWorker -> READY (or STARTING) -> heartbeats. Silent for ``missed_heartbeats_unhealthy``
intervals -> UNHEALTHY (no new traffic); a heartbeat brings it back. Silent for ``eviction_timeout_s`` -> dropped:
its in-flight requests are told (``on_evict``) and fail over / end with UNAVAILABLE.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Iterable

from pdserve.errors import FailedPrecondition, InvalidArgument, ServiceError, Unauthenticated
from pdserve.parallel_config import ParallelConfig, kv_dtype_mismatch
from pdserve.security import secrets_match
from pdserve_api.v1 import common_pb2, registry_pb2, router_pb2
from router.config import RouterConfig
from router.local_prefill import AUTO, auto_threshold
from router.placement import DecodeView, PrefillView, blocks_needed
from router.registry_checks import heartbeat_problem, kv_stats_problem, register_problem
from router.validation import check_for_role, facts_from_shape, parallel_from_proto, shape_mismatch

log = logging.getLogger("router.registry")

READY = common_pb2.POD_STATE_READY
STARTING = common_pb2.POD_STATE_STARTING
DRAINING = common_pb2.POD_STATE_DRAINING
UNHEALTHY = common_pb2.POD_STATE_UNHEALTHY
PREFILL = common_pb2.ROLE_PREFILL
DECODE = common_pb2.ROLE_DECODE
UNIFIED = common_pb2.ROLE_UNIFIED  # prefills its own requests; takes decodes like a decode pod too


@dataclass
class PodEntry:
    pod_id: str
    role: common_pb2.Role
    model: str
    address: str
    kv_transfer_address: str
    parallel: ParallelConfig
    registration: registry_pb2.RegisterWorkerRequest
    registered_at: float
    last_heartbeat: float
    state: common_pb2.PodState = READY
    load: common_pb2.LoadStats = field(default_factory=common_pb2.LoadStats)
    kv_free: list[int] = field(default_factory=list)  # per TP rank, as last reported
    kv_total: list[int] = field(default_factory=list)
    # --- the router's own bookkeeping ---
    inflight: int = 0  # requests routed here and not finished
    inflight_prompt_tokens: int = 0  # prefill: prompt tokens of Prefill calls in flight
    pending_blocks: list[int] = field(default_factory=list)  # decode: reserved by the router since last report
    routed_total: int = 0  # requests ever placed here
    # decode pods: prompts this short are prefilled here, without a KV transfer (router/local_prefill.py); 0: never
    local_prefill_max_tokens: int = 0
    desired_state: common_pb2.PodState = common_pb2.POD_STATE_UNSPECIFIED

    @property
    def layout(self) -> common_pb2.KVLayout:
        return self.registration.kv_layout

    @property
    def tp(self) -> int:
        return self.parallel.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.parallel.decode_context_parallel_size

    @property
    def interleave(self) -> int:
        return self.parallel.dcp_kv_cache_interleave_size if self.dcp > 1 else 1

    @property
    def block_size(self) -> int:
        return self.registration.kv_layout.block_size or self.parallel.block_size

    @property
    def max_model_len(self) -> int:
        return self.registration.capacity.max_model_len or self.registration.model_shape.max_model_len

    def blocks_for(self, num_tokens: int) -> list[int]:
        return blocks_needed(num_tokens, self.tp, self.dcp, self.interleave, self.block_size)

    def effective_free(self) -> list[int]:
        if len(self.kv_free) != self.tp:
            return []
        pend = self.pending_blocks or [0] * self.tp
        return [f - p for f, p in zip(self.kv_free, pend)]


class Registry:
    def __init__(
        self,
        config: RouterConfig,
        model_name: str,
        model_aliases: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.model_name = model_name
        self.model_aliases = {model_name, *model_aliases}
        self.clock = clock
        self.router_id = uuid.uuid4().hex[:12]
        self.pods: dict[str, PodEntry] = {}
        self._on_change: list[Callable[[], None]] = []
        self._on_evict: list[Callable[[str], None]] = []
        self._on_register: list[Callable[[str, str], None]] = []
        self._threshold_logged: dict[str, int] = {}  # decode pod -> the auto threshold last logged for it

    # --- listeners ---
    def on_change(self, fn: Callable[[], None]) -> None:
        """Called when capacity may have grown (registration, heartbeat, a request's KV given back)."""
        self._on_change.append(fn)

    def on_evict(self, fn: Callable[[str], None]) -> None:
        """Called with the pod id when a pod is dropped (evicted or deregistered)."""
        self._on_evict.append(fn)

    def on_register(self, fn: Callable[[str, str], None]) -> None:
        """Called with the pod id and its address when a pod is accepted at registration (its start, or again after
        a router restart or its eviction)."""
        self._on_register.append(fn)

    def changed(self) -> None:
        for fn in self._on_change:
            fn()

    def _lost(self, pod_id: str) -> None:
        self._threshold_logged.pop(pod_id, None)
        for fn in self._on_evict:
            fn(pod_id)

    def _check_token(self, token: str) -> None:
        if self.config.cluster_token and not secrets_match(token, self.config.cluster_token):  # constant time
            raise Unauthenticated("wrong cluster_token: start the worker with the router's --cluster-token")

    # --- RPCs ---
    def register(self, req: registry_pb2.RegisterWorkerRequest) -> registry_pb2.RegisterWorkerResponse:
        self._check_token(req.cluster_token)
        problem = self._malformed(req)
        if problem:
            raise InvalidArgument(f"RegisterWorker: {problem}")
        reason, parallel = self._refusal(req)
        resp = registry_pb2.RegisterWorkerResponse(
            heartbeat_interval_s=self.config.heartbeat_interval_s, router_id=self.router_id
        )
        if reason is not None:
            role = common_pb2.Role.Name(req.role) if req.role in common_pb2.Role.values() else req.role
            log.warning("refused pod %r (%s at %s): %s", req.pod_id, role, req.address, reason)
            resp.accepted = False
            resp.message = reason
            return resp
        assert parallel is not None
        now = self.clock()
        reg = registry_pb2.RegisterWorkerRequest()
        reg.CopyFrom(req)
        reg.ClearField("cluster_token")
        old = self.pods.get(req.pod_id)
        state = req.state if req.state != common_pb2.POD_STATE_UNSPECIFIED else READY
        entry = PodEntry(
            pod_id=req.pod_id,
            role=req.role,
            model=self.model_name,
            address=req.address,
            kv_transfer_address=req.kv_transfer_address,
            parallel=parallel,
            registration=reg,
            registered_at=now,
            last_heartbeat=now,
            state=state,
        )
        if old is not None:  # re-registration keeps the router's own in-flight bookkeeping
            entry.inflight, entry.inflight_prompt_tokens = old.inflight, old.inflight_prompt_tokens
            entry.routed_total = old.routed_total
        self._apply_kv(entry, req.kv)
        if req.role == DECODE:
            entry.local_prefill_max_tokens = self._local_threshold(req)
        self.pods[req.pod_id] = entry
        log.info(
            "registered %s pod %r at %s (tp=%d dcp=%d, %s)",
            common_pb2.Role.Name(req.role),
            req.pod_id,
            req.address,
            entry.tp,
            entry.dcp,
            common_pb2.PodState.Name(state),
        )
        for fn in self._on_register:
            fn(req.pod_id, req.address)
        resp.accepted = True
        resp.message = f"welcome {req.pod_id}: serving {self.model_name!r} as {common_pb2.Role.Name(req.role)}"
        self.changed()
        return resp

    def _local_threshold(self, req: registry_pb2.RegisterWorkerRequest) -> int:
        """The decode pod's local-prefill threshold: the router's fixed one, or auto's from the pod's profile
        (logged when a pod first gets one and when it changes)."""
        fixed = self.config.local_prefill_max_tokens
        if fixed != AUTO:
            assert isinstance(fixed, int)  # RouterConfig checked it
            return fixed
        t = auto_threshold(req.step_profile if req.HasField("step_profile") else None)
        if self._threshold_logged.get(req.pod_id) != t.tokens:  # a heartbeat-lost router re-registers pods often
            log.info("local prefill threshold for pod %s: %d tokens (auto: %s)", req.pod_id, t.tokens, t.why)
            self._threshold_logged[req.pod_id] = t.tokens
        return t.tokens

    @staticmethod
    def _malformed(req: registry_pb2.RegisterWorkerRequest) -> str | None:
        """Fields no pod could mean (INVALID_ARGUMENT); a well-formed pod the router will not take (other model,
        refused parallel config, different checkpoint) is answered accepted = false by _refusal instead."""
        if not req.pod_id:
            return "pod_id is empty: give every pod a unique, stable id"
        if req.role not in (PREFILL, DECODE, UNIFIED):
            return "role must be ROLE_PREFILL, ROLE_DECODE or ROLE_UNIFIED"
        if not req.address:
            return "address is empty: send the host:port of the pod's worker service"
        if req.role == PREFILL and not req.kv_transfer_address:
            return (
                "kv_transfer_address is empty: prefill pods must serve the kv_transfer control channel and send "
                "its host:port"
            )
        return register_problem(req)

    def _refusal(self, req: registry_pb2.RegisterWorkerRequest) -> tuple[str | None, ParallelConfig | None]:
        if req.model and req.model not in self.model_aliases:
            return (
                f"model {req.model!r} is not served by this router (it tokenizes for {self.model_name!r}): "
                f"start the worker with the router's model, or a router with --model for {req.model!r}"
            ), None
        if req.state not in (common_pb2.POD_STATE_UNSPECIFIED, READY, STARTING):
            name = common_pb2.PodState.Name(req.state) if req.state in common_pb2.PodState.values() else req.state
            return (
                f"cannot register in state {name}: register as POD_STATE_READY or POD_STATE_STARTING (or leave "
                "it unset)"
            ), None
        try:
            facts = facts_from_shape(req.model_shape, "model_shape")
        except ServiceError as e:
            return f"invalid model_shape: {e.message}", None
        block = req.kv_layout.block_size
        parallel = parallel_from_proto(req.parallel, block)
        verdict = check_for_role(facts.info, parallel, req.role, req.parallel.data_parallel_size)
        if not verdict.valid:
            return f"invalid parallel config: {verdict.refusal_text()}", None
        lay = req.kv_layout
        for name, want in (
            ("tp_size", parallel.tensor_parallel_size),
            ("dcp_size", parallel.decode_context_parallel_size),
        ):
            got = getattr(lay, name)
            if got and got != want:
                return f"kv_layout.{name} ({got}) disagrees with the parallel config ({want})", None
        if req.kv and len(req.kv) != parallel.tensor_parallel_size:
            return (
                f"kv stats list {len(req.kv)} ranks but tensor_parallel_size is {parallel.tensor_parallel_size}"
            ), None
        problem = kv_stats_problem("kv", req.kv, parallel.tensor_parallel_size)
        if problem:
            return problem, None
        for other in self.pods.values():
            if other.pod_id == req.pod_id:
                continue
            if other.role != req.role:
                mine, theirs = (
                    req.kv_layout.dtype or req.model_shape.dtype,
                    other.layout.dtype or other.registration.model_shape.dtype,
                )
                pre, dec = ((mine, f"prefill pod {req.pod_id!r}"), (theirs, f"decode pod {other.pod_id!r}"))
                if req.role != common_pb2.ROLE_PREFILL:
                    pre, dec = ((theirs, f"prefill pod {other.pod_id!r}"), (mine, f"decode pod {req.pod_id!r}"))
                problem = kv_dtype_mismatch(pre[0], dec[0], pre[1], dec[1])
                if problem:  # the pair can never move KV: refused here, never at transfer time
                    raise FailedPrecondition(problem)
            diff = shape_mismatch(other.registration.model_shape, req.model_shape)
            if diff is not None:
                return (
                    f"model shape differs from pod {other.pod_id!r} serving {self.model_name!r}: {diff}; "
                    "every pod of a model must load the same checkpoint"
                ), None
            if (
                other.role != req.role
                and lay.num_layers
                and other.layout.num_layers
                and lay.num_layers != other.layout.num_layers
            ):
                return (
                    f"kv_layout.num_layers {lay.num_layers} differs from pod {other.pod_id!r} "
                    f"({other.layout.num_layers}): KV cannot move between them"
                ), None
        return None, parallel

    def heartbeat(self, req: registry_pb2.HeartbeatRequest) -> registry_pb2.HeartbeatResponse:
        self._check_token(req.cluster_token)
        entry = self.pods.get(req.pod_id)
        if entry is None:
            return registry_pb2.HeartbeatResponse(known=False)
        problem = heartbeat_problem(req, entry.tp)
        if problem:  # refused whole: the entry keeps its last good report
            raise InvalidArgument(f"heartbeat of pod {req.pod_id!r}: {problem}")
        entry.last_heartbeat = self.clock()
        entry.load.CopyFrom(req.load)
        self._apply_kv(entry, req.kv)
        if req.state != common_pb2.POD_STATE_UNSPECIFIED:
            entry.state = req.state
        elif entry.state == UNHEALTHY:
            entry.state = READY
        self.changed()
        return registry_pb2.HeartbeatResponse(known=True, desired_state=entry.desired_state)

    def deregister(self, req: registry_pb2.DeregisterWorkerRequest) -> registry_pb2.DeregisterWorkerResponse:
        self._check_token(req.cluster_token)
        found = self.pods.pop(req.pod_id, None) is not None
        if found:
            log.info("pod %r deregistered", req.pod_id)
            self._lost(req.pod_id)
        return registry_pb2.DeregisterWorkerResponse(found=found)

    def _apply_kv(self, entry: PodEntry, kv: Iterable[common_pb2.RankKVStats]) -> None:
        stats = sorted(kv, key=lambda s: s.rank)
        if len(stats) != entry.tp:
            return
        entry.kv_free = [s.free_blocks for s in stats]
        entry.kv_total = [s.total_blocks for s in stats]
        entry.pending_blocks = [0] * entry.tp  # the report covers what the router reserved before it

    # --- health ---
    def tick(self) -> list[str]:
        """Mark silent pods UNHEALTHY and drop the ones past the eviction timeout. Returns the dropped ids."""
        now = self.clock()
        dropped = []
        for pod_id, e in list(self.pods.items()):
            age = now - e.last_heartbeat
            if age > self.config.eviction_timeout_s:
                del self.pods[pod_id]
                dropped.append(pod_id)
                log.warning("pod %r silent for %.1fs: dropped", pod_id, age)
                self._lost(pod_id)
            elif age > self.config.unhealthy_after_s and e.state != UNHEALTHY:
                log.warning(
                    "pod %r missed %d heartbeats: unhealthy (drained of new traffic)",
                    pod_id,
                    self.config.missed_heartbeats_unhealthy,
                )
                e.state = UNHEALTHY  # in-flight requests carry on; they fail on their own if it is dead
        return dropped

    def suspect(self, pod_id: str) -> None:
        """A call to the pod failed at the transport level (UNAVAILABLE): no new traffic until its next heartbeat
        proves it alive (a dead pod then goes on to be evicted; a live one is READY again within an interval)."""
        e = self.pods.get(pod_id)
        if e is not None and e.state == READY:
            log.warning("pod %r unreachable: unhealthy until its next heartbeat", pod_id)
            e.state = UNHEALTHY

    # --- views for placement ---
    def ready(self, role: int) -> list[PodEntry]:
        return [e for e in self.pods.values() if e.role == role and e.state == READY]

    def decode_views(self, roles: tuple[int, ...] = (DECODE, UNIFIED)) -> list[DecodeView]:
        out = []
        for e in [e for role in roles for e in self.ready(role)]:
            free = e.effective_free()
            cap = e.registration.capacity
            running = max(e.load.num_running_seqs + e.load.num_waiting_seqs, e.inflight)
            out.append(
                DecodeView(
                    pod_id=e.pod_id,
                    tp=e.tp,
                    dcp=e.dcp,
                    interleave=e.interleave,
                    block_size=e.block_size,
                    free_blocks=tuple(free),
                    total_blocks=tuple(e.kv_total) if free else (),
                    running_seqs=running,
                    max_num_seqs=cap.max_num_seqs,
                    inflight=e.inflight,
                    max_model_len=e.max_model_len,
                    routed=e.routed_total,
                )
            )
        return out

    def prefill_views(self) -> list[PrefillView]:
        return [
            PrefillView(
                pod_id=e.pod_id,
                queued_tokens=max(e.load.queued_prompt_tokens, e.inflight_prompt_tokens),
                inflight=e.inflight,
                max_model_len=e.max_model_len,
                routed=e.routed_total,
            )
            for e in self.ready(PREFILL)
        ]

    def max_model_len(self) -> int:
        """Longest context every READY pod of both roles can serve (0: unknown)."""
        lens = [e.max_model_len for e in self.pods.values() if e.state == READY and e.max_model_len]
        return min(lens) if lens else 0

    def vocab_size(self) -> int:
        sizes = [
            e.registration.model_shape.vocab_size for e in self.pods.values() if e.registration.model_shape.vocab_size
        ]
        return min(sizes) if sizes else 0

    # --- the router's own bookkeeping ---
    def reserve_decode(self, pod_id: str, num_tokens: int) -> list[int]:
        e = self.pods[pod_id]
        need = e.blocks_for(num_tokens)
        if len(e.kv_free) == e.tp:
            e.pending_blocks = [p + n for p, n in zip(e.pending_blocks or [0] * e.tp, need)]
        e.inflight += 1
        e.routed_total += 1
        return need

    def release_decode(self, pod_id: str, need: list[int]) -> None:
        e = self.pods.get(pod_id)
        if e is None:
            return
        e.inflight = max(0, e.inflight - 1)
        if len(e.kv_free) == e.tp and len(need) == e.tp:
            e.pending_blocks = [p - n for p, n in zip(e.pending_blocks or [0] * e.tp, need)]
        self.changed()

    def mark_decode_full(self, pod_id: str) -> None:
        """AllocateKV said RESOURCE_EXHAUSTED: treat the pod as full until its next report."""
        e = self.pods.get(pod_id)
        if e is not None and len(e.kv_free) == e.tp:
            e.pending_blocks = list(e.kv_free)

    def start_prefill(self, pod_id: str, prompt_tokens: int) -> None:
        e = self.pods[pod_id]
        e.inflight += 1
        e.routed_total += 1
        e.inflight_prompt_tokens += prompt_tokens

    def end_prefill(self, pod_id: str, prompt_tokens: int) -> None:
        e = self.pods.get(pod_id)
        if e is None:
            return
        e.inflight = max(0, e.inflight - 1)
        e.inflight_prompt_tokens = max(0, e.inflight_prompt_tokens - prompt_tokens)

    # --- ClusterStatus ---
    def pod_status(self, e: PodEntry) -> router_pb2.PodStatus:
        now = self.clock()
        st = router_pb2.PodStatus(
            pod_id=e.pod_id,
            role=e.role,
            address=e.address,
            kv_transfer_address=e.kv_transfer_address,
            model=e.model,
            state=e.state,
            last_heartbeat_age_s=now - e.last_heartbeat,
            uptime_s=now - e.registered_at,
            num_inflight_requests=e.inflight,
            local_prefill_max_tokens=e.local_prefill_max_tokens,
        )
        st.parallel.CopyFrom(e.registration.parallel)
        st.load.CopyFrom(e.load)
        st.kv_layout.CopyFrom(e.layout)
        for r, (f, t) in enumerate(zip(e.kv_free, e.kv_total)):
            st.kv.add(rank=r, free_blocks=f, total_blocks=t)
        return st

    def ready_models(self) -> list[str]:
        roles = {e.role for e in self.pods.values() if e.state == READY}
        return [self.model_name] if UNIFIED in roles or {PREFILL, DECODE} <= roles else []

    def serves_unified(self) -> bool:
        """Requests go to unified pods (prefill and decode in one engine): there are READY ones and no READY
        prefill pod (with prefill pods, unified pods serve as decode targets of the P/D journey)."""
        return bool(self.ready(UNIFIED)) and not self.ready(PREFILL)
