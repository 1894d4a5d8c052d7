"""docker/: the Dockerfile's shape (multi-stage, CPU by default, CUDA by build argument with flashinfer and NCCL,
non-root, models baked at build time, gRPC HEALTHCHECK) and the compose cluster as Compose resolves it (router +
prefill + decode with DCP=2 inside one container, ports on 127.0.0.1, config by environment and a mounted YAML)."""

from __future__ import annotations

import importlib.util
import json
import re

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

import pytest
import yaml
from deploy_helpers import REPO, checks, entrypoint

from pdserve.parallel_config import ModelParallelInfo, ParallelConfig, check_parallel_config

DOCKERFILE = (REPO / "docker" / "Dockerfile").read_text()


def _instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", DOCKERFILE)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def test_dockerfile_stages_and_flavors():
    ins = _instructions()
    froms = [rest for op, rest in ins if op == "FROM"]
    stages = {m.group(1) for f in froms if (m := re.search(r" AS (\S+)$", f, re.I))}
    assert {"base-cpu", "base-cuda", "base", "builder", "models", "runtime"} <= stages
    assert ("ARG", "FLAVOR=cpu") in ins  # CPU by default
    assert "base-${FLAVOR} AS base" in froms
    cuda = DOCKERFILE.split("AS base-cuda", 1)[1].split("FROM", 1)[0]
    assert 'PDSERVE_EXTRAS="[gpu]"' in cuda and "cu128" in cuda
    gpu_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    assert any(d.startswith("flashinfer") for d in gpu_extra)
    assert "nvidia-nccl-cu12" in DOCKERFILE and "flashinfer-python" in DOCKERFILE  # checked in the build


def test_dockerfile_runtime_is_non_root_with_grpc_healthcheck_and_baked_models():
    ins = _instructions()
    runtime = ins[max(i for i, (op, rest) in enumerate(ins) if op == "FROM") :]
    users = [rest for op, rest in runtime if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    health = [rest for op, rest in runtime if op == "HEALTHCHECK"]
    assert health and "pdserve-healthcheck" in health[0]
    assert ("ENTRYPOINT", '["pdserve-entrypoint"]') in runtime
    assert any(op == "COPY" and "--from=models" in rest for op, rest in runtime)
    assert "build_models.py" in DOCKERFILE and "HF_HUB_OFFLINE=1" in DOCKERFILE
    # Scripts copied into the image keep their executable bit from git (no BuildKit-only COPY --chmod).
    for name in ("entrypoint.py", "healthcheck.py"):
        assert (REPO / "docker" / name).stat().st_mode & 0o111, name
    assert "--chmod" not in DOCKERFILE


def test_tiny_dcp_model_fits_the_compose_layout():
    spec = importlib.util.spec_from_file_location("build_models", REPO / "docker" / "build_models.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    shape = mod.TINY_SHAPE
    model = ModelParallelInfo(shape["num_heads"], shape["num_kv_heads"])
    assert check_parallel_config(model, ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)).valid
    # ... and SmolLM2 cannot do DCP=2 at all, which is why compose serves the tiny model.
    smol = ModelParallelInfo(9, 3)
    assert not any(
        check_parallel_config(smol, ParallelConfig(tensor_parallel_size=tp, decode_context_parallel_size=2)).valid
        for tp in range(1, 33)
    )


@pytest.fixture(scope="module")
def compose(tools) -> dict:
    r = checks.compose_config(tools, fmt="json")
    assert r.ok, r.output
    return json.loads(r.output)


def test_compose_services_ports_and_config(compose):
    services = compose["services"]
    assert set(services) == {"router", "prefill", "decode", "openai"}
    for name, svc in services.items():
        assert svc["command"] == [name]
        for port in svc.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
        mounts = [v for v in svc["volumes"] if v["target"] == svc["environment"]["PDSERVE_CONFIG"]]
        assert mounts and mounts[0]["read_only"] and mounts[0]["type"] == "bind"
        assert svc["healthcheck"]["test"] == ["CMD", "pdserve-healthcheck"]
        assert svc["user"] == "10001:10001" and "ALL" in svc["cap_drop"]
    assert {p["target"] for p in services["router"]["ports"]} == {50051}
    for worker in ("prefill", "decode", "openai"):
        assert services[worker]["depends_on"]["router"]["condition"] == "service_healthy"
    assert [(p["host_ip"], p["target"]) for p in services["openai"]["ports"]] == [("127.0.0.1", 8000)]


def _settings(compose: dict, role: str) -> dict:
    svc = compose["services"][role]
    cfg = yaml.safe_load((REPO / "docker" / "config" / "pdserve.yaml").read_text())
    return entrypoint.resolve(role, cfg, {k: str(v) for k, v in svc["environment"].items() if v is not None})


def test_compose_decode_runs_dcp2_in_one_container(compose):
    d = _settings(compose, "decode")
    assert (d["tensor_parallel_size"], d["decode_context_parallel_size"]) == (2, 2)
    assert d["router"] == "router:50051" and d["port"] == 50053
    assert compose["services"]["decode"]["shm_size"]  # the ranks share memory through /dev/shm
    p = _settings(compose, "prefill")
    assert p["tensor_parallel_size"] == 1 and "decode_context_parallel_size" not in p
    assert d["model"] == p["model"] == _settings(compose, "router")["model"] == "/opt/pdserve/models/tiny-mqa-dcp"


def test_compose_environment_overrides_the_yaml(tools, monkeypatch):
    monkeypatch.setenv("PDSERVE_DECODE_TP", "4")
    r = checks._run(
        tools, "compose", [tools.compose, "-f", REPO / "docker" / "compose.yaml", "config", "--format", "json"]
    )
    # checks' tool env drops nothing named PDSERVE_DECODE_*: the override reaches the decode container.
    assert r.ok, r.output
    svc = json.loads(r.output)["services"]["decode"]
    assert svc["environment"]["PDSERVE_ARG_TENSOR_PARALLEL_SIZE"] == "4"


@pytest.fixture(scope="module")
def compose_tls(tools) -> dict:
    r = checks.compose_config(tools, (checks.COMPOSE_FILE, checks.COMPOSE_TLS_FILE), fmt="json")
    assert r.ok, r.output
    return json.loads(r.output)


def test_compose_tls_overlay_sets_mutual_tls_on_every_service(compose_tls):
    """docker compose -f compose.yaml -f compose.tls.yaml: every service gets the certificate directory (read-only,
    next to its config file) and PDSERVE_TLS_*, mutual TLS by default; the rest is compose.yaml's."""
    services = compose_tls["services"]
    assert set(services) == {"router", "prefill", "decode", "openai"}
    for name, svc in services.items():
        env = svc["environment"]
        assert env["PDSERVE_TLS_CERT_FILE"] == "/etc/pdserve/tls/tls.crt"
        assert env["PDSERVE_TLS_KEY_FILE"] == "/etc/pdserve/tls/tls.key"
        assert env["PDSERVE_TLS_CA_FILE"] == "/etc/pdserve/tls/ca.crt"
        assert env["PDSERVE_TLS_SERVER_NAME"] == "pdserve.internal"
        assert env["PDSERVE_TLS_REQUIRE_CLIENT_CERT"] == "true"
        targets = {v["target"]: v for v in svc["volumes"]}
        assert env["PDSERVE_CONFIG"] in targets  # compose.yaml's config mount is kept (merged by target)
        tls = targets["/etc/pdserve/tls"]
        assert tls["type"] == "bind" and tls["read_only"] and tls["source"] == str(REPO / "docker" / "tls")
        assert svc["healthcheck"]["test"] == ["CMD", "pdserve-healthcheck"]  # reads the same env, presents tls.crt
        assert svc["command"] == [name] and svc["user"] == "10001:10001"
        s = entrypoint.resolve(name, {}, {k: str(v) for k, v in env.items() if v is not None})
        assert s["tls_cert_file"] == "/etc/pdserve/tls/tls.crt" and s["tls_ca_file"] == "/etc/pdserve/tls/ca.crt"


def test_compose_tls_overlay_settings_from_the_environment(tools, monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_TLS_DIR", str(tmp_path))
    monkeypatch.setenv("PDSERVE_TLS_REQUIRE_CLIENT_CERT", "false")
    monkeypatch.setenv("PDSERVE_TLS_SERVER_NAME", "pdserve.example")
    r = checks.compose_config(tools, (checks.COMPOSE_FILE, checks.COMPOSE_TLS_FILE), fmt="json")
    assert r.ok, r.output
    for svc in json.loads(r.output)["services"].values():
        assert svc["environment"]["PDSERVE_TLS_REQUIRE_CLIENT_CERT"] == "false"
        assert svc["environment"]["PDSERVE_TLS_SERVER_NAME"] == "pdserve.example"
        assert any(v["target"] == "/etc/pdserve/tls" and v["source"] == str(tmp_path) for v in svc["volumes"])


def test_tls_material_stays_out_of_git_and_the_build_context():
    assert "/docker/tls/" in (REPO / ".gitignore").read_text().splitlines()
    assert "docker/tls" in (REPO / "docker" / "Dockerfile.dockerignore").read_text().splitlines()


def test_both_builders_ignore_the_same_paths():
    """BuildKit reads docker/Dockerfile.dockerignore, the legacy builder (docker/build_image.sh offline) only the
    root .dockerignore: the two must not drift apart."""

    def paths(name: str) -> list[str]:
        return [ln for ln in (REPO / name).read_text().splitlines() if ln.strip() and not ln.startswith("#")]

    assert paths(".dockerignore") == paths("docker/Dockerfile.dockerignore")


def test_wheelhouse_is_a_context_folder_pip_installs_from_when_it_holds_wheels():
    assert (REPO / "docker" / "wheelhouse").is_dir()  # COPY needs it, empty or not
    assert "/docker/wheelhouse/*.whl" in (REPO / ".gitignore").read_text().splitlines()
    ins = _instructions()
    assert ("ARG", "WHEELHOUSE=docker/wheelhouse") in ins and ("COPY", "${WHEELHOUSE} /wheelhouse") in ins
    assert "--no-index --find-links /wheelhouse" in DOCKERFILE
    pip_runs = [rest for op, rest in ins if op == "RUN" and "install" in rest and "pip" in rest]
    assert pip_runs and all("pdserve-pip " in r for r in pip_runs), pip_runs


def test_compose_two_router_overlay(tools):
    """docker/compose.routers.yaml: a second router like the first on its own host port, and both pods registered
    with both routers."""
    r = checks.compose_config(
        tools, [REPO / "docker" / "compose.yaml", REPO / "docker" / "compose.routers.yaml"], fmt="json"
    )
    assert r.ok, r.output
    merged = json.loads(r.output)
    services = merged["services"]
    assert set(services) == {"router", "router-2", "prefill", "decode", "openai"}
    assert services["router-2"]["command"] == ["router"] and services["router-2"]["hostname"] == "router-2"
    assert [(p["host_ip"], p["target"]) for p in services["router-2"]["ports"]] == [("127.0.0.1", 50051)]
    assert {p["published"] for p in services["router"]["ports"]} != {
        p["published"] for p in services["router-2"]["ports"]
    }
    for worker in ("prefill", "decode", "openai"):
        assert _settings(merged, worker)["router"] == "router:50051,router-2:50051"
        assert set(services[worker]["depends_on"]) == {"router", "router-2"}
    # both routers weigh more than the pods (Docker's default cpu_shares: 1024) where they share cores
    assert services["router"]["cpu_shares"] == services["router-2"]["cpu_shares"] > 1024
    assert all(services[worker].get("cpu_shares", 1024) == 1024 for worker in ("prefill", "decode"))


def test_second_router_gets_tls_from_its_overlay(tools):
    """compose.routers.yaml + compose.tls.yaml + compose.routers.tls.yaml: router-2 serves TLS as router does (its
    `extends` of compose.yaml's router alone would leave it plaintext)."""
    docker = REPO / "docker"
    files = [
        docker / f for f in ("compose.yaml", "compose.routers.yaml", "compose.tls.yaml", "compose.routers.tls.yaml")
    ]
    r = checks.compose_config(tools, files, fmt="json")
    assert r.ok, r.output
    services = json.loads(r.output)["services"]
    for name in ("router", "router-2", "openai"):
        env = services[name]["environment"]
        assert env["PDSERVE_TLS_CERT_FILE"] == "/etc/pdserve/tls/tls.crt", name
        assert any(v["target"] == "/etc/pdserve/tls" and v["read_only"] for v in services[name]["volumes"]), name
    assert [p["target"] for p in services["router-2"]["ports"]] == [50051]
    assert services["router-2"]["command"] == ["router"]
