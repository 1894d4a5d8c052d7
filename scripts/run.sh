#!/usr/bin/env bash
# Installs pdserve (CPU torch first), converts the default model once, and answers a real prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
if pdserve --help | grep -q " up "; then
  exec pdserve up --ask "What is the capital of France?"
fi
exec pdserve offline "What is the capital of France?"
