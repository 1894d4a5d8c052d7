"""A request's whole journey through the cluster, top to bottom: ``generate``.

    validate -> book decode KV (queue if no pod has room) -> place prefill -> AllocateKV on decode
    -> Prefill (retried once on another prefill pod if it fails before the KV handoff)
    -> first token to the client -> Decode stream -> detokenize / stop strings -> tokens to the client

A prompt short enough for --local-prefill-max-tokens (conditional disaggregation, router/placement.py) skips the
prefill pod and the transfer: book decode KV -> one Decode call without a KV handle, the decode pod computing the
prompt in chunks between its decode steps -> every token, the first one included, from that stream.

Failure and cancellation rules:
- Before the first token, a failure is the call's gRPC status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE,
  DEADLINE_EXCEEDED, ...). After it, the stream ends with a final message (FINISH_REASON_ERROR plus
  error_message) and then status UNAVAILABLE; tokens already sent are never repeated.
- Cancel RPC: the stream ends with a final FINISH_REASON_CANCELLED message. Client disconnect or deadline: the call
  just ends. Either way every pod the request touched is told (CancelPrefill, ReleaseKV, CancelDecode) from a
  background task that outlives the call, so all KV is freed.
- The client's deadline goes to every pod call as its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import grpc

from pdserve.errors import KV_LOAD_FAILED_METADATA, ServiceError
from pdserve_api.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2
from router.admission import Admitted
from router.core import Prepared, RouterCore
from router.detok import OutputAssembler
from router.flight import Cancelled, Flight, PodLost

log = logging.getLogger("router.journey")

# Prefill failures that another prefill pod will not fix: passed to the client as they are.
_PREFILL_FINAL = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
}
_FINISH = {common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH}


async def generate(
    core: RouterCore, request: router_pb2.GenerateRequest, context: grpc.aio.ServicerContext
) -> AsyncIterator[router_pb2.GenerateResponse]:
    arrival = time.monotonic()
    # 1. Validate: prompt -> token ids, sampling parameters, model, request id.
    try:
        prep = await core.prepare(request)
    except ServiceError as e:
        core.metrics.count_request(e.code.name)
        _set_status(context, e.code, e.message)
        return
    rid = prep.request_id
    flight = Flight(rid)
    core.flights[rid] = flight
    core.metrics.inflight.inc()
    deadline = None if context.time_remaining() is None else time.monotonic() + context.time_remaining()
    ans = _Answer(core, request, prep, context, arrival)
    try:
        on_one_pod = None  # the prompt computed where it decodes: no prefill pod, no KV transfer
        if core.registry.serves_unified():  # colocated pods
            _refuse_prompt_logprobs_on_unified(prep)
            on_one_pod = _on_one_pod(core, flight, prep, ans, deadline, common_pb2.ROLE_DECODE, "unified pod")
        elif local := core.local_prefill_pods(prep):  # conditional disaggregation: short prompt, or busy prefill
            core.metrics.prefill_local.inc()
            on_one_pod = _on_one_pod(core, flight, prep, ans, deadline, common_pb2.ROLE_UNIFIED, "decode pod", local)
        if on_one_pod is not None:
            async with contextlib.aclosing(on_one_pod) as tokens:
                async for msg in tokens:
                    yield msg
            return
        if not prep.prefill_only:
            core.metrics.prefill_remote.inc()

        # 2-4. Book decode KV, place prefill, AllocateKV, Prefill.
        pre = await _to_first_token(core, flight, prep, ans, deadline)

        # 5. The first token of every sequence goes to the client now (it came from prefill).
        ch = _Choices(core, prep, ans)
        if len(pre.first_tokens) > 1:
            firsts = list(pre.first_tokens)
        else:
            firsts = [
                common_pb2.SampledToken(
                    token_id=pre.first_token_id,
                    logprob=pre.first_token_logprob,
                    top_logprobs=pre.first_token_top_logprobs,
                    finished=pre.finished,
                    finish_reason=pre.finish_reason,
                )
            ]
        if len(firsts) != ch.count:
            raise ServiceError(
                grpc.StatusCode.INTERNAL,
                f"the prefill pod returned {len(firsts)} first tokens for {ch.count} sequences",
            )
        msgs = []
        for i, ft in enumerate(firsts):
            msg = ch.add(
                i,
                [ft.token_id],
                [ft.logprob],
                [ft.top_logprobs],
                ft.finish_reason if ft.finished else common_pb2.FINISH_REASON_UNSPECIFIED,
                first=True,
            )
            if ft.finished and not ch.done[i]:  # prefill says it is over even if it gave no known reason
                ch.end(i, msg, ft.finish_reason or common_pb2.FINISH_REASON_LENGTH, "")
            if i == 0 and pre.HasField("prompt_logprobs"):
                msg.prompt_logprobs.CopyFrom(pre.prompt_logprobs)
                msg.prompt_logprobs.token_ids[:] = prep.prompt_ids
                tok = core.tokenizer
                msg.prompt_logprobs.tokens[:] = [tok.decode([t], skip_special_tokens=False) for t in prep.prompt_ids]
                for alt in msg.prompt_logprobs.top_logprobs:
                    alt.tokens[:] = [tok.decode([t], skip_special_tokens=False) for t in alt.token_ids]
            msgs.append(msg)
        ch.pod_ended.update(i for i, ft in enumerate(firsts) if ft.finished)
        for msg in ch.release(msgs):
            yield msg
        if ch.all_done:
            return

        # 6. Decode: the decode pod pulls the KV under the lease and streams the tokens after the first ones.
        #    If it cannot load the KV and the policy says so, the prompt is computed again (once) and decoding goes
        #    on from the first tokens already sent.
        while True:
            try:
                async with contextlib.aclosing(_decode(core, flight, prep, pre, firsts, ch, ans, deadline)) as tokens:
                    async for msg in tokens:
                        yield msg
                break
            except grpc.aio.AioRpcError as e:
                if not _may_recompute(core, flight, e):
                    raise
                pre = await _recompute_kv(core, flight, prep, pre, ans, deadline, _describe(e))

    except ServiceError as e:  # before the first token: the call's status
        ans.outcome = e.code.name
        _set_status(context, e.code, e.message)
    except Cancelled:
        yield ans.finish(router_pb2.GenerateResponse(request_id=rid), common_pb2.FINISH_REASON_CANCELLED)
    except (asyncio.CancelledError, GeneratorExit):  # the client went away, or its deadline passed
        ans.outcome = "CLIENT_GONE"
        raise
    except (_DecodeFailed, PodLost, grpc.aio.AioRpcError, KeyError) as e:
        text = f"decode pod {flight.decode_pod!r} is gone" if isinstance(e, KeyError) else _describe(e)
        if ans.sent == 0:  # cannot happen after step 5, kept for safety
            ans.outcome = "UNAVAILABLE"
            _set_status(context, grpc.StatusCode.UNAVAILABLE, text)
        else:
            log.warning("request %s: decode failed after %d tokens: %s", rid, ans.sent, text)
            ans.timing.decode_s = time.monotonic() - ans.t_decode
            yield ans.finish(router_pb2.GenerateResponse(request_id=rid), common_pb2.FINISH_REASON_ERROR, error=text)
            ans.outcome = "UNAVAILABLE"
            context.set_code(grpc.StatusCode.UNAVAILABLE)
            context.set_details(f"decode failed after {ans.sent} tokens were sent: {text}")
    finally:
        # 7. Whatever happened: give the pods back every block this request still holds.
        core.metrics.count_request(ans.outcome)
        core.metrics.inflight.dec()
        core.flights.pop(rid, None)
        _clean_up(core, flight)


async def _to_first_token(
    core: RouterCore, flight: Flight, prep: Prepared, ans: _Answer, deadline: float | None
) -> prefill_pb2.PrefillResponse:
    """Steps 2-4: book decode KV for the prompt on the decode pod with the most room (queue if none has), place
    prefill (least queued tokens, prefix affinity), reserve the blocks (AllocateKV; a refusal goes back to the
    booking, hence one helper), then Prefill with the decode target (retried once on another prefill pod if it
    fails before the handoff)."""

    def timeout() -> float:
        left = core.config.pod_rpc_timeout_s if deadline is None else deadline - time.monotonic()
        return max(0.001, min(left, core.config.pod_rpc_timeout_s))

    timing, routing = ans.timing, ans.routing
    if prep.prefill_only:  # max_tokens=1: the first token is the whole answer, no decode pod needed
        alloc, prefill_pod = None, _place_prefill(core, prep)
    else:
        alloc, prefill_pod = await _book_decode(core, flight, prep, timeout, deadline)
        timing.queue_s = flight.admitted.queue_s if flight.admitted else 0.0
        core.metrics.queue.observe(timing.queue_s)
    ans.pod_time += flight.allocate_s
    routing.decode_pod_id = flight.decode_pod or ""

    t = time.monotonic()
    pre, prefill_pod = await _prefill(core, flight, prep, alloc, prefill_pod, timeout, deadline)
    timing.prefill_s = time.monotonic() - t
    ans.pod_time += timing.prefill_s
    ans.pod_self = pre.queue_s + pre.compute_s
    routing.prefill_pod_id = prefill_pod
    routing.transfer_mode = (
        pre.kv_handle.transfer_mode if pre.HasField("kv_handle") else common_pb2.TRANSFER_MODE_UNSPECIFIED
    )
    ans.usage.cached_prompt_tokens = pre.num_cached_tokens
    if pre.HasField("kv_handle") and pre.kv_handle.lease_id:
        flight.lease = (prefill_pod, pre.kv_handle.lease_id)
    return pre


async def _decode(
    core: RouterCore,
    flight: Flight,
    prep: Prepared,
    pre: prefill_pb2.PrefillResponse,
    firsts: list[common_pb2.SampledToken],
    ch: _Choices,
    ans: _Answer,
    deadline: float | None,
) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
    """Step 6: the Decode stream (chunks of the n sequences), detokenized and cut at stop strings / max_tokens per
    sequence, as client messages."""
    ans.t_decode = time.monotonic()
    ended_normally = False
    pod = flight.decode_pod
    assert pod is not None  # booked in step 2 (prefill-only requests end at step 5)
    req = decode_pb2.DecodeRequest(
        request_id=prep.request_id,
        prompt_token_ids=prep.prompt_ids,
        first_token_id=pre.first_token_id,
        first_token_logprob=pre.first_token_logprob,
        sampling_params=prep.params,
        kv_handle=pre.kv_handle,
        num_cached_tokens=pre.num_cached_tokens,
    )
    if ch.count > 1:
        req.first_token_ids.extend(ft.token_id for ft in firsts)
        req.first_token_logprobs.extend(ft.logprob for ft in firsts)
    stream = core.decode_stub(pod).Decode(
        req, timeout=None if deadline is None else max(0.001, deadline - time.monotonic())
    )
    try:
        while True:
            chunk = await flight.read(pod, stream)
            if chunk is grpc.aio.EOF:
                raise _DecodeFailed("the decode stream ended without a final chunk")
            if chunk.token_ids or chunk.finish_reason in _FINISH:
                flight.kv_consumed = True  # decode streams only once it holds every layer
            i = chunk.index
            if not 0 <= i < ch.count:
                raise _DecodeFailed(f"decode pod {pod!r} sent a chunk for sequence {i} of {ch.count}")
            final = chunk.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
            if final and chunk.finish_reason not in _FINISH and not ch.done[i]:
                if chunk.finish_reason == common_pb2.FINISH_REASON_CANCELLED and flight.cancelled:
                    raise Cancelled()
                what = chunk.error_message or common_pb2.FinishReason.Name(chunk.finish_reason)
                msg = ch.add(
                    i,
                    _new_tokens(chunk, ch.sent[i], prep.request_id),
                    list(chunk.logprobs),
                    list(chunk.top_logprobs),
                    common_pb2.FINISH_REASON_UNSPECIFIED,
                    final=True,
                )
                for m in ch.release([msg]) if msg.token_ids else ():
                    yield m
                raise _DecodeFailed(f"decode pod {flight.decode_pod!r} ended the request: {what}")
            if final:
                ch.pod_ended.add(i)
                ans.timing.kv_transfer_s = chunk.kv_transfer_s
            if ch.done[i]:  # ended here already (a stop string): the pod's rest of it is dropped
                continue
            msg = ch.add(
                i,
                _new_tokens(chunk, ch.sent[i], prep.request_id),
                list(chunk.logprobs),
                list(chunk.top_logprobs),
                chunk.finish_reason,
                final=final,
            )
            if ch.all_done:
                ans.timing.decode_s = time.monotonic() - ans.t_decode
                flight.decode_done = ended_normally = len(ch.pod_ended) == ch.count
            for m in ch.release([msg]):
                yield m
            if ch.all_done:
                return  # a router-side stop leaves the decode pod to the clean-up
    finally:
        if ended_normally:
            core.spawn(_drain(stream, core.config.cleanup_timeout_s))  # collect the status off the hot path
        else:
            stream.cancel()


def _may_recompute(core: RouterCore, flight: Flight, e: grpc.aio.AioRpcError) -> bool:
    """The decode pod could not load the KV (it says so in the trailing metadata), no decode token came yet, the
    policy is recompute and this request was not computed again already."""
    if core.config.kv_load_failure_policy != "recompute" or flight.kv_consumed or flight.recomputed:
        return False
    return any(k == KV_LOAD_FAILED_METADATA for k, _ in (e.trailing_metadata() or ()))


async def _recompute_kv(
    core: RouterCore,
    flight: Flight,
    prep: Prepared,
    pre: prefill_pb2.PrefillResponse,
    ans: _Answer,
    deadline: float | None,
    why: str,
) -> prefill_pb2.PrefillResponse:
    """Give back what the failed attempt holds, then steps 2-4 again (a new booking, AllocateKV, Prefill). The
    client already has the first tokens: decoding goes on from them, so the new prefill's own are dropped."""
    log.warning(
        "request %s: decode pod %r could not load the KV (%s); computing it again",
        prep.request_id,
        flight.decode_pod,
        why,
    )
    core.metrics.kv_recomputes.inc()
    flight.recomputed = True
    if flight.lease is not None:
        await core.release_kv(*flight.lease)
        flight.lease = None
    if flight.admitted is not None:  # the decode pod dropped the request itself when its load failed
        core.admission.release(flight.admitted)
    flight.decode_pod, flight.admitted = None, None
    again = await _to_first_token(core, flight, prep, ans, deadline)
    again.first_token_id, again.first_token_logprob = pre.first_token_id, pre.first_token_logprob
    return again


async def _admit(
    core: RouterCore, flight: Flight, prep: Prepared, deadline: float | None, exclude: frozenset[str]
) -> Admitted:
    """Book the request's KV on a decode (or unified) pod outside ``exclude``, queueing until one has room or the
    deadline passes; a Cancel of the waiting request ends the wait as Cancelled."""
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        return await core.admission.admit(prep.kv_tokens, left, exclude, on_wait=lambda f: flight.set_pending(f))
    except asyncio.CancelledError:
        if flight.cancelled:
            raise Cancelled() from None
        raise
    finally:
        flight.set_pending(None)


def _refuse_prompt_logprobs_on_unified(prep: Prepared) -> None:
    if prep.params.HasField("prompt_logprobs"):
        raise ServiceError(
            grpc.StatusCode.FAILED_PRECONDITION,
            "prompt logprobs (echo with logprobs) are computed by prefill pods; this cluster serves "
            "through unified pods only: ask without them or add a prefill pod",
        )


async def _on_one_pod(
    core: RouterCore,
    flight: Flight,
    prep: Prepared,
    ans: _Answer,
    deadline: float | None,
    other_role: int,
    what: str,
    only: frozenset[str] | None = None,
) -> AsyncGenerator[router_pb2.GenerateResponse, None]:
    """Book the request's KV as for a decode pod, on a pod not of ``other_role`` and, when given, among ``only`` (the
    decode pods whose local-prefill threshold takes the prompt) (queue if none has room), then one
    Decode call without a KV handle; the pod prefills in its own engine (chunked between its decode steps) and
    streams every token, the first one included. A unified pod's journey, and conditional disaggregation's local
    path on a decode pod."""
    roles = (other_role,) if only is None else (common_pb2.ROLE_DECODE, common_pb2.ROLE_UNIFIED)
    exclude = frozenset(v.pod_id for v in core.registry.decode_views(roles) if only is None or v.pod_id not in only)
    flight.admitted = await _admit(core, flight, prep, deadline, exclude)
    ans.timing.queue_s = flight.admitted.queue_s
    core.metrics.queue.observe(ans.timing.queue_s)
    pod = flight.decode_pod = ans.routing.decode_pod_id = flight.admitted.pod_id
    try:
        async with contextlib.aclosing(
            _decode(core, flight, prep, prefill_pb2.PrefillResponse(), [], _Choices(core, prep, ans), ans, deadline)
        ) as tokens:
            async for msg in tokens:
                yield msg
    except grpc.aio.AioRpcError as e:
        if ans.sent:
            raise
        # before any token the pod's own status is the answer (a bad prompt is INVALID_ARGUMENT, not UNAVAILABLE)
        if e.code() == grpc.StatusCode.UNAVAILABLE:
            core.registry.suspect(pod)
        raise ServiceError(e.code(), f"{what} {pod!r}: {e.details()}") from None


class _Choices:
    """The n sequences of a request as the client sees them: per sequence its detokenizer and stop rules, tokens
    sent, whether it ended. With best_of > n the messages wait here until every candidate ended, and the n with the
    highest cumulative logprob go out, renumbered in that order (vLLM / OpenAI best_of)."""

    def __init__(self, core: RouterCore, prep: Prepared, ans: _Answer) -> None:
        sp = prep.params
        self.prep, self.ans = prep, ans
        self.n = max(sp.n, 1)
        self.count = max(self.n, sp.best_of)
        self.outs = [
            OutputAssembler(
                core.tokenizer,
                stop=list(sp.stop),
                stop_token_ids=sp.stop_token_ids,
                eos_token_ids=core.eos_token_ids,
                ignore_eos=sp.ignore_eos,
                min_tokens=sp.min_tokens,
                skip_special_tokens=(sp.skip_special_tokens if sp.HasField("skip_special_tokens") else True),
            )
            for _ in range(self.count)
        ]
        self.sent = [0] * self.count
        self.done = [False] * self.count
        self.cum_logprob = [0.0] * self.count
        self.pod_ended: set[int] = set()  # sequences the pods reported ended
        self.buffered: list[list[router_pb2.GenerateResponse]] = [[] for _ in range(self.count)]

    @property
    def all_done(self) -> bool:
        return all(self.done)

    @property
    def best_of(self) -> bool:
        return self.count > self.n

    def add(
        self,
        i: int,
        ids: list[int],
        logprobs: list[float],
        top: list[Any],
        pod_reason: common_pb2.FinishReason,
        final: bool = False,
        first: bool = False,
    ) -> router_pb2.GenerateResponse:
        """Sequence i's new tokens as a client message (ended, with its reason, when they complete it)."""
        prep = self.prep
        if prep.max_tokens is not None:
            ids = ids[: max(0, prep.max_tokens - self.sent[i])]
        piece = self.outs[i].add(ids, final=final or pod_reason != common_pb2.FINISH_REASON_UNSPECIFIED)
        self.cum_logprob[i] += sum(logprobs[: len(piece.token_ids)])
        msg = self.ans.message(piece.token_ids, piece.text, logprobs, top)
        msg.index = i
        self.sent[i] += len(piece.token_ids)
        done = _ended(self.outs[i], piece, self.sent[i], prep.max_tokens, pod_reason)
        if done is not None:
            self.end(i, msg, *done)
        return msg

    def end(self, i: int, msg: router_pb2.GenerateResponse, reason: common_pb2.FinishReason, stop: str) -> None:
        self.done[i] = True
        msg.finish_reason = reason
        msg.stop_reason = stop

    def release(self, msgs: list[router_pb2.GenerateResponse]) -> list[router_pb2.GenerateResponse]:
        """What goes to the client now: msgs (or, with best_of, nothing until all ended, then the chosen ones). The
        request's last message carries usage, timing and routing."""
        if self.best_of:
            for m in msgs:
                self.buffered[m.index].append(m)
            if not self.all_done:
                return []
            ranked = sorted(range(self.count), key=lambda k: -self.cum_logprob[k])[: self.n]
            msgs = []
            for new, k in enumerate(ranked):
                for m in self.buffered[k]:
                    m.index = new
                    msgs.append(m)
            self.ans.sent = sum(self.sent[k] for k in ranked)  # usage counts the returned sequences, as vLLM does
        else:
            msgs = [
                m
                for m in msgs
                if m.token_ids or m.text or m.finish_reason or m.HasField("prompt_logprobs") or m.prompt_token_ids
            ]
        if self.all_done and msgs:
            last = msgs[-1]
            self.ans.finish(last, last.finish_reason, last.stop_reason)
        return msgs


class _Answer:
    """What the client gets for one request: token messages, and the final one with usage, timing and routing;
    feeds the router's metrics on the way."""

    def __init__(
        self,
        core: RouterCore,
        request: router_pb2.GenerateRequest,
        prep: Prepared,
        context: grpc.aio.ServicerContext,
        arrival: float,
    ) -> None:
        self.m = core.metrics
        self.core = core
        self.request, self.prep, self.context, self.arrival = request, prep, context, arrival
        self.timing = common_pb2.Timing()
        self.routing = router_pb2.RoutingInfo()
        self.usage = common_pb2.Usage(prompt_tokens=len(prep.prompt_ids))
        self.sent = 0  # tokens streamed to the client
        self.t_first = self.t_last = self.t_decode = 0.0
        self.pod_time = 0.0  # AllocateKV + Prefill on the path to the first token
        self.pod_self = 0.0  # the part of it the prefill pod reports as its own (engine queue + compute)
        self.outcome = "error"

    def message(
        self, piece_ids: list[int], text: str, logprobs: Sequence[float] = (), top: Sequence[Any] = ()
    ) -> router_pb2.GenerateResponse:
        prep, timing = self.prep, self.timing
        msg = router_pb2.GenerateResponse(request_id=prep.request_id, token_ids=piece_ids, text=text)
        if prep.want_logprobs:
            msg.logprobs.extend(logprobs[: len(piece_ids)])
            tok = self.core.tokenizer
            msg.tokens.extend(tok.decode([t], skip_special_tokens=False) for t in piece_ids)
            if prep.params.top_logprobs > 0:
                msg.top_logprobs.extend(top[: len(piece_ids)])
                for alt in msg.top_logprobs:
                    alt.tokens[:] = [tok.decode([t], skip_special_tokens=False) for t in alt.token_ids]
        if self.sent == 0 and self.request.return_prompt_token_ids:
            msg.prompt_token_ids.extend(prep.prompt_ids)
        if piece_ids:
            now = time.monotonic()
            if self.sent == 0:
                self.t_first = now
                timing.ttft_s = now - self.arrival
                self.m.ttft.observe(timing.ttft_s)
                self.m.overhead.observe(max(0.0, timing.ttft_s - timing.queue_s - self.pod_time))
            self.t_last = now
            self.sent += len(piece_ids)
            self.m.tokens.inc(len(piece_ids))
        return msg

    def finish(
        self, msg: router_pb2.GenerateResponse, reason: common_pb2.FinishReason, stop_reason: str = "", error: str = ""
    ) -> router_pb2.GenerateResponse:
        timing = self.timing
        msg.finish_reason = reason
        msg.stop_reason = stop_reason
        msg.error_message = error
        timing.e2e_s = time.monotonic() - self.arrival
        if self.sent > 1:
            timing.mean_tpot_s = (self.t_last - self.t_first) / (self.sent - 1)
        self.usage.completion_tokens = self.sent
        msg.usage.CopyFrom(self.usage)
        msg.timing.CopyFrom(timing)
        msg.routing.CopyFrom(self.routing)
        self.m.e2e.observe(timing.e2e_s)
        self.outcome = common_pb2.FinishReason.Name(reason)
        self.context.set_trailing_metadata(
            (
                ("pdserve-router-ttft-s", f"{timing.ttft_s:.9f}"),
                ("pdserve-pod-time-s", f"{self.pod_time:.9f}"),
                ("pdserve-queue-s", f"{timing.queue_s:.9f}"),
                ("pdserve-pod-self-s", f"{self.pod_self:.9f}"),
            )
        )
        return msg


class _DecodeFailed(Exception):
    pass


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return str(e)


def _set_status(context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
    context.set_code(code)
    context.set_details(message)


async def _drain(stream: Any, timeout: float) -> None:
    try:
        await asyncio.wait_for(stream.code(), timeout)
    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
        stream.cancel()


def _new_tokens(chunk: decode_pb2.TokenChunk, sent: int, rid: str) -> list[int]:
    """The chunk's tokens minus any the client already has (num_output_tokens counts the first token too)."""
    ids = list(chunk.token_ids)
    if chunk.num_output_tokens:
        overlap = sent + len(ids) - chunk.num_output_tokens
        if overlap > 0:
            log.warning("request %s: decode repeated %d token(s); dropped", rid, overlap)
            ids = ids[overlap:]
    return ids


def _ended(
    out: OutputAssembler, piece: Any, sent: int, max_tokens: int | None, pod_reason: common_pb2.FinishReason
) -> tuple[common_pb2.FinishReason, str] | None:
    """(finish reason, stop string) when the output is complete, else None."""
    if piece.stop is not None:
        return common_pb2.FINISH_REASON_STOP, piece.stop
    if piece.stopped_on_token:
        return common_pb2.FINISH_REASON_STOP, ""
    if pod_reason in _FINISH:
        return pod_reason, ""
    if max_tokens is not None and sent >= max_tokens:
        return common_pb2.FINISH_REASON_LENGTH, ""
    return None


def _need_prefill_pods(core: RouterCore) -> None:
    if not core.registry.prefill_views():
        raise ServiceError(
            grpc.StatusCode.UNAVAILABLE,
            "no READY prefill pod: start prefill pods (python -m prefill_svc ... --router ...) or wait "
            "until they register",
        )


def _place_prefill(core: RouterCore, prep: Prepared) -> str:
    """The prefill pod of a prefill-only request (booked on it: ``_prefill`` gives it back)."""
    pod = core.pick_prefill(prep, set())
    if pod is None:
        _need_prefill_pods(core)  # the clearer message when there is none at all
        raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no READY prefill pod can take the prompt")
    return pod


async def _book_decode(
    core: RouterCore, flight: Flight, prep: Prepared, timeout: Any, deadline: float | None
) -> tuple[Any, str]:
    """Admission (decode pod with room, or wait) -> prefill pod -> AllocateKV. A decode pod that is full gets
    re-queued behind its next report (for at most max_queue_wait_s in all, then RESOURCE_EXHAUSTED: the router's
    booking is an estimate, the pod's own count is the truth); one that errors is skipped for this request (at most
    3 pods)."""
    _need_prefill_pods(core)
    exclude: set[str] = set()
    failures: list[str] = []
    errors = 0
    t_first = time.monotonic()
    while errors < 3:
        try:
            admitted = await _admit(core, flight, prep, deadline, frozenset(exclude))
        except ServiceError as e:
            raise ServiceError(e.code, e.message + (f" (earlier: {'; '.join(failures)})" if failures else "")) from None
        flight.admitted = admitted
        pod = admitted.pod_id
        flight.decode_pod = pod
        prefill_pod = core.pick_prefill(prep, set())  # books the prompt on it; _prefill gives it back
        if prefill_pod is None:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "no READY prefill pod can take the prompt")
        try:
            t = time.monotonic()
            alloc = await flight.call(
                pod,
                core.decode_stub(pod).AllocateKV(
                    decode_pb2.AllocateKVRequest(
                        request_id=prep.request_id,
                        num_tokens=len(prep.prompt_ids),
                        num_reserved_output_tokens=prep.kv_tokens - len(prep.prompt_ids),
                        prefill_layout=core.registry.pods[prefill_pod].layout,
                    ),
                    timeout=timeout(),
                ),
            )
            flight.allocate_s = time.monotonic() - t
            return alloc, prefill_pod
        except BaseException as e:
            core.registry.end_prefill(prefill_pod, len(prep.prompt_ids))
            if not isinstance(e, (grpc.aio.AioRpcError, KeyError, PodLost)):
                raise
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
            detail = _describe(e)
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ServiceError(code, f"decode pod {pod!r} refused the request: {detail}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None and time.monotonic() >= deadline:
                raise ServiceError(code, f"deadline passed while decode pod {pod!r} reserved KV") from None
            if code == grpc.StatusCode.ALREADY_EXISTS:
                raise ServiceError(code, f"decode pod {pod!r}: {detail}") from None
            failures.append(f"{pod}: {detail}")
            # Gone from this request: the clean-up of a possible half-made reservation returns the booking.
            flight.decode_pod, flight.admitted = None, None
            core.spawn(core.cancel_decode(pod, prep.request_id, admitted))
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                core.registry.mark_decode_full(pod)
                failures = failures[-2:]  # a long wait must not grow the message without bound
                waited = time.monotonic() - t_first
                if waited >= core.config.max_queue_wait_s:
                    raise ServiceError(
                        code,
                        f"decode pods kept refusing KV for {len(prep.prompt_ids)} prompt tokens "
                        f"for {waited:.1f}s (max_queue_wait_s {core.config.max_queue_wait_s}): "
                        f"retry later or add decode pods (last: {'; '.join(failures)})",
                    ) from None
            else:
                errors += 1
                exclude.add(pod)
                if code == grpc.StatusCode.UNAVAILABLE:
                    core.registry.suspect(pod)
    raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"no decode pod could reserve KV: {'; '.join(failures)}")


async def _prefill(
    core: RouterCore,
    flight: Flight,
    prep: Prepared,
    alloc: decode_pb2.AllocateKVResponse | None,
    pod: str,
    timeout: Any,
    deadline: float | None,
) -> tuple[prefill_pb2.PrefillResponse, str]:
    """Prefill on ``pod``; if it fails before the KV handoff, once more on another prefill pod. ``alloc`` is None
    for a prefill-only request (no decode target: the pod keeps no KV once the request ends at its first token)."""
    target = None
    if alloc is not None:
        assert flight.decode_pod is not None
        target = prefill_pb2.DecodeTarget(
            decode_pod_id=flight.decode_pod,
            layout=alloc.layout,
            transfer_modes=alloc.transfer_modes,
        )
    req = prefill_pb2.PrefillRequest(
        request_id=prep.request_id,
        prompt_token_ids=prep.prompt_ids,
        sampling_params=prep.params,
        decode_target=target,  # None: not set
        lease_ttl_s=core.config.lease_ttl_s,
    )
    tried: list[str] = []
    failures: list[str] = []
    n = len(prep.prompt_ids)
    while True:  # ``pod`` has the prompt booked (pick_prefill)
        flight.prefill_pod = pod
        try:
            resp = await flight.call(pod, core.prefill_stub(pod).Prefill(req, timeout=timeout()))
            flight.prefill_pod = None
            return resp, pod
        except (grpc.aio.AioRpcError, KeyError, PodLost) as e:
            code = e.code() if isinstance(e, grpc.aio.AioRpcError) else grpc.StatusCode.UNAVAILABLE
            detail = _describe(e)
            if code in _PREFILL_FINAL:
                flight.prefill_pod = None
                raise ServiceError(code, f"prefill pod {pod!r} refused the request: {detail}") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and deadline is not None and time.monotonic() >= deadline:
                raise ServiceError(code, f"deadline passed during prefill on pod {pod!r}") from None
            # The pod may still be working on it (timeouts): tell it to stop and drop any lease.
            core.spawn(core.cancel_prefill(pod, prep.request_id))
            if code == grpc.StatusCode.UNAVAILABLE:
                core.registry.suspect(pod)
            flight.prefill_pod = None
            tried.append(pod)
            failures.append(f"{pod}: {detail}")
            log.warning("request %s: prefill on %r failed (%s)", prep.request_id, pod, detail)
        finally:
            core.registry.end_prefill(pod, n)
        nxt = core.pick_prefill(prep, set(tried)) if len(tried) < 2 else None
        if nxt is None:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"prefill failed ({'; '.join(failures)})"
                + ("" if len(tried) >= 2 else "; no other READY prefill pod to retry on"),
            )
        core.metrics.prefill_retries.inc()
        pod = nxt


def _clean_up(core: RouterCore, flight: Flight) -> None:
    """Free everything the request still holds on pods; runs in the background (the call may be cancelled)."""
    rid = flight.request_id
    if flight.prefill_pod is not None:
        core.spawn(core.cancel_prefill(flight.prefill_pod, rid))
    if flight.lease is not None and not flight.kv_consumed:
        core.spawn(core.release_kv(*flight.lease))
    if flight.decode_pod is not None and not flight.decode_done:
        core.spawn(core.cancel_decode(flight.decode_pod, rid, flight.admitted))
    elif flight.admitted is not None:
        core.admission.release(flight.admitted)
    flight.admitted = None
