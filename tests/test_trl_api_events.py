"""The Trainer API around train() (issue 49): callback events in TRL's order, the control a callback
sets, evaluate() and eval_dataset/eval_strategy, the summary row of log_history, push_to_hub."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from datasets import Dataset

TESTS = Path(__file__).resolve().parent
ROWS = [{"prompt": "Hi"}, {"prompt": "Yo"}]
EVENTS = (
    "on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
    "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_prediction_step",
    "on_evaluate", "on_save", "on_epoch_end", "on_train_end",
)  # fmt: skip
NOT_LOGGED = {"eval_loss", "eval_entropy", "eval_num_tokens"}
"""TRL's eval keys leangrpo does not log (with eval_clip_ratio/*; docs/trl.md)."""


def short(completions, **kwargs):
    return [-float(len(c)) for c in completions]


class AllEvents:
    """A TRL callback recording every event as (event, global_step)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        for event in EVENTS:
            setattr(self, event, self._recorder(event))

    def _recorder(self, event):
        def record(args, state, control, **kwargs):
            self.seen.append((event, state.global_step))

        return record


def _args(module, out, **extra):
    fields = dict(
        output_dir=str(out), max_steps=2, logging_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, report_to="none", save_steps=100, per_device_eval_batch_size=4,
    )  # fmt: skip
    return module.GRPOConfig(**{**fields, **extra})


TRL_RUN = """
import json, sys
from datasets import Dataset
import trl
from test_trl_api_events import ROWS, AllEvents, _args, short

recorder = AllEvents()
args = _args(trl, sys.argv[2], use_cpu=True, **json.loads(sys.argv[3]))
trainer = trl.GRPOTrainer(
    sys.argv[1], short, args, Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS),
    callbacks=[recorder],
)
trainer.train()
print("RUN " + json.dumps([recorder.seen, trainer.state.log_history]))
"""


def _trl_run(tmp_path, model_dir, **fields):
    """TRL 1.16's GRPOTrainer on the tiny model with the eval_dataset, GRPOConfig(**fields) over `_args`:
    its events and rows (in a process of its own: TRL's accelerate state is not leangrpo's)."""
    pytest.importorskip("trl")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    done = subprocess.run(
        [sys.executable, "-c", TRL_RUN, str(model_dir), str(tmp_path / "trl"), json.dumps(fields)], env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen, rows = json.loads(done.stdout.split("RUN ", 1)[1])
    return [tuple(event) for event in seen], rows


def test_events_eval_rows_and_summary_row_as_trl(tmp_path, tiny_model_dir, caplog):
    """The same 2-step run with an eval_dataset evaluated every step, under TRL and under leangrpo: the same
    callback events in the same order at the same global_step; log_history's rows alike (each eval row
    has TRL's eval_* keys but those said at start-up; the last row is transformers' summary row)."""
    import leangrpo

    trl_events, trl_rows = _trl_run(tmp_path, tiny_model_dir, eval_strategy="steps", eval_steps=1)
    recorder = AllEvents()
    args = _args(leangrpo, tmp_path / "lean", eval_strategy="steps", eval_steps=1)
    with caplog.at_level(logging.WARNING):
        trainer = leangrpo.GRPOTrainer(
            str(tiny_model_dir), short, args, Dataset.from_list(ROWS), eval_dataset=Dataset.from_list(ROWS),
            callbacks=[recorder],
        )  # fmt: skip
    assert "HF generate on the main process" in caplog.text
    assert "without eval_loss, eval_entropy, eval_clip_ratio/* or eval_num_tokens" in caplog.text
    with caplog.at_level(logging.WARNING):
        output = trainer.train()
    assert "on_optimizer_step fire after the step's update (TRL: around its optimizer step)" in caplog.text
    assert recorder.seen == trl_events
    rows = trainer.state.log_history
    assert [r["step"] for r in rows] == [r["step"] for r in trl_rows] == [1, 1, 2, 2, 2]
    for ours, theirs in zip(rows[1:4:2], trl_rows[1:4:2], strict=True):
        expected = {k for k in theirs if k not in NOT_LOGGED and not k.startswith("eval_clip_ratio/")}
        assert set(ours) == expected
        assert ours["eval_rewards/short/mean"] == ours["eval_reward"] <= 0
    assert list(rows[-1]) == list(trl_rows[-1])  # train_runtime, ..., total_flos, train_loss, epoch, step
    assert {k: rows[-1][k] for k in output.metrics} == output.metrics

    recorder.seen.clear()
    metrics = trainer.evaluate()
    assert recorder.seen == [("on_prediction_step", 2)] * 2 + [("on_log", 2), ("on_evaluate", 2)]
    assert metrics == {k: v for k, v in trainer.state.log_history[-1].items() if k != "step"}
    assert "test_reward" in trainer.evaluate(ROWS[:1], metric_key_prefix="test")


@pytest.mark.parametrize("lora", [False, True])
def test_evaluate_logs_the_kl_to_the_reference_at_beta_above_zero(tmp_path, tiny_model_dir, lora):
    """As TRL at beta != 0, evaluate() logs `eval_kl`: 0 before training (the reference is the model),
    above 0 once training moved the policy (the frozen copy, or LoRA's adapter off); none at beta 0."""
    from peft import LoraConfig

    import leangrpo

    peft = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if lora else None
    args = _args(leangrpo, tmp_path / "kl", beta=0.04, learning_rate=0.05)
    trainer = leangrpo.GRPOTrainer(
        str(tiny_model_dir), short, args, ROWS, eval_dataset=ROWS, peft_config=peft
    )
    assert trainer.evaluate()["eval_kl"] == 0.0
    trainer.train()
    assert trainer.evaluate()["eval_kl"] > 1e-6
    args = _args(leangrpo, tmp_path / "no-kl")
    assert "eval_kl" not in leangrpo.GRPOTrainer(str(tiny_model_dir), short, args, ROWS).evaluate(ROWS)


def test_epoch_events_and_evaluation_as_trl(tmp_path, tiny_model_dir):
    """eval_strategy='epoch' over 3 steps of 2-step epochs, 2 micro-batches a step: on_substep_end before
    each step's last; on_epoch_end, then the evaluation, then the next epoch's on_epoch_begin, as TRL."""
    import leangrpo

    fields = dict(
        eval_strategy="epoch", max_steps=3, gradient_accumulation_steps=2, per_device_train_batch_size=2
    )
    trl_events, _ = _trl_run(tmp_path, tiny_model_dir, **fields)
    recorder = AllEvents()
    args = _args(leangrpo, tmp_path / "lean", **fields)
    trainer = leangrpo.GRPOTrainer(
        str(tiny_model_dir), short, args, ROWS, eval_dataset=ROWS, callbacks=[recorder]
    )
    trainer.train()
    assert recorder.seen == trl_events
    assert [e for e in recorder.seen if e[0] == "on_substep_end"] == [
        ("on_substep_end", s) for s in (0, 1, 2)
    ]
    assert [e for e in recorder.seen if e[0] in ("on_epoch_end", "on_evaluate")] == [
        ("on_epoch_end", 2), ("on_evaluate", 2), ("on_epoch_end", 3), ("on_evaluate", 3)
    ]  # fmt: skip


def test_eval_strategy_without_eval_dataset_is_refused_at_init(tmp_path, tiny_model_dir):
    import leangrpo
    from leangrpo.core.errors import UserError

    args = _args(leangrpo, tmp_path, eval_strategy="steps")
    with pytest.raises(UserError) as e:
        leangrpo.GRPOTrainer(str(tiny_model_dir), short, args, ROWS)
    assert str(e.value) == (
        "GRPOTrainer: eval_strategy='steps' needs an eval_dataset: pass eval_dataset= or set "
        "eval_strategy='no'"
    )

    def lookup(x: int) -> str:
        """Looks up x.

        Args:
            x: the key
        """
        return str(x)

    args = _args(leangrpo, tmp_path)
    with pytest.raises(UserError, match="^GRPOTrainer: eval_dataset: evaluation with a rollout_func is not"):
        leangrpo.GRPOTrainer(
            str(tiny_model_dir), short, args, ROWS, eval_dataset=ROWS, tools=[lookup], rollout_func=print
        )


def test_evaluate_with_an_environment_goes_through_the_tool_loop_as_trl(tmp_path, tiny_model_dir):
    """As TRL, an eval_dataset of a run with an environment_factory is evaluated through the tool loop,
    before and after train(): its get_reward scores the eval rollouts, the rewards get them as messages,
    and TRL's tools/* metrics join the eval row."""
    from test_trl_environments import Counter

    import leangrpo

    seen = []

    def messages(completions, **kwargs):
        seen.extend(completions)
        return [0.0] * len(completions)

    chats = [{"prompt": [{"role": "user", "content": "Count."}]}] * 2
    args = _args(leangrpo, tmp_path, max_steps=1, max_completion_length=8)
    trainer = leangrpo.GRPOTrainer(
        str(tiny_model_dir), messages, args, chats, eval_dataset=chats, environment_factory=Counter
    )
    before = trainer.evaluate()
    assert {"eval_rewards/Counter/mean", "eval_tools/call_frequency", "eval_tools/failure_frequency"} <= set(
        before
    )
    assert len(seen) == 8 and all(isinstance(c, list) and c[0]["role"] == "assistant" for c in seen)
    trainer.train()
    assert set(trainer.evaluate()) == set(before)


def test_evaluate_before_training_on_a_dict_of_eval_datasets(tmp_path, tiny_model_dir):
    """A dict of eval datasets is evaluated set by set, each under its own prefix (the model as given)."""
    import leangrpo

    evals = {"a": Dataset.from_list(ROWS), "b": ROWS[:1]}
    args = _args(leangrpo, tmp_path, num_generations_eval=2)
    trainer = leangrpo.GRPOTrainer(str(tiny_model_dir), short, args, ROWS, eval_dataset=evals)
    metrics = trainer.evaluate()
    assert metrics["eval_a_samples_per_second"] > 0 and metrics["eval_b_reward"] <= 0
    assert metrics["eval_a_completions/max_length"] <= 4
    assert trainer.evaluate("b")["eval_reward"] <= 0
    assert [row["step"] for row in trainer.state.log_history] == [0, 0, 0]


class Steer:
    """Asks, as a TRL callback may: a checkpoint after step 1, a log row and an evaluation after step 3."""

    def __init__(self) -> None:
        self.saved: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            control.should_save = True
        if state.global_step == 3:
            control.should_log = control.should_evaluate = True

    def on_save(self, args, state, control, **kwargs):
        self.saved.append(state.global_step)


def test_control_should_save_log_and_evaluate(tmp_path, tiny_model_dir, monkeypatch):
    """should_save checkpoints the step (on_save once it is on disk), should_log logs the step's row,
    should_evaluate evaluates; push_to_hub with no hub to reach is one line."""
    import huggingface_hub

    import leangrpo
    from leangrpo.core.errors import UserError

    run, steer = tmp_path / "run", Steer()
    args = _args(leangrpo, run, max_steps=4, logging_steps=10)
    trainer = leangrpo.GRPOTrainer(
        str(tiny_model_dir), short, args, ROWS, eval_dataset=ROWS, callbacks=[steer]
    )
    with pytest.raises(UserError, match="nothing trained yet"):
        trainer.push_to_hub()
    trainer.train()
    assert (run / "checkpoint-1").is_dir() and not (run / "checkpoint-2").exists()
    assert steer.saved == [1, 4]  # and the last step's, as TRL saves at the end
    steps = [(row["step"], "eval_reward" in row) for row in trainer.state.log_history]
    assert steps == [(1, False), (3, False), (3, True), (4, False)]

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(UserError) as e:
        trainer.push_to_hub(blocking=False)
    assert str(e.value).startswith("push_to_hub: cannot push to http://127.0.0.1:9 (run): ")
    assert len(str(e.value).splitlines()) == 1

    uploads = []  # a hub that answers: what push_to_hub asks of it

    def create_repo(self, repo_id, **kwargs):
        return SimpleNamespace(repo_id=f"me/{repo_id}")

    def upload_folder(self, repo_id, folder_path, commit_message, revision):
        uploads.append((repo_id, sorted(p.name for p in Path(folder_path).iterdir()), commit_message))
        return SimpleNamespace(commit_url="https://hub.test/me/run/commit/1")

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    assert trainer.push_to_hub("done") == "https://hub.test/me/run/commit/1"
    [(repo_id, files, message)] = uploads
    assert (repo_id, message) == ("me/run", "done")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)  # save_model's layout

    # blocking=False, as transformers: a Future of the upload, which runs in the background
    gate, folders = threading.Event(), []

    def slow_upload(self, repo_id, folder_path, commit_message, revision):
        gate.wait(60)
        folders.append(Path(folder_path))
        return upload_folder(self, repo_id, folder_path, commit_message, revision)

    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", slow_upload)
    future = trainer.push_to_hub("later", blocking=False)
    assert not future.done()
    gate.set()
    assert future.result(timeout=60).commit_url == "https://hub.test/me/run/commit/1"
    assert uploads[-1][2] == "later" and "training_args.json" in uploads[-1][1]
    for _ in range(200):  # the staged copy goes once the upload is done (its callback may trail result())
        if not folders[0].exists():
            break
        time.sleep(0.05)
    assert not folders[0].exists()
