#!/usr/bin/env bash
# Installs everything the tests need (CPU torch first, so nothing pulls a CUDA build), lints, checks the
# formatting and type-checks (configured in pyproject.toml), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e ".[dev]"
if [ -x deploy/ci/install_tools.sh ]; then bash deploy/ci/install_tools.sh; fi
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
python3 -m pytest -q "$@"
