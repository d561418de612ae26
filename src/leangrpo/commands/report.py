"""`leangrpo report RUN_DIR`: training curves as PNGs in the run directory and one self-contained
`report.html` (images embedded, no network) with the curves, the config, the before/after evaluation and
sample completions from early and late in training. matplotlib is imported only here, with Agg."""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeGuard

from leangrpo.commands.compare import fmt_value
from leangrpo.run.rundir import (
    CURVES,
    Curve,
    RunDirError,
    atomic_file,
    claim,
    is_run_dir,
    kind,
    read_bytes,
    read_jsonl,
    read_yaml,
    remove,
    with_trl_names,
    write_text_atomic,
)

SAMPLES_EACH = 3  # sample completions shown from the start and from the end


def _numeric(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _series(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, tuple[list[int], list[float]]]:
    """{key: (steps, values)} for every key matched by `keys` that has at least one finite value."""
    found: list[str] = []
    for key in keys:
        for row in rows:
            for k in row:
                matches = k.startswith(key) if key.endswith(("/", "@")) else k == key
                if matches and k not in found:
                    found.append(k)
    out = {}
    for k in found:
        points = [(r["step"], float(r[k])) for r in rows if _numeric(r.get(k))]
        if points:
            out[k] = ([s for s, _ in points], [v for _, v in points])
    return out


def plot_curve(rows: list[dict[str, Any]], curve: Curve, out: Path) -> Path | None:
    """Draw one curve into `out` (PNG); None when the run recorded none of its metrics."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no display needed (Agg)
    from matplotlib.ticker import MaxNLocator

    series = _series(rows, curve.keys)
    if not series:
        return None
    fig = Figure(figsize=(6.4, 3.6), dpi=100)
    ax = fig.subplots()
    for key, (steps, values) in series.items():
        ax.plot(steps, values, marker="o" if len(steps) <= 30 else None, markersize=3, label=key)
    ax.set_title(curve.title)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_file(out) as f:
        fig.savefig(f, format="png")
    return out


def load_run(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The run's metrics rows (those with a step number) and notes about skipped lines; one-line errors
    for a non-run."""
    if not is_run_dir(run_dir):
        raise RunDirError(f"{run_dir} is not a run directory (no leangrpo config.yaml)")
    if kind(run_dir / "metrics.jsonl", run_dir) is None:
        raise RunDirError(f"run directory {run_dir} has no metrics.jsonl yet")
    loaded = read_jsonl(run_dir / "metrics.jsonl")
    rows = [with_trl_names(r) for r in loaded.rows if _numeric(r.get("step"))]
    if len(rows) < len(loaded.rows):
        loaded.notes.append(
            f"skipped {len(loaded.rows) - len(rows)} rows of metrics.jsonl with no step number"
        )
    return rows, loaded.notes


def _table(header: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    cells = ("".join(f"<td>{html.escape(fmt_value(c))}</td>" for c in r) for r in rows)
    body = "".join(f"<tr>{c}</tr>" for c in cells)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _flatten(d: dict[str, Any], prefix: str = "") -> list[list[Any]]:
    out: list[list[Any]] = []
    for k, v in d.items():
        if isinstance(v, dict):
            out += _flatten(v, f"{prefix}{k}.")
        else:
            out.append([f"{prefix}{k}", v if isinstance(v, (int, float, str)) or v is None else str(v)])
    return out


def before_after(eval_rows: list[dict[str, Any]]) -> str:
    """metric | first evaluation | last evaluation | difference."""
    if not eval_rows:
        return "<p>No evaluation in this run (enable it with <code>eval.enabled: true</code>).</p>"
    first, last = eval_rows[0], eval_rows[-1]
    rows = []
    for key in first:
        if key.startswith("eval/"):
            a, b = first.get(key), last.get(key)
            delta = f"{b - a:+.4g}" if _numeric(a) and _numeric(b) else ""
            rows.append([key[5:], a, b, delta])
    return _table(["metric", f"step {first['step']}", f"step {last['step']}", "difference"], rows)


def _samples(samples: list[dict[str, Any]]) -> str:
    if not samples:
        return (
            "<p>No sample completions were logged (logging.log_completions_steps; in a TRL config, "
            "log_completions).</p>"
        )
    picked = samples if len(samples) <= 2 * SAMPLES_EACH else samples[:SAMPLES_EACH] + samples[-SAMPLES_EACH:]
    parts = []
    for s in picked:
        rewards = ", ".join(f"{k}={fmt_value(v)}" for k, v in (s.get("rewards") or {}).items())
        parts.append(
            f"<div class='sample'><h3>step {html.escape(str(s.get('step')))}</h3>"
            f"<p><b>Q:</b> {html.escape(str(s.get('question', '')))}</p>"
            f"<pre>{html.escape(str(s.get('completion', '')))}</pre>"
            f"<p>extracted <code>{html.escape(repr(s.get('extracted')))}</code> · gold "
            f"<code>{html.escape(str(s.get('gold')))}</code> · {html.escape(rewards)}</p></div>"
        )
    return "".join(parts)


STYLE = """body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:14px}td,th{border:1px solid #ccc;padding:3px 8px}
th{background:#f2f2f2}td:not(:first-child){text-align:right}.plots{display:flex;flex-wrap:wrap;gap:8px}
.plots img{width:540px;border:1px solid #ddd}pre{white-space:pre-wrap;background:#f7f7f7;padding:6px}
.note{color:#a60}.sample{border-top:1px solid #ddd}"""


def write_report(run_dir: str | Path) -> tuple[Path, list[str]]:
    """Write the PNGs and `report.html` into `run_dir`; returns the HTML path and notes (skipped lines,
    curves with no data)."""
    run_dir = Path(run_dir)
    rows, notes = load_run(run_dir)
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    images = []
    for curve in CURVES:
        claim(run_dir, f"{curve.stem}.png")
        png = plot_curve(evals if curve.eval_rows else train, curve, run_dir / f"{curve.stem}.png")
        if png is None:
            if kind(stale := run_dir / f"{curve.stem}.png", run_dir) in ("file", "link"):
                remove(stale, run_dir)  # an earlier run's PNG, or a link (removed, never followed)
            notes.append(f"{curve.title}: not recorded in this run")
            continue
        data = base64.b64encode(read_bytes(png, run_dir)).decode()
        images.append(f"<img alt='{html.escape(curve.title)}' src='data:image/png;base64,{data}'>")
    has_samples = kind(run_dir / "completions.jsonl", run_dir) is not None
    samples = read_jsonl(run_dir / "completions.jsonl") if has_samples else None
    if samples:
        notes += samples.notes
    config = read_yaml(run_dir / "config.yaml", run_dir)  # is_run_dir read it: a mapping
    last = train[-1] if train else {}
    summary: list[list[Any]] = [
        ["steps logged", len(train)],
        [
            "reward, first → last step",
            f"{fmt_value(train[0]['reward'])} → {fmt_value(last['reward'])}" if train else "-",
        ],
        ["training time (s)", sum(r.get("step_seconds") or 0 for r in train)],
        ["peak memory (MiB)", max((r.get("peak_memory_mb") or 0 for r in train), default=None)],
    ]
    title = f"leangrpo run {html.escape(run_dir.name)}"
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{title}</title>
<style>{STYLE}</style></head><body>
<h1>leangrpo run: {html.escape(str(run_dir))}</h1>
{"".join(f"<p class='note'>note: {html.escape(n)}</p>" for n in notes)}
{_table(["", ""], summary)}
<h2>Training curves</h2><div class="plots">{"".join(images)}</div>
<h2>Evaluation: before and after</h2>{before_after(evals)}
<h2>Sample completions, early and late</h2>{_samples(samples.rows if samples else [])}
<h2>Config</h2>{_table(["key", "value"], _flatten(config or {}))}
</body></html>
"""
    out = run_dir / "report.html"
    claim(run_dir, out.name)
    write_text_atomic(out, page, run_dir)
    return out, notes


def write_report_after_training(run_dir: Path, write: Callable[[str], None]) -> None:
    """The end-of-training report, never allowed to fail a run whose model is already saved."""
    try:
        path, _ = write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - the run is done; say why the report is missing
        write(f"report: could not be written: {type(e).__name__}: {e}")
        return
    write(f"report: {path}")
