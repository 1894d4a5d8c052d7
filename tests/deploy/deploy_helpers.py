"""Shared helpers of tests/deploy: the checks module (deploy/ci/checks.py), the container entrypoint and health
check scripts (docker/), loaded by path, and small manifest helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


checks = _load("pdserve_deploy_checks", REPO / "deploy" / "ci" / "checks.py")
entrypoint = _load("pdserve_docker_entrypoint", REPO / "docker" / "entrypoint.py")
healthcheck = _load("pdserve_docker_healthcheck", REPO / "docker" / "healthcheck.py")


def docs_of(manifests: str) -> list[dict]:
    import yaml

    return [d for d in yaml.safe_load_all(manifests) if d]


def find(docs: list[dict], kind: str, component: str | None = None) -> list[dict]:
    out = [d for d in docs if d.get("kind") == kind]
    if component is not None:
        out = [d for d in out if d["metadata"].get("labels", {}).get("app.kubernetes.io/component") == component]
    return out
