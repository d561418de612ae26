"""Where metrics go: metrics.jsonl in the run directory, the experiment trackers of `logging.report_to`
(TensorBoard, W&B, trackio; each imported only when asked for), a compact console table, and sample
completions."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import json
import math
import resource
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from leangrpo.core.errors import UserError
from leangrpo.run.rundir import append_text

# Console table columns: (metrics key, header).
CONSOLE_COLUMNS = (
    ("reward", "reward"),
    ("reward_std", "reward_std"),
    ("loss", "loss"),
    ("kl", "kl"),
    ("clip_ratio/region_mean", "clip"),
    ("completions/mean_length", "length"),
    ("step_seconds", "s/step"),
)
HEADER_EVERY = 20  # rows between repeated headers
SAMPLE_CHARS = 4000  # longest text of a logged sample kept (console, completions.jsonl, the report)


class TrackerError(UserError, RuntimeError):
    """An experiment tracker in logging.report_to cannot be used."""


class Tracker(Protocol):
    """An experiment tracker: scalars and sample completions per step, closed at the end of the run."""

    def log(self, metrics: dict[str, Any], step: int) -> None: ...

    def log_sample(self, sample: dict[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in metrics.items()
        if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    }


def tracker_tag(key: str) -> str:
    """A metric's name in the trackers, as HF's Trainer and TRL name it: `eval/...` as it is, every
    other under `train/` (metrics.jsonl keeps the bare names)."""
    return key if key.startswith(("eval/", "train/")) else f"train/{key}"


def _sample_table(sample: dict[str, Any]) -> tuple[list[str], list[str | int | float]]:
    """A logged sample as one table row (columns, values): nested values (rewards, extras) as JSON."""
    columns = [k for k in sample if k != "rewards"] + [f"reward/{k}" for k in sample.get("rewards", {})]
    values = [sample[k] for k in sample if k != "rewards"] + list(sample.get("rewards", {}).values())
    return columns, [v if isinstance(v, (str, int, float)) else json.dumps(v) for v in values]


class TensorBoardTracker:
    """Scalars into `RUN/tensorboard/` (event files), one tag per metric key."""

    def __init__(self, run_dir: Path, config: dict[str, Any], project: str, run_name: str) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        for key, value in _scalars(metrics).items():
            self.writer.add_scalar(tracker_tag(key), value, step)
        self.writer.flush()

    def log_sample(self, sample: dict[str, Any], step: int) -> None:
        """The sample as a markdown table under the `completions` text tag."""
        columns, values = _sample_table(sample)
        cells = [str(v).replace("|", "\\|").replace("\n", "<br>") for v in values]
        table = "\n".join(
            ["| " + " | ".join(columns) + " |", "|---" * len(columns) + "|", "| " + " | ".join(cells) + " |"]
        )
        self.writer.add_text("completions", table, step)

    def close(self) -> None:
        self.writer.close()


class WandbLikeTracker:
    """W&B or trackio (same API: init, log, finish). W&B writes to `RUN/wandb/` (WANDB_MODE=offline
    needs no account); trackio to its local database ($TRACKIO_DIR)."""

    def __init__(self, module: str, run_dir: Path, config: dict[str, Any], project: str, run_name: str):
        self.lib = importlib.import_module(module)
        where = {"dir": str(run_dir)} if module == "wandb" else {}
        self.lib.init(project=project, name=run_name, config=config, **where)

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.lib.log({tracker_tag(k): v for k, v in _scalars(metrics).items()}, step=step)

    def log_sample(self, sample: dict[str, Any], step: int) -> None:
        """The sample as a one-row `completions` table (as TRL logs its completions to W&B)."""
        columns, values = _sample_table(sample)
        self.lib.log({"completions": self.lib.Table(columns=columns, data=[values])}, step=step)

    def close(self) -> None:
        self.lib.finish()


# name -> opener(run_dir, config, project, run_name)
TRACKERS: dict[str, Callable[[Path, dict[str, Any], str, str], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "wandb": functools.partial(WandbLikeTracker, "wandb"),
    "trackio": functools.partial(WandbLikeTracker, "trackio"),
}


def open_trackers(
    names: Sequence[str], run_dir: Path, config: dict[str, Any], project: str, run_name: str
) -> list[Tracker]:
    return [TRACKERS[name](run_dir, config, project, run_name) for name in names]


def peak_memory_mb() -> float:
    """Peak memory of this process in MiB: CUDA max allocated on GPU, peak RSS on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10  # bytes on macOS, KiB on Linux


def _clean(value: Any) -> Any:
    """JSON has no NaN/inf: write null instead, so every line stays parseable."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def eval_line(title: str, metrics: dict[str, Any]) -> str:
    """An evaluation's `eval/...` metrics on one console line."""
    shown = "  ".join(f"{k[5:]}={v:.4g}" for k, v in _scalars(metrics).items() if k.startswith("eval/"))
    return f"{title}: {shown}"


class MetricsLogger:
    """Appends one JSON object per logged step to metrics.jsonl (and to each tracker), prints it as a
    row of a compact console table, and appends samples to completions.jsonl."""

    def __init__(self, run_dir: Path, write: Any = print, trackers: list[Tracker] | None = None):
        self.metrics_path = run_dir / "metrics.jsonl"
        self.samples_path = run_dir / "completions.jsonl"
        self.write = write
        self.trackers = trackers or []
        self.rows_printed = 0

    def log(self, metrics: dict[str, Any]) -> None:
        row = json.dumps({k: _clean(v) for k, v in metrics.items()})
        append_text(self.metrics_path, row + "\n", self.metrics_path.parent)
        for tracker in self.trackers:
            tracker.log(metrics, metrics["step"])
        if any(k.startswith("eval/") for k in metrics):
            self.write(eval_line(f"eval at step {metrics['step']}", metrics))
        else:
            self.write(self._table_row(metrics))

    def _table_row(self, metrics: dict[str, Any]) -> str:
        cells = [f"{metrics['step']:>6}"]
        for key, header in CONSOLE_COLUMNS:
            value = metrics.get(key)
            text = f"{value:.4g}" if isinstance(value, float) and math.isfinite(value) else "-"
            cells.append(text.rjust(max(len(header), 8)))
        row = " ".join(cells)
        if self.rows_printed % HEADER_EVERY == 0:
            header = " ".join(["  step", *(h.rjust(max(len(h), 8)) for _, h in CONSOLE_COLUMNS)])
            row = f"{header}\n{row}"
        self.rows_printed += 1
        return row

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()

    def log_sample(self, sample: dict[str, Any]) -> None:
        sample = {k: abridge(v) if isinstance(v, str) else v for k, v in sample.items()}
        line = json.dumps(sample, ensure_ascii=False) + "\n"
        append_text(self.samples_path, line, self.samples_path.parent)
        for tracker in self.trackers:
            tracker.log_sample(sample, sample["step"])
        rewards = " ".join(f"{k}={v:.3g}" for k, v in sample["rewards"].items())
        self.write(
            f"--- sample at step {sample['step']} ---\n"
            f"Q: {sample['question']}\nA: {sample['completion']}\n"
            f"extracted={sample['extracted']!r} gold={sample['gold']!r} | {rewards}"
        )


def abridge(text: str, limit: int = SAMPLE_CHARS) -> str:
    """`text`, cut to `limit` characters with a note of how much was left out: a 50 MB question must not
    be echoed whole to the console, completions.jsonl and the report."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [{len(text) - limit} more characters]"
