"""The asyncio client (grpc.aio), same API as :class:`pdserve.client.Client` with ``await`` / ``async for``.

from pdserve.client import AsyncClient

async with AsyncClient("127.0.0.1:50051") as c:
    print((await c.generate("The capital of France is", max_tokens=8, temperature=0)).text)
    async for chunk in c.chat_stream([{"role": "user", "content": "Hi!"}], max_tokens=32):
        print(chunk.text, end="", flush=True)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Iterable, Mapping, Sequence

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


class AsyncGenerateStream:
    """Async iterator of :class:`GenerateChunk` for one Generate call (see :class:`GenerateStream`)."""

    def __init__(
        self,
        client: "AsyncClient",
        request: router_pb2.GenerateRequest,
        timeout: float | None,
        retry: RetryPolicy,
        own_id: bool = False,
    ) -> None:
        self._own_id = own_id  # the SDK made the request id: a retry may take a fresh one
        self._client = client
        self._order = client._routers.order()  # attempts go round the routers (a retry: the next one)
        self._attempt = 0
        self._on = 0  # index of the router the current attempt went to
        self._request = self._request_first = request
        self._deadline = Deadline(timeout)
        self._retry = RetryState(retry, self._deadline)
        self._call: Any = None
        self._cancelled = False
        self._cancel_event: asyncio.Event | None = None
        self._done = False
        self._failed: PdserveError | None = None
        self._got_message = False
        self._builder = CompletionBuilder(request.request_id, max(request.sampling_params.n, 1))
        self._t0 = time.monotonic()
        self._t_first: float | None = None
        self._t_end: float | None = None
        self._completion: Completion | None = None

    @property
    def request_id(self) -> str:
        return self._builder.request_id

    @property
    def text(self) -> str:
        return self._builder.text

    @property
    def token_ids(self) -> list[int]:
        return list(self._builder.token_ids)

    @property
    def done(self) -> bool:
        return self._done

    @property
    def router(self) -> str:
        """Address of the router the current (or last) attempt went to."""
        return self._client.addresses[self._on]

    @property
    def client_ttft_s(self) -> float | None:
        return None if self._t_first is None else self._t_first - self._t0

    @property
    def completion(self) -> Completion:
        if not self._done:
            raise RuntimeError("the stream is not finished; iterate it to the end (or await until_done())")
        if self._completion is None:
            self._completion = self._build()
        return self._completion

    async def until_done(self) -> Completion:
        async for _ in self:
            pass
        return self.completion

    async def text_chunks(self) -> AsyncIterator[str]:
        async for chunk in self:
            if chunk.text:
                yield chunk.text

    def cancel(self) -> None:
        """Stop the generation (the router frees the request's KV). Idempotent."""
        if self._done or self._cancelled:
            return
        self._cancelled = True
        if self._cancel_event is not None:
            self._cancel_event.set()
        if self._call is not None:
            self._call.cancel()
        self._finish()

    async def __aenter__(self) -> "AsyncGenerateStream":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if not self._done:
            self.cancel()

    def __aiter__(self) -> "AsyncGenerateStream":
        return self

    async def __anext__(self) -> GenerateChunk:
        if self._failed is not None:
            err, self._failed = self._failed, None
            self._finish()
            raise err
        while True:
            if self._done:
                raise StopAsyncIteration
            if self._cancelled:
                self._finish()
                raise StopAsyncIteration
            call = await self._ensure_call()
            try:
                msg = await call.read()
            except asyncio.CancelledError:
                if self._cancelled:  # our own cancel(); anything else is the caller's task being cancelled
                    self._finish()
                    raise StopAsyncIteration from None
                self._abandon()
                raise
            except grpc.RpcError as e:
                if self._cancelled:
                    self._finish()
                    raise StopAsyncIteration from None
                err = from_rpc_error(e, self.request_id)
                if self._got_message:
                    self._finish()
                    if isinstance(err, UnavailableError):  # never re-sent elsewhere: tokens would repeat
                        raise GenerationFailedError(
                            self._client._on_router(self._on, err.message),
                            request_id=self.request_id,
                            partial=self._build("error"),
                        ) from None
                    raise err from None
                if isinstance(err, UnavailableError):
                    self._client._routers.failed(self._on)
                try:
                    delay = self._retry.next_delay(err)
                except PdserveError as final:
                    self._finish()
                    raise final from None
                self._call = None
                self._attempt += 1  # no token yet: the next attempt goes to the next router
                if await self._sleep(delay):
                    continue
                self._finish()
                raise StopAsyncIteration from None
            if msg is grpc.aio.EOF:
                self._finish()
                if self._builder.last is None and not self._cancelled:
                    raise GenerationFailedError(
                        "the Generate stream ended without a final message",
                        request_id=self.request_id,
                        partial=self._build(),
                    )
                raise StopAsyncIteration
            return self._on_message(msg)

    async def _ensure_call(self) -> Any:
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
            stub = await self._client._router(self._on)
            self._call = stub.Generate(self._request, timeout=left, metadata=self._client.metadata or None)
        return self._call

    def _fresh_id(self) -> None:
        """Another router now: the dead one may have left a reservation under the old id on a decode pod (until
        its TTL), which would refuse the same id as ALREADY_EXISTS. Ids the caller chose are kept."""
        if self._own_id:
            self._request = router_pb2.GenerateRequest()
            self._request.CopyFrom(self._request_first)
            self._request.request_id = self._builder.request_id = new_request_id()

    async def _sleep(self, delay: float) -> bool:
        if self._cancel_event is None:
            self._cancel_event = asyncio.Event()
        try:
            await asyncio.wait_for(self._cancel_event.wait(), delay)
            return False  # cancelled while waiting
        except asyncio.TimeoutError:
            return not self._cancelled

    def _on_message(self, msg: router_pb2.GenerateResponse) -> GenerateChunk:
        now = time.monotonic()
        if not self._got_message:
            self._client._routers.ok(self._on)
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

    def _abandon(self) -> None:
        if self._call is not None:
            self._call.cancel()
        self._finish()

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        self._t_end = time.monotonic()
        call, self._call = self._call, None
        if call is not None and self._builder.last is None:
            call.cancel()

    def _build(self, finish_reason: str | None = None) -> Completion:
        if finish_reason is None and self._builder.last is None and self._cancelled:
            finish_reason = "cancelled"
        end = self._t_end if self._t_end is not None else time.monotonic()
        return self._builder.build(finish_reason, self.client_ttft_s, end - self._t0)


class AsyncClient:
    """asyncio client of pdserve routers. The channels are opened on first use, in the running event loop.

    ``address``: one router, or several (a list, or comma-separated): calls go round robin over them, and a call
    that failed UNAVAILABLE before its first token is retried on the next router.

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
        channel: grpc.aio.Channel | None = None,
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
        self._options = secure_options(self.tls, list(DEFAULT_CHANNEL_OPTIONS) + list(channel_options or ()))
        self._own_channel = channel is None
        self._channel: grpc.aio.Channel | None = channel
        self._stub: router_pb2_grpc.RouterStub | None = None
        self._channels: dict[int, grpc.aio.Channel] = {} if channel is None else {0: channel}
        self._stubs: dict[int, router_pb2_grpc.RouterStub] = {}
        self._routers = RouterSet(len(self.addresses))

    def _on_router(self, i: int, message: str) -> str:
        """An error message naming the router (when there are several to tell apart)."""
        return f"router {self.addresses[i]} failed mid-stream: {message}" if len(self.addresses) > 1 else message

    async def _router(self, i: int = 0) -> router_pb2_grpc.RouterStub:
        stub = self._stubs.get(i)
        if stub is None:
            ch = self._channels.get(i)
            if ch is None:
                a = self.addresses[i]
                ch = self._channels[i] = (
                    grpc.aio.secure_channel(a, self.tls.channel_credentials(), options=self._options)
                    if self.tls is not None
                    else grpc.aio.insecure_channel(a, options=self._options)
                )
            stub = self._stubs[i] = router_pb2_grpc.RouterStub(ch)
            if i == 0:
                self._channel, self._stub = ch, stub
        return stub

    async def close(self) -> None:
        if self._own_channel:
            for ch in self._channels.values():
                await ch.close()
        self._channels.clear()
        self._stubs.clear()
        self._channel = None
        self._stub = None

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    def _timeout(self, timeout: Any) -> float | None:
        return self.timeout if timeout is DEFAULT else timeout

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
    ) -> AsyncGenerateStream:
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
        return AsyncGenerateStream(self, req, self._timeout(timeout), self.retry, own_id=request_id is None)

    async def generate(self, prompt: Prompt, **kw: Any) -> Completion:
        return await self.generate_stream(prompt, **kw).until_done()

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
    ) -> AsyncGenerateStream:
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
        return AsyncGenerateStream(self, req, self._timeout(timeout), self.retry, own_id=request_id is None)

    async def chat(self, messages: Iterable[Message], **kw: Any) -> Completion:
        return await self.chat_stream(messages, **kw).until_done()

    async def _unary(self, name: str, request: Any, timeout: Any) -> Any:
        deadline = Deadline(self._timeout(timeout))
        state = RetryState(self.retry, deadline)
        order = self._routers.order()
        while True:
            left = deadline.remaining()
            if left is not None and left <= 0:
                raise DeadlineExceededError(f"deadline of {deadline.timeout:g}s exceeded")
            i = order[(state.attempt - 1) % len(order)]  # each retry: the next router
            method = getattr(await self._router(i), name)
            try:
                return await method(request, timeout=left, metadata=self.metadata or None)
            except grpc.RpcError as e:
                err = from_rpc_error(e, getattr(request, "request_id", None) or None)
                if isinstance(err, UnavailableError):
                    self._routers.failed(i)
                try:
                    delay = state.next_delay(err)
                except PdserveError as final:
                    raise final from None
                await asyncio.sleep(delay)

    async def cancel(self, request_id: str, *, timeout: Any = DEFAULT) -> bool:
        """True if the request was in flight; with several routers each is asked until one holds it."""
        req = router_pb2.CancelRequest(request_id=request_id)
        if len(self.addresses) == 1:
            return (await self._unary("Cancel", req, timeout)).found
        for i in range(len(self.addresses)):
            try:
                stub = await self._router(i)
                if (await stub.Cancel(req, timeout=self._timeout(timeout), metadata=self.metadata or None)).found:
                    return True
            except grpc.RpcError:
                continue  # a router that is down holds nothing now
        return False

    async def cluster_status(
        self, *, role: str | int | None = None, model: str = "", timeout: Any = DEFAULT
    ) -> router_pb2.ClusterStatusResponse:
        return await self._unary(
            "ClusterStatus", router_pb2.ClusterStatusRequest(role=role_value(role), model=model), timeout
        )

    async def validate_config(self, *, timeout: Any = DEFAULT, **kw: Any) -> router_pb2.ValidateConfigResponse:
        return await self._unary("ValidateConfig", validate_request(**kw), timeout)

    async def health(self, *, service: str = "", timeout: float = 2.0) -> bool:
        await self._router()
        assert self._channel is not None
        try:
            r = await health_pb2_grpc.HealthStub(self._channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
        return r.status == health_pb2.HealthCheckResponse.SERVING

    async def wait_ready(self, timeout: float = 60.0, *, model: str | None = None, poll_s: float = 0.2) -> list[str]:
        stub = await self._router()
        end = time.monotonic() + timeout
        last = "router not reachable"
        while True:
            try:
                st = await stub.ClusterStatus(router_pb2.ClusterStatusRequest(), timeout=max(0.1, min(2.0, timeout)))
                ready = list(st.ready_models)
                if ready and (model is None or model in ready):
                    return ready
                last = f"ready models: {ready or 'none'}"
            except grpc.RpcError as e:
                last = f"{e.code().name}: {e.details()}"
            if time.monotonic() >= end:
                raise DeadlineExceededError(f"cluster at {self.address} not ready after {timeout:g}s ({last})")
            await asyncio.sleep(poll_s)
