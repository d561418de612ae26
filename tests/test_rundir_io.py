"""Issue 50's hostile run directories, one test per case (the item number in the name): what is in a run,
checkpoint or export directory was not necessarily written by leangrpo, so links are never followed to
write, move or delete, only regular files are read, and bad content is one line (exit 2), never a
traceback, a hang, or a file of the user's changed. The shared tiny run is test_hostile's."""

# ruff: noqa: F811 - the tests take test_hostile's fixtures `run` and `trained` by name

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_e2e import PYTHONPATH
from test_hostile import cli, md5s, no_traceback, run, trained  # noqa: F401 - `run`, `trained`: fixtures

from leangrpo.commands import export as export_module
from leangrpo.run.checkpoint import STATE_FILE, file_hashes, truncate_log
from leangrpo.run.rundir import (
    LOCK_FILE,
    MANIFEST,
    REPLACED,
    RunDirError,
    RunLock,
    claim,
    drop_replaced,
    restore_replaced,
    start_run,
)

SRC = Path(__file__).resolve().parents[1] / "src" / "leangrpo"


@pytest.fixture
def outside(tmp_path) -> Path:
    """A folder of the user's, outside every run, with one file: nothing may change it."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "victim.txt").write_text("the user's")
    return folder


def list_in_manifest(run_dir: Path, *names: str) -> None:
    with (run_dir / MANIFEST).open("a") as f:
        f.write("".join(f"{n}\n" for n in names))


# -------------------------------------------------------------------------- 6-10. links in a run directory


@pytest.mark.parametrize("aside_exists", [False, True])
def test_6_overwrite_never_deletes_through_a_linked_folder(run, outside, aside_exists):
    """The manifest lists `sub/victim.txt`, and `sub` links outside: deleted after step 1 (moved aside,
    then dropped), or at once when `.leangrpo-replaced/` already existed."""
    (run / "sub").symlink_to(outside)
    list_in_manifest(run, "sub/victim.txt")
    if aside_exists:
        (run / REPLACED).mkdir()
    start_run(run, overwrite=True, base="some/hub-id")
    drop_replaced(run)
    assert (outside / "victim.txt").read_text() == "the user's"


def test_7_the_lock_is_never_taken_through_a_link(run, outside):
    (run / LOCK_FILE).unlink(missing_ok=True)
    (run / LOCK_FILE).symlink_to(outside / "victim.txt")
    with pytest.raises(RunDirError, match="symbolic link"):
        RunLock(run)
    result = cli("train", "--resume", str(run), "--trust-run-code", "optim.max_steps=3")
    no_traceback(result)
    assert "symbolic link" in result.output and (outside / "victim.txt").read_text() == "the user's"


def test_8_report_never_writes_through_a_linked_temporary_file(run, tmp_path):
    targets = {name: tmp_path / f"target-{name}" for name in (".report.html.tmp", ".reward_curve.png.tmp")}
    for name, target in targets.items():
        target.write_text("the user's")
        (run / name).symlink_to(target)
    assert cli("report", str(run)).exit_code == 0
    assert all(target.read_text() == "the user's" for target in targets.values())
    assert (run / "report.html").is_file() and not (run / "report.html").is_symlink()


def test_8_eval_never_writes_through_a_linked_file_or_folder(run, outside, gsm8k_dir):
    (outside / "eval-test.json").write_text("the user's")
    (run / "eval" / ".eval-test.json.tmp").symlink_to(outside / "eval-test.json")
    args = ("eval", "--model", str(run), "--data", str(gsm8k_dir), "--limit", "1")
    result = cli(*args)
    assert result.exit_code == 0, result.output
    assert (outside / "eval-test.json").read_text() == "the user's"
    before = md5s(outside)
    os.rename(run / "eval", run / "eval-moved")
    (run / "eval").symlink_to(outside)
    result = cli(*args)
    no_traceback(result)
    assert "symbolic link" in result.output and md5s(outside) == before


def test_8_resume_never_appends_or_writes_through_links(run, outside):
    """A linked `.leangrpo-manifest` (claim appends to it) and `.metrics.jsonl.tmp` (the log's rewrite)."""
    truncate_target = outside / "metrics-target"
    truncate_target.write_text("the user's")
    (run / ".metrics.jsonl.tmp").symlink_to(truncate_target)
    truncate_log(run / "metrics.jsonl", 1)
    assert truncate_target.read_text() == "the user's"
    (run / MANIFEST).unlink()
    (run / MANIFEST).symlink_to(outside / "victim.txt")
    with pytest.raises(RunDirError):
        claim(run, "checkpoint-9")
    result = cli("train", "--resume", str(run), "--trust-run-code", "optim.max_steps=3")
    no_traceback(result)
    assert "symbolic link" in result.output and (outside / "victim.txt").read_text() == "the user's"


def test_8_resume_never_lets_a_tracker_write_through_a_linked_folder(run, outside):
    (run / "tensorboard").symlink_to(outside)
    args = ("--trust-run-code", "logging.report_to=[tensorboard]", "optim.max_steps=3")
    result = cli("train", "--resume", str(run), *args)
    no_traceback(result)
    assert "symbolic link" in result.output and sorted(os.listdir(outside)) == ["victim.txt"]


@pytest.mark.parametrize("linked", ["aside", "folder in it"])
def test_9_restoring_a_replaced_run_never_moves_files_in_through_a_link(run, tmp_path, linked):
    fake = tmp_path / "fake-aside"
    (fake / "sub").mkdir(parents=True)
    (fake / "secret.txt").write_text("the user's")
    (fake / "sub" / "secret.txt").write_text("the user's")
    (fake / MANIFEST).write_text("secret.txt\nsub/secret.txt\n")
    if linked == "aside":
        (run / REPLACED).symlink_to(fake)
    else:
        (run / REPLACED).mkdir()
        (run / REPLACED / MANIFEST).write_text("config.yaml\nsub/secret.txt\n")
        (run / REPLACED / "config.yaml").write_text((run / "config.yaml").read_text())
        (run / REPLACED / "sub").symlink_to(fake / "sub")
    before = md5s(fake)
    restore_replaced(run)
    assert md5s(fake) == before
    assert not (run / "secret.txt").exists() and not (run / "sub" / "secret.txt").exists()


def test_10_a_manifest_entry_linking_to_the_root_is_moved_as_a_link(run, tiny_model_dir):
    (run / "rootlink").symlink_to("/")
    list_in_manifest(run, "rootlink")
    assert start_run(run, overwrite=True, base=str(tiny_model_dir)) == str(tiny_model_dir)
    assert (run / REPLACED / "rootlink").is_symlink()
    drop_replaced(run)
    assert Path("/").is_dir() and not (run / REPLACED).exists()


# ----------------------------------------------------------------------------------- 11, 22, 26. export


def test_11_export_never_deletes_the_users_own_temporary_folder(trained, tmp_path):
    (tmp_path / ".x.tmp").mkdir()
    (tmp_path / ".x.tmp" / "mine.txt").write_text("the user's")
    result = cli("export", str(trained), "--out", str(tmp_path / "x"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / ".x.tmp" / "mine.txt").read_text() == "the user's"
    assert (tmp_path / "x" / "leangrpo_export.json").is_file()


@pytest.mark.parametrize("out", [".", "..", "here/.."])
def test_22_export_never_replaces_the_working_directory(trained, tmp_path, monkeypatch, out):
    cwd = tmp_path / "empty" / "here"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    result = cli("export", str(trained), "--out", out)
    no_traceback(result)
    assert "working directory" in result.output
    assert cwd.is_dir() and not list(cwd.iterdir()) and sorted(os.listdir(cwd.parent)) == ["here"]


def test_26_an_interrupted_export_leaves_no_temporary_folder(trained, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(export_module, "load_trained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        export_module.export(trained, tmp_path / "x", merge=True)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 14. FIFOs never hang


def run_with_timeout(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run(
        [sys.executable, "-m", "leangrpo", *args], input=stdin, capture_output=True, text=True, env=env,
        timeout=120,
    )  # fmt: skip


def test_14_a_fifo_in_a_run_is_refused_not_waited_on(run, tmp_path):
    os.mkfifo(run / "eval" / "step-9.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"metrics": {"eval/accuracy": 0.5}}))
    result = run_with_timeout("compare", str(run), str(other))
    assert result.returncode == 2 and "not a regular file" in result.stderr, result.stderr
    (run / "config.yaml").unlink()
    os.mkfifo(run / "config.yaml")
    result = run_with_timeout("chat", str(run), stdin="hi\n")
    assert result.returncode == 2 and "not a regular file" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------ 19. bad artefacts: eval, chat, export


def _export_dir(trained: Path, tmp_path: Path) -> Path:
    out = tmp_path / "exported"
    assert cli("export", str(trained), "--out", str(out)).exit_code == 0
    return out


def _invalid_export(trained, tmp_path):
    out = _export_dir(trained, tmp_path)
    (out / "leangrpo_export.json").write_text("{")
    return out


def _empty_export(trained, tmp_path):
    out = _export_dir(trained, tmp_path)
    (out / "leangrpo_export.json").write_text("{}")
    return out


def _list_export(trained, tmp_path):
    out = _export_dir(trained, tmp_path)
    (out / "leangrpo_export.json").write_text("[1, 2]")
    return out


def _copy(trained: Path, tmp_path: Path) -> Path:
    import shutil

    return Path(shutil.copytree(trained, tmp_path / "copy"))


def _config_without_optim(trained, tmp_path):
    out = _copy(trained, tmp_path)
    config = yaml.safe_load((out / "config.yaml").read_text())
    del config["optim"]
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    return out


def _invalid_state(trained, tmp_path):
    ckpt = _copy(trained, tmp_path) / "checkpoint-2"
    (ckpt / STATE_FILE).write_text("{")
    return ckpt


def _state_without_step(trained, tmp_path):
    ckpt = _copy(trained, tmp_path) / "checkpoint-2"
    state = json.loads((ckpt / STATE_FILE).read_text())
    del state["step"]
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    return ckpt


def _checkpoint_without_config(trained, tmp_path):
    """A consistent checkpoint (its state records no config.yaml) that has none."""
    ckpt = _copy(trained, tmp_path) / "checkpoint-2"
    (ckpt / "config.yaml").unlink()
    state = json.loads((ckpt / STATE_FILE).read_text())
    state["files"].pop("config.yaml")
    state["sha256"].pop("config.yaml")
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    return ckpt


def _invalid_hashes(trained, tmp_path):
    out = _copy(trained, tmp_path)
    (out / "model" / "leangrpo_sha256.json").write_text("{not json")
    return out


ARTEFACTS = [_invalid_export, _empty_export, _list_export, _config_without_optim, _invalid_state,
             _state_without_step, _checkpoint_without_config, _invalid_hashes]  # fmt: skip


@pytest.mark.parametrize("command", ["eval", "chat", "export"])
@pytest.mark.parametrize("make", ARTEFACTS, ids=lambda f: f.__name__.strip("_"))
def test_19_bad_artefacts_are_one_line(trained, tmp_path, gsm8k_dir, command, make):
    source = str(make(trained, tmp_path))
    args = {
        "eval": ("eval", "--model", source, "--data", str(gsm8k_dir), "--limit", "1"),
        "chat": ("chat", source),
        "export": ("export", source, "--out", str(tmp_path / "again")),
    }[command]
    result = cli(*args, input="hi\n")
    no_traceback(result)
    assert len([line for line in result.output.splitlines() if line.startswith("error:")]) == 1


# ---------------------------------------------------------------------------------- 20. deep nesting


DEEP_JSON = "[" * 100_000 + "]" * 100_000
DEEP_YAML = "a: " + "[" * 20_000 + "]" * 20_000 + "\n"


def test_20_deep_nesting_is_one_line(run, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text(DEEP_JSON)
    result = cli("compare", str(deep), str(deep))
    no_traceback(result)
    assert "nests deeper" in result.output
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n" + DEEP_JSON + "\n{}\n")
    no_traceback(cli("report", str(run)))
    (run / "config.yaml").write_text(DEEP_YAML)
    no_traceback(cli("report", str(run)))
    config = tmp_path / "deep.yaml"
    config.write_text(DEEP_YAML)
    result = cli("train", "-c", str(config))
    no_traceback(result)
    assert "nests deeper" in result.output


# --------------------------------------------------------------------------- 24. garbage weights


def test_24_garbage_weights_with_their_hash_recorded_are_one_line_on_resume(run):
    ckpt = run / "checkpoint-2"
    weights = ckpt / "model.safetensors"
    weights.write_bytes(os.urandom(weights.stat().st_size))
    state = json.loads((ckpt / STATE_FILE).read_text())
    state["sha256"] = {k: v for k, v in file_hashes(ckpt).items() if k != STATE_FILE}
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    (run / "model").rename(run / "model-gone")  # the final model is not what a resume reads
    result = cli("train", "--resume", str(run), "--trust-run-code", "optim.max_steps=3")
    no_traceback(result)
    assert "model.safetensors" in result.output


# ------------------------------------------------------------------------------ 29. data files


def test_29_a_jsonl_whose_first_line_is_an_array_names_the_file_and_line(tmp_path, gsm8k_dir):
    data = tmp_path / "rows.jsonl"
    data.write_text('[1, 2]\n{"question": "q", "answer": "1"}\n')
    result = cli("eval", "--model", "m", "--data", str(data))
    no_traceback(result)
    assert f"{data}:1" in result.output and "not a JSON object" in result.output


# ----------------------------------------------------------------------------- the one I/O module


# Files that open, copy, move or delete outside run-directory I/O, each for a reason.
ALLOWED = {
    "cli.py": "reads the accelerate config templates shipped inside the package",
    "cpu/onednn.py": "its speed-up cache in the user's cache directory, not a run",
    "engines/vllm.py": "the LoRA adapters vLLM loads, each its own folder in a private (0700) temp folder or "
    "the server's weights folder",
    "engines/vllm_client.py": "its weight-transfer folder in the system temp directory, created with O_EXCL",
    "engines/vllm_server.py": "the server's own weights folder, made private (0700) by itself",
    "models/load.py": "the GGUF conversion cache, and files inside a save folder just made by the caller",
    "data/sources.py": "reads the user's data files (rows are validated one by one)",
    "commands/plan.py": "reads a model's config.json the user names",
    "commands/trl_api.py": "TRL's save_model copies into the folder the caller names, as TRL does",
    "train/distributed.py": "reads /proc for the launcher's command line",
}
DIRECT_IO = re.compile(
    r"(?<![\w.])(?<!def )open\(|\.open\(\s*[\"']|shutil\.(?!copyfileobj)|"
    r"os\.(open|replace|rename|unlink|remove|rmdir|mkdir)\(|"
    r"\.(write_text|write_bytes|read_text|read_bytes|unlink|rmdir|rename|mkdir)\("
)


def direct_io(root: Path, allowed: tuple[str, ...] = ("run/rundir.py", *ALLOWED)) -> list[str]:
    """'path:line: code' of each direct file operation outside the `allowed` files."""
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel in allowed:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            code = line.split("#")[0]
            if DIRECT_IO.search(code) and "Path(__file__)" not in code:
                found.append(f"{rel}:{number}: {line.strip()}")
    return found


def test_only_the_rundir_module_touches_run_directories():
    assert direct_io(SRC) == []
    stale = [rel for rel in ALLOWED if not any(h.startswith(f"{rel}:") for h in direct_io(SRC, ()))]
    assert not stale, f"allowed, but no longer opening, moving or deleting files: {stale}"


def test_direct_io_finds_one(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "rundir.py").write_text("open('x')\n")
    (tmp_path / "m.py").write_text("import shutil\nshutil.rmtree(p)\nwith open(p) as f:\n    pass\n")
    assert direct_io(tmp_path) == ["m.py:2: shutil.rmtree(p)", "m.py:3: with open(p) as f:"]
