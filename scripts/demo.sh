#!/usr/bin/env bash
# Installs everything, then runs the offline demo: GRPO on SmolLM2-135M-Instruct, two-digit sums (reasoning-gym).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/leangrpo demo "$@"
