#!/usr/bin/env bash
# Installs everything, then runs lint and the whole test suite (CPU; GPU tests skip without CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/ruff format --check src tests
.venv/bin/python -m pytest -q "$@"
