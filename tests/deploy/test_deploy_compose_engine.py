"""End to end, where a Docker engine answers: build the image, bring the compose cluster up, send a real request
through the pdserve SDK, tear everything down. Skipped, with the reason, where no engine answers.

The `docker` CLI drives the engine (detect, build, inspect the containers' health, logs on failure, clean-up),
through subprocess: `import docker` here would find the repo's own docker/ folder, not the SDK. `up --wait` /
`down` run the Compose v2 binary that deploy/ci/install_tools.sh installs, on the same engine.
Time: a first build downloads torch and converts the default model (minutes); later builds hit the layer cache.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid

import pytest
from pdserve.net import free_port
from deploy_helpers import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

CPU_BASE = "python:3.11-slim-bookworm"


def _docker(*args: str, timeout: float = 60, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed ({res.returncode}): {res.stderr[-2000:]}")
    return res


def _engine_problem() -> str | None:
    """None when a Docker engine answers the docker CLI, else why not."""
    if shutil.which("docker") is None:
        return "no Docker engine answers: the docker CLI is not installed"
    try:
        res = _docker("version", "--format", "{{.Server.Version}}", timeout=15, check=False)
    except subprocess.TimeoutExpired:
        return "no Docker engine answers: `docker version` timed out"
    if res.returncode != 0 or not res.stdout.strip():
        where = os.environ.get("DOCKER_HOST") or "the default socket"
        return f"no Docker engine answers at {where}: {res.stderr.strip()[-300:]}"
    return None


def _containers(project: str) -> list[dict]:
    """docker inspect of every container of the compose project."""
    ids = _docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={project}").stdout.split()
    return json.loads(_docker("inspect", *ids).stdout) if ids else []


@pytest.fixture(scope="module")
def engine():
    why = _engine_problem()
    if why is not None:
        pytest.skip(why)


def test_compose_cluster_serves_a_request(engine, tools):
    from pdserve.client import Client

    tag = f"pdserve-e2e:{uuid.uuid4().hex[:8]}"
    project = f"pdserve-e2e-{uuid.uuid4().hex[:8]}"
    # FLAVOR=cpu; the CUDA stage points at the CPU base too, so a builder that runs every stage pulls nothing CUDA.
    _docker(
        "build",
        "-f",
        str(REPO / "docker" / "Dockerfile"),
        "-t",
        tag,
        "--build-arg",
        "FLAVOR=cpu",
        "--build-arg",
        f"CUDA_BASE_IMAGE={CPU_BASE}",
        str(REPO),
        timeout=3000,
    )
    ports = {name: free_port() for name in ("ROUTER", "PREFILL", "DECODE")}
    env = {
        **tools.env(),
        "PDSERVE_IMAGE": tag,
        "PDSERVE_PROJECT": project,
        **{f"PDSERVE_{k}_PORT": str(v) for k, v in ports.items()},
    }
    compose = [str(tools.compose), "-f", str(REPO / "docker" / "compose.yaml"), "-p", project]
    try:
        up = subprocess.run(
            [*compose, "up", "-d", "--no-build", "--wait", "--wait-timeout", "900"],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        containers = _containers(project)
        states = {
            c["Config"]["Labels"]["com.docker.compose.service"]: (
                c["State"]["Status"],
                (c["State"].get("Health") or {}).get("Status"),
            )
            for c in containers
        }
        if up.returncode != 0:
            logs = "\n".join(
                f"--- {c['Name']}\n" + _docker("logs", "--tail", "80", c["Id"], check=False).stdout for c in containers
            )
            pytest.fail(f"compose up failed: {up.stderr[-3000:]}\nstates: {states}\n{logs}")
        assert states == {s: ("running", "healthy") for s in ("router", "prefill", "decode")}, states
        with Client(f"127.0.0.1:{ports['ROUTER']}", timeout=120) as client:
            client.wait_ready(timeout=300)
            out = client.generate("The capital of France is", max_tokens=8, temperature=0)
        assert out.finish_reason in ("stop", "length"), out
        assert out.usage.completion_tokens >= 1 and out.token_ids
        assert out.routing.prefill_pod_id and out.routing.decode_pod_id
    finally:
        subprocess.run(
            [*compose, "down", "--volumes", "--remove-orphans", "--timeout", "30"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        label = f"label=com.docker.compose.project={project}"
        ids = _docker("ps", "-aq", "--filter", label, check=False).stdout.split()
        if ids:
            _docker("rm", "-f", *ids, check=False)
        nets = _docker("network", "ls", "-q", "--filter", label, check=False).stdout.split()
        if nets:
            _docker("network", "rm", *nets, check=False)
        _docker("rmi", "-f", tag, check=False)  # best effort
