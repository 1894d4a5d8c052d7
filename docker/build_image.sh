#!/usr/bin/env bash
# Builds the pdserve CPU image (docker/Dockerfile) on a Docker engine that may reach no container registry and whose
# containers may reach no package index: the stock base image when it can be had, else an equivalent base built from
# Debian packages; every wheel collected on this host with its own pip setup and handed to the build.
#
#   bash docker/build_image.sh [-t TAG] [--base auto|stock|debian] [--no-wheelhouse] [-- DOCKER BUILD ARGS...]
#
#   -t TAG            image tag (default $PDSERVE_IMAGE, else pdserve:cpu)
#   --base auto       python:3.11-slim-bookworm when present or pullable, else the Debian-built one (default)
#   --base stock      python:3.11-slim-bookworm only; --base debian: the Debian-built one only
#   --no-wheelhouse   let pip inside the build use the indexes the Dockerfile names (needs network in the build)
#
# Base from Debian packages: `debootstrap --variant=minbase bookworm` with python3, python3-venv and ca-certificates
# (Python 3.11, as the stock base), imported as $PDSERVE_DEBIAN_BASE (default pdserve-base:bookworm-py3.11) and kept
# there for later builds. Needs root and debootstrap (installed with apt-get when missing).
# Wheelhouse: `pip wheel` on this host (its pip config: find-links, CA bundle, constraints) of torch (the Dockerfile's
# TORCH_VERSION; the CPU build where this host's pip provides it), the project with the image's extras, and the
# models stage's transformers / gguf pins. Kept per requirement set in $PDSERVE_WHEELHOUSE_CACHE (default
# ~/.cache/pdserve-wheelhouse) and linked into docker/wheelhouse/, which the Dockerfile installs from (--no-index).
# Layer cache: every build stage is tagged pdserve-build-cache:STAGE (the legacy builder keeps its cache in those
# images, so a later build reuses them and no untagged image is left); an image a tag used to name is removed.
# Prints the build time and the image size.
set -euo pipefail
cd "$(dirname "$0")/.."

TAG="${PDSERVE_IMAGE:-pdserve:cpu}"
BASE_MODE=auto
WHEELHOUSE=1
STOCK_BASE="python:3.11-slim-bookworm"
DEBIAN_BASE="${PDSERVE_DEBIAN_BASE:-pdserve-base:bookworm-py3.11}"
CACHE_REPO="pdserve-build-cache"
EXTRA=()
while (($#)); do
  case "$1" in
    -t | --tag) TAG="${2:?-t needs a tag}"; shift 2 ;;
    --base) BASE_MODE="${2:?--base needs auto, stock or debian}"; shift 2 ;;
    --no-wheelhouse) WHEELHOUSE=0; shift ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "build_image.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$BASE_MODE" in auto | stock | debian) ;; *) echo "build_image.sh: --base must be auto, stock or debian" >&2; exit 2 ;; esac
say() { echo "build_image.sh: $*" >&2; }
die() { say "error: $*"; exit 1; }

docker version --format '{{.Server.Version}}' >/dev/null 2>&1 || die "no Docker engine answers the docker CLI"

# --- base image -------------------------------------------------------------------------------------------------------
have_image() { docker image inspect "$1" >/dev/null 2>&1; }

debian_base() {
  if have_image "$DEBIAN_BASE"; then return 0; fi
  [[ "$(id -u)" == 0 ]] || die "building $DEBIAN_BASE needs root (debootstrap); pull $STOCK_BASE instead"
  if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap >/dev/null; } \
      || die "cannot install debootstrap"
  fi
  local root t0
  root="$(mktemp -d)"
  t0=$SECONDS
  say "building $DEBIAN_BASE with debootstrap (Debian bookworm, python3, python3-venv, ca-certificates)"
  # Low priority: the host's other work keeps its share of the cores.
  nice -n 10 debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
    >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; rm -rf "$root" "$root.log"; die "debootstrap failed"; }
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$DEBIAN_BASE" >/dev/null
  rm -rf "$root" "$root.log"
  say "built $DEBIAN_BASE in $((SECONDS - t0)) s"
}

BASE_PID=""
if [[ "$BASE_MODE" != debian ]] && { have_image "$STOCK_BASE" || timeout 300 docker pull -q "$STOCK_BASE" >/dev/null 2>&1; }; then
  BASE="$STOCK_BASE"
elif [[ "$BASE_MODE" == stock ]]; then
  die "cannot pull $STOCK_BASE (no registry reachable?); use --base debian"
else
  BASE="$DEBIAN_BASE"
  # Built while the wheels are collected: the two wait on different mirrors.
  debian_base &
  BASE_PID=$!
fi
say "base image: $BASE"

# --- wheelhouse -------------------------------------------------------------------------------------------------------
dockerfile_arg() { sed -n "s/^ARG $1=\"\{0,1\}\([^\"]*\)\"\{0,1\}$/\1/p" docker/Dockerfile | head -1; }
rm -f docker/wheelhouse/*.whl
if ((WHEELHOUSE)); then
  TORCH_VERSION="$(dockerfile_arg TORCH_VERSION)"
  EXTRAS="$(sed -n 's/^ *PDSERVE_EXTRAS="\(\[[a-z,]*\]\)".*/\1/p' docker/Dockerfile | head -1)"
  REQS=("torch==$TORCH_VERSION" "setuptools>=68" wheel ".$EXTRAS" "$(dockerfile_arg TRANSFORMERS_SPEC)" "$(dockerfile_arg GGUF_SPEC)")
  PY="${PYTHON:-python3}"
  # The image's Python is 3.11: wheels for another host Python would not install there.
  [[ "$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')" == 3.11 ]] \
    || die "the wheelhouse needs a Python 3.11 host interpreter (set PYTHON=...); or use --no-wheelhouse"
  key="$({ printf '%s\n' "${REQS[@]}" "${PIP_INDEX_URL:-}" "${PIP_EXTRA_INDEX_URL:-}"; sed -n '/^dependencies = \[/,/^\]/p;/^\[project.optional-dependencies\]/,/^$/p' pyproject.toml; } \
    | sha256sum | cut -c1-16)"
  store="${PDSERVE_WHEELHOUSE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pdserve-wheelhouse}/$key"
  if [[ ! -f "$store/.complete" ]]; then
    t0=$SECONDS
    say "collecting wheels into $store: ${REQS[*]}"
    rm -rf "$store"; mkdir -p "$store"
    nice -n 10 "$PY" -m pip wheel --quiet --disable-pip-version-check -w "$store" "${REQS[@]}" \
      || die "pip wheel failed (see above)"
    rm -f "$store"/pdserve-*.whl  # the project itself is built from this source tree in the image
    if compgen -G "$store/nvidia_*.whl" >/dev/null; then
      say "warning: the host's pip gave torch's CUDA build (nvidia-* wheels); for the CPU one rerun with" \
        "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu"
    fi
    touch "$store/.complete"
    say "wheelhouse collected in $((SECONDS - t0)) s"
  fi
  # Hard links when on one file system (no copy of torch), else a copy.
  cp -l "$store"/*.whl docker/wheelhouse/ 2>/dev/null || cp "$store"/*.whl docker/wheelhouse/
  say "wheelhouse: $(find docker/wheelhouse -name '*.whl' | wc -l) wheels, $(du -shL docker/wheelhouse | cut -f1)"
fi

if [[ -n "$BASE_PID" ]]; then wait "$BASE_PID" || die "no base image"; fi

# --- build --------------------------------------------------------------------------------------------------------------
# The build's inputs (sources the Dockerfile copies, base image, wheels, arguments) as one hash, kept as a label of the
# image: an image whose label matches is what this build would make, and is used as it is.
inputs="$({
  find pyproject.toml README* pdserve pdserve_api router prefill_svc decode_svc kv_transfer bench docker -type f \
    ! -path 'docker/wheelhouse/*' ! -path 'docker/tls/*' ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 \
    | sort -z | xargs -0 sha256sum
  docker image inspect -f '{{.Id}}' "$BASE"
  find docker/wheelhouse -name '*.whl' -printf '%f %s\n' | sort
  printf '%s\n' "${EXTRA[@]}"
} | sha256sum | cut -c1-32)"
if [[ "$(docker image inspect -f '{{index .Config.Labels "io.pdserve.build-inputs"}}' "$TAG" 2>/dev/null)" == "$inputs" ]]; then
  size="$(docker image inspect -f '{{.Size}}' "$TAG")"
  say "built $TAG in 0 s: up to date with this tree (inputs $inputs), image size $((size / 1024 / 1024)) MiB"
  exit 0
fi
# BuildKit only where buildx exists and a registry answered (the Dockerfile's syntax line pulls its frontend);
# the legacy builder needs neither.
if [[ "$BASE" == "$STOCK_BASE" ]] && docker buildx version >/dev/null 2>&1; then export DOCKER_BUILDKIT=1; else export DOCKER_BUILDKIT=0; fi
ARGS=(-f docker/Dockerfile --build-arg FLAVOR=cpu --build-arg "CPU_BASE_IMAGE=$BASE" --build-arg "CUDA_BASE_IMAGE=$BASE")
image_id() { docker image inspect -f '{{.Id}}' "$1" 2>/dev/null || true; }
build_tagged() {  # build_tagged TAG [ARGS...]: build, then remove the image TAG named before, if it changed
  local tag="$1" old new
  shift
  old="$(image_id "$tag")"
  docker build -q "${ARGS[@]}" "$@" -t "$tag" . >/dev/null
  new="$(image_id "$tag")"
  if [[ -n "$old" && "$old" != "$new" ]]; then docker rmi "$old" >/dev/null 2>&1 || true; fi
}
t0=$SECONDS
log="$(mktemp)"
if [[ "$DOCKER_BUILDKIT" == 0 ]]; then
  # Each stage the legacy builder runs ends in an image; tagged, it stays as cache without dangling.
  for stage in base-cuda builder models; do
    build_tagged "$CACHE_REPO:$stage" --target "$stage" "${EXTRA[@]}" 2>"$log" || { cat "$log" >&2; die "docker build (--target $stage) failed"; }
  done
fi
build_tagged "$TAG" --label "io.pdserve.build-inputs=$inputs" "${EXTRA[@]}" 2>"$log" || { cat "$log" >&2; die "docker build failed"; }
rm -f "$log"
size="$(docker image inspect -f '{{.Size}}' "$TAG")"
say "built $TAG in $((SECONDS - t0)) s, image size $((size / 1024 / 1024)) MiB (base $BASE, $([[ $DOCKER_BUILDKIT == 1 ]] && echo BuildKit || echo legacy builder))"
