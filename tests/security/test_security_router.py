"""A real router (in-process gRPC server on loopback) with TLS, mutual TLS, an API key and the cluster token:
who gets in and who is refused, over gRPC and the OpenAI HTTP front. Certificates are made per run."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_helpers import register_request
from security_helpers import Pki, make_pki

from pdserve.client import Client, UnauthenticatedError
from pdserve.security import MAX_MESSAGE_BYTES, TLSConfig
from pdserve_api.v1 import registry_pb2_grpc, router_pb2, router_pb2_grpc
from router.config import RouterConfig
from router.openai_http import start_openai_http
from router.server import RouterServer

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextlib.asynccontextmanager
async def router(**kw) -> AsyncIterator[str]:
    server = RouterServer(RouterConfig(port=0, **kw))
    port = await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=0.2)


def server_tls(pki: Pki, mtls: bool = False) -> dict:
    return dict(
        tls_cert_file=str(pki.server_cert),
        tls_key_file=str(pki.server_key),
        tls_ca_file=str(pki.ca),
        tls_require_client_cert=mtls,
    )


async def status(channel: grpc.aio.Channel, metadata=None, timeout: float = 10.0) -> router_pb2.ClusterStatusResponse:
    return await router_pb2_grpc.RouterStub(channel).ClusterStatus(
        router_pb2.ClusterStatusRequest(), timeout=timeout, metadata=metadata
    )


def creds(ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        ca.read_bytes(), key.read_bytes() if key else None, cert.read_bytes() if cert else None
    )


def test_tls_router_serves_right_ca_and_refuses_plaintext_and_wrong_ca(pki):
    """TLS only (no client certs): a client trusting our CA is served, through the SDK too; a plaintext client and a
    client trusting another CA never reach a servicer."""

    async def body():
        async with router(**server_tls(pki)) as addr:
            async with grpc.aio.secure_channel(addr, creds(pki.ca)) as ch:
                assert (await status(ch)).router_queue_depth == 0
            async with grpc.aio.insecure_channel(addr) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await status(ch, timeout=3)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            async with grpc.aio.secure_channel(addr, creds(pki.wrong_ca)) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await status(ch, timeout=3)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(body())


def test_sdk_speaks_tls_with_root_ca(pki):
    """pdserve.client.Client(root_ca=...) reaches a TLS router; without it the SDK reports UNAVAILABLE."""

    async def body():
        async with router(**server_tls(pki)) as addr:

            def sdk() -> None:
                with Client(addr, root_ca=str(pki.ca), timeout=10) as c:
                    assert c.health()
                    assert c.cluster_status().router_queue_depth == 0
                with Client(addr, timeout=3, retry=None) as c:
                    assert not c.health()

            await asyncio.to_thread(sdk)

    asyncio.run(body())


def test_mtls_router_requires_a_client_certificate_from_our_ca(pki):
    """Mutual TLS: no client certificate, or one signed by another CA, is refused at the handshake; our client
    certificate is served (also through the SDK's client_cert / client_key)."""

    async def body():
        async with router(**server_tls(pki, mtls=True)) as addr:
            async with grpc.aio.secure_channel(addr, creds(pki.ca, pki.client_cert, pki.client_key)) as ch:
                assert (await status(ch)).router_queue_depth == 0
            for bad in (creds(pki.ca), creds(pki.ca, pki.rogue_cert, pki.rogue_key)):
                async with grpc.aio.secure_channel(addr, bad) as ch:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await status(ch, timeout=3)
                    assert e.value.code() == grpc.StatusCode.UNAVAILABLE

            def sdk() -> None:
                with Client(
                    addr,
                    root_ca=str(pki.ca),
                    client_cert=str(pki.client_cert),
                    client_key=str(pki.client_key),
                    timeout=10,
                ) as c:
                    assert c.cluster_status().router_queue_depth == 0

            await asyncio.to_thread(sdk)

    asyncio.run(body())


def test_api_key_guards_the_router_api_not_health_or_registry():
    """--api-key: Router RPCs without the key or with a wrong one get UNAUTHENTICATED saying how to send it;
    'authorization: Bearer KEY' and 'x-api-key: KEY' both work, and so does the SDK's api_key=. Health checks and
    the pods' Registry (guarded by the cluster token instead) do not need the key."""

    async def body():
        async with router(api_key="k3y", cluster_token="t0ken") as addr:
            async with grpc.aio.insecure_channel(addr) as ch:
                for md in (None, [("authorization", "Bearer nope")], [("x-api-key", "k3y-")]):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await status(ch, metadata=md)
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "authorization: Bearer" in e.value.details()
                # streaming RPCs are covered too
                stream = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(text="hi"), timeout=10)
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in stream:
                        pass
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                await status(ch, metadata=[("authorization", "Bearer k3y")])
                await status(ch, metadata=[("x-api-key", "k3y")])
                h = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert h.status == health_pb2.HealthCheckResponse.SERVING
                reg = registry_pb2_grpc.RegistryStub(ch)
                r = await reg.RegisterWorker(register_request("d0", cluster_token="t0ken"), timeout=5)
                assert r.accepted

            def sdk() -> None:
                with Client(addr, api_key="k3y", timeout=10) as c:
                    assert [p.pod_id for p in c.cluster_status().pods] == ["d0"]
                with Client(addr, timeout=10) as c, pytest.raises(UnauthenticatedError):
                    c.cluster_status()

            await asyncio.to_thread(sdk)

    asyncio.run(body())


def test_http_front_uses_the_same_key_as_the_router():
    """The OpenAI HTTP front started with the router's key: 401 without / with a wrong bearer token; with the right
    one the request goes through to the key-protected router (the front forwards the same key)."""

    async def body():
        async with router(api_key="k3y") as addr:
            front = await start_openai_http(addr, "127.0.0.1", 0, api_key="k3y")
            try:
                async with aiohttp.ClientSession() as s:
                    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k3y"}):
                        async with s.get(f"{front.url}/v1/models", headers=headers) as r:
                            assert r.status == 401, headers
                    async with s.get(f"{front.url}/v1/models", headers={"Authorization": "Bearer k3y"}) as r:
                        assert r.status == 200, await r.text()
                        assert (await r.json())["object"] == "list"
            finally:
                await front.stop()

    asyncio.run(body())


def test_oversized_message_is_refused_and_the_router_keeps_serving():
    """A request above the shared limit (pdserve.security.MAX_MESSAGE_BYTES) gets RESOURCE_EXHAUSTED; the next
    normal call on the same server succeeds."""

    async def body():
        async with router() as addr:
            opts = [("grpc.max_send_message_length", 2 * MAX_MESSAGE_BYTES)]
            async with grpc.aio.insecure_channel(addr, options=opts) as ch:
                big = router_pb2.GenerateRequest(text="x" * (MAX_MESSAGE_BYTES + 1024))
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    async for _ in router_pb2_grpc.RouterStub(ch).Generate(big, timeout=60):
                        pass
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert (await status(ch)).router_queue_depth == 0

    asyncio.run(body())


def test_bad_tls_settings_fail_at_construction_naming_the_flag(pki, tmp_path):
    """Missing files, a key that does not match the certificate, half a pair and mTLS without a CA are refused
    when the config is built, each naming the flag to fix."""
    from pdserve.security import TLSConfigError

    with pytest.raises(TLSConfigError, match="--tls-cert-file.*cannot read"):
        TLSConfig(cert_file=str(tmp_path / "nope.pem"), key_file=str(pki.server_key))
    with pytest.raises(TLSConfigError, match="--tls-key-file"):
        TLSConfig(cert_file=str(pki.server_cert))
    with pytest.raises(TLSConfigError, match="not a PEM certificate and its matching private key"):
        TLSConfig(cert_file=str(pki.server_cert), key_file=str(pki.client_key))
    with pytest.raises(TLSConfigError, match="--tls-require-client-cert.*--tls-ca-file"):
        TLSConfig(cert_file=str(pki.server_cert), key_file=str(pki.server_key), require_client_cert=True)
    with pytest.raises(TLSConfigError, match="--tls-ca-file.*not a PEM CA"):
        TLSConfig(ca_file=str(pki.server_key))
    with pytest.raises(ValueError, match="--tls-ca-file"):
        RouterConfig(tls_ca_file=str(tmp_path / "missing-ca.pem"))
    from router.__main__ import main

    assert main(["--port", "0", "--tls-cert-file", str(tmp_path / "x.pem"), "--tls-key-file", "y"]) == 2
