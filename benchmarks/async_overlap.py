"""Step time of synchronous against async rollouts (`grpo.async_rollouts`, max_staleness 1), HF generate in
the training process, on vs_trl.py's model (SmolLM2-135M's architecture, random weights, fp32) and its
GSM8K prompts: each mode trains `--steps` steps, the modes alternating `--pairs` times; prints each run's
mean step seconds and phase seconds over the steps after the first (step 1 has no batch generated ahead),
the background generation's own seconds, and the load average before and after.

    python benchmarks/async_overlap.py [--steps 5] [--pairs 1] [--completion-length 32] [--lora] [--model DIR]

`--model DIR`: another local model directory (e.g. the tests' tiny model) instead of vs_trl.py's.

Async shows as rollout time hidden behind the update: `time/rollout` (the wait for the batch) drops
below the background generation's seconds. On a CPU both threads share the same cores, so the
update slows while it overlaps a generation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import build_model, default_data  # noqa: E402

from leangrpo.models.load import cache_root  # noqa: E402
from leangrpo.run.resolve import validate_config  # noqa: E402
from leangrpo.train.trainer import Trainer  # noqa: E402

PHASES = ("rollout", "sync", "score", "advantages", "reference", "update")


def config(args: argparse.Namespace, model: Path, out: Path, async_rollouts: bool) -> dict:
    """One run: 4 prompts × G=4 completions of `--completion-length` tokens (EOS ignored, so both modes
    generate the same number of tokens), one micro-batch."""
    return {
        "model": {"name_or_path": str(model), "dtype": "float32", "lora": {"enabled": args.lora, "r": 16}},
        "data": {"path": str(default_data()), "limit": 64},
        "rewards": {"functions": [{"name": "int"}, {"name": "correctness"}]},
        "grpo": {
            "num_generations": 4,
            "max_completion_length": args.completion_length,
            "max_prompt_length": 256,
            "ignore_eos": True,
            "async_rollouts": async_rollouts,
            "max_staleness": 1,
        },
        "optim": {
            "per_device_train_batch_size": 16,
            "gradient_accumulation_steps": 1,
            "max_steps": args.steps,
            "learning_rate": 1e-5,
        },
        "logging": {"log_completions_steps": 0, "progress_bar": False, "save_steps": 0, "save_minutes": 0},
        "output_dir": str(out),
    }


def run(args: argparse.Namespace, model: Path, async_rollouts: bool) -> dict[str, float]:
    """Mean seconds per step after the first: the step, each phase, and the background generation."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        load = os.getloadavg()[0]
        Trainer(
            validate_config(config(args, model, out, async_rollouts), "benchmark"), overwrite=True
        ).train()
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    keys = ["step_seconds", *(f"time/{p}" for p in PHASES), "async/generate_seconds"]
    means = {k: statistics.mean(r[k] for r in rows) for k in keys if all(k in r for r in rows)}
    return {**means, "load_before": load, "load_after": os.getloadavg()[0]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=1)
    parser.add_argument("--completion-length", type=int, default=32)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--model", type=Path, help="a local model directory (default: vs_trl.py's)")
    args = parser.parse_args()
    model = args.model or build_model(cache_root())
    for pair in range(args.pairs):
        for mode in (False, True) if pair % 2 == 0 else (True, False):
            result = run(args, model, mode)
            print(
                json.dumps(
                    {"mode": "async" if mode else "sync", **{k: round(v, 3) for k, v in result.items()}}
                )
            )


if __name__ == "__main__":
    main()
