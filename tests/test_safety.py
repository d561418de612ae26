"""Fault injection: nothing the user wrote is lost, whatever they or the machine do (issue 18).

Each test names the fault it injects; the run-directory rules are tested on the functions themselves,
and through the CLI where the order of validation, loading and writing is what matters."""

from __future__ import annotations

import errno
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_e2e import write_config

from leangrpo.cli import main
from leangrpo.config.schema import ConfigError
from leangrpo.data.rewards import RewardError, score_completions
from leangrpo.run.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    is_complete,
    load_rank_state,
    save_checkpoint,
    save_final_model,
)
from leangrpo.run.resolve import load_config, save_config, validate_config
from leangrpo.run.rundir import (
    MANIFEST,
    REPLACED,
    RunDirError,
    RunLock,
    check_output_dir,
    claim,
    drop_replaced,
    start_run,
)
from leangrpo.run.tracking import MetricsLogger
from leangrpo.run.trust import UntrustedCodeError, resume_config
from leangrpo.train.trainer import Trainer


def minimal_cfg(out: Path):
    rewards = {"functions": [{"name": "correctness"}]}
    return validate_config(
        {
            "model": {"name_or_path": "m"},
            "data": {"path": "d.jsonl"},
            "output_dir": str(out),
            "rewards": rewards,
        }
    )


def fake_run(run_dir: Path, steps: tuple[int, ...] = (2,)) -> Path:
    """A finished-looking run on disk: config, metrics, a final model and checkpoints (no weights)."""
    (run_dir / "model").mkdir(parents=True)
    (run_dir / "model" / "config.json").write_text("{}")
    save_config(minimal_cfg(run_dir), run_dir / "config.yaml")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n')
    (run_dir / "reward_curve.png").write_text("png")
    for step in steps:
        (run_dir / f"checkpoint-{step}").mkdir()
    names = ["model", "config.yaml", "metrics.jsonl", "reward_curve.png", *(f"checkpoint-{s}" for s in steps)]
    (run_dir / MANIFEST).write_text("".join(f"{n}\n" for n in names))
    return run_dir


def train_cli(*args: str):
    return CliRunner().invoke(main, ["train", *args])


def one_line_error(result, *needles: str) -> None:
    """Exit code 2 and one `error:` line holding every needle (progress bars of model loading aside)."""
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "Traceback" not in result.output, result.output
    for needle in needles:
        assert needle in errors[0], errors[0]


# ----------------------------------------------------------------------- 1. --overwrite and demo


def test_overwrite_of_a_non_run_refuses_and_keeps_the_users_files(tmp_path, tiny_model_dir, gsm8k_dir):
    """The issue's reproduction: `d/model/my_weights.bin` and `d/config.yaml`, then --overwrite into d."""
    out = tmp_path / "d"
    (out / "model").mkdir(parents=True)
    (out / "model" / "my_weights.bin").write_text("w")
    (out / "config.yaml").write_text("c")
    (out / "notes.txt").write_text("n")
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", out)
    one_line_error(train_cli("-c", str(cfg), "--overwrite"), "config.yaml", "model", "never replaces")
    assert (out / "model" / "my_weights.bin").read_text() == "w"
    assert (out / "config.yaml").read_text() == "c" and (out / "notes.txt").read_text() == "n"


@pytest.mark.parametrize(
    "override", ["data.path=/nonexistent.jsonl", "rewards.functions=[{name: no_such_reward}]",
                 "model.name_or_path=/no/such/model"],
)  # fmt: skip
def test_overwrite_with_a_bad_input_leaves_the_earlier_run(tmp_path, tiny_model_dir, gsm8k_dir, override):
    run = fake_run(tmp_path / "run")
    before = sorted(p.relative_to(run) for p in run.rglob("*"))
    cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", run)
    result = train_cli("-c", str(cfg), "--overwrite", override)
    assert result.exit_code == 2, result.output
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before


def test_replacing_a_run_moves_only_its_own_entries_aside_until_the_new_one_starts(tmp_path):
    run = fake_run(tmp_path / "run", steps=(2, 4))
    (run / "notes.txt").write_text("mine")
    (run / "my_plot.png").write_text("mine")
    assert start_run(run, overwrite=True, base="some/hub-id") == "some/hub-id"
    assert sorted(p.name for p in run.iterdir()) == [MANIFEST, REPLACED, "my_plot.png", "notes.txt"]
    aside = run / REPLACED
    assert {p.name for p in aside.iterdir()} == {
        "checkpoint-2", "checkpoint-4", "config.yaml", "metrics.jsonl", "model", "reward_curve.png", MANIFEST,
    }  # fmt: skip
    # A replacing run that dies before its first step: the next --overwrite deletes its files and keeps
    # the earlier run aside, untouched.
    (run / "config.yaml").write_text((aside / "config.yaml").read_text())
    (run / "metrics.jsonl").write_text("")
    claim(run, "metrics.jsonl")
    start_run(run, overwrite=True, base="some/hub-id")
    assert sorted(p.name for p in run.iterdir()) == [MANIFEST, REPLACED, "my_plot.png", "notes.txt"]
    assert (aside / "model" / "config.json").is_file()
    drop_replaced(run)
    assert sorted(p.name for p in run.iterdir()) == [MANIFEST, "my_plot.png", "notes.txt"]


def test_a_non_run_directory_is_written_into_only_when_nothing_clashes(tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match="not a leangrpo run"):
        check_output_dir(other, overwrite=False)
    (other / "checkpoint-5").mkdir()  # another trainer's checkpoint
    with pytest.raises(RunDirError, match="checkpoint-5"):
        check_output_dir(other, overwrite=True)
    (other / "checkpoint-5").rmdir()
    assert start_run(other, overwrite=True, base="m") == "m"
    assert (other / "notes.txt").read_text() == "mine"
    (other / "checkpoint-5").mkdir()  # written after the run started: not the run's
    start_run(other, overwrite=True, base="m")
    assert (other / "notes.txt").read_text() == "mine" and (other / "checkpoint-5").is_dir()


def test_train_from_the_runs_own_model_into_the_run_with_overwrite(tmp_path, tiny_model_dir, gsm8k_dir):
    """`train model.name_or_path=runs/x/model output_dir=runs/x --overwrite`: the model loads before the
    run is replaced, and is kept as the new run's base-model/, which its config records."""
    run = tmp_path / "x"
    fake_run(run)
    shutil.rmtree(run / "model")
    shutil.copytree(tiny_model_dir, run / "model")
    (run / "notes.txt").write_text("mine")
    cfg = write_config(
        tmp_path / "c.yaml", run / "model", gsm8k_dir / "train.jsonl", run,
        optim={"max_steps": 1, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        grpo={"num_generations": 4},
    )  # fmt: skip
    result = train_cli("-c", str(cfg), "--overwrite")
    assert result.exit_code == 0, result.output
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["model"]["name_or_path"] == str(run / "base-model")
    assert (run / "base-model" / "model.safetensors").is_file() and (run / "model" / "config.json").is_file()
    assert not (run / REPLACED).exists() and not (run / "checkpoint-2").exists()
    assert (run / "notes.txt").read_text() == "mine"


# ------------------------------------------------------------------------ 2. one process per run


def test_a_second_process_on_a_run_directory_stops_in_one_line(tmp_path, tiny_model_dir, gsm8k_dir):
    run = fake_run(tmp_path / "run")
    lock = RunLock(run)  # another training process, as far as the CLI can tell
    try:
        cfg = write_config(tmp_path / "c.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", run)
        result = train_cli("-c", str(cfg), "--overwrite", "optim.max_steps=1")
        one_line_error(result, "in use", f"PID {os.getpid()}")
        assert (run / "checkpoint-2").is_dir() and (run / "model" / "config.json").is_file()
    finally:
        lock.release()
    RunLock(run).release()  # free again once the holder lets go


# --------------------------------------------------------------------- 3. checkpoints by default


def tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, out: Path, **sections) -> Path:
    """The fewest, smallest steps; logging left at its defaults unless given."""
    small = {"optim": {"max_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
             "grpo": {"num_generations": 4}}  # fmt: skip
    for section, values in sections.items():
        small[section] = {**small.get(section, {}), **values}
    data = gsm8k_dir / "train.jsonl"
    return write_config(tmp_path / f"{out.name}.yaml", tiny_model_dir, data, out, **small)


def steps_logged(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_default_run_checkpoints_and_can_be_extended(tmp_path, tiny_model_dir, gsm8k_dir):
    """The README's `--resume runs/x optim.max_steps=N` on a run with the default logging section."""
    run = tmp_path / "x"
    assert train_cli("-c", str(tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run))).exit_code == 0
    assert [p.name for p in checkpoint_dirs(run)] == ["checkpoint-2"]  # the last step, by default
    result = train_cli("--resume", str(run), "--trust-run-code", "optim.max_steps=3")
    assert result.exit_code == 0, result.output
    assert steps_logged(run) == [1, 2, 3]


def test_save_minutes_checkpoints_by_time(tmp_path, tiny_model_dir, gsm8k_dir):
    run = tmp_path / "timed"
    logging = {"save_steps": 0, "save_minutes": 1e-9, "save_total_limit": None}
    cfg = tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run, logging=logging)
    assert train_cli("-c", str(cfg)).exit_code == 0
    assert [p.name for p in checkpoint_dirs(run)] == ["checkpoint-1", "checkpoint-2"]


def test_resume_completes_a_final_save_the_run_died_in(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    """A kill after the last checkpoint and before `model/` is complete: --resume writes the final model."""
    run = tmp_path / "x"
    cfg = tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run)

    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # stands in for the kill: the process ends mid-save

    with monkeypatch.context() as patch:
        patch.setattr("leangrpo.train.trainer.save_final_model", killed)
        with pytest.raises(KeyboardInterrupt):
            Trainer(load_config(str(cfg))).train()
    assert is_complete(run / "checkpoint-2") and not (run / "model").exists()
    result = train_cli("--resume", str(run), "--trust-run-code")
    assert result.exit_code == 0 and "final model was never saved" in result.output, result.output
    assert (run / "model" / "model.safetensors").is_file()
    assert steps_logged(run) == [1, 2]


# ------------------------------------------------------------------------------ 4. a full disk


@contextmanager
def file_size_limit(nbytes: int):
    """Writes past `nbytes` fail with EFBIG, as they would on a full disk (SIGXFSZ ignored meanwhile)."""
    import resource
    import signal

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


class _Writes:
    """A model or tokenizer whose save_pretrained writes `size` float32 zeros as safetensors."""

    def __init__(self, name: str, size: int):
        self.name, self.size = name, size

    def save_pretrained(self, out: Path) -> None:
        from safetensors.torch import save_file

        save_file({"w": torch.zeros(self.size)}, str(Path(out) / self.name))


def save_small_checkpoint(run_dir: Path, step: int, optimizer_floats: int = 4) -> Path:
    cfg = minimal_cfg(run_dir)
    sched = torch.optim.lr_scheduler.LambdaLR(
        torch.optim.SGD([torch.nn.Parameter(torch.ones(1))]), lambda s: 1
    )
    return save_checkpoint(
        run_dir, step, model=_Writes("adapter_model.safetensors", 4), tokenizer=_Writes("tok.safetensors", 4),
        optimizer_state={"state": {0: {"exp_avg": torch.zeros(optimizer_floats)}}}, scheduler=sched, cfg=cfg,
        state={"world_size": 1, "skipped_steps": 0, "nonfinite_in_a_row": 0}, rank=0, barrier=lambda: None,
    )  # fmt: skip


def test_disk_full_in_torch_save_is_one_line_naming_the_os_reason_and_the_last_checkpoint(tmp_path):
    save_small_checkpoint(tmp_path, 2)
    with file_size_limit(64 * 1024), pytest.raises(CheckpointError) as caught:
        save_small_checkpoint(tmp_path, 4, optimizer_floats=100_000)  # optimizer.pt: 400 kB
    assert "File too large (errno 27)" in str(caught.value) and "checkpoint-2, is intact" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]  # no .checkpoint-4.tmp


def test_disk_full_in_safetensors_is_one_line_and_leaves_no_partial_model(tmp_path):
    save_small_checkpoint(tmp_path, 2)
    with file_size_limit(64 * 1024), pytest.raises(CheckpointError) as caught:
        save_final_model(
            _Writes("model.safetensors", 100_000), _Writes("tok.safetensors", 4), tmp_path / "model", "base"
        )
    assert "File too large" in str(caught.value) and "checkpoint-2, is intact" in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_disk_full_at_start_leaves_no_partial_config(tmp_path):
    with file_size_limit(10), pytest.raises(RunDirError, match=r"config.yaml: File too large \(errno 27\)"):
        save_config(minimal_cfg(tmp_path), tmp_path / "config.yaml")
    assert list(tmp_path.iterdir()) == []


def test_report_that_cannot_be_written_is_one_line(tmp_path):
    run = fake_run(tmp_path / "run")
    (run / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n{"step": 2, "reward": 0.7}\n')
    (run / "reward_curve.png").unlink()
    with file_size_limit(0):
        result = CliRunner().invoke(main, ["report", str(run)])
    one_line_error(result, "reward_curve.png", "errno 27")
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]


def test_a_write_failing_mid_run_stops_in_one_line_naming_the_last_checkpoint(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch
):
    real_log = MetricsLogger.log

    def log(self, metrics):
        if metrics["step"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.metrics_path))
        real_log(self, metrics)

    monkeypatch.setattr(MetricsLogger, "log", log)
    run = tmp_path / "x"
    cfg = tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run, logging={"save_steps": 1})
    one_line_error(train_cli("-c", str(cfg)), "No space left on device (errno 28)", "checkpoint-1, is intact")


# ----------------------------------------------------------- 5. integrity, and no code from artifacts


def flip_a_byte(path: Path) -> None:
    """Same-size corruption: one byte in the middle of the file changes."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_checkpoint_is_named_and_the_previous_one_used(tmp_path, tiny_model_dir, gsm8k_dir, caplog):
    run = tmp_path / "x"
    cfg = tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run, logging={"save_steps": 1})
    assert train_cli("-c", str(cfg)).exit_code == 0
    flip_a_byte(run / "checkpoint-2" / "model.safetensors")
    flip_a_byte(run / "model" / "model.safetensors")
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "out")])
    one_line_error(result, "model.safetensors is corrupt")
    result = train_cli("--resume", str(run), "--trust-run-code", "optim.max_steps=3")
    assert result.exit_code == 0, result.output
    assert "checkpoint-2/model.safetensors is corrupt" in caplog.text  # a warning on stderr
    assert f"resuming from {run / 'checkpoint-1'} at step 1" in result.output
    assert steps_logged(run) == [1, 2, 3]


def test_a_crafted_checkpoint_file_cannot_run_code(tmp_path):
    ckpt = save_small_checkpoint(tmp_path, 2)
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save(Payload(), ckpt / "scheduler.pt")
    with pytest.raises(CheckpointError, match="cannot read .*scheduler.pt"):
        load_rank_state(ckpt, 0)
    assert not marker.exists()
    (ckpt / "optimizer.pt").write_bytes(b"garbage")  # and garbage is one line too
    with pytest.raises(CheckpointError, match="cannot read .*optimizer.pt"):
        load_rank_state(ckpt, 0)


def test_a_run_directory_cannot_grant_itself_remote_code(tmp_path):
    run = fake_run(tmp_path / "run")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["model"]["trust_remote_code"] = True
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(UntrustedCodeError, match="cannot grant itself"):
        resume_config(None, [], str(run))
    assert resume_config(None, [], str(run), trust_run_code=True).model.trust_remote_code
    assert resume_config(None, ["model.trust_remote_code=true"], str(run)).model.trust_remote_code


# ------------------------------------------------------------ 6. one line, or sane, for the rest


def test_non_finite_learning_rate_is_refused(tmp_path):
    for bad in (".inf", ".nan", "-.inf"):
        with pytest.raises(ConfigError, match="optim.learning_rate"):
            load_config(None, ["model.name_or_path=m", "data.path=d", f"optim.learning_rate={bad}"])


def test_binary_config_file_is_one_line(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00")
    one_line_error(train_cli("-c", str(path)), "is not YAML text", str(path))


def test_non_finite_weights_are_never_saved(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    real_step = Trainer.step

    def step(self, n):
        metrics = real_step(self, n)
        with torch.no_grad():
            next(self.policy.parameters()).fill_(float("nan"))  # as an infinite learning rate would
        return metrics

    monkeypatch.setattr(Trainer, "step", step)
    run = tmp_path / "x"
    result = train_cli("-c", str(tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run)))
    one_line_error(result, "NaN or inf", "checkpoint-2 is not saved")
    assert not (run / "model").exists() and not checkpoint_dirs(run, complete=False)


@pytest.mark.parametrize("args", [["-G", "0"], ["-G", "-4"], ["--batch", "0"], ["--lora-r", "-3"],
                                  ["--margin", "1.5"]])  # fmt: skip
def test_plan_refuses_nonsense(args):
    result = CliRunner().invoke(main, ["plan", "--model", "m", "--gpu-memory", "24GB", *args])
    assert result.exit_code == 2 and "Invalid value" in result.output and "Traceback" not in result.output


def test_eval_checks_split_and_output_before_loading_the_model(tmp_path, gsm8k_dir, monkeypatch):
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the output was checked")

    monkeypatch.setattr("leangrpo.run.trained.load_trained", never)
    blocker = tmp_path / "file"
    blocker.write_text("")
    base = ["eval", "--model", "m", "--data", str(gsm8k_dir)]
    one_line_error(CliRunner().invoke(main, [*base, "--split", "../x"]), "is not a split name")
    one_line_error(CliRunner().invoke(main, [*base, "--out", str(blocker / "e.json")]), "cannot write")


@pytest.mark.parametrize("reward", [lambda **kw: [10**400] * len(kw["completions"]),
                                    lambda **kw: __import__("sys").exit(3)])  # fmt: skip
def test_a_misbehaving_reward_is_named_in_one_line(reward):
    with pytest.raises(RewardError, match="reward function 'r'") as caught:
        score_completions([("r", reward, 1.0)], ["p"], ["c"], {}, "raise")
    assert "\n" not in str(caught.value)


def test_a_huge_question_is_abridged_in_the_logs(tmp_path):
    lines: list[str] = []
    logger = MetricsLogger(tmp_path, write=lines.append)
    huge = "x" * 1_000_000
    logger.log_sample({"step": 1, "question": huge, "completion": "c", "extracted": "1", "gold": "1",
                       "rewards": {"r": 1.0}})  # fmt: skip
    assert len((tmp_path / "completions.jsonl").read_text()) < 10_000 and len(lines[0]) < 10_000
    assert "[996000 more characters]" in lines[0]


def test_prompts_longer_than_max_prompt_length_are_counted_once(tmp_path, tiny_model_dir, gsm8k_dir):
    run = tmp_path / "x"
    cfg = tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run, grpo={"max_prompt_length": 128},
                          optim={"max_steps": 1})  # fmt: skip
    result = train_cli("-c", str(cfg))  # 70 to 159 tokens rendered, each question with its header <= 125
    assert result.exit_code == 0, result.output
    assert result.output.count("prompts are longer than grpo.max_prompt_length=128") == 1
    assert " of 64 prompts" in result.output  # write_config limits the data to 64 rows


def test_a_hanging_reward_is_named_after_timeout_s():
    import time

    def stuck(**kw):
        time.sleep(30)

    def fine(**kw):
        return [1.0] * len(kw["completions"])

    start = time.monotonic()
    with pytest.raises(
        RewardError, match="reward function 'stuck' did not return within rewards.timeout_s=0.2s"
    ):
        score_completions([("stuck", stuck, 1.0)], ["p"], ["c"], {}, "raise", timeout_s=0.2)
    scores = score_completions([("stuck", stuck, 1.0), ("fine", fine, 1.0)], ["p", "q"], ["c", "d"], {},
                               "missing", timeout_s=0.2)  # fmt: skip
    assert scores.failed.all() and scores.per_func[:, 1].tolist() == [1.0, 1.0]
    assert time.monotonic() - start < 5
    assert score_completions(
        [("fine", fine, 1.0)], ["p"], ["c"], {}, "raise", timeout_s=5
    ).total.tolist() == [1.0]


def test_export_to_a_full_disk_is_one_line(tmp_path, tiny_model_dir, gsm8k_dir):
    run = tmp_path / "x"
    assert train_cli("-c", str(tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run))).exit_code == 0
    with file_size_limit(64 * 1024):
        result = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / "out")])
    one_line_error(result, "cannot export to", "File too large")
    assert not (tmp_path / "out").exists() and not (tmp_path / ".out.tmp").exists()


def test_a_huge_prompt_is_not_tokenized_whole(real_tokenizer_dir):
    from transformers import AutoTokenizer

    from leangrpo.engines.types import encode_prompts

    tokenizer = AutoTokenizer.from_pretrained(real_tokenizer_dir, padding_side="left", truncation_side="left")
    seen: list[int] = []

    def spy(texts, **kwargs):
        seen.extend(map(len, texts))
        return tokenizer(texts, **kwargs)

    huge = "What is 2 + 2? " * 400_000  # 6 MB
    ids, _ = encode_prompts(spy, [huge], max_prompt_length=32, repeat=1)
    assert max(seen) <= 64 * 32
    assert ids[0].tolist() == tokenizer(huge[-20_000:], add_special_tokens=False).input_ids[-32:]


def test_a_disk_failing_as_the_run_starts_is_one_line(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr("leangrpo.run.session.open_trackers", full)  # the first write after the config
    run = tmp_path / "x"
    one_line_error(
        train_cli("-c", str(tiny_run_config(tmp_path, tiny_model_dir, gsm8k_dir, run))), "errno 28"
    )
