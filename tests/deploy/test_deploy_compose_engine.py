"""End to end on a real Docker engine: build the image (docker/build_image.sh: no registry or package index needed),
run the compose cluster (router, OpenAI front, prefill pod, TP 2 x DCP 2 decode pod, each container on the project's
bridge network) and check what it serves against the in-process engine, then tear everything down.

Checked: every container healthy by its HEALTHCHECK; greedy tokens through the pdserve SDK and through the official
`openai` client equal LLMEngine's on the same checkpoint (copied out of the image); KV moves between the prefill and
decode containers (separate network namespaces) over NIXL with UCX held to TCP and over the kv_transfer TCP
fallback, with the transfer rate of each request printed; Prometheus /metrics of router, prefill and decode answer;
a decode pod whose processes are all SIGKILLed is brought back by the restart policy, re-registers, and the cluster
serves again (time printed); the two-router and mutual-TLS overlays come up and answer; `down -v` leaves no
container, network or volume. The image: non-root, HEALTHCHECK, `--help` of each role's entry point.

The `docker` CLI drives the engine through subprocess (`import docker` here would find the repo's docker/ folder);
`up --wait` / `down` run the Compose v2 binary that deploy/ci/install_tools.sh installs. Skipped, with the reason,
where no engine answers, unless PDSERVE_REQUIRE_DOCKER=1 (scripts/test.sh sets it once it has an engine): then that
fails. Time: a cold build collects wheels, builds a base and converts the default model (minutes); later runs hit the
wheelhouse and layer caches.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
from deploy_helpers import REPO, _load

from pdserve.net import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]

IMAGE = os.environ.get("PDSERVE_E2E_IMAGE", "pdserve:e2e")
MODEL_IN_IMAGE = "/opt/pdserve/models/tiny-mqa-dcp"  # what docker/config/pdserve.yaml serves
COMPOSE = REPO / "docker" / "compose.yaml"
ROUTERS = REPO / "docker" / "compose.routers.yaml"
TLS = REPO / "docker" / "compose.tls.yaml"
ROUTERS_TLS = REPO / "docker" / "compose.routers.tls.yaml"
SERVICES = ("router", "prefill", "decode", "openai")


def _ids(n: int, seed: int) -> list[int]:
    return [(i * 7919 + seed * 104729 + 13) % 49000 + 100 for i in range(n)]


PROMPT = _ids(384, 0)  # token ids, used verbatim by both APIs
# Longer prompts for the KV rate (2048 tokens: 512 KiB of the tiny model's KV), two per path: the first request of
# a pod pair also sets its connection up.
KV_PROMPTS = (_ids(2048, 1), _ids(2048, 2))
NEW_TOKENS = 12
METRICS_PORT = 9400  # docker/config/pdserve.yaml
REPORT: list[str] = []  # the figures, printed at the end of the run by conftest.py (also under -q)
DANGLING_BEFORE: set[str] = set()  # untagged images that were there before this module built anything


def _docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    res = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed ({res.returncode}): {res.stderr[-2000:]}")
    return res


def _engine_problem() -> str | None:
    """None when a Docker engine answers the docker CLI, else why not."""
    if shutil.which("docker") is None:
        return "no Docker engine answers: the docker CLI is not installed"
    try:
        res = _docker("version", "--format", "{{.Server.Version}}", timeout=20, check=False)
    except subprocess.TimeoutExpired:
        return "no Docker engine answers: `docker version` timed out"
    if res.returncode != 0 or not res.stdout.strip():
        where = os.environ.get("DOCKER_HOST") or "the default socket"
        return f"no Docker engine answers at {where}: {res.stderr.strip()[-300:]}"
    return None


def _dangling() -> list[str]:
    return _docker("images", "-q", "--no-trunc", "--filter", "dangling=true").stdout.split()


def _report(line: str) -> None:
    REPORT.append(line)
    print(line, flush=True)


@pytest.fixture(scope="module")
def engine():
    why = _engine_problem()
    if why is not None:
        if os.environ.get("PDSERVE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"PDSERVE_REQUIRE_DOCKER=1 but {why}", pytrace=False)
        pytest.skip(why)


@pytest.fixture(scope="module")
def image(engine) -> str:
    DANGLING_BEFORE.update(_dangling())
    t0 = time.monotonic()
    res = subprocess.run(
        ["bash", str(REPO / "docker" / "build_image.sh"), "-t", IMAGE],
        capture_output=True,
        text=True,
        timeout=3000,
    )
    if res.returncode != 0:
        pytest.fail(f"docker/build_image.sh failed ({res.returncode}):\n{res.stderr[-4000:]}", pytrace=False)
    built = [ln for ln in res.stderr.splitlines() if "built " in ln or "collected" in ln]
    _report(f"image {IMAGE} ready in {time.monotonic() - t0:.0f} s ({'; '.join(built) or 'no output'})")
    return IMAGE


@pytest.fixture(scope="module")
def engine_tokens(image, tmp_path_factory) -> dict[tuple[int, ...], list[int]]:
    """LLMEngine's greedy tokens for PROMPT and KV_PROMPTS, on the checkpoint the cluster serves (copied out of
    the image)."""
    from pdserve.engine.llm_engine import EngineConfig, LLMEngine
    from pdserve.sampling_params import SamplingParams

    dest = tmp_path_factory.mktemp("model")
    cid = _docker("create", image).stdout.strip()
    try:
        _docker("cp", f"{cid}:{MODEL_IN_IMAGE}", str(dest))
    finally:
        _docker("rm", "-f", cid, check=False)
    model = dest / Path(MODEL_IN_IMAGE).name
    sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    prompts = [PROMPT, *KV_PROMPTS]
    with LLMEngine(EngineConfig(model=str(model), num_kv_blocks=1024)) as eng:
        outs = eng.generate(prompts, sp)
    return {tuple(p): list(o["token_ids"]) for p, o in zip(prompts, outs)}


@pytest.fixture(scope="module")
def reference(engine_tokens) -> list[int]:
    return engine_tokens[tuple(PROMPT)]


class Cluster:
    """One compose project on the engine: up --wait, inspection, teardown that leaves nothing behind."""

    def __init__(self, tools, image: str, files: tuple[Path, ...] = (COMPOSE,), **env: str) -> None:
        self.project = f"pdserve-e2e-{uuid.uuid4().hex[:8]}"
        self.ports = {name: free_port() for name in ("ROUTER", "ROUTER2", "PREFILL", "DECODE", "OPENAI")}
        self.env = {
            **tools.env(),
            "PDSERVE_IMAGE": image,
            "PDSERVE_PROJECT": self.project,
            **{f"PDSERVE_{k}_PORT": str(v) for k, v in self.ports.items()},
            **env,
        }
        self.cmd = [str(tools.compose), "-p", self.project]
        for f in files:
            self.cmd += ["-f", str(f)]

    def compose(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return subprocess.run([*self.cmd, *args], env=self.env, capture_output=True, text=True, timeout=timeout)

    def containers(self) -> dict[str, dict]:
        """docker inspect of each service's container."""
        ids = _docker("ps", "-aq", "--filter", f"label=com.docker.compose.project={self.project}").stdout.split()
        docs = json.loads(_docker("inspect", *ids).stdout) if ids else []
        return {c["Config"]["Labels"]["com.docker.compose.service"]: c for c in docs}

    def states(self) -> dict[str, tuple[str, str | None]]:
        return {
            s: (c["State"]["Status"], (c["State"].get("Health") or {}).get("Status"))
            for s, c in self.containers().items()
        }

    def logs(self, tail: int = 60) -> str:
        return "\n".join(
            f"--- {name}\n" + _docker("logs", "--tail", str(tail), c["Id"], check=False).stderr[-6000:]
            for name, c in self.containers().items()
        )

    def up(self) -> float:
        t0 = time.monotonic()
        res = self.compose("up", "-d", "--no-build", "--wait", "--wait-timeout", "600", timeout=900)
        took = time.monotonic() - t0
        if res.returncode != 0:
            pytest.fail(f"compose up failed: {res.stderr[-3000:]}\nstates: {self.states()}\n{self.logs()}")
        return took

    def ip(self, service: str) -> str:
        nets = self.containers()[service]["NetworkSettings"]["Networks"]
        return next(iter(nets.values()))["IPAddress"]

    def down(self) -> None:
        self.compose("down", "--volumes", "--remove-orphans", "--timeout", "30", timeout=300)
        label = f"label=com.docker.compose.project={self.project}"
        left = {
            kind: _docker(*cmd, "--filter", label, check=False).stdout.split()
            for kind, cmd in (
                ("containers", ("ps", "-aq")),
                ("networks", ("network", "ls", "-q")),
                ("volumes", ("volume", "ls", "-q")),
            )
        }
        # Clean up whatever down left before failing on it, so one failure does not leak into the next run.
        if left["containers"]:
            _docker("rm", "-f", *left["containers"], check=False)
        if left["networks"]:
            _docker("network", "rm", *left["networks"], check=False)
        if left["volumes"]:
            _docker("volume", "rm", "-f", *left["volumes"], check=False)
        assert not any(left.values()), f"compose down left {left}"


def _all_healthy(cluster: Cluster, services=SERVICES) -> None:
    states = cluster.states()
    assert states == {s: ("running", "healthy") for s in services}, states


def _metrics(host: str, port: int = METRICS_PORT) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        return r.read().decode()


def _counter(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _sdk_generate(address: str, prompt: list[int] = PROMPT, **client_kw):
    from pdserve.client import Client

    with Client(address, timeout=120, **client_kw) as client:
        client.wait_ready(timeout=120)
        return client.generate(prompt, max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


def _openai_tokens(port: int) -> list[int]:
    import openai

    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0)
    model = oa.models.list().data[0].id
    out = oa.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    tokens = out.choices[0].logprobs.tokens
    assert all(t.startswith("token_id:") for t in tokens), tokens
    return [int(t.split(":", 1)[1]) for t in tokens]


def _kv_requests(cluster: Cluster, engine_tokens: dict, mode: str, label: str) -> None:
    """SDK requests whose KV crosses from the prefill to the decode container over ``mode``; the rate of each."""
    decode_ip = cluster.ip("decode")
    for i, prompt in enumerate(KV_PROMPTS):
        before = _counter(_metrics(decode_ip), "pdserve_decode_kv_received_bytes")
        out = _sdk_generate(f"127.0.0.1:{cluster.ports['ROUTER']}", prompt)
        nbytes = _counter(_metrics(decode_ip), "pdserve_decode_kv_received_bytes") - before
        assert list(out.token_ids) == engine_tokens[tuple(prompt)], i
        assert out.routing.transfer_mode == mode, out.routing
        assert nbytes > 0 and out.timing.kv_transfer_s > 0, (nbytes, out.timing)
        _report(
            f"KV {label}, request {i + 1}{' (sets the connection up)' if i == 0 else ''}: {nbytes / 1024:.0f} KiB "
            f"in {out.timing.kv_transfer_s * 1e3:.1f} ms = {nbytes / out.timing.kv_transfer_s / 1e6:.1f} MB/s "
            f"(prefill {cluster.ip('prefill')} -> decode {decode_ip})"
        )


def _decode_pod(address: str):
    from pdserve.client import Client
    from pdserve_api.v1 import common_pb2

    with Client(address, timeout=10) as client:
        pods = [p for p in client.cluster_status().pods if p.role == common_pb2.ROLE_DECODE]
    return pods[0] if len(pods) == 1 and pods[0].state == common_pb2.POD_STATE_READY else None


def test_image_runs_non_root_with_healthcheck_and_role_entry_points(image):
    cfg = json.loads(_docker("image", "inspect", image).stdout)[0]["Config"]
    assert cfg["User"] == "10001:10001" and cfg["Healthcheck"]["Test"] == ["CMD", "pdserve-healthcheck"]
    assert _docker("run", "--rm", "--entrypoint", "id", image, "-u").stdout.strip() == "10001"
    for role, module in (
        ("router", "router"),
        ("prefill", "prefill_svc"),
        ("decode", "decode_svc"),
        ("openai", "router.openai_http"),
    ):
        res = _docker("run", "--rm", image, role, "--help", timeout=300, check=False)
        assert res.returncode == 0, (role, res.stderr[-2000:])
        assert "usage:" in res.stdout and "--port" in res.stdout, (role, res.stdout[:500])
        assert f"-m {module}" in res.stderr, (role, res.stderr[-500:])  # the entrypoint's exec line


def test_compose_cluster_nixl_over_tcp_serves_restarts_and_tears_down(tools, image, engine_tokens, reference):
    cluster = Cluster(tools, image, PDSERVE_KV_TRANSPORT="nixl", PDSERVE_UCX_TRANSPORTS="tcp")
    try:
        _report(f"compose up --wait (NIXL, UCX_TLS=tcp): {cluster.up():.0f} s")
        _all_healthy(cluster)
        c = cluster.containers()
        net = next(iter(c["prefill"]["NetworkSettings"]["Networks"]))
        assert json.loads(_docker("network", "inspect", net).stdout)[0]["Driver"] == "bridge"
        assert net == next(iter(c["decode"]["NetworkSettings"]["Networks"])) and net != "bridge"
        # Separate containers: separate network namespaces, KV crosses the bridge between them.
        assert c["prefill"]["NetworkSettings"]["SandboxKey"] != c["decode"]["NetworkSettings"]["SandboxKey"]
        assert cluster.ip("prefill") != cluster.ip("decode")

        assert list(_sdk_generate(f"127.0.0.1:{cluster.ports['ROUTER']}").token_ids) == reference
        assert _openai_tokens(cluster.ports["OPENAI"]) == reference
        _kv_requests(cluster, engine_tokens, "nixl_pull", "NIXL (UCX_TLS=tcp)")
        for svc, family in (
            ("router", "pdserve_router"),
            ("prefill", "pdserve_prefill"),
            ("decode", "pdserve_decode"),
        ):
            assert family in _metrics(cluster.ip(svc)), svc

        # The decode pod dies (every process SIGKILLed, as an OOM kill would): the restart policy brings it back.
        # (`docker kill` is a manual stop to Docker: it never restarts a container, whatever the policy.)
        router = f"127.0.0.1:{cluster.ports['ROUTER']}"
        before = _decode_pod(router)
        assert before is not None
        t0 = time.monotonic()
        _docker("exec", c["decode"]["Id"], "python3", "-c", "import os, signal; os.kill(-1, signal.SIGKILL)")
        restarted = None
        while time.monotonic() - t0 < 300:
            now = cluster.containers()["decode"]["State"]
            pod = _decode_pod(router) if now["Status"] == "running" else None
            if now.get("Health", {}).get("Status") == "healthy" and pod is not None and pod.uptime_s < before.uptime_s:
                restarted = time.monotonic() - t0
                break
            time.sleep(0.5)
        assert restarted is not None, f"decode did not come back\n{cluster.states()}\n{cluster.logs()}"
        assert cluster.containers()["decode"]["RestartCount"] >= 1
        out = _sdk_generate(router)
        served = time.monotonic() - t0
        assert list(out.token_ids) == reference
        _report(f"decode SIGKILLed: healthy, re-registered after {restarted:.1f} s; serving again after {served:.1f} s")
        _all_healthy(cluster)
    finally:
        cluster.down()


def test_compose_cluster_kv_over_tcp_fallback(tools, image, engine_tokens):
    cluster = Cluster(tools, image, PDSERVE_KV_TRANSPORT="tcp")
    try:
        _report(f"compose up --wait (kv_transfer TCP fallback): {cluster.up():.0f} s")
        _all_healthy(cluster)
        _kv_requests(cluster, engine_tokens, "tcp", "TCP fallback")
    finally:
        cluster.down()


def test_compose_two_routers_with_mutual_tls(tools, image, reference):
    """compose.routers.yaml and compose.tls.yaml stacked (with compose.routers.tls.yaml for router-2): both routers
    serve, over mutual TLS only, and the OpenAI front reaches them with the same certificate."""
    pki = _load("pdserve_security_helpers", REPO / "tests" / "security" / "security_helpers.py").make_pki(
        Path(tempfile.mkdtemp(prefix="pdserve-e2e-pki-"))
    )
    tls_dir = pki.ca.parent / "compose"
    tls_dir.mkdir()
    for src, name in ((pki.ca, "ca.crt"), (pki.server_cert, "tls.crt"), (pki.server_key, "tls.key")):
        shutil.copy(src, tls_dir / name)
        (tls_dir / name).chmod(0o644)  # the containers' user (uid 10001) reads them; throwaway test material
    for d in (pki.ca.parent, tls_dir):
        d.chmod(0o755)
    cluster = Cluster(
        tools,
        image,
        (COMPOSE, ROUTERS, TLS, ROUTERS_TLS),
        PDSERVE_TLS_DIR=str(tls_dir),
        PDSERVE_TLS_SERVER_NAME="localhost",  # the certificate's name (localhost, 127.0.0.1)
    )
    try:
        _report(f"compose up --wait (two routers, mutual TLS): {cluster.up():.0f} s")
        _all_healthy(cluster, (*SERVICES, "router-2"))
        tls = dict(root_ca=str(pki.ca), client_cert=str(pki.client_cert), client_key=str(pki.client_key))
        for port in (cluster.ports["ROUTER"], cluster.ports["ROUTER2"]):
            assert list(_sdk_generate(f"127.0.0.1:{port}", **tls).token_ids) == reference, port
        # Without a client certificate the routers refuse the caller.
        from pdserve.client import Client

        for port in (cluster.ports["ROUTER"], cluster.ports["ROUTER2"]):
            with Client(f"127.0.0.1:{port}", timeout=10, root_ca=str(pki.ca)) as bare:
                assert not bare.health(), port
        assert _openai_tokens(cluster.ports["OPENAI"]) == reference
    finally:
        cluster.down()
        shutil.rmtree(pki.ca.parent, ignore_errors=True)


def test_nothing_of_the_project_left_on_the_engine(image):
    """After the clusters: no pdserve-e2e container, network or volume, and no untagged image from the build."""
    for cmd in (("ps", "-a"), ("network", "ls"), ("volume", "ls")):
        out = _docker(*cmd, "--format", "{{.Names}}" if cmd[0] == "ps" else "{{.Name}}").stdout.split()
        assert not [n for n in out if n.startswith("pdserve-e2e-")], (cmd, out)
    new = set(_dangling()) - DANGLING_BEFORE
    assert not new, f"untagged images left by the build: {sorted(new)}"
