"""Where metrics go: metrics.jsonl in the run directory, a compact console line, and sample completions."""

from __future__ import annotations

import json
import math
import resource
import sys
from pathlib import Path
from typing import Any

import torch

CONSOLE_KEYS = ("reward", "reward_std", "loss", "kl", "clip_ratio", "completion_length/mean")


def peak_memory_mb() -> float:
    """Peak memory of this process: CUDA max allocated on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write null instead, so every line stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends one JSON object per logged step to metrics.jsonl, and samples to completions.jsonl."""

    def __init__(self, run_dir: Path, write: Any = print):
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "completions.jsonl"
        self.write = write

    def log(self, metrics: dict[str, Any]) -> None:
        with self.metrics_path.open("a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in metrics.items()}) + "\n")
        shown = " ".join(
            f"{k.split('/')[0]}={metrics[k]:.4g}" for k in CONSOLE_KEYS if isinstance(metrics.get(k), float)
        )
        self.write(f"step {metrics['step']:>5} | {shown}")

    def log_sample(self, sample: dict[str, Any]) -> None:
        with self.samples_path.open("a") as f:
            f.write(json.dumps(sample, ensure_ascii=False) + "\n")
        rewards = " ".join(f"{k}={v:.3g}" for k, v in sample["rewards"].items())
        self.write(
            f"--- sample at step {sample['step']} ---\n"
            f"Q: {sample['question']}\nA: {sample['completion']}\n"
            f"extracted={sample['extracted']!r} gold={sample['gold']!r} | {rewards}"
        )
