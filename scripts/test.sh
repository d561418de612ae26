#!/usr/bin/env bash
# Installs everything, then runs lint, the type checker and the whole test suite (CPU; GPU tests skip without CUDA),
# then the real vLLM tests in their own environment (.venv-vllm, see docs/vllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."
disk_free() { echo "disk free ($1): $(df -h --output=avail . | tail -1 | tr -d ' ')"; }
disk_free "before install"
bash scripts/setup.sh
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/python -m mypy  # [tool.mypy] in pyproject.toml: src/leangrpo
.venv/bin/python -m pytest -q "$@"
disk_free "before the vLLM environment"
bash scripts/setup-vllm.sh
.venv-vllm/bin/python -m pytest -q tests/real_vllm
