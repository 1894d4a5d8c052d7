"""pdserve.security's ssl.SSLContexts for plain sockets: a real TLS socket pair on loopback with mutual TLS; a
client without a certificate, and one trusting another CA, fail the handshake."""

from __future__ import annotations

import socket
import ssl
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from security_helpers import make_pki

from pdserve.security import TLSConfig

pytestmark = pytest.mark.timeout(60)


def test_mtls_socket_contexts(tmp_path):
    pki = make_pki(tmp_path)
    server = TLSConfig(
        cert_file=str(pki.server_cert), key_file=str(pki.server_key), ca_file=str(pki.ca), require_client_cert=True
    ).ssl_server_context()
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    results: list[str] = []

    def serve() -> None:
        for _ in range(3):
            conn, _ = lsock.accept()
            try:
                with server.wrap_socket(conn, server_side=True) as tls:
                    tls.sendall(b"hi " + tls.getpeercert()["subject"][0][0][1].encode())
                    results.append("ok")
            except (ssl.SSLError, OSError):
                results.append("refused")

    t = threading.Thread(target=serve, daemon=True)
    t.start()

    def dial(cfg: TLSConfig) -> bytes:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            with cfg.ssl_client_context().wrap_socket(raw, server_hostname="localhost") as tls:
                return tls.recv(100)

    good = TLSConfig(cert_file=str(pki.client_cert), key_file=str(pki.client_key), ca_file=str(pki.ca))
    assert dial(good) == b"hi pdserve client"
    with pytest.raises((ssl.SSLError, OSError)):
        dial(TLSConfig(ca_file=str(pki.ca)))  # no client certificate: the server refuses the handshake
    with pytest.raises(ssl.SSLCertVerificationError):
        dial(TLSConfig(ca_file=str(pki.wrong_ca)))  # we do not trust the server
    t.join(10)
    lsock.close()
    assert results[0] == "ok" and results[1] == "refused"
