"""RouterCore: the state one router process shares between its RPCs (tokenizer, registry, admission queue, prefix
index, metrics, channels to pods, in-flight requests) plus request validation (prompt -> token ids, sampling
parameters) and the background clean-up of pods (CancelPrefill / CancelDecode / ReleaseKV)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

import grpc

from pdserve.engine.config import MAX_N
from pdserve.errors import InvalidArgument, ServiceError
from pdserve.pod.sampling import num_sequences, requested_params
from pdserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingParamsError
from pdserve.security import aio_channel
from pdserve.structured import StructuredOutputError, StructuredSpec, check_spec
from pdserve.tokenizer import Tokenizer
from pdserve_api.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc, router_pb2
from router.admission import Admission, Admitted
from router.chat import template_inputs
from router.config import RouterConfig
from router.flight import Flight
from router.metrics import RouterMetrics
from router.placement import PrefixIndex, block_hashes, pick_prefill, prefill_locally, prefix_key, rendezvous
from router.registry import DECODE, Registry

log = logging.getLogger("router")

_TEXT_TO_THREAD = 4096  # tokenize prompts longer than this (characters) off the event loop


@dataclass
class Prepared:
    """A validated request."""

    request_id: str
    prompt_ids: list[int]
    params: common_pb2.SamplingParams  # forwarded to the pods as the client sent it
    max_tokens: int | None
    want_logprobs: bool
    kv_tokens: int  # tokens of decode KV to book: prompt + reserved output room
    block_hashes: list[int] = field(default_factory=list)
    affinity_key: bytes | None = None  # rendezvous key of the prompt's first blocks (placement.prefix_key)
    # max_tokens == 1: the prefill pod samples the only token and ends the request itself (it sees max_tokens=1),
    # so no decode pod is involved: no admission booking, no AllocateKV, no Decode stream, no CancelDecode.
    prefill_only: bool = False


def _resolve_model_path(config: RouterConfig) -> str:
    if config.model is not None:
        return config.model
    from pdserve.default_model import ensure_default_model

    return str(ensure_default_model())


class RouterCore:
    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.model_path = _resolve_model_path(config)
        self.tokenizer = Tokenizer(self.model_path)
        self.model_name = config.model_name_for(self.model_path)
        p = Path(self.model_path)
        aliases = {self.model_path, str(p.resolve()), p.name}
        self.registry = Registry(config, self.model_name, aliases, clock=clock)
        self.admission = Admission(self.registry, config)
        self.prefix = PrefixIndex(config.prefix_block_size, config.prefix_index_capacity)
        self.metrics = RouterMetrics()
        self.flights: dict[str, Flight] = {}
        self.draining = False
        self.eos_token_ids = self._eos_ids()
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[tuple[str, type], Any] = {}  # (address, stub class) -> stub on that address's channel
        self._tls = config.tls  # built once: the certificate files are read when a channel is made
        self._tasks: set[asyncio.Task] = set()
        self.registry.on_evict(self._pod_lost)
        self.registry.on_register(self._pod_registered)
        self.registry.on_register(self._show_threshold)

    def _eos_ids(self) -> set[int]:
        ids: set[int] = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        try:
            eos = json.loads((Path(self.model_path) / "config.json").read_text()).get("eos_token_id")
        except (OSError, ValueError):
            eos = None
        if isinstance(eos, int):
            ids.add(eos)
        elif isinstance(eos, list):
            ids.update(e for e in eos if isinstance(e, int))
        return ids

    # ------------------------------------------------------------------------------------------------------------
    # Pods
    # ------------------------------------------------------------------------------------------------------------

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            ch = aio_channel(address, self._tls)  # TLS (client cert under mTLS) as configured; shared size limits
            self._channels[address] = ch
        return ch

    def _stub(self, pod_id: str, kind: type) -> Any:
        """The pod's stub of ``kind``, made once per address (building a stub is not free: not per call)."""
        e = self.registry.pods.get(pod_id)
        if e is None:
            raise KeyError(pod_id)
        stub = self._stubs.get((e.address, kind))
        if stub is None:
            stub = self._stubs[(e.address, kind)] = kind(self.channel(e.address))
        return stub

    def prefill_stub(self, pod_id: str) -> prefill_pb2_grpc.PrefillWorkerStub:
        return self._stub(pod_id, prefill_pb2_grpc.PrefillWorkerStub)

    def decode_stub(self, pod_id: str) -> decode_pb2_grpc.DecodeWorkerStub:
        return self._stub(pod_id, decode_pb2_grpc.DecodeWorkerStub)

    def _pod_registered(self, pod_id: str, address: str) -> None:
        """A pod registering may be a new process behind an address whose channel still waits out gRPC's reconnect
        backoff from the old one (seconds to minutes), failing every call at once with the old error. A channel
        that is not connected is replaced, so the next call connects now; a connected one is kept with its calls."""
        ch = self._channels.get(address)
        if ch is None or ch.get_state(try_to_connect=False) == grpc.ChannelConnectivity.READY:
            return
        del self._channels[address]
        for key in [k for k in self._stubs if k[0] == address]:
            del self._stubs[key]
        self.spawn(ch.close(grace=self.config.cleanup_timeout_s))

    def _show_threshold(self, pod_id: str, address: str) -> None:
        e = self.registry.pods[pod_id]
        if e.role == DECODE and self.config.local_prefill:
            self.metrics.local_prefill_max_tokens.labels(pod_id).set(e.local_prefill_max_tokens)

    def _pod_lost(self, pod_id: str) -> None:
        self.metrics.forget_pod(pod_id)
        self.prefix.forget_pod(pod_id)
        for f in list(self.flights.values()):
            f.pod_lost(pod_id)

    def local_prefill_pods(self, prep: Prepared) -> frozenset[str]:
        """Conditional disaggregation: the READY decode pods that would compute this request's prompt themselves
        instead of a prefill pod (placement.prefill_locally with each pod's own threshold, router/local_prefill.py);
        empty: prefill on a prefill pod. Prompt logprobs are a prefill pod's job, so those requests never are."""
        cfg = self.config
        if not cfg.local_prefill or prep.prefill_only or prep.params.HasField("prompt_logprobs"):
            return frozenset()
        queued = min((v.queued_tokens for v in self.registry.prefill_views()), default=None)
        n, most = len(prep.prompt_ids), cfg.local_prefill_queue_tokens
        return frozenset(
            e.pod_id
            for e in self.registry.ready(DECODE)
            if prefill_locally(n, e.local_prefill_max_tokens, queued, most)
        )

    def pick_prefill(self, prep: Prepared, exclude: set[str]) -> str | None:
        """Choose a prefill pod and book the prompt's tokens on it at once (so a burst of requests sees each
        other's choices); the caller gives them back with ``registry.end_prefill`` when its Prefill call ends."""
        aff, _ = self.prefix.lookup(prep.block_hashes)
        views = self.registry.prefill_views()
        if aff is None and prep.affinity_key is not None:  # unseen prefix: the pod every replica would pick
            aff = rendezvous(prep.affinity_key, [v.pod_id for v in views if v.pod_id not in exclude])
        pod = pick_prefill(views, len(prep.prompt_ids), aff, exclude, self.config.affinity_max_imbalance_tokens)
        if pod is not None:
            self.prefix.record(prep.block_hashes, pod)
            self.registry.start_prefill(pod, len(prep.prompt_ids))
        return pod

    # ------------------------------------------------------------------------------------------------------------
    # Background clean-up (must survive the cancellation of the request that needs it)
    # ------------------------------------------------------------------------------------------------------------

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
        return t

    async def _quiet(self, rpc: str, pod_id: str, call: Callable[[], Awaitable[Any]]) -> Any:
        try:
            return await call()
        except (grpc.aio.AioRpcError, KeyError, asyncio.TimeoutError) as e:
            self.metrics.cleanup_failures.labels(rpc).inc()
            detail = e.details() if isinstance(e, grpc.aio.AioRpcError) else repr(e)
            log.info("%s on pod %r failed (%s); the pod frees it on its own timeout", rpc, pod_id, detail)
            return None

    async def cancel_prefill(self, pod_id: str, request_id: str) -> None:
        t = self.config.cleanup_timeout_s
        await self._quiet(
            "CancelPrefill",
            pod_id,
            lambda: self.prefill_stub(pod_id).CancelPrefill(
                prefill_pb2.CancelPrefillRequest(request_id=request_id), timeout=t
            ),
        )

    async def release_kv(self, pod_id: str, lease_id: str) -> None:
        t = self.config.cleanup_timeout_s
        await self._quiet(
            "ReleaseKV",
            pod_id,
            lambda: self.prefill_stub(pod_id).ReleaseKV(prefill_pb2.ReleaseKVRequest(lease_id=lease_id), timeout=t),
        )

    async def cancel_decode(self, pod_id: str, request_id: str, admitted: Admitted | None = None) -> None:
        t = self.config.cleanup_timeout_s
        try:
            await self._quiet(
                "CancelDecode",
                pod_id,
                lambda: self.decode_stub(pod_id).CancelDecode(
                    decode_pb2.CancelDecodeRequest(request_id=request_id), timeout=t
                ),
            )
        finally:
            if admitted is not None:  # the booking goes back once the pod has freed the blocks
                self.admission.release(admitted)

    async def close(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.cleanup_timeout_s + 1)
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()
        self._stubs.clear()

    # ------------------------------------------------------------------------------------------------------------
    # Request validation
    # ------------------------------------------------------------------------------------------------------------

    async def prepare(self, req: router_pb2.GenerateRequest) -> Prepared:
        """Validate a GenerateRequest; raises ServiceError (INVALID_ARGUMENT, NOT_FOUND, UNAVAILABLE,
        ALREADY_EXISTS)."""
        if self.draining:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, "router is shutting down: send the request to another router"
            )
        if req.model and req.model not in self.registry.model_aliases:
            raise ServiceError(
                grpc.StatusCode.NOT_FOUND,
                f"model {req.model!r} is not served here; this cluster serves {self.model_name!r} "
                "(or leave model empty)",
            )
        if req.request_id:
            _check_request_id(req.request_id)
        rid = req.request_id or uuid.uuid4().hex
        if rid in self.flights:
            raise ServiceError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {rid!r} is already in flight: use a unique id per request (or leave it "
                "empty and the router assigns one)",
            )
        prompt_ids = await self._prompt_ids(req)
        vocab = self.registry.vocab_size() or self.tokenizer.vocab_size
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt token id {bad} is out of range for the model's vocabulary [0, {vocab})",
            )
        max_len = self.registry.max_model_len()
        if max_len and len(prompt_ids) >= max_len:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"prompt has {len(prompt_ids)} tokens but max_model_len is {max_len}: shorten it to at "
                f"most {max_len - 1} tokens",
            )
        sp = req.sampling_params
        params = _check_sampling(sp, vocab)
        await _check_structured(params.structured)
        if max_len and sp.min_tokens > max_len:
            raise ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"sampling_params: min_tokens ({sp.min_tokens}) must not exceed max_model_len ({max_len})",
            )
        max_tokens = sp.max_tokens if sp.HasField("max_tokens") else None
        max_tokens_eff: int | None
        if max_len and max_tokens is not None and len(prompt_ids) + max_tokens > max_len:
            max_tokens_eff = max_len - len(prompt_ids)  # decode stops at the context length (LENGTH)
        else:
            max_tokens_eff = max_tokens
        reserve = self.config.reserve_output_tokens
        if max_tokens_eff is not None:
            reserve = min(reserve, max(0, max_tokens_eff - 1))
        # n sequences share the prompt's KV: each needs its own output room and a copy of the prompt's last block.
        seqs = max(sp.n, sp.best_of, 1)
        kv_tokens = len(prompt_ids) + seqs * reserve + (seqs - 1) * self.config.prefix_block_size
        if max_len:
            kv_tokens = min(kv_tokens, max_len)
        want_logprobs = sp.logprobs or sp.top_logprobs > 0
        if sp.best_of > max(sp.n, 1):
            sp.logprobs = True  # the router ranks the candidates by cumulative logprob (want_logprobs: the client's)
        return Prepared(
            request_id=rid,
            prompt_ids=prompt_ids,
            params=sp,
            max_tokens=max_tokens,
            want_logprobs=want_logprobs,
            kv_tokens=kv_tokens,
            block_hashes=block_hashes(prompt_ids, self.config.prefix_block_size),
            affinity_key=prefix_key(prompt_ids, self.config.prefix_block_size, self.config.affinity_hash_blocks),
            prefill_only=max_tokens == 1,
        )

    async def _prompt_ids(self, req: router_pb2.GenerateRequest) -> list[int]:
        kind = req.WhichOneof("prompt")
        if kind is None:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "set exactly one prompt: text, token_ids or chat")
        if kind == "token_ids":
            ids = list(req.token_ids.ids)
        elif kind == "text":
            if not req.text:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "prompt text is empty")
            ids = await self._encode(req.text, True)
        else:
            if not req.chat.messages:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "chat prompt has no messages")
            msgs, tools = template_inputs(req.chat)
            add_gen = req.chat.add_generation_prompt if req.chat.HasField("add_generation_prompt") else True
            try:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=add_gen, tools=tools)
            except Exception as e:  # jinja2 errors, a model without a template
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"cannot render the chat template: {e}") from e
            ids = await self._encode(text, False)  # the template writes the special tokens itself
        if not ids:
            raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty: send at least one token")
        return ids

    async def _encode(self, text: str, add_special: bool) -> list[int]:
        if len(text) > _TEXT_TO_THREAD:
            return await asyncio.to_thread(self.tokenizer.encode, text, add_special)
        return self.tokenizer.encode(text, add_special)


MAX_REQUEST_ID_LEN = 256
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_LEN = 1024
MAX_STOP_TOKEN_IDS = 1024


def _check_request_id(rid: str) -> None:
    """Client ids travel to every pod and into logs and metric labels: bounded, printable."""
    if len(rid) > MAX_REQUEST_ID_LEN:
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request_id has {len(rid)} characters; use at most {MAX_REQUEST_ID_LEN} (or leave it empty "
            "and the router assigns one)",
        )
    if not rid.isprintable():
        raise ServiceError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request_id {rid!r} contains control characters; use printable characters only",
        )


async def _check_structured(spec: StructuredSpec | None) -> None:
    """An invalid output constraint is refused here, naming the problem, before any pod is contacted (compiling
    without a tokenizer, off the event loop: the first one imports xgrammar)."""
    if spec is None:
        return
    try:
        await asyncio.to_thread(check_spec, spec)
    except StructuredOutputError as e:
        msg = str(e) if str(e).startswith("structured_output") else f"structured_output: {e}"
        raise InvalidArgument(f"sampling_params: {msg}") from None


def _check_sampling(sp: common_pb2.SamplingParams, vocab: int) -> SamplingParams:
    """The request's sampling parameters as the engine's SamplingParams, whose construction checks every value
    (pdserve/sampling_params.py: the rules and their messages live there), plus the rules that need the router: the
    model's vocabulary, n / best_of against the engine's bound, the cost of stop strings, prompt_logprobs."""

    def bad(msg: str) -> None:
        raise InvalidArgument(f"sampling_params: {msg}")

    if sp.n < 0 or sp.n > MAX_N:
        bad(f"n must be in [1, {MAX_N}] (0: 1), got {sp.n}")
    if sp.best_of < 0 or sp.best_of > MAX_N:
        bad(f"best_of must be in [1, {MAX_N}] (0: n), got {sp.best_of}")
    # Every stop string is matched against the output after every token: bound the work one request can ask for.
    if len(sp.stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_STRING_LEN for s in sp.stop):
        bad(
            f"stop: at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_LEN} characters each, got "
            f"{len(sp.stop)} (longest {max(map(len, sp.stop))})"
        )
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        bad(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(sp.stop_token_ids)}")
    try:
        params = requested_params(sp)
        num_sequences(sp)  # best_of >= n
    except SamplingParamsError as e:
        raise InvalidArgument(f"sampling_params: {e}") from None
    if any(t >= vocab for t in sp.logit_bias):
        bad(
            f"logit_bias has token ids out of the model's vocabulary [0, {vocab}): "
            f"{sorted(t for t in sp.logit_bias if t >= vocab)[:8]}"
        )
    if sp.HasField("prompt_logprobs") and not 0 <= sp.prompt_logprobs <= MAX_LOGPROBS:
        bad(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {sp.prompt_logprobs}")
    return params
