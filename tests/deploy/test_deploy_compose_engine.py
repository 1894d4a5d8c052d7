"""End to end, where a Docker engine answers: build the image, bring the compose cluster up, send a real request
through the pdserve SDK, tear everything down. Skipped, with the reason, where no engine answers.

The `docker` Python package drives the engine: it detects it, builds the image, watches the containers' health,
collects logs on failure and removes whatever is left. Compose itself has no Python API in that package, so
`up --wait` / `down` run the Compose v2 binary that deploy/ci/install_tools.sh installs, on the same engine.
Time: a first build downloads torch and converts the default model (minutes); later builds hit the layer cache.
"""
from __future__ import annotations

import os
import socket
import subprocess
import uuid
from pathlib import Path

import pytest
from deploy_helpers import REPO, checks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CPU_BASE = "python:3.11-slim-bookworm"


def _engine():
    """(docker client, "") when an engine answers, else (None, why not)."""
    host = os.environ.get("DOCKER_HOST", "")
    sock = Path("/var/run/docker.sock")
    try:
        import docker
    except ImportError:
        if not host and not sock.exists():
            return None, "no Docker engine answers: DOCKER_HOST unset and no /var/run/docker.sock"
        pytest.fail("a Docker engine socket exists but the `docker` Python package is missing: pip install docker")
    try:
        client = docker.from_env(timeout=10)
        client.ping()
        return client, ""
    except Exception as e:  # noqa: BLE001 - any failure to reach the engine is "no engine"
        where = host or str(sock)
        return None, f"no Docker engine answers at {where}: {type(e).__name__}: {e}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def engine():
    client, why = _engine()
    if client is None:
        pytest.skip(why)
    yield client
    client.close()


def test_compose_cluster_serves_a_request(engine, tools):
    from pdserve.client import Client

    tag = f"pdserve-e2e:{uuid.uuid4().hex[:8]}"
    project = f"pdserve-e2e-{uuid.uuid4().hex[:8]}"
    # The engine's build API is the classic builder: it runs every stage, so point the CUDA stage at the CPU base
    # (nothing CUDA is pulled for a CPU image).
    engine.images.build(path=str(REPO), dockerfile="docker/Dockerfile", tag=tag, rm=True, forcerm=True,
                        buildargs={"FLAVOR": "cpu", "CUDA_BASE_IMAGE": CPU_BASE})
    ports = {name: _free_port() for name in ("ROUTER", "PREFILL", "DECODE")}
    env = {**tools.env(), "PDSERVE_IMAGE": tag, "PDSERVE_PROJECT": project,
           **{f"PDSERVE_{k}_PORT": str(v) for k, v in ports.items()}}
    compose = [str(tools.compose), "-f", str(REPO / "docker" / "compose.yaml"), "-p", project]
    try:
        up = subprocess.run([*compose, "up", "-d", "--no-build", "--wait", "--wait-timeout", "900"], env=env,
                            capture_output=True, text=True, timeout=1200)
        containers = engine.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
        states = {c.labels["com.docker.compose.service"]: (c.status, c.attrs["State"].get("Health", {}).get("Status"))
                  for c in containers}
        if up.returncode != 0:
            logs = "\n".join(f"--- {c.name}\n{c.logs(tail=80).decode(errors='replace')}" for c in containers)
            pytest.fail(f"compose up failed: {up.stderr[-3000:]}\nstates: {states}\n{logs}")
        assert states == {s: ("running", "healthy") for s in ("router", "prefill", "decode")}, states
        with Client(f"127.0.0.1:{ports['ROUTER']}", timeout=120) as client:
            client.wait_ready(timeout=300)
            out = client.generate("The capital of France is", max_tokens=8, temperature=0)
        assert out.finish_reason in ("stop", "length"), out
        assert out.usage.completion_tokens >= 1 and out.token_ids
        assert out.routing.prefill_pod_id and out.routing.decode_pod_id
    finally:
        subprocess.run([*compose, "down", "--volumes", "--remove-orphans", "--timeout", "30"], env=env,
                       capture_output=True, text=True, timeout=300)
        for c in engine.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"}):
            c.remove(force=True)
        for n in engine.networks.list(filters={"label": f"com.docker.compose.project={project}"}):
            n.remove()
        try:
            engine.images.remove(tag, force=True)
        except Exception:  # noqa: BLE001 - best effort
            pass
