"""Offline checks of docker/ and deploy/helm/: no Docker engine, no cluster, no network (after the tools are in).

    python deploy/ci/checks.py            # every check; installs the tools first if needed
    python deploy/ci/checks.py --list     # the check names
    python deploy/ci/checks.py NAME...    # only these

Checks:
  * compose: `docker compose config` (Docker Compose v2.40.3, the real parser and the compose-spec rules it embeds)
    and check-jsonschema against the compose specification's JSON schema (vendor.compose-spec), for compose.yaml
    and for compose.yaml + the TLS overlay compose.tls.yaml (the overlay alone against the schema too);
  * dockerfile: hadolint with docker/.hadolint.yaml (every finding down to style fails);
  * helm: `helm lint --strict` and `helm template` of the chart with its default values and every example values file
    in deploy/helm/examples/, then every rendered manifest validated strictly against the Kubernetes JSON schemas for
    the oldest and newest supported Kubernetes (deploy/ci/k8s_validate.py); values.schema.json checked against its
    metaschema.
The tools come from deploy/ci/install_tools.sh (PyPI packages only), in $PDSERVE_DEPLOY_TOOLS. tests/deploy runs the
same functions, plus the deliberate-error cases. Standard library only: this file runs in any Python >= 3.10.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

REPO = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPO / "deploy" / "ci" / "install_tools.sh"
K8S_VALIDATE = REPO / "deploy" / "ci" / "k8s_validate.py"
CHART = REPO / "deploy" / "helm" / "pdserve"
EXAMPLES_DIR = REPO / "deploy" / "helm" / "examples"
COMPOSE_FILE = REPO / "docker" / "compose.yaml"
COMPOSE_TLS_FILE = REPO / "docker" / "compose.tls.yaml"  # opt-in TLS / mTLS overlay on COMPOSE_FILE
DOCKERFILE = REPO / "docker" / "Dockerfile"
HADOLINT_CONFIG = REPO / "docker" / ".hadolint.yaml"
KUBE_VERSIONS = ("1.27", "1.37")  # Chart.yaml's kubeVersion floor, and the newest schemas kubernetes-validate ships
# API versions to announce to `helm template` for an example (as a cluster with those CRDs installed would).
EXAMPLE_API_VERSIONS: dict[str, tuple[str, ...]] = {
    "multi-node": ("leaderworkerset.x-k8s.io/v1/LeaderWorkerSet", "monitoring.coreos.com/v1/ServiceMonitor"),
    "gpu-1node": ("monitoring.coreos.com/v1/ServiceMonitor",),
    "mtls": ("monitoring.coreos.com/v1/ServiceMonitor",),
}


class ToolError(RuntimeError):
    """A tool is missing and could not be installed."""


@dataclass(frozen=True)
class Tools:
    root: Path

    @property
    def helm(self) -> Path:
        return self.root / "bin" / "helm"

    @property
    def compose(self) -> Path:
        return self.root / "bin" / "docker-compose"

    @property
    def hadolint(self) -> Path:
        return self.root / "bin" / "hadolint"

    @property
    def python(self) -> Path:
        return self.root / "venv" / "bin" / "python"

    @property
    def check_jsonschema(self) -> Path:
        return self.root / "venv" / "bin" / "check-jsonschema"

    def missing(self) -> list[str]:
        paths = (self.helm, self.compose, self.hadolint, self.python, self.check_jsonschema)
        return [str(p) for p in paths if not os.access(p, os.X_OK)]

    def env(self) -> dict[str, str]:
        """Environment for the tools: helm's state inside the tools dir, no user config leaking in."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HELM_", "COMPOSE_", "PDSERVE_ARG_"))}
        for name in ("CACHE", "CONFIG", "DATA"):
            env[f"HELM_{name}_HOME"] = str(self.root / "helm" / name.lower())
        env["DOCKER_CONFIG"] = str(self.root / "docker")
        env["NO_COLOR"] = "1"
        return env


def tools_dir() -> Path:
    out = subprocess.run(["bash", str(INSTALL_SCRIPT), "--print"], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def ensure_tools(install: bool = True) -> Tools:
    """The installed tools; runs deploy/ci/install_tools.sh first when any is missing (and ``install``)."""
    tools = Tools(tools_dir())
    if tools.missing() and install:
        proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise ToolError(
                f"deploy/ci/install_tools.sh failed (exit {proc.returncode}):\n"
                f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
    if tools.missing():
        raise ToolError("deploy tools missing after install: " + ", ".join(tools.missing()))
    return tools


@dataclass
class Result:
    name: str
    ok: bool
    output: str

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'} {self.name}" + ("" if self.ok else f"\n{self.output.rstrip()}")


def _run(
    tools: Tools, name: str, cmd: Sequence[str | os.PathLike[str]], stdin: str | None = None, cwd: Path = REPO
) -> Result:
    proc = subprocess.run(
        [str(c) for c in cmd], input=stdin, capture_output=True, text=True, cwd=cwd, env=tools.env(), timeout=300
    )
    return Result(name, proc.returncode == 0, proc.stdout + proc.stderr)


# --- compose ------------------------------------------------------------------------------------------------------


def compose_config(tools: Tools, path: Path | Sequence[Path] = COMPOSE_FILE, fmt: str | None = None) -> Result:
    """`docker compose config`: parses, interpolates, merges (several files: later ones override, as with
    `docker compose -f a -f b`) and validates the files as Compose itself does."""
    paths = [path] if isinstance(path, Path) else list(path)
    cmd: list[str | Path] = [tools.compose]
    for p in paths:
        cmd += ["-f", p]
    cmd += ["config", *(["--format", fmt] if fmt else ["--quiet"])]
    return _run(tools, f"docker compose config {' + '.join(p.name for p in paths)}", cmd)


def compose_schema(tools: Tools, path: Path = COMPOSE_FILE) -> Result:
    """The compose specification's JSON schema, as check-jsonschema vendors it."""
    return _run(
        tools,
        f"compose-spec schema {path.name}",
        [tools.check_jsonschema, "--builtin-schema", "vendor.compose-spec", path],
    )


# --- Dockerfile ---------------------------------------------------------------------------------------------------


def hadolint(tools: Tools, path: Path = DOCKERFILE) -> Result:
    return _run(tools, f"hadolint {path.name}", [tools.hadolint, "--no-color", "--config", HADOLINT_CONFIG, path])


# --- Helm ---------------------------------------------------------------------------------------------------------


def examples() -> list[Path]:
    return sorted(EXAMPLES_DIR.glob("*.yaml"))


def _values_args(values: Iterable[Path], sets: Iterable[str]) -> list[str]:
    args: list[str] = []
    for v in values:
        args += ["-f", str(v)]
    for s in sets:
        args += ["--set", s]
    return args


def helm_lint(tools: Tools, values: Sequence[Path] = (), sets: Sequence[str] = (), chart: Path = CHART) -> Result:
    label = ",".join(v.name for v in values) or "default values"
    return _run(tools, f"helm lint ({label})", [tools.helm, "lint", "--strict", chart, *_values_args(values, sets)])


def helm_template(
    tools: Tools,
    values: Sequence[Path] = (),
    sets: Sequence[str] = (),
    api_versions: Sequence[str] = (),
    chart: Path = CHART,
    release: str = "pdserve",
) -> Result:
    """`helm template`; on success ``output`` is the rendered manifests (stdout only)."""
    cmd: list[str | Path] = [
        tools.helm,
        "template",
        release,
        chart,
        "--namespace",
        "pdserve",
        *_values_args(values, sets),
    ]
    for a in api_versions:
        cmd += ["--api-versions", a]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=REPO, env=tools.env(), timeout=300)
    label = ",".join(v.name for v in values) or "default values"
    return Result(
        f"helm template ({label})",
        proc.returncode == 0,
        proc.stdout if proc.returncode == 0 else proc.stdout + proc.stderr,
    )


def k8s_validate(
    tools: Tools, manifests: str, label: str = "manifests", versions: Sequence[str] = KUBE_VERSIONS
) -> Result:
    cmd: list[str | Path] = [tools.python, K8S_VALIDATE]
    for v in versions:
        cmd += ["--kube-version", v]
    return _run(tools, f"kubernetes schemas ({label})", [*cmd, "-"], stdin=manifests)


def values_metaschema(tools: Tools) -> Result:
    return _run(
        tools,
        "values.schema.json metaschema",
        [tools.check_jsonschema, "--check-metaschema", CHART / "values.schema.json"],
    )


def render_and_validate(tools: Tools, values: Sequence[Path] = (), api_versions: Sequence[str] = ()) -> list[Result]:
    """lint + template + schema-validate every rendered manifest, for one set of values files."""
    results = [helm_lint(tools, values)]
    rendered = helm_template(tools, values, api_versions=api_versions)
    results.append(Result(rendered.name, rendered.ok, "" if rendered.ok else rendered.output))
    if rendered.ok:
        label = ",".join(v.name for v in values) or "default values"
        results.append(k8s_validate(tools, rendered.output, label))
    return results


# --- driver -------------------------------------------------------------------------------------------------------


def check_compose(tools: Tools) -> list[Result]:
    return [
        compose_config(tools),
        compose_schema(tools),
        compose_config(tools, (COMPOSE_FILE, COMPOSE_TLS_FILE)),
        compose_schema(tools, COMPOSE_TLS_FILE),
    ]


def check_dockerfile(tools: Tools) -> list[Result]:
    return [hadolint(tools)]


def check_helm(tools: Tools) -> list[Result]:
    results = [values_metaschema(tools)]
    results += render_and_validate(tools)
    for ex in examples():
        results += render_and_validate(tools, [ex], EXAMPLE_API_VERSIONS.get(ex.stem, ()))
    return results


CHECKS: dict[str, Callable[[Tools], list[Result]]] = {
    "compose": check_compose,
    "dockerfile": check_dockerfile,
    "helm": check_helm,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--list"]:
        print("\n".join(CHECKS))
        return 0
    unknown = [a for a in args if a not in CHECKS]
    if unknown:
        print(f"unknown check(s): {', '.join(unknown)} (known: {', '.join(CHECKS)})", file=sys.stderr)
        return 2
    tools = ensure_tools()
    results = [r for name in (args or CHECKS) for r in CHECKS[name](tools)]
    for r in results:
        print(r)
    failed = sum(not r.ok for r in results)
    print(f"deploy: {len(results) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
