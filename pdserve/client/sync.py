"""The blocking client.

from pdserve.client import Client

with Client("127.0.0.1:50051") as c:          # several routers: Client("h1:50051,h2:50051")
    print(c.generate("The capital of France is", max_tokens=8, temperature=0).text)
    for chunk in c.chat_stream([{"role": "user", "content": "Hi!"}], max_tokens=32):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client._common import (
    DEFAULT,
    DEFAULT_ADDRESS,
    DEFAULT_CHANNEL_OPTIONS,
    RouterSet,
    client_security,
    make_request,
    role_value,
    router_addresses,
    secure_options,
    validate_request,
)
from pdserve.client.errors import (
    DeadlineExceededError,
    GenerationFailedError,
    PdserveError,
    UnavailableError,
    from_rpc_error,
)
from pdserve.client.retry import Deadline, RetryPolicy, RetryState
from pdserve.client.types import (
    Completion,
    CompletionBuilder,
    GenerateChunk,
    Message,
    Prompt,
    chunk_from_proto,
    new_request_id,
)
from pdserve.security import TLSConfig
from pdserve_api.v1 import router_pb2, router_pb2_grpc


class GenerateStream:
    """Iterator of :class:`GenerateChunk` for one Generate call.

    Errors surface while iterating, as the SDK's typed exceptions. ``cancel()`` (from any thread) ends the call;
    the router then frees the request's KV and iteration stops with ``finish_reason == "cancelled"``.
    ``completion`` is the whole :class:`Completion` once the stream is done."""

    def __init__(
        self,
        stub: router_pb2_grpc.RouterStub,
        request: router_pb2.GenerateRequest,
        timeout: float | None,
        retry: RetryPolicy,
        metadata: Sequence[tuple[str, str]] | None,
        routers: "tuple[list[router_pb2_grpc.RouterStub], list[str], RouterSet] | None" = None,
        own_id: bool = False,
    ) -> None:
        self._own_id = own_id  # the SDK made the request id: a retry may take a fresh one
        # (stubs, addresses, RouterSet) of every router: attempts go round them (a retry: the next one)
        self._stubs, self._addresses, self._routers = routers or ([stub], [""], RouterSet(1))
        self._order = self._routers.order()
        self._attempt = 0
        self._on = 0  # index of the router the current attempt went to
        self._request = self._request_first = request
        self._deadline = Deadline(timeout)
        self._retry = RetryState(retry, self._deadline)
        self._metadata = tuple(metadata or ())
        self._call: Any = None
        self._lock = threading.Lock()
        self._cancelled = False
        self._done = False
        self._failed: PdserveError | None = None
        self._got_message = False
        self._builder = CompletionBuilder(request.request_id, max(request.sampling_params.n, 1))
        self._t0 = time.monotonic()
        self._t_first: float | None = None
        self._t_end: float | None = None
        self._completion: Completion | None = None

    # --- public API -------------------------------------------------------------------------------------------
    @property
    def request_id(self) -> str:
        return self._builder.request_id

    @property
    def text(self) -> str:
        """The text received so far."""
        return self._builder.text

    @property
    def token_ids(self) -> list[int]:
        return list(self._builder.token_ids)

    @property
    def done(self) -> bool:
        return self._done

    @property
    def router(self) -> str:
        """Address of the router the current (or last) attempt went to ("" for a stream on a bare stub)."""
        return self._addresses[self._on]

    @property
    def client_ttft_s(self) -> float | None:
        """Seconds from the call to the first token, measured here (None before it arrives)."""
        return None if self._t_first is None else self._t_first - self._t0

    @property
    def completion(self) -> Completion:
        """The whole result; valid once the stream is done (iterated to the end, or cancelled)."""
        if not self._done:
            raise RuntimeError("the stream is not finished; iterate it to the end (or call until_done())")
        if self._completion is None:
            self._completion = self._build()
        return self._completion

    def until_done(self) -> Completion:
        """Consume the rest of the stream and return the whole Completion."""
        for _ in self:
            pass
        return self.completion

    def text_chunks(self) -> Iterator[str]:
        """The text deltas only (empty deltas skipped)."""
        for chunk in self:
            if chunk.text:
                yield chunk.text

    def cancel(self) -> None:
        """Stop the generation. Safe to call from another thread, more than once, or after the end."""
        with self._lock:
            if self._done or self._cancelled:
                return
            self._cancelled = True
            call = self._call
        if call is not None:
            call.cancel()
        self._finish()

    def __enter__(self) -> "GenerateStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self._done:
            self.cancel()

    def __iter__(self) -> "GenerateStream":
        return self

    def __next__(self) -> GenerateChunk:
        if self._failed is not None:
            err, self._failed = self._failed, None
            self._finish()
            raise err
        while True:
            if self._done:
                raise StopIteration
            if self._cancelled:
                self._finish()
                raise StopIteration
            call = self._ensure_call()
            try:
                msg = next(call)
            except StopIteration:
                self._finish()
                if self._builder.last is None and not self._cancelled:
                    raise GenerationFailedError(
                        "the Generate stream ended without a final message",
                        request_id=self.request_id,
                        partial=self._build(),
                    ) from None
                raise
            except grpc.RpcError as e:
                if self._cancelled:
                    self._finish()
                    raise StopIteration from None
                err = from_rpc_error(e, self.request_id)
                if self._got_message:
                    self._finish()
                    if isinstance(err, UnavailableError):  # never re-sent elsewhere: tokens would repeat
                        raise GenerationFailedError(
                            _on_router(self._addresses[self._on], err.message),
                            request_id=self.request_id,
                            partial=self._build("error"),
                        ) from None
                    raise err from None
                if isinstance(err, UnavailableError):
                    self._routers.failed(self._on)
                try:
                    delay = self._retry.next_delay(err)
                except PdserveError as final:
                    self._finish()
                    raise final from None
                with self._lock:
                    self._call = None
                    self._attempt += 1  # no token yet: the next attempt goes to the next router
                if self._sleep(delay):
                    continue
                self._finish()
                raise StopIteration from None
            return self._on_message(msg)

    # --- internals -------------------------------------------------------------------------------------------
    def _ensure_call(self) -> Any:
        with self._lock:
            if self._call is None:
                left = self._deadline.remaining()
                if left is not None and left <= 0:
                    self._done = True
                    raise DeadlineExceededError(
                        f"deadline of {self._deadline.timeout:g}s exceeded", request_id=self.request_id
                    )
                on = self._order[self._attempt % len(self._order)]
                if self._attempt and on != self._on:
                    self._fresh_id()
                self._on = on
                self._call = self._stubs[self._on].Generate(
                    self._request, timeout=left, metadata=self._metadata or None
                )
            return self._call

    def _fresh_id(self) -> None:
        """Another router now: the dead one may have left a reservation under the old id on a decode pod (until
        its TTL), which would refuse the same id as ALREADY_EXISTS. Ids the caller chose are kept."""
        if self._own_id:
            self._request = router_pb2.GenerateRequest()
            self._request.CopyFrom(self._request_first)
            self._request.request_id = self._builder.request_id = new_request_id()

    def _sleep(self, delay: float) -> bool:
        """Backoff sleep, cut short by cancel(); False if cancelled meanwhile."""
        end = time.monotonic() + delay
        while not self._cancelled:
            left = end - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.05))
        return False

    def _on_message(self, msg: router_pb2.GenerateResponse) -> GenerateChunk:
        now = time.monotonic()
        if not self._got_message:
            self._routers.ok(self._on)
        self._got_message = True
        if self._t_first is None and len(msg.token_ids):
            self._t_first = now
        chunk = chunk_from_proto(msg, self.client_ttft_s, (now - self._t0) if msg.finish_reason != 0 else None)
        if self._builder.add(chunk):  # the request ended (all n sequences)
            if chunk.finish_reason == "error":
                self._failed = GenerationFailedError(
                    chunk.error_message or "the request failed after tokens were streamed",
                    request_id=self.request_id,
                    partial=self._build("error"),
                )
            else:
                self._finish()
        return chunk

    def _finish(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            self._t_end = time.monotonic()
            call, self._call = self._call, None
        if call is not None and self._builder.last is None:
            call.cancel()  # never leave a half-read call behind

    def _build(self, finish_reason: str | None = None) -> Completion:
        if finish_reason is None and self._builder.last is None and self._cancelled:
            finish_reason = "cancelled"
        end = self._t_end if self._t_end is not None else time.monotonic()
        return self._builder.build(finish_reason, self.client_ttft_s, end - self._t0)


def _on_router(address: str, message: str) -> str:
    return f"router {address} failed mid-stream: {message}" if address else message


class Client:
    """Blocking client of pdserve routers (gRPC).

    ``address``: one router, or several (a list, or comma-separated): calls go round robin over them, and a call
    that failed UNAVAILABLE before its first token is retried on the next router.

    ``timeout`` is the default deadline of every call in seconds (None: none); each call can override it.
    ``retry`` applies to UNAVAILABLE errors only, and to Generate only before its first message. ``model`` is the
    default model name ("" lets the router pick the cluster's only model).

    Security: ``api_key`` is sent as ``authorization: Bearer KEY`` (routers started with --api-key); ``root_ca`` (PEM
    file of the CA to trust) connects with TLS; ``client_cert`` / ``client_key`` add a client certificate (mutual
    TLS); ``server_name`` overrides the name checked in the server certificate; or pass a ready ``tls`` config."""

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        timeout: float | None = None,
        retry: RetryPolicy | None = None,
        model: str = "",
        metadata: Sequence[tuple[str, str]] | None = None,
        channel_options: Sequence[tuple[str, Any]] | None = None,
        channel: grpc.Channel | None = None,
        api_key: str | None = None,
        root_ca: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        server_name: str | None = None,
        tls: TLSConfig | None = None,
    ) -> None:
        self.addresses = (
            router_addresses(address)
            if channel is None
            else [address if isinstance(address, str) else ",".join(address)]
        )
        self.address = self.addresses[0]
        self.timeout = timeout
        self.retry = retry if retry is not None else RetryPolicy()
        self.model = model
        self.metadata, self.tls = client_security(
            api_key=api_key,
            tls=tls,
            root_ca=root_ca,
            client_cert=client_cert,
            client_key=client_key,
            server_name=server_name,
            metadata=metadata,
        )
        self._own_channel = channel is None
        opts = secure_options(self.tls, list(DEFAULT_CHANNEL_OPTIONS) + list(channel_options or ()))
        if channel is not None:
            self._channels = [channel]
        elif self.tls is not None:
            self._channels = [
                grpc.secure_channel(a, self.tls.channel_credentials(), options=opts) for a in self.addresses
            ]
        else:
            self._channels = [grpc.insecure_channel(a, options=opts) for a in self.addresses]
        self._channel = self._channels[0]
        self._stubs = [router_pb2_grpc.RouterStub(ch) for ch in self._channels]
        self._stub = self._stubs[0]
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._routers = RouterSet(len(self._stubs))
        self._names = self.addresses if len(self.addresses) > 1 else [""]  # error messages name the router

    # --- lifecycle ---------------------------------------------------------------------------------------------
    def close(self) -> None:
        if self._own_channel:
            for ch in self._channels:
                ch.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is DEFAULT else timeout

    # --- generation --------------------------------------------------------------------------------------------
    def generate_stream(
        self,
        prompt: Prompt,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        model: str | None = None,
        request_id: str | None = None,
        timeout: Any = DEFAULT,
        return_prompt_token_ids: bool = False,
        **sampling: Any,
    ) -> GenerateStream:
        """Stream a completion of ``prompt`` (text, or token ids used verbatim)."""
        req = make_request(
            prompt=prompt,
            messages=None,
            add_generation_prompt=None,
            model=model,
            default_model=self.model,
            request_id=request_id,
            return_prompt_token_ids=return_prompt_token_ids,
            sampling=dict(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop=stop,
                **sampling,
            ),
        )
        return GenerateStream(
            self._stub,
            req,
            self._timeout(timeout),
            self.retry,
            self.metadata,
            (self._stubs, self._names, self._routers),
            own_id=request_id is None,
        )

    def generate(self, prompt: Prompt, **kw: Any) -> Completion:
        """The whole completion of ``prompt`` (same arguments as :meth:`generate_stream`)."""
        return self.generate_stream(prompt, **kw).until_done()

    def chat_stream(
        self,
        messages: Iterable[Message],
        *,
        add_generation_prompt: bool | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        model: str | None = None,
        request_id: str | None = None,
        timeout: Any = DEFAULT,
        return_prompt_token_ids: bool = False,
        **sampling: Any,
    ) -> GenerateStream:
        """Stream the assistant's reply to ``messages`` (dicts with role/content, and tool_calls / tool_call_id),
        rendered by the router with the model's chat template (given ``tools``, OpenAI tool objects, too). Constrain
        the output with ``structured_output={"json_schema": ...}`` (or json_object, regex, choice, grammar)."""
        req = make_request(
            prompt=None,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            model=model,
            default_model=self.model,
            request_id=request_id,
            return_prompt_token_ids=return_prompt_token_ids,
            tools=tools,
            sampling=dict(
                max_tokens=max_tokens,
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                seed=seed,
                stop=stop,
                **sampling,
            ),
        )
        return GenerateStream(
            self._stub,
            req,
            self._timeout(timeout),
            self.retry,
            self.metadata,
            (self._stubs, self._names, self._routers),
            own_id=request_id is None,
        )

    def chat(self, messages: Iterable[Message], **kw: Any) -> Completion:
        """The assistant's whole reply (same arguments as :meth:`chat_stream`)."""
        return self.chat_stream(messages, **kw).until_done()

    # --- other RPCs --------------------------------------------------------------------------------------------
    def _unary(self, name: str, request: Any, timeout: Any) -> Any:
        deadline = Deadline(self._timeout(timeout))
        state = RetryState(self.retry, deadline)
        order = self._routers.order()
        while True:
            left = deadline.remaining()
            if left is not None and left <= 0:
                raise DeadlineExceededError(f"deadline of {deadline.timeout:g}s exceeded")
            i = order[(state.attempt - 1) % len(order)]  # each retry: the next router
            try:
                return getattr(self._stubs[i], name)(request, timeout=left, metadata=self.metadata or None)
            except grpc.RpcError as e:
                err = from_rpc_error(e, getattr(request, "request_id", None) or None)
                if isinstance(err, UnavailableError):
                    self._routers.failed(i)
                try:
                    delay = state.next_delay(err)
                except PdserveError as final:
                    raise final from None
                time.sleep(delay)

    def cancel(self, request_id: str, *, timeout: Any = DEFAULT) -> bool:
        """Cancel an in-flight request by id (from any client). True if it was in flight. With several routers, each
        is asked until one holds it (a request lives on the router it went to)."""
        req = router_pb2.CancelRequest(request_id=request_id)
        if len(self._stubs) == 1:
            return self._unary("Cancel", req, timeout).found
        for stub in self._stubs:
            try:
                if stub.Cancel(req, timeout=self._timeout(timeout), metadata=self.metadata or None).found:
                    return True
            except grpc.RpcError:
                continue  # a router that is down holds nothing now
        return False

    def cluster_status(
        self, *, role: str | int | None = None, model: str = "", timeout: Any = DEFAULT
    ) -> router_pb2.ClusterStatusResponse:
        """Every registered pod (state, load, KV blocks per rank) and the router's queue."""
        return self._unary(
            "ClusterStatus", router_pb2.ClusterStatusRequest(role=role_value(role), model=model), timeout
        )

    def validate_config(self, *, timeout: Any = DEFAULT, **kw: Any) -> router_pb2.ValidateConfigResponse:
        """Check a model + parallel config on the router (``model_path=`` or ``num_attention_heads=`` /
        ``num_kv_heads=``, plus ``tensor_parallel_size=``, ``decode_context_parallel_size=``, ...)."""
        return self._unary("ValidateConfig", validate_request(**kw), timeout)

    def health(self, *, service: str = "", timeout: float = 2.0) -> bool:
        """True if the router answers grpc.health.v1 SERVING."""
        try:
            r = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    def wait_ready(self, timeout: float = 60.0, *, model: str | None = None, poll_s: float = 0.2) -> list[str]:
        """Block until the router serves at least one model (or ``model``); return the ready models."""
        end = time.monotonic() + timeout
        last = "router not reachable"
        while True:
            try:
                st = self._stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=max(0.1, min(2.0, timeout)))
                ready = list(st.ready_models)
                if ready and (model is None or model in ready):
                    return ready
                last = f"ready models: {ready or 'none'}"
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= end:
                raise DeadlineExceededError(f"cluster at {self.address} not ready after {timeout:g}s ({last})")
            time.sleep(poll_s)
