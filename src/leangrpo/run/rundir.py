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
import io
import json
import os
import re
import secrets
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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


# ---------------------------------------------------------------------------------- run-directory I/O
#
# Every read, write, move and delete in a run, checkpoint or export directory goes through these. What is
# in such a directory was not necessarily written by leangrpo (issue 50): a path given with its `root` (the
# directory the user named) must stay inside it, and below the root no symbolic link is followed for a
# write, move or delete (each folder is opened with O_NOFOLLOW from the one above, by file descriptor); new
# files are created under random names with O_EXCL, then renamed in the same directory; only regular files
# are read, within a size bound, and JSON and YAML within a depth bound.

MAX_DOC_BYTES = 64 * 2**20  # the largest JSON or YAML document read whole (configs, states, evaluations)
MAX_LOG_BYTES = 2**30  # the largest JSON Lines log read whole (metrics, completions, records)
MAX_DEPTH = 100  # the deepest nesting a JSON or YAML document read from a run may have
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(path: Path, root: Path | None) -> tuple[Path, tuple[str, ...]]:
    """(root, the names from it down to `path`); `root` defaults to the parent. A path outside `root`
    (`..`, another absolute path) is refused."""
    root = path.parent if root is None else root
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        raise RunDirError(f"{path} is outside {root}") from None
    if not parts or ".." in parts:
        raise RunDirError(f"{path} is outside {root}")
    return root, parts


def _refused(path: Path, root: Path, e: OSError, verb: str) -> RunDirError:
    """A failed open or move in `root` as one line: a symbolic link in the way is named as such."""
    for folder in (path, *path.parents):
        if folder == root or root not in folder.parents:
            break
        if folder.is_symlink():
            return RunDirError(
                f"{folder} is a symbolic link; leangrpo follows none inside {root} to write, move or delete"
            )
    return RunDirError(f"cannot {verb} {path}: {os_reason(e)}")


@contextmanager
def _folder(root: Path, names: tuple[str, ...], create: bool = False) -> Iterator[int]:
    """A descriptor of `root`/`names`, each folder opened from the one above without following a link
    (made when `create`)."""
    fd = os.open(root, _DIR)
    try:
        for name in names:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, dir_fd=fd)
            below = os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = below
        yield fd
    finally:
        os.close(fd)


@contextmanager
def _parent(
    path: Path, root: Path | None, create: bool = False, verb: str = "write"
) -> Iterator[tuple[int, str]]:
    """(a descriptor of `path`'s folder, its name there), every OSError of the block as one line
    (`cannot {verb} {path}: ...`). With `create`, the folders down to it are made (`root` itself, a
    directory the user named, the ordinary way)."""
    root, parts = _parts(path, root)
    try:
        if create:
            root.mkdir(parents=True, exist_ok=True)
        with _folder(root, parts[:-1], create) as fd:
            yield fd, parts[-1]
    except OSError as e:
        raise _refused(path, root, e, verb) from None


def _temp_name(name: str) -> str:
    return f".{name}.{secrets.token_hex(4)}.tmp"


def _file(fd: int, path: Path, mode: str) -> IO[Any]:
    """A file object over the open descriptor `fd`, named `path` (as a plain `open` would name it)."""
    encoding = None if "b" in mode else "utf-8"
    return open(path, mode, encoding=encoding, opener=lambda *_: fd)  # noqa: SIM115 - the caller closes


@contextmanager
def atomic_file(path: Path, root: Path | None = None, text: bool = False) -> Iterator[IO[Any]]:
    """A new file to write, created under a random name beside `path` (O_EXCL, O_NOFOLLOW) and renamed to
    `path` when the block succeeds. On any failure (disk full, read-only...) it is removed and a
    RunDirError names the file and the OS reason: `path` is either the complete new file or the old one,
    never a partial one. Folders between `root` and `path` are made as needed."""
    with _parent(path, root, create=True) as (fd, name):
        tmp = _temp_name(name)
        try:
            handle = os.open(tmp, _NEW, 0o644, dir_fd=fd)
            with _file(handle, path.with_name(tmp), "w" if text else "wb") as f:
                yield f
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except BaseException as e:
            with contextlib.suppress(OSError):  # a read-only directory: there is no tmp to remove
                os.unlink(tmp, dir_fd=fd)
            if isinstance(e, UserError) or not isinstance(e, Exception):
                raise
            raise RunDirError(f"cannot write {path}: {error_reason(e)}") from None


def write_text_atomic(path: Path, text: str, root: Path | None = None) -> None:
    with atomic_file(path, root, text=True) as f:
        f.write(text)


@contextmanager
def new_file(path: Path, root: Path | None = None) -> Iterator[IO[bytes]]:
    """`path` created for writing (binary); refused if anything is there already (O_EXCL, O_NOFOLLOW)."""
    with _parent(path, root) as (fd, name):
        f = _file(os.open(name, _NEW, 0o644, dir_fd=fd), path, "wb")
    with f:
        yield f


def append_text(path: Path, text: str, root: Path | None = None) -> None:
    """Append `text` to the regular file `path` (made if missing), never through a link."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    with _parent(path, root) as (fd, name):
        handle = os.open(name, flags, 0o644, dir_fd=fd)
        with _file(handle, path, "a") as f:
            _check_regular(handle, path)
            f.write(text)


def check_writable(path: Path, root: Path | None = None) -> None:
    """Fail now, in one line, if `path` could not be written later (before a long computation)."""
    with _parent(path, root, create=True) as (fd, name):
        tmp = _temp_name(name)
        os.close(os.open(tmp, _NEW, 0o644, dir_fd=fd))
        os.unlink(tmp, dir_fd=fd)


def make_dir(path: Path, root: Path | None = None) -> None:
    """Create the folder `path`, which must not exist yet (nothing found there is used)."""
    with _parent(path, root, create=True) as (fd, name):
        os.mkdir(name, dir_fd=fd)


def make_temp_dir(beside: Path) -> Path:
    """A new folder with a random name beside `beside` (`.NAME.<random>.tmp`), for a directory written
    whole and renamed into place: whatever was there before is never reused or removed. The folders
    above `beside` (a path the user named) are made as needed."""
    tmp = beside.with_name(_temp_name(beside.name))
    make_dir(tmp)
    return tmp


def move(src: Path, dst: Path, root: Path) -> None:
    """Rename `src` to `dst`, both inside `root` (the entry itself, never what a link points to),
    making `dst`'s folders as needed."""
    with (
        _parent(src, root, verb="move") as (src_fd, src_name),
        _parent(dst, root, create=True, verb="move into") as (dst_fd, dst_name),
    ):
        os.rename(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def remove(path: Path, root: Path | None = None) -> None:
    """Delete a file, a link (not what it points to) or a directory tree, if it exists."""
    with _parent(path, root, verb="delete") as (fd, name):
        try:
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
        except FileNotFoundError:
            return
        if stat.S_ISDIR(mode):
            shutil.rmtree(name, dir_fd=fd)
        else:
            os.unlink(name, dir_fd=fd)


def remove_empty_dir(path: Path, root: Path) -> bool:
    """Remove the folder `path` if it is empty; False if it is not (or is not a folder)."""
    try:
        with _parent(path, root) as (fd, name):
            os.rmdir(name, dir_fd=fd)
    except RunDirError:
        return False
    return True


def kind(path: Path, root: Path | None = None) -> str | None:
    """What is at `path` reached without following a link below `root`: 'file', 'dir', 'link' or
    'other'; None when nothing is, or a folder on the way is a link."""
    try:
        with _parent(path, root) as (fd, name):
            mode = os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except (RunDirError, OSError):
        return None
    if stat.S_ISLNK(mode):
        return "link"
    return "file" if stat.S_ISREG(mode) else "dir" if stat.S_ISDIR(mode) else "other"


def refuse_link(path: Path, root: Path) -> None:
    """A one-line RunDirError if `path` is a link: for a folder a library writes into by name."""
    if kind(path, root) == "link":
        raise RunDirError(f"{path} is a symbolic link; leangrpo follows none inside {root} to write")


def fsync(path: Path) -> None:
    """Flush a file or folder to disk (a save's files before its rename); never through a link."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check_regular(fd: int, path: Path) -> os.stat_result:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise RunDirError(f"{path} is not a regular file; leangrpo reads only regular files")
    return info


def open_read(path: Path, root: Path | None = None, limit: int | None = None) -> io.BufferedReader:
    """`path` opened for reading if it is a regular file (a FIFO or device is refused at once, without
    blocking) of at most `limit` bytes. With `root`, no link below it is followed; without, `path` is
    one the user named and may be a link."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        if root is None:
            fd = os.open(path, flags)
        else:
            with _parent(path, root, verb="read") as (folder, name):
                fd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=folder)
    except OSError as e:
        raise RunDirError(f"cannot read {path}: {os_reason(e)}") from None
    try:
        size = _check_regular(fd, path).st_size
        if limit is not None and size > limit:
            raise RunDirError(f"{path} is {size} bytes, more than the {limit} leangrpo reads")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_bytes(path: Path, root: Path | None = None, limit: int = MAX_DOC_BYTES) -> bytes:
    with open_read(path, root, limit) as f:
        try:
            return f.read(limit + 1)[:limit]
        except OSError as e:
            raise RunDirError(f"cannot read {path}: {os_reason(e)}") from None


def read_text(path: Path, root: Path | None = None, limit: int = MAX_DOC_BYTES) -> str:
    """A regular file's text (UTF-8; an undecodable file is a one-line error)."""
    try:
        return read_bytes(path, root, limit).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunDirError(f"{path} is not UTF-8 text (byte {e.start})") from None


def _check_depth(data: Any, path: Path) -> Any:
    """`data` if it nests at most MAX_DEPTH deep (each container visited once: YAML aliases share)."""
    stack, seen = [(data, 0)], set()
    while stack:
        node, depth = stack.pop()
        if not isinstance(node, (dict, list)) or id(node) in seen:
            continue
        if depth >= MAX_DEPTH:
            raise RunDirError(f"{path} nests deeper than {MAX_DEPTH} levels")
        seen.add(id(node))
        stack += [(child, depth + 1) for child in (node.values() if isinstance(node, dict) else node)]
    return data


def read_json(path: Path, root: Path | None = None) -> Any:
    """A JSON document from a file a run (or anyone) wrote, within the size and depth bounds; bad
    content is a one-line RunDirError."""
    text = read_text(path, root)
    try:
        return _check_depth(json.loads(text), path)
    except RecursionError:
        raise RunDirError(f"{path} nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise RunDirError(f"{path} is not valid JSON: {e}") from None


def read_yaml(path: Path, root: Path | None = None, what: str = "") -> Any:
    """A YAML document (safe_load), as `read_json`; `what` goes before the path in messages."""
    try:
        text = read_bytes(path, root).decode("utf-8")
    except UnicodeDecodeError as e:
        raise RunDirError(f"{what}{path} is not YAML text (byte {e.start} is not UTF-8)") from None
    try:
        return _check_depth(yaml.safe_load(text), path)
    except RecursionError:
        raise RunDirError(f"{what}{path} nests deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f":{mark.line + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise RunDirError(f"{what}{path}{where} is not valid YAML: {problem}") from None


# ------------------------------------------------------------------------------ owning a run directory


def claim(run_dir: Path, *paths: str) -> None:
    """Record `paths` (relative to `run_dir`) in the run's manifest as the run's own, before or as it
    creates them: `--overwrite` moves exactly these. Nothing is recorded where there is no manifest (a
    directory `start_run` did not take)."""
    manifest = run_dir / MANIFEST
    if kind(manifest, run_dir) is None:
        return
    known = set(read_text(manifest, run_dir, MAX_LOG_BYTES).splitlines())
    if new := [p for p in dict.fromkeys(paths) if p not in known]:
        append_text(manifest, "".join(f"{p}\n" for p in new), run_dir)


def run_entries(run_dir: Path) -> list[Path]:
    """What the run in `run_dir` created and still exists: the paths in its manifest, and interrupted
    saves. Empty for a directory without a manifest. A path reached through a link is none of the run's
    (leangrpo makes none): it is left alone."""
    manifest = run_dir / MANIFEST
    if kind(manifest, run_dir) != "file":
        return []
    listed = (run_dir / p for p in read_text(manifest, run_dir, MAX_LOG_BYTES).splitlines() if _inside(p))
    partial = (p for p in run_dir.iterdir() if _PARTIAL.match(p.name))
    return sorted({p for p in (*listed, *partial) if kind(p, run_dir) is not None})


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
    keep = _holding(run_dir, entries, base)
    aside = run_dir / REPLACED
    manifest = run_dir / MANIFEST
    try:
        if entries and kind(aside, run_dir) is None:
            for entry in entries:
                if entry != keep:
                    move(entry, aside / entry.relative_to(run_dir), run_dir)
            move(manifest, aside / MANIFEST, run_dir)
        else:
            for entry in entries:
                if entry != keep:
                    remove(entry, run_dir)
        _drop_empty_dirs(run_dir, entries)
        write_text_atomic(manifest, "config.yaml\n", run_dir)
        if keep is not None:
            if keep.name != BASE_MODEL:
                move(keep, run_dir / BASE_MODEL, run_dir)
            claim(run_dir, BASE_MODEL)
            return str(run_dir / BASE_MODEL / Path(base).resolve().relative_to(keep.resolve()))
    except OSError as e:
        raise RunDirError(f"cannot replace the run in {run_dir}: {os_reason(e)}") from None
    return base


def _holding(run_dir: Path, entries: list[Path], base: str) -> Path | None:
    """The entry (a real folder, not a link) holding the model `base` being trained, if one does."""
    if not Path(base).exists():
        return None
    source = Path(base).resolve()
    for entry in entries:
        if kind(entry, run_dir) == "dir" and entry.resolve() in (source, *source.parents):
            return entry
    return None


def _drop_empty_dirs(run_dir: Path, moved: list[Path]) -> None:
    """Remove the folders that moving `moved` left empty (`eval/`), up to `run_dir`; a folder still
    holding anything (the user's own files) stays."""
    for entry in moved:
        for folder in entry.parents:
            if folder == run_dir or run_dir not in folder.parents or not remove_empty_dir(folder, run_dir):
                break


def restore_replaced(run_dir: Path) -> bool:
    """Undo `start_run`'s replacement when the new run failed before finishing a step: its own paths are
    deleted and the earlier run's moved back. False when there was nothing to restore."""
    aside = run_dir / REPLACED
    if kind(aside / MANIFEST, run_dir) != "file":  # nothing aside, or reached through a link
        return False
    failed = run_entries(run_dir)
    for entry in failed:
        remove(entry, run_dir)
    _drop_empty_dirs(run_dir, failed)
    remove(run_dir / MANIFEST, run_dir)
    for entry in (aside / MANIFEST, *run_entries(aside)):
        move(entry, run_dir / entry.relative_to(aside), run_dir)
    remove(aside, run_dir)
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
    remove(run_dir / REPLACED, run_dir)


class RunLock:
    """One process per run directory: an exclusive `flock` on `RUN/.leangrpo.lock`, which holds the
    owner's PID. The kernel releases it when the process dies, however it dies."""

    def __init__(self, run_dir: Path):
        import fcntl

        path = run_dir / LOCK_FILE
        self.fd: int | None = None
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            with _parent(path, run_dir) as (folder, name):
                self.fd = fd = os.open(name, flags, 0o644, dir_fd=folder)
            _check_regular(fd, path)
        except (OSError, RunDirError) as e:
            self.release()
            why = e if isinstance(e, RunDirError) else os_reason(e)
            raise RunDirError(f"output_dir {run_dir} is not writable: {why}") from None
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
    if not path.exists():
        raise RunDirError(f"file not found: {path}")
    lines = read_bytes(path, limit=MAX_LOG_BYTES).decode("utf-8", errors="replace").splitlines()
    numbered = [(i, line) for i, line in enumerate(lines, start=1) if line.strip()]
    out = JsonlRows([])
    for pos, (lineno, line) in enumerate(numbered):
        try:
            row = _check_depth(json.loads(line), path)
            if not isinstance(row, dict):
                raise ValueError(f"not a JSON object ({type(row).__name__})")
        except (ValueError, RecursionError, RunDirError) as e:
            if pos == len(numbered) - 1:
                out.notes.append(f"skipped the truncated last line {lineno} of {path}")
                break
            raise RunDirError(f"{path}:{lineno} is not valid JSON: {e}") from None
        out.rows.append(row)
    return out


def is_run_dir(path: Path) -> bool:
    """True when `path` holds a leangrpo run: a config.yaml (a regular file, not a link) with the sections
    leangrpo writes. One that is neither a file, a link nor a folder (a FIFO...) is a one-line RunDirError:
    reading it could block."""
    config = path / "config.yaml"
    found = kind(config, path)
    if found == "other":
        raise RunDirError(f"{config} is not a regular file; leangrpo reads only regular files")
    try:
        data = read_yaml(config, path) if found == "file" else None
    except RunDirError:
        return False
    return isinstance(data, dict) and {"model", "data", "rewards", "grpo"} <= data.keys()


def eval_files(run_dir: Path) -> list[Path]:
    """The run's evaluation JSONs (training's `eval/step-N.json`, `leangrpo eval` outputs), oldest first."""
    return sorted((run_dir / "eval").glob("*.json"), key=lambda p: (p.lstat().st_mtime, p.name))
