"""kv_transfer.control with TLS and the cluster token, on a real loopback socket: a mutual-TLS client holding the
token is served (and an idle TLS connection reads as alive until the server goes away); plaintext clients, clients
trusting another CA and clients without a certificate are refused before any request is handled."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from security_helpers import make_pki

from kv_transfer.control import ControlClient, ControlServer, KVAuthError
from kv_transfer.transport import HandshakeTimeout, TransferUnavailable
from pdserve.security import TLSConfig

pytestmark = pytest.mark.timeout(120)


def test_tls_control_channel(tmp_path):
    pki = make_pki(tmp_path)
    handled: list[str] = []

    def handler(conn, msg, payload):
        handled.append(msg["op"])
        conn.send({"ok": True, "echo": msg["op"]}, bytes(payload))

    server_tls = TLSConfig(
        cert_file=str(pki.server_cert), key_file=str(pki.server_key), ca_file=str(pki.ca), require_client_cert=True
    )
    srv = ControlServer(handler, auth_token="tok", tls=server_tls).start()
    try:
        good = TLSConfig(cert_file=str(pki.client_cert), key_file=str(pki.client_key), ca_file=str(pki.ca))
        c = ControlClient(srv.endpoint, io_timeout_s=10, auth_token="tok", tls=good)
        c.connect(10)
        reply, data = c.call({"op": "ping"}, b"x" * 100_000)  # bytes through TLS, several records
        assert reply["echo"] == "ping" and bytes(data) == b"x" * 100_000
        assert c.alive()
        c.call({"op": "again"})
        for bad in (None, TLSConfig(ca_file=str(pki.wrong_ca)), TLSConfig(ca_file=str(pki.ca))):
            with pytest.raises((HandshakeTimeout, TransferUnavailable)):
                b = ControlClient(srv.endpoint, io_timeout_s=3, auth_token="tok", tls=bad)
                b.connect(5)  # a client without a certificate may only learn at its first request
                b.call({"op": "sneak"})
        with pytest.raises(KVAuthError):
            ControlClient(srv.endpoint, io_timeout_s=3, auth_token="nope", tls=good).connect(5)
        assert handled == ["ping", "again"]
    finally:
        srv.close()
    deadline = time.monotonic() + 10
    while c.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not c.alive()
