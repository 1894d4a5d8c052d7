#!/usr/bin/env bash
# Installs pdserve (CPU torch first), converts the default model once, and has the local cluster answer a real prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
# Brings the local cluster up (router, prefill pod, decode pod with DCP), streams one answer, shuts it down.
exec pdserve up --port 0 --http-port 0 --ask "${1:-What is the capital of France?}"
