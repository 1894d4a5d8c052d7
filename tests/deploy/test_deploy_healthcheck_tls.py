"""docker/healthcheck.py against TLS and mutual-TLS gRPC servers, as the exec probes (Helm, tls.enabled) and the
compose TLS overlay run it: the probe trusts PDSERVE_TLS_CA_FILE, checks PDSERVE_TLS_SERVER_NAME and presents the
container's certificate (PDSERVE_TLS_CERT_FILE / _KEY_FILE), so it passes a service that requires client
certificates, also when the service learnt that from its config file rather than PDSERVE_TLS_REQUIRE_CLIENT_CERT."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from deploy_helpers import REPO, _load, healthcheck
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

pki_mod = _load("pdserve_security_helpers", REPO / "tests" / "security" / "security_helpers.py")

TLS_VARS = (
    "PDSERVE_TLS_CERT_FILE",
    "PDSERVE_TLS_KEY_FILE",
    "PDSERVE_TLS_CA_FILE",
    "PDSERVE_TLS_SERVER_NAME",
    "PDSERVE_TLS_REQUIRE_CLIENT_CERT",
)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return pki_mod.make_pki(tmp_path_factory.mktemp("pki"))


def _server(pki, require_client_cert: bool):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    creds = grpc.ssl_server_credentials(
        [(pki.server_key.read_bytes(), pki.server_cert.read_bytes())],
        root_certificates=pki.ca.read_bytes(),
        require_client_auth=require_client_cert,
    )
    port = server.add_secure_port("127.0.0.1:0", creds)
    server.start()
    return server, port


@pytest.fixture
def mtls_port(pki):
    server, port = _server(pki, require_client_cert=True)
    yield port
    server.stop(None)


@pytest.fixture
def tls_port(pki):
    server, port = _server(pki, require_client_cert=False)
    yield port
    server.stop(None)


def _container_env(monkeypatch, pki, **extra):
    """The environment the chart / compose overlay give a container (the service's own certificate)."""
    for v in TLS_VARS:
        monkeypatch.delenv(v, raising=False)
    env = {
        "PDSERVE_TLS_CERT_FILE": str(pki.server_cert),
        "PDSERVE_TLS_KEY_FILE": str(pki.server_key),
        "PDSERVE_TLS_CA_FILE": str(pki.ca),
        "PDSERVE_TLS_SERVER_NAME": "localhost",
        **extra,
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("require_env", ["true", "1", None])
def test_probe_presents_the_container_certificate_under_mtls(mtls_port, pki, monkeypatch, capsys, require_env):
    # None: the service requires client certificates because of its config file; the probe cannot know.
    _container_env(monkeypatch, pki, **({"PDSERVE_TLS_REQUIRE_CLIENT_CERT": require_env} if require_env else {}))
    assert healthcheck.main(["--port", str(mtls_port)]) == 0, capsys.readouterr().err
    assert "SERVING" in capsys.readouterr().out


def test_mtls_server_refuses_a_probe_without_a_certificate(mtls_port, pki, monkeypatch):
    # What the probe would get without presenting the certificate (only the CA): the handshake fails.
    _container_env(monkeypatch, pki, PDSERVE_TLS_REQUIRE_CLIENT_CERT="true")
    monkeypatch.delenv("PDSERVE_TLS_KEY_FILE")
    ok, why = healthcheck.probe("127.0.0.1", mtls_port, timeout=3.0)
    assert not ok and "UNAVAILABLE" in why


def test_probe_over_tls_without_client_auth(tls_port, pki, monkeypatch):
    _container_env(monkeypatch, pki, PDSERVE_TLS_REQUIRE_CLIENT_CERT="false")
    ok, why = healthcheck.probe("127.0.0.1", tls_port, timeout=3.0)
    assert ok, why


def test_probe_checks_the_server_name(tls_port, pki, monkeypatch):
    _container_env(monkeypatch, pki, PDSERVE_TLS_SERVER_NAME="pdserve.internal")  # not in the certificate
    ok, why = healthcheck.probe("127.0.0.1", tls_port, timeout=3.0)
    assert not ok and "UNAVAILABLE" in why


def test_probe_with_a_certificate_from_another_ca_is_refused(mtls_port, pki, monkeypatch):
    _container_env(monkeypatch, pki, PDSERVE_TLS_CERT_FILE=str(pki.rogue_cert), PDSERVE_TLS_KEY_FILE=str(pki.rogue_key))
    ok, why = healthcheck.probe("127.0.0.1", mtls_port, timeout=3.0)
    assert not ok
