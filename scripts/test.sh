#!/usr/bin/env bash
# Installs everything the tests need (CPU torch first, so nothing pulls a CUDA build), lints, checks the
# formatting and type-checks (configured in pyproject.toml), brings up a Docker engine for the compose tests when
# none answers, then runs the whole suite.
#
# Docker engine (tests/deploy/test_deploy_compose_engine.py builds the image and runs the compose cluster on it):
# when `docker version` gets no answer and this runs as root, docker.io is installed if dockerd is missing, dockerd
# is started (storage driver: dockerd's choice, vfs where that fails to start; $PDSERVE_DOCKERD_STORAGE_DRIVER forces
# one) on the default socket and data root, so images and build cache stay for the next run, and stopped at exit.
# An engine that already answered is left as it was. PDSERVE_REQUIRE_DOCKER=1 then tells the compose tests to fail,
# not skip, if the engine is gone. Without root and without an engine they skip, saying why.
#
# --quick: what a developer runs while working (a few minutes on two cores): the same lint, format and type checks,
# then only the tests not marked `slow` (no Docker engine, no installs once everything imports). Further arguments go
# to pytest either way.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
if [[ "${1:-}" == "--quick" ]]; then
  QUICK=1
  shift
fi
if [[ "$QUICK" == 0 ]] || ! python3 -c "import torch, pdserve, grpc, pydantic, schemathesis, ruff, mypy" 2>/dev/null; then
  python3 -m pip install -q torch==2.13.0
  python3 -m pip install -q -e ".[dev]"
  if [ -x deploy/ci/install_tools.sh ]; then bash deploy/ci/install_tools.sh; fi
fi
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
if [[ "$QUICK" == 1 ]]; then
  exec python3 -m pytest -q -m "not slow" "$@"
fi

DOCKERD_PID=""
DOCKERD_LOG=""
stop_dockerd() {
  [[ -n "$DOCKERD_PID" ]] || return 0
  echo "test.sh: stopping the dockerd this run started (pid $DOCKERD_PID)"
  kill -TERM "$DOCKERD_PID" 2>/dev/null || true
  # dockerd stops its containers and its containerd before it exits.
  for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
  if kill -0 "$DOCKERD_PID" 2>/dev/null; then
    echo "test.sh: dockerd did not stop in 60 s; killing it" >&2
    kill -KILL "$DOCKERD_PID" 2>/dev/null || true
  fi
  DOCKERD_PID=""
}
trap stop_dockerd EXIT

engine_answers() { command -v docker >/dev/null && timeout 20 docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

start_dockerd() {  # start_dockerd [STORAGE_DRIVER]: 0 once the engine answers
  local args=()
  [[ -n "${1:-}" ]] && args=(--storage-driver "$1")
  DOCKERD_LOG="$(mktemp -t pdserve-dockerd.XXXXXX.log)"
  # Low priority: image builds and containers leave the host's other work its share of the cores.
  nice -n 10 dockerd "${args[@]}" >"$DOCKERD_LOG" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    engine_answers && return 0
    kill -0 "$DOCKERD_PID" 2>/dev/null || break
    sleep 1
  done
  echo "test.sh: dockerd ${1:+(storage driver $1) }did not come up:" >&2
  tail -15 "$DOCKERD_LOG" >&2
  stop_dockerd
  return 1
}

if engine_answers; then
  export PDSERVE_REQUIRE_DOCKER=1
elif [[ "$(id -u)" != 0 ]]; then
  echo "test.sh: no Docker engine answers and this is not root: the compose tests will skip"
else
  if ! command -v dockerd >/dev/null || ! command -v docker >/dev/null; then
    echo "test.sh: installing docker.io for the compose tests"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io; } >/dev/null \
      || echo "test.sh: apt-get install docker.io failed" >&2
  fi
  if ! command -v dockerd >/dev/null; then
    echo "test.sh: no dockerd to start (docker.io not installable): the compose tests will skip" >&2
  elif { [[ -n "${PDSERVE_DOCKERD_STORAGE_DRIVER:-}" ]] && start_dockerd "$PDSERVE_DOCKERD_STORAGE_DRIVER"; } \
    || { [[ -z "${PDSERVE_DOCKERD_STORAGE_DRIVER:-}" ]] && { start_dockerd || start_dockerd vfs; }; }; then
    echo "test.sh: started dockerd (pid $DOCKERD_PID, log $DOCKERD_LOG, storage $(docker info --format '{{.Driver}}'))"
    export PDSERVE_REQUIRE_DOCKER=1
  else
    echo "test.sh: dockerd would not start (log above): the compose tests will skip" >&2
  fi
fi

python3 -m pytest -q "$@"
