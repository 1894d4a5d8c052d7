#!/usr/bin/env python3
"""gRPC health probe for a pdserve container (Docker HEALTHCHECK, Kubernetes exec probes when TLS is on).

    pdserve-healthcheck [--port P] [--host H] [--service NAME] [--timeout S] [--http]

Asks grpc.health.v1.Health/Check on host:port (default 127.0.0.1 and the port the entrypoint recorded in
$PDSERVE_RUN_DIR/health.json, else $PDSERVE_HEALTH_PORT, else 50051). The empty service name (the default) is the
server's overall health. With PDSERVE_TLS_CERT_FILE set (the service serves TLS) the probe uses TLS, trusting
PDSERVE_TLS_CA_FILE (else the certificate itself) and checking the name PDSERVE_TLS_SERVER_NAME (default localhost),
and presents PDSERVE_TLS_CERT_FILE / _KEY_FILE as its client certificate, as the services do to each other: a service
under mutual TLS (PDSERVE_TLS_REQUIRE_CLIENT_CERT, or tls_require_client_cert in the config file, which this probe
cannot see) refuses a caller without one, and a service without mutual TLS does not mind it.
The OpenAI front (role `openai` in health.json, or --http) serves HTTP, not gRPC: the probe is GET /health there,
over HTTPS when PDSERVE_HTTP_TLS_CERT_FILE is set (the front's own certificate; its name is not checked).
Exit status 0: SERVING (HTTP: 200); 1: anything else (the reason on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Sequence


def recorded_state() -> dict:
    state = Path(os.environ.get("PDSERVE_RUN_DIR") or "/tmp/pdserve") / "health.json"
    try:
        data = json.loads(state.read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def recorded_port() -> int:
    try:
        return int(recorded_state()["port"])
    except (KeyError, ValueError, TypeError):
        return int(os.environ.get("PDSERVE_HEALTH_PORT") or 50051)


def probe_http(host: str, port: int, timeout: float = 3.0) -> tuple[bool, str]:
    """GET /health of the OpenAI front: healthy on 200."""
    import ssl
    import urllib.error
    import urllib.request

    https = bool(os.environ.get("PDSERVE_HTTP_TLS_CERT_FILE"))
    url = f"{'https' if https else 'http'}://{host}:{port}/health"
    ctx = None
    if https:
        # Reached by loopback address inside the container: the certificate's name cannot match it.
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=ctx) as resp:
            return resp.status == 200, f"{url}: HTTP {resp.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: HTTP {e.code}"
    except (OSError, ValueError) as e:
        return False, f"{url}: {e}"


def channel(target: str):
    import grpc

    cert = os.environ.get("PDSERVE_TLS_CERT_FILE")
    if not cert:
        return grpc.insecure_channel(target)
    ca = os.environ.get("PDSERVE_TLS_CA_FILE") or cert
    key = os.environ.get("PDSERVE_TLS_KEY_FILE")
    # Always present the container's own certificate: under mutual TLS the service refuses certificate-less callers,
    # and whether it requires one may come from its config file rather than PDSERVE_TLS_REQUIRE_CLIENT_CERT.
    creds = grpc.ssl_channel_credentials(
        root_certificates=Path(ca).read_bytes(),
        private_key=Path(key).read_bytes() if key else None,
        certificate_chain=Path(cert).read_bytes() if key else None,
    )
    name = os.environ.get("PDSERVE_TLS_SERVER_NAME") or "localhost"
    return grpc.secure_channel(target, creds, options=[("grpc.ssl_target_name_override", name)])


def probe(host: str, port: int, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    target = f"{host}:{port}"
    try:
        with channel(target) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        return False, f"{target}: {e.code().name}: {e.details()}"
    except OSError as e:
        return False, f"{target}: {e}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    return resp.status == health_pb2.HealthCheckResponse.SERVING, f"{target} service={service!r}: {status}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="pdserve-healthcheck", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None)
    p.add_argument("--service", default=os.environ.get("PDSERVE_HEALTH_SERVICE", ""))
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--http", action="store_true", help="probe the OpenAI front's GET /health (default: by role)")
    args = p.parse_args(argv)
    port = args.port if args.port is not None else recorded_port()
    if args.http or recorded_state().get("role") == "openai":
        ok, why = probe_http(args.host, port, args.timeout)
    else:
        ok, why = probe(args.host, port, args.service, args.timeout)
    print(why, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
