"""`leangrpo compare A B`: two evaluations side by side (metrics and their difference), and the questions
that flipped between them, with both completions. A and B are eval JSONs or run directories (a run
directory means its newest evaluation, plus its first and last training reward)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from leangrpo.run.rundir import (
    RunDirError,
    eval_files,
    is_run_dir,
    kind,
    read_json,
    read_jsonl,
    with_trl_names,
)


@dataclass
class Side:
    """One side of a comparison."""

    label: str
    metrics: dict[str, Any]
    records: list[dict[str, Any]] | None
    notes: list[str] = field(default_factory=list)


def load_eval_json(path: Path) -> Side:
    """An evaluation written by `EvalResult.save`: its metrics, and its records from the JSONL beside it."""
    doc = read_json(path)
    if not isinstance(doc, dict) or not isinstance(doc.get("metrics"), dict):
        raise RunDirError(f"{path} is not an evaluation written by leangrpo (no 'metrics' object)")
    side = Side(str(path), with_trl_names(doc["metrics"]), None)
    records = str(doc.get("records_file", path.with_suffix(".jsonl").name))
    if Path(records).name != records or records in ("", ".", ".."):
        raise RunDirError(f"{path}: records_file {records!r} is not a file name beside it")
    records_path = path.parent / records
    if kind(records_path) is not None:
        loaded = read_jsonl(records_path)
        side.records, side.notes = loaded.rows, loaded.notes
    else:
        side.notes.append(f"no per-question records ({records_path} is missing): flips not shown")
    return side


def load_side(source: str) -> Side:
    """An eval JSON, or a run directory: its newest `eval/*.json` and its training reward."""
    path = Path(source).expanduser()
    if path.exists() and not path.is_dir():
        return load_eval_json(path)
    if not is_run_dir(path):
        raise RunDirError(f"{source} is neither an evaluation JSON nor a run directory")
    train: dict[str, Any] = {}
    notes: list[str] = []
    if (path / "metrics.jsonl").is_file():
        loaded = read_jsonl(path / "metrics.jsonl")
        notes = loaded.notes
        steps = [r for r in loaded.rows if isinstance(r.get("reward"), (int, float))]
        if steps:
            train = {
                "train/steps": steps[-1].get("step"),
                "train/reward (first step)": steps[0]["reward"],
                "train/reward (last step)": steps[-1]["reward"],
            }
    evals = eval_files(path)
    if not evals and not train:
        raise RunDirError(
            f"run directory {source} has no evaluation (eval/*.json) and no training metrics; "
            f"evaluate it first: leangrpo eval --model {source} --data ..."
        )
    side = load_eval_json(evals[-1]) if evals else Side(source, {}, None, ["no evaluation in eval/"])
    side.label = f"{source} ({evals[-1].name})" if evals else source
    side.metrics.update(train)
    side.notes = notes + side.notes
    return side


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def fmt_value(value: Any) -> str:
    """A metric for a table: 4 significant digits, '-' for none."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell; the first column left-aligned, the rest right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def metrics_table(a: Side, b: Side) -> str:
    """metric | A | B | B - A, over the union of both sides' metrics."""
    keys = list(a.metrics) + [k for k in b.metrics if k not in a.metrics]
    rows = []
    for key in keys:
        va, vb = a.metrics.get(key), b.metrics.get(key)
        delta = f"{vb - va:+.4g}" if _is_number(va) and _is_number(vb) else ""
        rows.append([key, fmt_value(va), fmt_value(vb), delta])
    return format_table(["metric", "A", "B", "B - A"], rows)


def flips(
    a: Side, b: Side
) -> tuple[list[tuple[dict[str, Any], dict[str, Any]]], list[tuple[dict[str, Any], dict[str, Any]]]]:
    """(wrong→right, right→wrong) pairs of records of the same question, in A's order."""
    if a.records is None or b.records is None:
        return [], []
    by_question = {(r.get("question"), str(r.get("gold"))): r for r in b.records}
    pairs = [
        (ra, rb)
        for ra in a.records
        if (rb := by_question.get((ra.get("question"), str(ra.get("gold"))))) is not None
    ]
    better = [(ra, rb) for ra, rb in pairs if not ra.get("correct") and rb.get("correct")]
    worse = [(ra, rb) for ra, rb in pairs if ra.get("correct") and not rb.get("correct")]
    return better, worse


def _indent(text: str) -> str:
    return "\n".join("      " + line for line in (text or "(empty)").splitlines())


def compare(source_a: str, source_b: str, max_flips: int = 5) -> str:
    """The whole comparison as text: notes, the metric table, and up to `max_flips` flips each way."""
    a, b = load_side(source_a), load_side(source_b)
    out = [f"note: {n}" for n in a.notes + b.notes]
    out += [f"A: {a.label}", f"B: {b.label}", "", metrics_table(a, b)]
    if a.records is not None and b.records is not None:
        better, worse = flips(a, b)
        for title, pairs in (("wrong → right", better), ("right → wrong", worse)):
            shown = pairs[:max_flips]
            more = f" (showing {len(shown)})" if len(pairs) > len(shown) else ""
            out += ["", f"{title}: {len(pairs)} question(s){more}"]
            for ra, rb in shown:
                out += [
                    f"  Q: {ra.get('question')}",
                    f"  gold: {ra.get('gold')}",
                    f"    A (extracted {ra.get('extracted')!r}):",
                    _indent(str(ra.get("completion", ""))),
                    f"    B (extracted {rb.get('extracted')!r}):",
                    _indent(str(rb.get("completion", ""))),
                ]
    return "\n".join(out)
