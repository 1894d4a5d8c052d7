#!/usr/bin/env bash
# The prepared GPU check (docs/deploy.md, "GPU check"): installs the carried wheels (no network), then runs
# scripts/gpu_check.py. Usage: bash scripts/gpu_check.sh --out DIR [--dry-run] [--budget-s SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
out="" dry=0
args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --out) out="$2"; shift 2 ;;
        --out=*) out="${1#--out=}"; shift ;;
        --dry-run) dry=1; shift ;;
        --budget-s) shift 2 ;;  # passed on to gpu_check.py
        --budget-s=*) shift ;;
        *) echo "usage: $0 --out DIR [--dry-run] [--budget-s SECONDS]" >&2; exit 2 ;;
    esac
done
[ -n "$out" ] || { echo "usage: $0 --out DIR [--dry-run] [--budget-s SECONDS]" >&2; exit 2; }
mkdir -p "$out"
site=""
wheels=$(ls .whl/*.whl 2>/dev/null || true)
if [ "$dry" = 0 ] && [ -f .whl/wheels.tar.xz ]; then
    # fetch_gpu_wheels.sh ships the wheels' contents as one xz tarball: zip each back into its wheel for pip
    unpacked=$(mktemp -d -t pdserve-gpu-wheels.XXXXXX)
    tar -C "$unpacked/" -xJf .whl/wheels.tar.xz
    mkdir "$unpacked/whl"
    python3 - "$unpacked" <<'PY'
import os
import sys
import zipfile

root = sys.argv[1]
for name in sorted(n for n in os.listdir(root) if n.endswith(".whl")):
    src = os.path.join(root, name)
    with zipfile.ZipFile(os.path.join(root, "whl", name), "w", zipfile.ZIP_STORED) as z:
        for d, _, files in os.walk(src):
            for f in sorted(files):
                z.write(os.path.join(d, f), os.path.relpath(os.path.join(d, f), src))
PY
    wheels="$wheels $(ls "$unpacked"/whl/*.whl)"
fi
if [ "$dry" = 1 ]; then
    # the wheels are built for the GPU machine's Python 3.12 / CUDA 13: never put them beside this interpreter
    echo "gpu_check: dry run: carried wheels not installed"
elif [ -z "$wheels" ]; then
    echo "gpu_check: no wheels in .whl/ (scripts/fetch_gpu_wheels.sh): using what this python has"
else
    site=$(mktemp -d -t pdserve-gpu-site.XXXXXX)
    # --no-deps: fetch_gpu_wheels.sh carries exactly the closure the machine lacks; --no-index: it has no network
    echo "gpu_check: installing $(echo $wheels | wc -w) carried wheels into $site"
    python3 -m pip install -q --no-index --no-deps --target "$site" $wheels 2>&1 | tee "$out/pip_install.log"
fi
# the repository itself is imported from the tree (no pip install -e on the GPU machine)
export PYTHONPATH="$repo${site:+:$site}${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1
exec python3 scripts/gpu_check.py "${args[@]}"
