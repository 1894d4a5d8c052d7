"""The HTTP application: routes, API-key check, errors in OpenAI's shape, and the listening site (HTTP or HTTPS).

Served with aiohttp rather than FastAPI + uvicorn, the usual pairing (vLLM's): aiohttp cancels a handler when its
client disconnects (``handler_cancellation``), which cancels the gRPC call so the router frees the request's KV at
once, for whole answers as well as streams; Starlette notices a gone client only while streaming (vLLM wraps its
handlers in a with_cancellation decorator for that). HTTPS and mutual TLS keep their tested ssl context. The OpenAPI
document FastAPI would derive is made from the same pydantic models (openapi.py) and served at /openapi.json.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable

import grpc
from aiohttp import web

from pdserve.client import AsyncClient, PdserveError
from pdserve.security import TLSConfig, check_https_serving, secrets_match
from router.openai.errors import ApiError, bad
from router.openai.openapi import openapi_document
from router.openai.protocol import ChatCompletionRequest, CompletionRequest, validate
from router.openai.serving_chat import serve_chat
from router.openai.serving_completion import serve_completion
from router.tool_parsers import ToolParser, tool_parser

log = logging.getLogger("router.openai_http")


class OpenAIHttpServer:
    """The aiohttp application and its listening site. ``await start()`` -> port; ``await stop()``.

    ``tls``: this server's certificate (server side; None = plain HTTP). With ``tls.require_client_cert`` it is
    mutual TLS: a client without a certificate signed by ``tls.ca_file`` is refused at the handshake."""

    def __init__(
        self,
        client: AsyncClient,
        host: str = "127.0.0.1",
        port: int = 8000,
        *,
        api_key: str | None = None,
        own_client: bool = False,
        tls: TLSConfig | None = None,
        tool_call_parser: str = "hermes",
    ) -> None:
        check_https_serving(tls)
        self.tool_parser: ToolParser = tool_parser(tool_call_parser)
        self.tls, self.client, self.host, self.port, self.api_key = tls, client, host, port, api_key
        self._own_client = own_client
        self.created = int(time.time())
        self.openapi = openapi_document(auth=api_key is not None)
        self.app = web.Application(middlewares=[self._errors_middleware])
        self.app.add_routes(
            [
                web.get("/health", self.health),
                web.get("/openapi.json", self.openapi_json),
                web.get("/v1/models", self.models),
                web.get("/v1/models/{model}", self.model),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat_completions),
            ]
        )
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"{'https' if self.tls is not None else 'http'}://{self.host}:{self.port}"

    async def start(self) -> int:
        # handler_cancellation: a client that disconnects cancels its handler, which cancels the gRPC call, so the
        # router frees the request's KV.
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        ssl_context = self.tls.ssl_server_context() if self.tls is not None else None
        site = web.TCPSite(self._runner, self.host, self.port, ssl_context=ssl_context)
        await site.start()
        if self.port == 0:
            self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        log.info(
            "OpenAI-compatible HTTP API on %s/v1%s",
            self.url,
            " (mutual TLS)" if self.tls is not None and self.tls.require_client_cert else "",
        )
        return self.port

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._own_client:
            await self.client.close()

    # --- plumbing ----------------------------------------------------------------------------------------------
    def _check_key(self, request: web.Request) -> None:
        if self.api_key is not None and request.path.startswith("/v1/"):
            auth = request.headers.get("Authorization", "")
            if not (auth[:7].lower() == "bearer " and secrets_match(auth[7:].strip(), self.api_key)):
                raise ApiError(401, "Incorrect API key provided.", "authentication_error", None, "invalid_api_key")

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            self._check_key(request)
            return await handler(request)
        except ApiError as e:
            return e.response()
        except PdserveError as e:
            return ApiError.from_sdk(e).response()
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _http_error(request, e).response()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # every failure leaves in OpenAI's shape
            log.exception("unexpected error on %s %s", request.method, request.path)
            return ApiError(500, f"internal error: {type(e).__name__}: {e}", "server_error").response()

    @staticmethod
    async def _body(request: web.Request) -> Any:
        try:
            return await request.json(loads=json.loads)
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            raise bad("We could not parse the JSON body of your request. Send a JSON object.") from None

    async def _model_names(self) -> list[str]:
        st = await self.client.cluster_status(timeout=10.0)
        return list(dict.fromkeys([*st.ready_models, *(p.model for p in st.pods if p.model)]))

    async def response_model(self, requested: str) -> str:
        """The model name a response carries: the one asked for, else the cluster's first."""
        if requested:
            return requested
        try:
            names = await self._model_names()
        except PdserveError:
            return ""
        return names[0] if names else ""

    # --- endpoints ---------------------------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def openapi_json(self, request: web.Request) -> web.Response:
        return web.json_response(self.openapi)

    async def models(self, request: web.Request) -> web.Response:
        data = [self._card(n) for n in await self._model_names()]
        return web.json_response({"object": "list", "data": data})

    async def model(self, request: web.Request) -> web.Response:
        name = request.match_info["model"]
        if name not in await self._model_names():
            raise ApiError(
                404, f"The model '{name}' does not exist", "invalid_request_error", "model", "model_not_found"
            )
        return web.json_response(self._card(name))

    def _card(self, name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "pdserve"}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = validate(CompletionRequest, await self._body(request))
        return await serve_completion(self.client, request, body, self.response_model)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = validate(ChatCompletionRequest, await self._body(request))
        return await serve_chat(self.client, request, body, self.response_model, self.tool_parser)


def _http_error(request: web.Request, e: web.HTTPException) -> ApiError:
    """aiohttp's own refusals (no such route, wrong method) in OpenAI's shape."""
    msg = {
        404: f"Unknown route {request.method} {request.path}",
        405: f"Method {request.method} is not allowed on {request.path}",
    }.get(e.status, e.reason)
    return ApiError(e.status, msg, "invalid_request_error", None, "unknown_url" if e.status == 404 else None)


def _client_for(router: Any, api_key: str | None = None, tls: TLSConfig | None = None) -> tuple[AsyncClient, bool]:
    """An AsyncClient for what the router passes: an address, an AsyncClient, a grpc.aio channel, or a running
    server object exposing ``port`` and ``host`` / ``config.host``. ``api_key``: the one key both APIs share, sent
    on to the router's gRPC API; ``tls``: how to reach a router serving TLS."""
    if isinstance(router, AsyncClient):
        return router, False
    if isinstance(router, str):
        return AsyncClient(router, api_key=api_key, tls=tls), True
    if isinstance(router, grpc.aio.Channel):
        return AsyncClient(channel=router, api_key=api_key), True
    port = getattr(router, "port", None)
    host = getattr(router, "host", None) or getattr(getattr(router, "config", None), "host", None)
    if isinstance(port, int) and port > 0 and isinstance(host, str):
        if host in ("0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        return AsyncClient(f"{host}:{port}", api_key=api_key, tls=tls), True
    raise TypeError(
        "start_openai_http needs the router's address ('host:port'), an AsyncClient, a grpc.aio "
        f"channel, or a started server with .port and .config.host; got {type(router).__name__}"
    )


async def start_openai_http(
    router: Any,
    host: str = "127.0.0.1",
    port: int = 8000,
    *,
    api_key: str | None = None,
    router_tls: TLSConfig | None = None,
    tls: TLSConfig | None = None,
    tool_call_parser: str = "hermes",
) -> OpenAIHttpServer:
    """Serve the OpenAI-compatible API on ``host:port`` (0: any free port, see ``.port``) in the running event
    loop, over ``router``'s gRPC Generate path. ``await server.stop()`` to stop it.

    ``router_tls``: how to reach a router serving TLS (client side). ``tls``: this server's own certificate, to
    serve HTTPS (mutual TLS with ``require_client_cert``; see pdserve.security.http_server_tls)."""
    check_https_serving(tls)  # before a client is made that would then need closing
    client, own = _client_for(router, api_key, router_tls)
    server = OpenAIHttpServer(
        client, host, port, api_key=api_key, own_client=own, tls=tls, tool_call_parser=tool_call_parser
    )
    try:
        await server.start()
    except BaseException:
        await server.stop()
        raise
    return server
