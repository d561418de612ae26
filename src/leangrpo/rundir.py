"""Reading what a run directory holds: its metrics (tolerating a crash-truncated last line), its final
model, and its evaluations. Light: no torch, so `compare` and `report` start fast."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import UserError


class RunDirError(UserError, RuntimeError):
    """A run directory (or a file in it) cannot be used as asked."""


@dataclass
class JsonlRows:
    """Parsed JSON lines, plus a note for each line that was skipped (only a torn last line is)."""

    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


def read_jsonl(path: Path) -> JsonlRows:
    """Read a JSON Lines file written by a run. A last line that does not parse (the run died while
    writing it) is skipped with a note; a bad line anywhere else is an error naming file and line."""
    if not path.is_file():
        raise RunDirError(f"file not found: {path}")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    numbered = [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    out = JsonlRows([])
    for pos, (lineno, line) in enumerate(numbered):
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"not a JSON object ({type(row).__name__})")
        except ValueError as e:
            if pos == len(numbered) - 1:
                out.notes.append(f"skipped the truncated last line {lineno} of {path}")
                break
            raise RunDirError(f"{path}:{lineno} is not valid JSON: {e}") from None
        out.rows.append(row)
    return out


def is_run_dir(path: Path) -> bool:
    """True when `path` holds a leangrpo run: a config.yaml with the sections leangrpo writes."""
    try:
        data = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and {"model", "data", "rewards", "grpo"} <= data.keys()


def run_model_dir(run_dir: Path) -> Path:
    """The final model of a run: `run_dir/model`, or a one-line error if training never got there."""
    model = run_dir / "model"
    if not (model / "config.json").is_file():
        raise RunDirError(
            f"run directory {run_dir} has no model (no {model}/config.json): "
            "the run did not finish; evaluate a checkpoint or a model directory instead"
        )
    return model


def eval_files(run_dir: Path) -> list[Path]:
    """The run's evaluation JSONs (training's `eval/step-N.json`, `leangrpo eval` outputs), oldest first."""
    return sorted((run_dir / "eval").glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
