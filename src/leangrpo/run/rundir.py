"""The run directory: what a run owns in it, replacing an earlier run safely, the one-process lock, and
reading what it holds (metrics tolerating a crash-truncated last line, the final model, evaluations).
Light: no torch, so `compare` and `report` start fast.

Nothing a run did not write is ever removed. A run records each path it creates in its manifest
(`.leangrpo-manifest`), and `--overwrite` moves exactly those: a directory without a manifest is never
overwritten. It checks the directory before anything loads, and only once every input is validated and
the model is in memory does it move the earlier run's paths aside into `.leangrpo-replaced/`, which is
deleted when the new run has finished its first step, and moved back if it fails before that.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from leangrpo.core.errors import UserError, error_reason, os_reason

BASE_MODEL = "base-model"  # the replaced run's entry the new run trains from, kept (see `start_run`)
# The top-level entries a run writes (besides `checkpoint-N/`, partial saves and the report's PNGs).
RUN_FILES = (
    "config.yaml", "metrics.jsonl", "completions.jsonl", "model", "eval", "tensorboard", "wandb",
    "report.html", BASE_MODEL,
)  # fmt: skip
# The report's plots (report.py draws them; the run directory owns their PNGs).


@dataclass(frozen=True)
class Curve:
    """One PNG: the metrics keys it draws (prefix-matched when the key ends with '/')."""

    stem: str
    title: str
    keys: tuple[str, ...]
    eval_rows: bool = False  # drawn from the evaluation rows (eval/...) instead of the training rows


CURVES = (
    Curve("reward_curve", "Reward: total and per function", ("reward", "rewards/")),
    Curve("reward_std", "Reward std (all rewards of the step)", ("reward_std",)),
    Curve("kl", "KL to the reference", ("kl",)),
    Curve("loss", "Loss", ("loss",)),
    Curve(
        "completion_length",
        "Completion length (tokens)",
        ("completions/mean_length", "completions/max_length"),
    ),
    Curve("clip_ratio", "Clip ratio", ("clip_ratio/",)),
    Curve("phase_seconds", "Seconds per step, by phase", ("time/",)),
    Curve(
        "eval_accuracy",
        "Held-out evaluation",
        ("eval/accuracy", "eval/accuracy/lenient", "eval/pass@", "eval/format/"),
        True,
    ),
)


REPLACED = ".leangrpo-replaced"  # the earlier run, moved aside until the new one has finished a step
LOCK_FILE = ".leangrpo.lock"
MANIFEST = ".leangrpo-manifest"  # every path the run created, relative to the run directory, one a line
_CHECKPOINT = re.compile(r"^checkpoint-\d+$")
_PARTIAL = re.compile(r"^\.(checkpoint-\d+|model)\.(tmp|old)$")  # an interrupted save of a claimed entry


class RunDirError(UserError, RuntimeError):
    """A run directory (or a file in it) cannot be used as asked."""


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """A temporary file beside `path` to write into, renamed to `path` when the block succeeds. On any
    failure (disk full, read-only...) it is removed and a RunDirError names the file and the OS reason:
    `path` is either the complete new file or the old one, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except Exception as e:
        with contextlib.suppress(OSError):  # a read-only directory: there is no tmp to remove
            tmp.unlink(missing_ok=True)
        if isinstance(e, UserError):
            raise
        raise RunDirError(f"cannot write {path}: {error_reason(e)}") from None


def check_writable(path: Path) -> None:
    """Fail now, in one line, if `path` could not be written later (before a long computation)."""
    probe = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise RunDirError(f"cannot write {path}: {os_reason(e)}") from None


def write_text_atomic(path: Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


# ------------------------------------------------------------------------------ owning a run directory


def claim(run_dir: Path, *paths: str) -> None:
    """Record `paths` (relative to `run_dir`) in the run's manifest as the run's own, before or as it
    creates them: `--overwrite` moves exactly these. Nothing is recorded where there is no manifest (a
    directory `start_run` did not take)."""
    manifest = run_dir / MANIFEST
    if not manifest.is_file():
        return
    known = set(manifest.read_text(encoding="utf-8").splitlines())
    new = [p for p in dict.fromkeys(paths) if p not in known]
    if new:
        with manifest.open("a", encoding="utf-8") as f:
            f.write("".join(f"{p}\n" for p in new))


def run_entries(run_dir: Path) -> list[Path]:
    """What the run in `run_dir` created and still exists: the paths in its manifest, and interrupted
    saves. Empty for a directory without a manifest."""
    manifest = run_dir / MANIFEST
    if not manifest.is_file():
        return []
    listed = (run_dir / p for p in manifest.read_text(encoding="utf-8").splitlines() if _inside(p))
    partial = (p for p in run_dir.iterdir() if _PARTIAL.match(p.name))
    return sorted({p for p in (*listed, *partial) if p.exists() or p.is_symlink()})


def _inside(relative: str) -> bool:
    """A manifest line that names a path inside the run directory (a hand-edited one might not)."""
    parts = Path(relative).parts
    return bool(parts) and not Path(relative).is_absolute() and ".." not in parts and parts[0] != REPLACED


def check_output_dir(run_dir: Path, overwrite: bool) -> None:
    """Refuse an output_dir a fresh run may not use; reads only, so it runs before anything loads.

    An earlier run needs `--overwrite`, and a manifest saying what it wrote. A non-empty directory that is
    not a run needs `--overwrite` too, and even then is refused if it holds anything under a name a run
    writes: those files are the user's."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDirError(f"output_dir {run_dir} is a file, not a directory")
    if not run_dir.is_dir() or all(p.name == LOCK_FILE for p in run_dir.iterdir()):
        return
    if is_run_dir(run_dir) or (run_dir / MANIFEST).is_file():
        if not overwrite:
            raise RunDirError(
                f"output_dir {run_dir} already holds a run; continue it with --resume {run_dir}, "
                "replace it with --overwrite, or choose another output_dir"
            )
        if not (run_dir / MANIFEST).is_file():
            raise RunDirError(
                f"output_dir {run_dir} holds a config.yaml but no {MANIFEST} listing what a run wrote, so "
                "leangrpo cannot tell its files from yours and replaces nothing there: choose another "
                "output_dir, or move the directory away"
            )
        return
    if not overwrite:
        raise RunDirError(
            f"output_dir {run_dir} exists and is not a leangrpo run; choose another output_dir "
            "or pass --overwrite to write into it (nothing of it is deleted)"
        )
    names = {*RUN_FILES, *(f"{c.stem}.png" for c in CURVES)}
    if clash := sorted(p.name for p in run_dir.iterdir() if p.name in names or _CHECKPOINT.match(p.name)):
        raise RunDirError(
            f"output_dir {run_dir} is not a leangrpo run but holds {', '.join(clash[:5])}, which a run would "
            "write; leangrpo never replaces files it did not write: move them or choose another output_dir"
        )


def start_run(run_dir: Path, overwrite: bool, base: str) -> str:
    """Make `run_dir` ready for a fresh run, once every input is validated and the model is loaded (and
    under the lock), and start its manifest. An earlier run's paths are moved into `.leangrpo-replaced/`
    (deleted by `drop_replaced` once the new run has finished a step, moved back by `restore_replaced` if
    it fails first); when that already exists, the paths are those of a replacing run that never finished
    a step, and are deleted. An entry holding the model being trained (`--overwrite` of `runs/x` from
    `runs/x/model`) is kept, as `base-model/`: a resume or an export of an adapter still finds its base.
    Returns the model path to record in the config."""
    check_output_dir(run_dir, overwrite)
    entries = run_entries(run_dir) if overwrite else []
    source = Path(base).resolve() if Path(base).exists() else None
    keep = next((e for e in entries if source and e.resolve() in (source, *source.parents)), None)
    aside = run_dir / REPLACED
    manifest = run_dir / MANIFEST
    try:
        if entries and not aside.exists():
            for entry in entries:
                if entry != keep:
                    _move(entry, aside / entry.relative_to(run_dir))
            _move(manifest, aside / MANIFEST)
        else:
            for entry in entries:
                if entry != keep:
                    remove(entry)
        _drop_empty_dirs(run_dir, entries)
        manifest.write_text("config.yaml\n", encoding="utf-8")
        if keep is not None and source is not None:
            if keep.name != BASE_MODEL:
                keep.rename(run_dir / BASE_MODEL)
            claim(run_dir, BASE_MODEL)
            return str(run_dir / BASE_MODEL / source.relative_to(keep.resolve()))
    except OSError as e:
        raise RunDirError(f"cannot replace the run in {run_dir}: {os_reason(e)}") from None
    return base


def _move(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    src.rename(dst)


def _drop_empty_dirs(run_dir: Path, moved: list[Path]) -> None:
    """Remove the folders that moving `moved` left empty (`eval/`), up to `run_dir`; a folder still
    holding anything (the user's own files) stays."""
    for entry in moved:
        for folder in entry.parents:
            if folder == run_dir or run_dir not in folder.parents:
                break
            try:
                folder.rmdir()
            except OSError:
                break


def restore_replaced(run_dir: Path) -> bool:
    """Undo `start_run`'s replacement when the new run failed before finishing a step: its own paths are
    deleted and the earlier run's moved back. False when there was nothing to restore."""
    aside = run_dir / REPLACED
    if not (aside / MANIFEST).is_file():
        return False
    failed = run_entries(run_dir)
    for entry in failed:
        remove(entry)
    _drop_empty_dirs(run_dir, failed)
    (run_dir / MANIFEST).unlink(missing_ok=True)
    for entry in (aside / MANIFEST, *run_entries(aside)):
        _move(entry, run_dir / entry.relative_to(aside))
    shutil.rmtree(aside)
    return True


def replaced_note(run_dir: Path) -> str:
    """Where the run that `run_dir`'s failed replacement moved aside is, and how to restore it ('' if
    none is)."""
    aside = run_dir / REPLACED
    if not aside.is_dir():
        return ""
    return (
        f"; the run it replaced is intact in {aside}: to restore it, move the new run's entries out of "
        f"{run_dir} and everything in {aside} (its {MANIFEST} too) back into {run_dir}"
    )


def drop_replaced(run_dir: Path) -> None:
    """Delete the run `start_run` moved aside: the new one has finished a step."""
    remove(run_dir / REPLACED)


def remove(path: Path) -> None:
    """Delete a file or a directory tree, if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


class RunLock:
    """One process per run directory: an exclusive `flock` on `RUN/.leangrpo.lock`, which holds the
    owner's PID. The kernel releases it when the process dies, however it dies."""

    def __init__(self, run_dir: Path):
        import fcntl

        path = run_dir / LOCK_FILE
        self.fd: int | None = None
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            self.fd = fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RunDirError(f"output_dir {run_dir} is not writable: {os_reason(e)}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            self.release()
            raise RunDirError(
                f"output_dir {run_dir} is in use by another leangrpo process (PID {holder}, holding {path}); "
                "wait for it to end, or choose another output_dir"
            ) from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as e:
            self.release()
            raise RunDirError(f"output_dir {run_dir} is not writable: {os_reason(e)}") from None

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    __del__ = release

    @staticmethod
    def holder(run_dir: Path) -> str | None:
        """The PID of the process that holds `run_dir`'s lock now (a run training there), else None;
        takes nothing and creates nothing."""
        import fcntl

        try:
            fd = os.open(run_dir / LOCK_FILE, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return None
        except OSError:
            return os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        finally:
            os.close(fd)  # closing lets go of the shared lock, if it was taken


@dataclass
class JsonlRows:
    """Parsed JSON lines, plus a note for each line that was skipped (only a torn last line is)."""

    rows: list[dict[str, Any]]
    notes: list[str] = field(default_factory=list)


_EARLIER_NAMES = {
    "completion_length/mean": "completions/mean_length",
    "completion_length/max": "completions/max_length",
    "truncated_frac": "completions/clipped_ratio",
    "zero_std_frac": "frac_reward_zero_std",
    "clip_ratio": "clip_ratio/region_mean",
}
"""Metric names of run directories written before leangrpo took TRL's, and TRL's name for each."""


def with_trl_names(metrics: dict[str, Any]) -> dict[str, Any]:
    """A metrics row (or an evaluation's metrics) with earlier leangrpo names as TRL's, so that `report` and
    `compare` read older run directories. A per-reward key named after its config spec
    (`rewards/pkg.mod:func/mean`, `rewards//path/to/rm/mean`, `rewards/correctness/mean`) takes the name
    TRL logs: the function's, the reward model's basename, a built-in's function name."""
    from leangrpo.data.rewards import BUILTIN_REWARDS

    out = {}
    for key, value in metrics.items():
        if key.startswith("rewards/") and key.endswith("/mean") and key != "rewards//mean":
            name = key.removeprefix("rewards/").removesuffix("/mean")
            name = name.rpartition(":")[2].rstrip("/").rpartition("/")[2]
            if name in BUILTIN_REWARDS:
                name = BUILTIN_REWARDS[name].__name__
            key = f"rewards/{name}/mean"
        out[_EARLIER_NAMES.get(key, key)] = value
    return out


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


def eval_files(run_dir: Path) -> list[Path]:
    """The run's evaluation JSONs (training's `eval/step-N.json`, `leangrpo eval` outputs), oldest first."""
    return sorted((run_dir / "eval").glob("*.json"), key=lambda p: (p.stat().st_mtime, p.name))
