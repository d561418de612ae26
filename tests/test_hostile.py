"""Issue 40's hostile cases, one test each (the item number in the name): code-execution markers that must
never appear, md5s of the user's files before and after, signal exit codes, and never a traceback. One
tiny trained run is shared by the module; cases copy it before changing it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_e2e import PYTHONPATH, write_config

from leangrpo.cli import main
from leangrpo.config.schema import ConfigError
from leangrpo.core.errors import UserError
from leangrpo.run.checkpoint import (
    STATE_FILE,
    CheckpointError,
    last_good_checkpoint,
    load_trainable,
    resume_checkpoint,
    truncate_log,
)
from leangrpo.run.resolve import load_config
from leangrpo.run.rundir import MANIFEST, REPLACED, RunDirError, start_run
from leangrpo.run.trust import UntrustedCodeError, resume_config

EVIL = {"name": "os:system", "kwargs": {"command": "touch PWNED"}}


def md5s(root: Path) -> dict[str, str]:
    """Every file's md5 but the run lock's (it holds the PID of the last process to take it)."""
    files = (p for p in root.rglob("*") if p.is_file() and p.name != ".leangrpo.lock")
    return {str(p.relative_to(root)): hashlib.md5(p.read_bytes()).hexdigest() for p in files}


def cli(*args: str, **kwargs):
    return CliRunner().invoke(main, list(args), **kwargs)


def no_traceback(result, code: int = 2) -> None:
    output = result.output + (result.stderr if hasattr(result, "stderr") else "")
    assert result.exit_code == code and "Traceback" not in output, output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)


def cli_proc(*args: str, cwd: Path, extra_path: str = "", **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{PYTHONPATH}{os.pathsep + extra_path if extra_path else ''}"}
    return subprocess.Popen(
        [sys.executable, "-m", "leangrpo", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, **kwargs,
    )  # fmt: skip


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_model_dir, gsm8k_dir) -> Path:
    """A 2-step run, checkpointed at each step, with an evaluation at the start and the end."""
    root = tmp_path_factory.mktemp("hostile")
    small = {
        "optim": {"max_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        "grpo": {"num_generations": 4},
        "logging": {"save_steps": 1, "progress_bar": False},
        "eval": {"enabled": True, "path": str(gsm8k_dir), "limit": 2},
    }
    cfg = write_config(root / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", root / "run", **small)
    result = cli("train", "-c", str(cfg))
    assert result.exit_code == 0, result.output
    return root / "run"


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """A copy of the shared run, to change."""
    return Path(shutil.copytree(trained, tmp_path / "run"))


def plant(config: Path, rewards: list[dict]) -> None:
    """Make a run's (or export's) config name `rewards`."""
    data = yaml.safe_load(config.read_text())
    data["rewards"]["functions"] = rewards
    config.write_text(yaml.safe_dump(data))


# ------------------------------------------------------------------------------- 1-3. trust boundary


@pytest.mark.slow
def test_1_2_eval_of_a_run_or_export_never_runs_what_its_config_names(run, tmp_path, gsm8k_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exported = tmp_path / "export"
    assert cli("export", str(run), "--out", str(exported)).exit_code == 0
    info = json.loads((exported / "leangrpo_export.json").read_text())
    reward_model = {"name": str(run / "model"), "kwargs": {"trust_remote_code": True}}
    info["config"]["rewards"]["functions"] = [EVIL, reward_model]
    (exported / "leangrpo_export.json").write_text(json.dumps(info))
    plant(run / "config.yaml", [EVIL, reward_model])
    for args in (["--model", str(run)], ["--model", str(run), "-c", str(run)], ["--model", str(exported)]):
        out = tmp_path / "e.json"
        result = cli("eval", *args, "--data", str(gsm8k_dir), "--limit", "1", "--out", str(out))
        assert result.exit_code == 0, result.output
        assert not (tmp_path / "PWNED").exists()
        assert "accuracy" in json.loads(out.read_text())["metrics"]  # scored without any reward code


def test_1_resume_asks_for_the_grant(run, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plant(run / "config.yaml", [EVIL])
    with pytest.raises(UntrustedCodeError, match="os:system.*--trust-run-code"):
        resume_config(None, [], str(run))
    no_traceback(cli("train", "--resume", str(run)))
    assert not (tmp_path / "PWNED").exists()
    assert resume_config(None, [], str(run), trust_run_code=True).rewards.functions[0].name == "os:system"
    # the user's own choice on the command line is theirs to make
    assert resume_config(None, ["rewards.functions=[{name: correctness}]"], str(run))


def test_1_eval_refuses_the_tools_a_run_names(run, tmp_path, gsm8k_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = yaml.safe_load((run / "config.yaml").read_text())
    (run / "config.yaml").write_text(yaml.safe_dump({**data, "tools": {"functions": ["os:system"]}}))
    result = cli("eval", "--model", str(run), "--data", str(gsm8k_dir), "--limit", "1", "--out", "e.json")
    no_traceback(result)
    assert "os:system" in result.output and "--trust-run-code" in result.output


def test_3_the_current_directory_is_never_on_the_import_path(run, gsm8k_dir):
    """`cd RUN; python -m leangrpo eval --model .` with an `evil.py` (and a `click.py`) there: even granted,
    `evil:reward` is not found and nothing in the directory runs. The user's own modules, on their
    PYTHONPATH, still import (the shared run's `toy_rewards`)."""
    (run / "evil.py").write_text(
        "import pathlib\npathlib.Path('PWNED').touch()\ndef reward(**kw): return []\n"
    )
    (run / "click.py").write_text("import pathlib\npathlib.Path('PWNED').touch()\n")
    plant(run / "config.yaml", [{"name": "evil:reward"}])
    proc = cli_proc("eval", "--model", ".", "--trust-run-code", "--data", str(gsm8k_dir), cwd=run)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "cannot import module 'evil'" in output and "Traceback" not in output, (
        output
    )
    assert not (run / "PWNED").exists()


def test_3_a_users_own_config_finds_modules_beside_them(run, tmp_path, gsm8k_dir):
    """The other side of test 3: `eval -c MINE.yaml` naming `mine:reward`, with mine.py in the current
    directory (as `trl grpo` finds rewards), imports it."""
    (tmp_path / "mine.py").write_text(
        "def reward(completions, **kw):\n    return [0.25] * len(completions)\n"
    )
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["rewards"]["functions"] = [{"name": "mine:reward"}]
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(cfg))
    args = [
        "--model",
        str(run),
        "-c",
        "mine.yaml",
        "--data",
        str(gsm8k_dir),
        "--limit",
        "1",
        "--out",
        "e.json",
    ]
    proc = cli_proc("eval", *args, cwd=tmp_path)
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output
    assert json.loads((tmp_path / "e.json").read_text())["metrics"]["rewards/reward/mean"] == 0.25


# ------------------------------------------------------------------------------- 4-7. --overwrite


def test_4_overwrite_never_touches_a_project_that_is_not_a_run(trained, tmp_path):
    project = tmp_path / "project"
    (project / "eval").mkdir(parents=True)
    (project / "model").mkdir()
    (project / "eval" / "harness.py").write_text("print('mine')")
    (project / "model" / "README.md").write_text("mine")
    (project / "report.html").write_text("<p>mine</p>")
    cfg = yaml.safe_load((trained / "config.yaml").read_text())
    (project / "config.yaml").write_text(yaml.safe_dump({**cfg, "output_dir": "."}))
    before = md5s(project)
    result = subprocess.run(
        [sys.executable, "-m", "leangrpo", "train", "-c", "config.yaml", "--overwrite"], cwd=project,
        env={**os.environ, "PYTHONPATH": PYTHONPATH}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert md5s(project) == before


def test_5_overwrite_moves_only_the_runs_own_paths(run):
    (run / "eval" / "my_eval_script.py").write_text("print('mine')")
    (run / "notes.txt").write_text("mine")
    mine = {k: v for k, v in md5s(run).items() if k in ("eval/my_eval_script.py", "notes.txt")}
    start_run(run, overwrite=True, base="m")
    assert {k: v for k, v in md5s(run).items() if k in mine} == mine
    assert not (run / "checkpoint-1").exists() and (run / REPLACED / "checkpoint-1").is_dir()
    assert (run / REPLACED / "eval" / "step-2.json").is_file()


def test_6_demo_refuses_a_directory_that_is_not_a_run(tmp_path):
    out = tmp_path / "plots"
    out.mkdir()
    for name in ("correctness_curve.png", "format_curve.png"):
        (out / name).write_bytes(b"my own plot")
    before = md5s(out)
    result = cli(
        "demo", "--output-dir", str(out), "--max-steps", "1", "--sft-steps", "0", "--eval-limit", "3"
    )
    no_traceback(result)
    assert "not a leangrpo run" in result.output and md5s(out) == before


@pytest.mark.slow
def test_7_a_replacement_failing_at_step_1_restores_the_run(run, tmp_path, tiny_model_dir, gsm8k_dir):
    before = md5s(run)
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["rewards"]["functions"] = [{"name": "failing_rewards:always_raises"}]
    cfg["output_dir"], cfg["eval"]["enabled"] = str(run), False
    (tmp_path / "again.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "failing_rewards.py").write_text("def always_raises(**kw):\n    raise ValueError('no')\n")
    proc = cli_proc(
        "train", "-c", str(tmp_path / "again.yaml"), "--overwrite", cwd=tmp_path, extra_path=str(tmp_path)
    )
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2 and "Traceback" not in output, output
    assert "always_raises" in output and md5s(run) == before  # the finished run, back in place


def test_7_resume_after_a_failed_replacement_names_the_replaced_run(run):
    start_run(run, overwrite=True, base="m")
    shutil.copy(run / REPLACED / "config.yaml", run / "config.yaml")  # ...died before its first step
    with pytest.raises(CheckpointError, match=f"{REPLACED}.*restore") as caught:
        resume_checkpoint(run)
    assert "--overwrite" not in str(caught.value)


# ------------------------------------------------------------------------------- 8-9. signals

HANG = """
import pathlib, threading
calls = []
def hang_at_step_2(prompts, completions, **kw):
    calls.append(1)
    if len(calls) == 2:
        pathlib.Path("HANGING").touch()
        threading.Event().wait()
    return [0.5] * len(completions)
"""


@pytest.mark.slow
def test_8_one_sigterm_stops_a_run_whose_reward_hangs(tmp_path, trained):
    (tmp_path / "hang.py").write_text(HANG)
    cfg = yaml.safe_load((trained / "config.yaml").read_text())
    cfg["rewards"] = {"functions": [{"name": "hang:hang_at_step_2"}], "timeout_s": None}
    cfg["logging"]["save_steps"], cfg["eval"]["enabled"] = 0, False
    cfg["output_dir"] = str(tmp_path / "out")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    proc = cli_proc("train", "-c", "c.yaml", cwd=tmp_path, extra_path=str(tmp_path))
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "HANGING").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()  # a run that did not stop
    assert proc.returncode == 143 and "Traceback" not in output, output
    assert "resume from step 1" in output and (tmp_path / "out" / "checkpoint-1").is_dir()


STOP = """
import os, signal, time
from leangrpo.run.signals import StopSignals
with StopSignals():
    os.kill(os.getpid(), signal.{0})
    time.sleep(0.1)
    try:
        os.kill(os.getpid(), signal.{0})  # inside a library that catches every exception
        time.sleep(5)
    except BaseException:
        pass
print("survived")
"""


@pytest.mark.parametrize(("name", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_9_a_second_signal_exits_128_plus_its_number(name, code):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run([sys.executable, "-c", STOP.format(name)], env=env, capture_output=True, text=True)
    assert proc.returncode == code and "survived" not in proc.stdout and "Traceback" not in proc.stderr


# --------------------------------------------------------------------- 10-16. one line, rc 2


@pytest.mark.parametrize("seed", ["-1", str(2**32)])
def test_10_seeds_out_of_range(seed, tmp_path):
    with pytest.raises(ConfigError, match="seed"):
        load_config(None, ["model.name_or_path=m", "data.path=d.jsonl", f"seed={seed}"])
    no_traceback(cli("demo", "--seed", seed, "--output-dir", str(tmp_path / "d")))


def test_11_23_chat_refuses_text_that_is_not_utf8_and_a_nan_temperature(tiny_model_dir):
    no_traceback(cli("chat", str(tiny_model_dir), "caf\udce9"))
    no_traceback(cli("chat", str(tiny_model_dir), "--temperature", "nan", "hi"))
    result = CliRunner().invoke(main, ["chat", str(tiny_model_dir)], input=b"caf\xe9\n")
    no_traceback(result)
    assert "stdin is not UTF-8" in result.output


def test_12_report_on_a_read_only_run_is_one_line(run, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    monkeypatch.setattr(Path, "unlink", refuse)
    result = cli("report", str(run))
    no_traceback(result)
    assert "Permission denied" in result.output


def test_13_a_checkpoint_without_its_trainable_weights_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("leangrpo.models.load.is_peft", lambda model: True)
    with pytest.raises(CheckpointError, match="adapter_model.safetensors is missing"):
        load_trainable(torch.nn.Linear(2, 2), tmp_path)
    monkeypatch.setattr("leangrpo.models.load.is_peft", lambda model: False)
    with pytest.raises(CheckpointError, match="no trainable weights"):
        load_trainable(torch.nn.Linear(2, 2), tmp_path)


def test_14_15_compare_and_report_take_records_and_rows_with_fields_missing(run):
    records = run / "eval" / "step-2.jsonl"
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    records.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "gold"}) + "\n" for r in rows))
    no_traceback(cli("compare", str(run / "eval" / "step-0.json"), str(run / "eval" / "step-2.json")), 0)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    metrics[0].pop("step")
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    no_traceback(cli("report", str(run)), 0)


def test_16_plan_of_a_model_with_no_attention_heads(tiny_model_dir, tmp_path):
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 0}))
    result = cli("plan", "--model", str(model), "--gpu-memory", "24GB")
    no_traceback(result)
    assert "num_attention_heads" in result.output


# ------------------------------------------------------------------------------------ 17-23. minor


def test_17_a_full_disk_at_resume_names_the_file_and_leaves_no_tmp(run, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(RunDirError, match="metrics.jsonl: No space left on device"):
        truncate_log(run / "metrics.jsonl", 1)
    assert not any(p.name.endswith(".tmp") for p in run.iterdir())


def test_18_an_incomplete_newest_checkpoint_is_named(run, caplog):
    (run / "checkpoint-2" / "adapter_model.safetensors").unlink(missing_ok=True)
    for weights in (run / "checkpoint-2").glob("*.safetensors"):
        weights.unlink()
    with caplog.at_level(logging.WARNING):
        assert last_good_checkpoint(run) == run / "checkpoint-1"
    assert "checkpoint-2 is incomplete" in caplog.text
    assert json.loads((run / "checkpoint-1" / STATE_FILE).read_text())["step"] == 1


def test_19_a_trl_config_takes_one_reward_name(tmp_path, gsm8k_dir):
    base = {"model_name_or_path": "m", "dataset_name": str(gsm8k_dir / "train.jsonl")}
    (tmp_path / "trl.yaml").write_text(yaml.safe_dump({**base, "reward_funcs": "xmlcount"}))
    assert [s.name for s in load_config(tmp_path / "trl.yaml").rewards.functions] == ["xmlcount"]
    (tmp_path / "bad.yaml").write_text(
        yaml.safe_dump({**base, "reward_funcs": "xmlcount", "reward_weights": "abc"})
    )
    with pytest.raises(UserError, match="reward_weights=.abc.: must be a list"):
        load_config(tmp_path / "bad.yaml")


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        (
            "grpo.generation_kwargs={no_such_field: 1}",
            "no_such_field: not a transformers GenerationConfig field",
        ),
        ("grpo.generation_kwargs={early_stopping: abc}", "early_stopping"),
        ("optim.learning_rate=true", "a number is needed, not true/false"),
    ],
)
def test_20_21_bad_generation_kwargs_and_booleans_as_numbers(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(None, ["model.name_or_path=m", "data.path=d.jsonl", override])


def test_22_output_dir_expands_the_home_directory():
    cfg = load_config(None, ["model.name_or_path=m", "data.path=d.jsonl", "output_dir=~/x"])
    assert cfg.output_dir == str(Path.home() / "x")


def test_a_run_records_what_it_wrote(trained):
    listed = set((trained / MANIFEST).read_text().splitlines())
    assert {
        "config.yaml",
        "metrics.jsonl",
        "checkpoint-1",
        "checkpoint-2",
        "model",
        "eval/step-2.json",
    } <= listed
