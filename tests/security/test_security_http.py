"""HTTPS and mutual TLS on the OpenAI HTTP front (router/openai_http.py): the front in-process (and once as
``python -m router.openai_http``) over a real in-process router, a pod registered in it so /v1/models has something
to list; who gets in and who is refused; bad certificate settings fail at startup naming the --http-tls-* flag; and
the plan / health check of ``pdserve up`` under --tls-*. Certificates are made per run."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
import sys
from pathlib import Path
from typing import AsyncIterator

import aiohttp
import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "router"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from router_helpers import register_request
from security_helpers import Pki, make_pki

from pdserve.cli_config import from_args
from pdserve.cluster.supervisor import LocalCluster, _http_ok
from pdserve.cluster.topology import Topology
from pdserve.security import TLSConfig, TLSConfigError, http_server_tls
from pdserve_api.v1 import registry_pb2_grpc
from router.config import OpenAIHttpConfig, RouterConfig
from router.openai_http import main as front_main
from router.openai_http import parser as front_parser
from router.openai_http import start_openai_http
from router.server import RouterServer

pytestmark = pytest.mark.timeout(120)
MODEL = "SmolLM2-135M-Instruct"  # what register_request's pod serves


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki-http"))


def service_tls(pki: Pki, mtls: bool = False) -> TLSConfig:
    """What every service of a cluster serves (and, as a client of the others, presents)."""
    return TLSConfig(
        cert_file=str(pki.server_cert), key_file=str(pki.server_key), ca_file=str(pki.ca), require_client_cert=mtls
    )


@contextlib.asynccontextmanager
async def router_with_a_pod(tls: TLSConfig | None = None) -> AsyncIterator[str]:
    kw = (
        {}
        if tls is None
        else dict(
            tls_cert_file=tls.cert_file,
            tls_key_file=tls.key_file,
            tls_ca_file=tls.ca_file,
            tls_require_client_cert=tls.require_client_cert,
        )
    )
    server = RouterServer(RouterConfig(port=0, **kw))
    port = await server.start()
    addr = f"127.0.0.1:{port}"
    try:
        ch = (
            grpc.aio.insecure_channel(addr) if tls is None else grpc.aio.secure_channel(addr, tls.channel_credentials())
        )
        async with ch:
            r = await registry_pb2_grpc.RegistryStub(ch).RegisterWorker(register_request("d0"), timeout=10)
            assert r.accepted, r.message
        yield addr
    finally:
        await server.stop(grace=0.2)


def client_ctx(ca: Path, cert: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert), str(key))
    return ctx


async def models(url: str, ssl_ctx: ssl.SSLContext | bool | None = None) -> list[str]:
    """GET /v1/models; the ids listed (raises aiohttp.ClientError when the connection is refused)."""
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        async with s.get(f"{url}/v1/models", ssl=ssl_ctx if ssl_ctx is not None else True) as r:
            assert r.status == 200, await r.text()
            return [m["id"] for m in (await r.json())["data"]]


def test_without_a_certificate_the_front_stays_plain_http():
    """The default is unchanged: no TLS config, plain HTTP (``url`` says http), /v1/models answers, and the
    supervisor's health check of a plain front passes."""

    async def body():
        async with router_with_a_pod() as addr:
            front = await start_openai_http(addr, "127.0.0.1", 0)
            try:
                assert front.url == f"http://127.0.0.1:{front.port}"
                assert await models(front.url) == [MODEL]
                assert await asyncio.to_thread(_http_ok, f"{front.url}/health")
            finally:
                await front.stop()

    asyncio.run(body())


def test_https_front_serves_a_client_that_trusts_our_ca(pki):
    """With a server certificate the front serves HTTPS (``url`` says https): a client trusting our CA gets a real
    /v1/models answer, which went through the front's gRPC client to the router (it lists the registered pod's
    model), and /health answers too."""

    async def body():
        async with router_with_a_pod() as addr:
            front = await start_openai_http(
                addr, "127.0.0.1", 0, tls=http_server_tls(str(pki.server_cert), str(pki.server_key))
            )
            try:
                assert front.url == f"https://127.0.0.1:{front.port}"
                assert await models(front.url, client_ctx(pki.ca)) == [MODEL]
                async with aiohttp.ClientSession() as s:
                    async with s.get(f"{front.url}/health", ssl=client_ctx(pki.ca)) as r:
                        assert r.status == 200 and (await r.json()) == {"status": "ok"}
            finally:
                await front.stop()

    asyncio.run(body())


def test_https_front_refuses_plain_http_and_a_client_trusting_another_ca(pki):
    """The HTTPS port answers no plain-HTTP request (the connection is dropped, no response), and a client that
    trusts another CA rejects the front's certificate at the handshake; neither gets the model list."""

    async def body():
        async with router_with_a_pod() as addr:
            front = await start_openai_http(
                addr, "127.0.0.1", 0, tls=http_server_tls(str(pki.server_cert), str(pki.server_key))
            )
            try:
                with pytest.raises(aiohttp.ClientError):
                    await models(f"http://127.0.0.1:{front.port}")
                with pytest.raises(aiohttp.ClientConnectorCertificateError):
                    await models(front.url, client_ctx(pki.wrong_ca))
                with pytest.raises(aiohttp.ClientConnectorCertificateError):  # nor the system roots
                    await models(front.url)
                assert await models(front.url, client_ctx(pki.ca)) == [MODEL]  # still serving
            finally:
                await front.stop()

    asyncio.run(body())


def test_mtls_front_requires_a_client_certificate_from_our_ca(pki):
    """Mutual TLS as `pdserve up --tls-require-client-cert` runs it (the router serves mTLS too; the front reaches
    it with the service certificate and serves HTTPS with the same one): a client without a certificate, or with
    one signed by another CA, is refused; a client certificate signed by our CA gets /v1/models. The supervisor's
    health check (_http_ok with the cluster's TLSConfig) passes; without the CA and certificate it does not."""

    async def body():
        tls = service_tls(pki, mtls=True)
        async with router_with_a_pod(tls) as addr:
            front = await start_openai_http(addr, "127.0.0.1", 0, router_tls=tls, tls=tls)
            try:
                for bad in (client_ctx(pki.ca), client_ctx(pki.ca, pki.rogue_cert, pki.rogue_key)):
                    with pytest.raises(aiohttp.ClientError):
                        await models(front.url, bad)
                assert await models(front.url, client_ctx(pki.ca, pki.client_cert, pki.client_key)) == [MODEL]
                health = f"{front.url}/health"
                assert await asyncio.to_thread(_http_ok, health, tls)
                assert not await asyncio.to_thread(_http_ok, health, TLSConfig(ca_file=str(pki.ca)))
                assert not await asyncio.to_thread(_http_ok, health)
                assert not await asyncio.to_thread(_http_ok, f"http://127.0.0.1:{front.port}/health")
            finally:
                await front.stop()

    asyncio.run(body())


def test_cli_serves_https_from_its_http_tls_flags(pki):
    """`python -m router.openai_http --http-tls-cert-file ... --http-tls-key-file ... --http-tls-ca-file ...
    --http-tls-require-client-cert` (a real process) prints an https URL and serves mutual TLS on it."""

    async def body():
        async with router_with_a_pod() as addr:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "router.openai_http",
                "--router",
                addr,
                "--port",
                "0",
                "--log-level",
                "WARNING",
                "--http-tls-cert-file",
                str(pki.server_cert),
                "--http-tls-key-file",
                str(pki.server_key),
                "--http-tls-ca-file",
                str(pki.ca),
                "--http-tls-require-client-cert",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=str(Path(__file__).resolve().parents[2]),
            )
            try:
                line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
                assert "https://127.0.0.1:" in line, (line, (await proc.stderr.read()).decode())
                url = line.split(" on ", 1)[1].split("/v1", 1)[0]
                with pytest.raises(aiohttp.ClientError):
                    await models(url, client_ctx(pki.ca))
                assert await models(url, client_ctx(pki.ca, pki.client_cert, pki.client_key)) == [MODEL]
            finally:
                proc.terminate()
                await asyncio.wait_for(proc.wait(), 30)

    asyncio.run(body())


def test_bad_https_settings_fail_at_startup_naming_the_http_tls_flag(pki, tmp_path, capsys, monkeypatch):
    """The CLI exits with status 2 before serving anything, and the message names the flag (or environment variable)
    to fix: an unreadable certificate, half a pair, a key that does not match, a CA alone (no certificate to serve),
    mTLS without a CA. The client-side --tls-* flags keep their own names."""
    cert, key, ca = str(pki.server_cert), str(pki.server_key), str(pki.ca)
    missing = str(tmp_path / "nope.pem")
    cases = [
        (["--http-tls-cert-file", missing, "--http-tls-key-file", key], r"--http-tls-cert-file .*cannot read"),
        (["--http-tls-cert-file", cert], r"--http-tls-key-file"),
        (
            ["--http-tls-cert-file", cert, "--http-tls-key-file", str(pki.client_key)],
            r"--http-tls-cert-file .* / --http-tls-key-file .*not a PEM certificate and its matching private key",
        ),
        (["--http-tls-ca-file", ca], r"--http-tls-ca-file .*needs --http-tls-cert-file and --http-tls-key-file"),
        (
            ["--http-tls-cert-file", cert, "--http-tls-key-file", key, "--http-tls-require-client-cert"],
            r"--http-tls-require-client-cert .*needs --http-tls-ca-file",
        ),
        (
            ["--http-tls-cert-file", cert, "--http-tls-key-file", key, "--http-tls-ca-file", missing],
            r"--http-tls-ca-file \(PDSERVE_HTTP_TLS_CA_FILE\): cannot read",
        ),
        (["--tls-ca-file", missing], r"^python -m router.openai_http: error: --tls-ca-file \(PDSERVE_TLS_CA_FILE\)"),
    ]
    for argv, pattern in cases:
        assert front_main(["--port", "0", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert re.search(pattern, err), (argv, err)
        if argv[0].startswith("--http-"):
            assert "--tls-" not in err.replace("--http-tls-", ""), err  # never the client-side flag's name
    monkeypatch.setenv("PDSERVE_HTTP_TLS_CERT_FILE", missing)
    monkeypatch.setenv("PDSERVE_HTTP_TLS_KEY_FILE", key)
    assert front_main(["--port", "0"]) == 2
    assert "--http-tls-cert-file (PDSERVE_HTTP_TLS_CERT_FILE): cannot read" in capsys.readouterr().err
    with pytest.raises(TLSConfigError, match="--http-tls-cert-file"):  # the API refuses a config it cannot serve
        asyncio.run(start_openai_http("127.0.0.1:1", "127.0.0.1", 0, tls=TLSConfig(ca_file=ca)))


def _ckpt(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "num_attention_heads": 8,
                "num_key_value_heads": 1,
                "hidden_size": 64,
            }
        )
    )
    (d / "tokenizer.json").write_text("{}")
    return d


def _front_args(cluster: LocalCluster):
    (front,) = [s for s in cluster._plan() if s.kind == "http"]
    return from_args(
        OpenAIHttpConfig, front_parser().parse_args(front.argv[front.argv.index("router.openai_http") + 1 :])
    )


@pytest.mark.parametrize("mtls", [False, True])
def test_up_plan_serves_https_on_the_front_with_the_cluster_certificate(pki, tmp_path, monkeypatch, mtls):
    """`pdserve up --tls-*`: the front's command line makes it serve HTTPS with the services' certificate (and
    require client certificates when the cluster does), while reaching the router as a TLS client with the same
    files; the supervisor's scheme is https. A stray PDSERVE_HTTP_TLS_* in the environment does not reach the front.
    Without --tls-* nothing changes: plain HTTP."""
    monkeypatch.setenv("PDSERVE_HTTP_TLS_CERT_FILE", str(tmp_path / "stray.pem"))
    topo = Topology(model=str(_ckpt(tmp_path)), router_port=50551, http_port=8551).resolve()
    tls = service_tls(pki, mtls)
    cluster = LocalCluster(topo, log_dir=tmp_path / "logs", tls=tls)
    assert "PDSERVE_HTTP_TLS_CERT_FILE" not in cluster.env
    assert cluster.http_scheme == "https"
    args = _front_args(cluster)
    assert args.http_tls == tls
    router_side = args.router_tls
    assert router_side is not None and not router_side.require_client_cert
    assert (router_side.ca_file, router_side.cert_file) == (tls.ca_file, tls.cert_file)

    plain = LocalCluster(topo, log_dir=tmp_path / "logs")
    assert plain.http_scheme == "http"
    monkeypatch.delenv("PDSERVE_HTTP_TLS_CERT_FILE")
    args = _front_args(plain)
    assert args.http_tls is None and args.router_tls is None
