"""Training on the tiny model: exact resume, signals, a real SIGKILL, non-finite steps, reward rejects,
export and chat."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from safetensors.torch import load_file
from test_e2e import PYTHONPATH, TESTS, read_metrics, write_config

from leangrpo.cli import main
from leangrpo.core import grpo
from leangrpo.core.errors import Stopped
from leangrpo.run.checkpoint import checkpoint_dirs, is_complete
from leangrpo.run.resolve import load_config
from leangrpo.train.trainer import Trainer, TrainingError

pytestmark = pytest.mark.slow


def _timing(key: str) -> bool:
    return key in {"tokens_per_s", "step_seconds", "step_time", "peak_memory_mb"} or key.startswith("time/")


def make_config(tmp_path, tiny_model_dir, gsm8k_dir, name: str, **sections) -> Path:
    defaults = {
        "grpo": {"num_generations": 4},
        "optim": {"max_steps": 3, "lr_scheduler_type": "linear", "warmup_ratio": 0.5,
                  "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        "logging": {"save_steps": 2, "log_completions_steps": 1, "progress_bar": False},
    }  # fmt: skip
    sections = {k: {**defaults.get(k, {}), **sections.get(k, {})} for k in defaults.keys() | sections.keys()}
    positional = {k: sections.pop(k, {}) for k in ("model", "data")}  # write_config's own arguments
    path = write_config(
        tmp_path / f"{name}.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / name, **sections
    )
    cfg = yaml.safe_load(path.read_text())
    for key, values in positional.items():
        cfg[key].update(values)
    path.write_text(yaml.safe_dump(cfg))
    return path


def interrupt_after(monkeypatch, stop_step: int) -> None:
    """Send this process a real SIGINT at the end of step `stop_step`."""
    real_step = Trainer.step

    def step(self, step):
        metrics = real_step(self, step)
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGINT)
        return metrics

    monkeypatch.setattr(Trainer, "step", step)


def prompts_seen(tmp_path: Path, name: str) -> list[str]:
    return (tmp_path / name / "prompts-rank0.txt").read_text().splitlines()


@pytest.mark.parametrize(
    "sections",
    [
        {"grpo": {"beta": 0.04, "num_iterations": 2}},  # full fine-tune: the KL reference stays the start
        {"model": {"lora": {"enabled": True, "r": 4, "dropout": 0.1}}, "grpo": {"beta": 0.04}},
        # the extra prompts of dynamic sampling's rounds are drawn again, the same, after a resume
        {
            "grpo": {"dynamic_sampling": True, "max_resample_rounds": 2},
            "rewards": {
                "functions": [
                    {"name": "toy_rewards:vowel_share_some_questions"},
                    {"name": "toy_rewards:record_prompts"},
                ]
            },
        },
        # prompts in the dataset's order, and the adaptive entropy coefficient carried over
        {
            "data": {"shuffle_dataset": False},
            "grpo": {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 100.0},
        },
        # the reference moved before the interruption: the checkpoint keeps it
        {
            "grpo": {
                "beta": 0.04,
                "sync_ref_model": True,
                "ref_model_sync_steps": 1,
                "ref_model_mixup_alpha": 0.5,
            }
        },
        # TRL's generation buffer: checkpoints fall between generations, never inside one's slices
        {
            "grpo": {"beta": 0.04, "steps_per_generation": 4},
            "optim": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2},
        },
        # an optimizer step spanning generations (3 slices, 4 accumulated): checkpoint-2 falls inside one,
        # and keeps its pending gradient and entropy window
        {
            "grpo": {
                "steps_per_generation": 3,
                "use_adaptive_entropy": True,
                "entropy_coef": 0.01,
                "entropy_target": 100.0,
            },
            "optim": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "max_steps": 4},
        },  # fmt: skip
    ],
    ids=[
        "full",
        "lora",
        "dynamic_sampling",
        "in_order_adaptive_entropy",
        "sync_ref_model",
        "generation_buffer",
        "spanning_optimizer_step",
    ],
)
def test_interrupted_and_resumed_run_equals_uninterrupted(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch,
                                                          sections):  # fmt: skip
    sections = {
        "rewards": {
            "functions": [{"name": "toy_rewards:vowel_share"}, {"name": "toy_rewards:record_prompts"}]
        },
        **sections,
    }
    runs = {}
    for name in ("straight", "resumed"):
        runs[name] = load_config(make_config(tmp_path, tiny_model_dir, gsm8k_dir, name, **sections))
        (tmp_path / name).mkdir()
    monkeypatch.setenv("LEANGRPO_TEST_OUT", str(tmp_path / "straight"))
    assert Trainer(runs["straight"], overwrite=True).train() == tmp_path / "straight" / "model"

    monkeypatch.setenv("LEANGRPO_TEST_OUT", str(tmp_path / "resumed"))
    with monkeypatch.context() as m:
        interrupt_after(m, 2)
        with pytest.raises(Stopped) as stopped:  # by the signal, after its checkpoint
            Trainer(runs["resumed"], overwrite=True).train()
        assert stopped.value.exit_code == 130
    assert [p.name for p in checkpoint_dirs(tmp_path / "resumed")] == ["checkpoint-2"]
    trainer = Trainer(runs["resumed"], resume=True)
    assert trainer.start_step == 2
    assert trainer.train() == tmp_path / "resumed" / "model"

    straight, resumed = (
        load_file(tmp_path / n / "model" / "model.safetensors") for n in ("straight", "resumed")
    )
    assert straight.keys() == resumed.keys()
    start = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(straight[k], start[k]) for k in start)  # training changed the weights
    for key in straight:
        torch.testing.assert_close(resumed[key], straight[key], rtol=0, atol=1e-6)

    rows = {n: read_metrics(tmp_path / n) for n in runs}
    steps = runs["straight"].optim.max_steps
    assert [r["step"] for r in rows["resumed"]] == list(range(1, steps + 1))  # appended, nothing duplicated
    for a, b in zip(rows["straight"], rows["resumed"], strict=True):
        assert {k: v for k, v in a.items() if not _timing(k)} == pytest.approx(
            {k: v for k, v in b.items() if not _timing(k)}, abs=1e-6
        )
    assert len({r["learning_rate"] for r in rows["straight"]}) > 1  # the schedule did move
    assert prompts_seen(tmp_path, "straight") == prompts_seen(tmp_path, "resumed")
    if "dynamic_sampling" in sections["grpo"]:  # resampling happened, after the resume too
        assert rows["straight"][2]["dynamic_sampling/rounds"] > 0


def test_resume_refuses_a_changed_config_and_a_finished_run(tmp_path, tiny_model_dir, gsm8k_dir):
    cfg_path = make_config(
        tmp_path, tiny_model_dir, gsm8k_dir, "run", optim={"max_steps": 2}, sft={"steps": 1, "batch_size": 2}
    )
    run, cli = tmp_path / "run", CliRunner()
    result = cli.invoke(main, ["train", "-c", str(cfg_path)])
    assert result.exit_code == 0 and "sft step" in result.output
    result = cli.invoke(
        main, ["train", "--resume", str(run), "--trust-run-code", "optim.learning_rate=0.5", "grpo.beta=0.1"]
    )
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert "differs in grpo.beta (0.0 → 0.1); optim.learning_rate (0.001 → 0.5)" in result.output
    result = cli.invoke(main, ["train", "--resume", str(run), "--trust-run-code"])
    assert result.exit_code == 2 and "raise optim.max_steps" in result.output
    result = cli.invoke(
        main, ["train", "--resume", str(run), "--trust-run-code", "optim.max_steps=3"]
    )  # extend a finished run
    assert result.exit_code == 0, result.output
    assert "sft step" not in result.output  # the cold start belongs to the start of the run only
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


def test_sigkill_during_checkpoint_write_then_sigterm_then_finish(tmp_path, tiny_model_dir, gsm8k_dir):
    cfg_path = make_config(
        tmp_path, tiny_model_dir, gsm8k_dir, "run", optim={"max_steps": 8, "lr_scheduler_type": "constant"}
    )
    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}

    def start(*args, runner=("-m", "leangrpo")):
        return subprocess.Popen(
            [sys.executable, *runner, "train", *args],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def wait_for(condition, proc, timeout=120.0):
        deadline = time.monotonic() + timeout
        while not condition():
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.05)

    # 1. SIGKILL while checkpoint-4 is half written (slow_checkpoint.py sleeps inside each save).
    proc = start("-c", str(cfg_path), runner=(str(TESTS / "slow_checkpoint.py"), "2"))
    partial = run / ".checkpoint-4.tmp"
    wait_for(lambda: (partial / "optimizer.pt").is_file(), proc)
    proc.kill()
    proc.communicate()
    assert [p.name for p in checkpoint_dirs(run, complete=False)] == ["checkpoint-2"]
    assert is_complete(run / "checkpoint-2") and partial.is_dir()

    # 2. Resume, then SIGTERM: the step finishes, a checkpoint is saved, exit 143 with how to resume.
    proc = start("--resume", str(run), "--trust-run-code")
    wait_for(lambda: (run / "metrics.jsonl").is_file() and read_metrics(run)[-1]["step"] >= 5, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert f"resume with: leangrpo train --resume {run}" in out + err
    stopped = read_metrics(run)[-1]["step"]
    assert 5 <= stopped < 8 and is_complete(run / f"checkpoint-{stopped}")
    assert not partial.exists()

    # 3. Resume to the end (in this process): every step logged exactly once, every checkpoint complete.
    result = CliRunner().invoke(main, ["train", "--resume", str(run), "--trust-run-code"])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 9))
    assert all(is_complete(c) for c in checkpoint_dirs(run, complete=False))
    assert (run / "model" / "model.safetensors").is_file()


def test_non_finite_steps_are_skipped_then_stop_the_run(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    poisoned: set[int] = set()
    now = {"poison": False}
    real_loss, real_step = grpo.grpo_loss, Trainer.step

    def step(self, step):
        now["poison"] = step in poisoned
        return real_step(self, step)

    def loss(*args, **kwargs):
        value, stats = real_loss(*args, **kwargs)
        return (value * float("nan") if now["poison"] else value), stats

    monkeypatch.setattr(Trainer, "step", step)
    monkeypatch.setattr(grpo, "grpo_loss", loss)

    # Step 2 is poisoned: skipped (no optimizer or scheduler step), counted, and the run goes on.
    # The flaky reward's rejects (NaN, inf, a string, the wrong length) are counted too.
    poisoned.add(2)
    cfg = load_config(make_config(
        tmp_path, tiny_model_dir, gsm8k_dir, "skip", optim={"max_steps": 3},
        rewards={"functions": [{"name": "toy_rewards:vowel_share"}, {"name": "toy_rewards:flaky"}],
                 "on_error": "missing"},
    ))  # fmt: skip
    trainer = Trainer(cfg)
    trainer.train()
    rows = read_metrics(tmp_path / "skip")
    assert [r["skipped_steps"] for r in rows] == [0, 1, 1]
    assert rows[1]["loss"] is None and rows[1]["grad_norm"] is None and rows[2]["loss"] is not None
    assert trainer.scheduler.last_epoch == 2
    assert all(int(s["step"]) == 2 for s in trainer.optimizer.state.values())
    assert sum(r["reward_failures"] for r in rows) > 0 and all(r["reward"] is not None for r in rows)

    # Every step poisoned: stop after optim.max_nonfinite_steps in a row, with the last good weights saved.
    poisoned.update(range(1, 10))
    logging = {"save_steps": 0, "progress_bar": False}
    cfg_path = make_config(
        tmp_path, tiny_model_dir, gsm8k_dir, "stop", optim={"max_nonfinite_steps": 2}, logging=logging
    )
    cfg = load_config(cfg_path)
    with pytest.raises(TrainingError, match=r"stopped at step 2: 2 steps in a row .*max_nonfinite_steps=2"):
        Trainer(cfg).train()
    assert is_complete(tmp_path / "stop" / "checkpoint-2")


def test_export_and_chat(tmp_path, tiny_model_dir, gsm8k_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg_path = make_config(
        tmp_path, tiny_model_dir, gsm8k_dir, "run",
        model={"lora": {"enabled": True, "r": 4}}, optim={"max_steps": 2, "learning_rate": 0.05},
        data={"system_prompt": "You are a careful test bot."},
    )  # fmt: skip
    assert Trainer(load_config(cfg_path)).train() is not None
    run, cli = tmp_path / "run", CliRunner()

    result = cli.invoke(main, ["export", str(run), "--out", str(tmp_path / "adapter")])
    assert result.exit_code == 0, result.output
    assert {"adapter_config.json", "adapter_model.safetensors", "leangrpo_export.json"} <= {
        p.name for p in (tmp_path / "adapter").iterdir()
    }
    info = json.loads((tmp_path / "adapter" / "leangrpo_export.json").read_text())
    assert info["format"] == "peft adapter" and info["step"] == 2 and info["final_metrics"]["step"] == 2

    merged_dir = tmp_path / "merged"
    result = cli.invoke(main, ["export", str(run / "checkpoint-2"), "--out", str(merged_dir), "--merge"])
    assert result.exit_code == 0, result.output
    merged = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    with_adapter = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), run / "checkpoint-2"
    ).eval()
    ids = torch.tensor([[1, 520, 1116, 3155, 2700, 30]])
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(merged.generate(ids, **kw), with_adapter.generate(ids, **kw))
        torch.testing.assert_close(merged(ids).logits, with_adapter(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(merged(ids).logits, base(ids).logits, atol=1e-3)  # the adapter matters
    assert (
        "chat_template" in (merged_dir / "tokenizer_config.json").read_text()
        or (merged_dir / "chat_template.jinja").is_file()
    )

    result = cli.invoke(main, ["export", str(run), "--out", str(merged_dir)])
    assert result.exit_code == 2 and "not an empty directory" in result.output

    from leangrpo.commands.chat import Chat

    bot = Chat(str(run), None, max_new_tokens=4)
    assert "You are a careful test bot." in bot.prompt("What is 2+2?")
    result = cli.invoke(main, ["chat", str(run), "What is 2+2?", "--max-new-tokens", "4"])
    assert result.exit_code == 0 and result.output.strip(), result.output
    result = cli.invoke(main, ["chat", str(merged_dir), "--max-new-tokens", "4"], input="One?\n\nTwo?\n")
    assert result.exit_code == 0, result.output
    result = cli.invoke(main, ["chat", str(tmp_path / "adapter"), "Hi?", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output

    # One loader for every tool: a run without its final model means its last complete checkpoint.
    from leangrpo.run.trained import locate

    (run / "model").rename(tmp_path / "model-moved")
    assert locate(run).adapter == run / "checkpoint-2" and locate(run).step == 2
    out = tmp_path / "eval.json"
    args = ["--data", str(gsm8k_dir), "--limit", "1", "--max-new-tokens", "2", "--out", str(out)]
    result = cli.invoke(main, ["eval", "--model", str(run), *args])
    assert result.exit_code == 0 and out.is_file(), result.output
    result = cli.invoke(main, ["chat", str(run), "Hi?", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    result = cli.invoke(main, ["export", str(run), "--out", str(tmp_path / "from-ckpt")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "from-ckpt" / "leangrpo_export.json").read_text())["source"] == str(run)


def test_output_dir_that_is_not_a_run_is_refused(tmp_path, tiny_model_dir, gsm8k_dir):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "thesis.tex").write_text("mine")
    cfg_path = make_config(tmp_path, tiny_model_dir, gsm8k_dir, "run")
    result = CliRunner().invoke(main, ["train", "-c", str(cfg_path)])
    assert result.exit_code == 2 and "is not a leangrpo run" in result.output
    assert len(result.output.strip().splitlines()) == 1
