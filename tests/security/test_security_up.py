"""`pdserve up` with mutual TLS and an API key, as a user runs it (a subprocess): every service serves mTLS, the pods
register and hand KV over with the (random) cluster token, and only a client with our CA, a client certificate and
the key is served, by the SDK, `pdserve status` and the OpenAI HTTP front alike."""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from security_helpers import Pki, make_pki
from up_helpers import UpProcess

from pdserve.client import Client

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # slow: an mTLS cluster
KEY = "up-k3y"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki-up"))


@pytest.fixture(scope="module")
def up(tmp_path_factory, tiny_factory, pki):
    tiny = tiny_factory("llama", num_heads=8, num_kv_heads=1, vocab_size=49152)
    u = UpProcess(
        [
            "--model",
            str(tiny),
            "--port",
            "0",
            "--http-port",
            "0",
            "--decode-tp",
            "2",
            "--decode-dcp",
            "2",
            "--num-kv-blocks",
            "64",
            "--api-key",
            KEY,
            "--tls-cert-file",
            str(pki.server_cert),
            "--tls-key-file",
            str(pki.server_key),
            "--tls-ca-file",
            str(pki.ca),
            "--tls-require-client-cert",
        ],
        log_dir=tmp_path_factory.mktemp("up-sec"),
        startup_timeout=600,
    )
    u.start()
    try:
        yield u
    finally:
        u.interrupt()


def client_flags(pki: Pki) -> list[str]:
    return [
        "--tls-ca-file",
        str(pki.ca),
        "--tls-cert-file",
        str(pki.client_cert),
        "--tls-key-file",
        str(pki.client_key),
    ]


def status(up: UpProcess, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "status", "--router", up.router, "--json", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_sdk_with_cert_and_key_generates_through_the_mtls_cluster(up, pki):
    """Greedy generation through router, prefill and a TP 2 x DCP 2 decode pod, all over mutual TLS; the pods
    found each other with the cluster token `pdserve up` made up (no secret given)."""
    with Client(
        up.router,
        root_ca=str(pki.ca),
        client_cert=str(pki.client_cert),
        client_key=str(pki.client_key),
        api_key=KEY,
        timeout=300,
    ) as c:
        a = c.generate("The capital of France is", max_tokens=6, temperature=0, ignore_eos=True)
        b = c.generate("The capital of France is", max_tokens=6, temperature=0, ignore_eos=True)
    assert len(a.token_ids) == 6 and a.token_ids == b.token_ids


def test_pdserve_status_needs_tls_flags_and_the_key(up, pki):
    """`pdserve status` with the client certificate and key lists the pods; without the key it fails naming the
    API key; without TLS it cannot reach the router."""
    ok = status(up, *client_flags(pki), "--api-key", KEY)
    assert ok.returncode == 0, ok.stderr
    assert len(json.loads(ok.stdout)["pods"]) == 2
    no_key = status(up, *client_flags(pki))
    assert no_key.returncode == 1 and "API key" in no_key.stderr, no_key.stderr
    plain = status(up, "--api-key", KEY, "--timeout", "5")
    assert plain.returncode == 1, plain.stdout


def test_http_front_serves_mtls_requires_the_key_and_reaches_the_mtls_router(up, pki):
    """The OpenAI front `pdserve up` starts serves HTTPS with the cluster's certificate under mutual TLS (the URL
    `pdserve up` reports says https): a client without a certificate is refused at the handshake; with our client
    certificate, 401 without the key; with it a completion comes back (the front is the router's mTLS client and
    forwards the same key)."""
    assert up.http.startswith("https://")
    body = json.dumps({"prompt": "Hello", "max_tokens": 3, "temperature": 0}).encode()
    req = urllib.request.Request(
        f"{up.http}/v1/completions", body, {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    )
    with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)) as refused:
        urllib.request.urlopen(req, timeout=120, context=ssl.create_default_context(cafile=str(pki.ca)))
    assert not isinstance(refused.value, urllib.error.HTTPError)  # no HTTP answer at all: refused at the handshake
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    req.remove_header("Authorization")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=120, context=ctx)
    assert e.value.code == 401
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=300, context=ctx) as r:
        out = json.loads(r.read())
    assert out["usage"]["completion_tokens"] == 3
