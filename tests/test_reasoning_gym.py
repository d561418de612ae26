"""The reasoning-gym task: generated splits, its verifier as correctness, one-line errors, and a real
training run (tiny model) on a generated dataset with held-out evaluation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from leangrpo.config.schema import ConfigError
from leangrpo.data.sources import load_rows
from leangrpo.data.tasks import load_task
from leangrpo.run.resolve import load_config, validate_config

pytest.importorskip("reasoning_gym")

RG = "reasoning_gym:"
CHAIN_SUM = {"chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}}


def config(path: str = "reasoning_gym:chain_sum", **task):
    return validate_config({"model": {"name_or_path": "m"}, "data": {"path": path}, "task": task or None})


def rows(cfg, split: str = "train") -> list[dict]:
    return load_rows(cfg.data.model_copy(update={"split": split}), load_task(cfg.task)).rows


def test_the_data_path_alone_picks_the_task_with_its_rewards():
    cfg = validate_config({"model": {"name_or_path": "m"}, "data": {"path": "reasoning_gym:chain_sum"}})
    assert cfg.task.name == "reasoning_gym"
    rewards = [r.name for r in cfg.rewards.functions]
    assert rewards == ["xmlcount", "soft_format", "strict_format", "correctness"]


def test_held_out_split_comes_from_eval_seed_without_training_problems():
    cfg = config(name="reasoning_gym", size=60, config=CHAIN_SUM)
    train, test = rows(cfg), rows(cfg, "test")
    assert len(train) == 60 and 0 < len(test) <= 60
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert len({r["question"] for r in test}) == len(test)
    assert rows(cfg) == train  # generated again, the same problems
    other = config(name="reasoning_gym", size=60, seed=5000, eval_seed=9000, config=CHAIN_SUM)
    assert rows(other) != train


def test_correctness_is_reasoning_gyms_score_of_the_answer_tags():
    cfg = config(name="reasoning_gym", size=5, config=CHAIN_SUM)
    task = load_task(cfg.task)
    row = rows(cfg)[0]
    right = f"<reasoning>\nx\n</reasoning>\n<answer>\n{row['answer']}\n</answer>"
    wrong = "<answer>\n99\n</answer>"
    assert task.is_correct(right, row) and not task.is_correct(wrong, row)
    assert not task.is_correct(row["answer"], row)  # no tags, no answer
    reward = task.rewards()["correctness"]
    columns = {k: [row[k]] * 2 for k in ("question", "answer", "metadata")}
    assert reward(["p", "p"], [right, wrong], **columns) == [2.0, 0.0]
    # the cold start's target is the format around the gold answer, and the task scores it correct
    assert task.solution(row).startswith("<reasoning>\n") and task.is_correct(task.solution(row), row)


def test_a_mix_of_datasets_scores_each_problem_with_its_own_generator():
    mix = "reasoning_gym:chain_sum,leg_counting"
    cfg = config(mix, name="reasoning_gym", size=30, weights={"leg_counting": 2})
    task, mixed = load_task(cfg.task), rows(cfg)
    assert {r["metadata"]["source_dataset"] for r in mixed} == {"chain_sum", "leg_counting"}
    assert all(task.is_correct(f"<answer>{r['answer']}</answer>", r) for r in mixed)


@pytest.mark.parametrize(
    ("path", "task", "message"),
    [
        (f"{RG}chain_summ", {}, "unknown reasoning-gym dataset 'chain_summ'; close matches: chain_sum"),
        (f"{RG}chain_sum", {"config": {"chain_sum": {"min_digits": 0}}}, "min_digits must be positive"),
        (f"{RG}chain_sum", {"config": {"chain_sum": {"digits": 1}}}, "unexpected keyword argument 'digits'"),
        (f"{RG}chain_sum", {"config": {"leg_counting": {}}}, "'leg_counting', which data.path does not"),
        (f"{RG}chain_sum", {"seed": 3, "eval_seed": 10}, "eval_seed: must be at least size=1000 away"),
        ("train.jsonl", {}, "task reasoning_gym needs data.path: reasoning_gym:<dataset>"),
    ],
)
def test_bad_input_is_one_line(path, task, message):
    with pytest.raises(ConfigError, match="^config error") as err:
        config(path, name="reasoning_gym", **task)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_reasoning_gym_path_with_another_task_is_refused():
    with pytest.raises(ConfigError, match="needs task: reasoning_gym"):
        config(name="gsm8k")


def test_a_bad_cold_start_task_is_one_line():
    base = {"model": {"name_or_path": "m"}, "data": {"path": f"{RG}chain_sum"}}
    for sft_task, message in (
        ({"config": {"chain_sum": {"min_digits": 0}}}, "sft.task: bad reasoning-gym generator config"),
        ({"digits": 1}, "sft.task: task reasoning_gym has no option 'digits'"),
        ({"name": "gsm8k"}, "sft.task: holds options of the task, not another task name"),
    ):
        with pytest.raises(ConfigError, match="^config error") as err:
            validate_config({**base, "sft": {"steps": 2, "task": sft_task}})
        assert message in str(err.value) and "\n" not in str(err.value)


def test_the_cold_start_trains_on_sft_task_problems(tmp_path, tiny_model_dir, monkeypatch):
    """sft.task's settings (one-digit sums) give the cold start its problems; GRPO keeps two-digit ones."""
    from leangrpo.train import sft
    from leangrpo.train.trainer import Trainer

    two_digits = {"chain_sum": {**CHAIN_SUM["chain_sum"], "min_digits": 2, "max_digits": 2}}
    cfg = validate_config(
        {
            "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
            "task": {"name": "reasoning_gym", "size": 40, "config": two_digits},
            "data": {"path": f"{RG}chain_sum"},
            "grpo": {"num_generations": 2, "max_completion_length": 32},
            "sft": {"steps": 2, "batch_size": 4, "task": {"config": CHAIN_SUM}},
            "logging": {"progress_bar": False},
            "output_dir": str(tmp_path / "run"),
        }
    )
    trainer = Trainer(cfg)
    taught: list[str] = []
    real_batch = sft.sft_batch
    monkeypatch.setattr(
        sft,
        "sft_batch",
        lambda tok, p, solutions, **k: taught.extend(solutions) or real_batch(tok, p, solutions, **k),
    )
    trainer.cold_start()

    def operands(question: str) -> list[str]:
        return question.split(":")[-1].replace("=", " ").replace("+", " ").replace("-", " ").split()

    assert len(taught) == 8 and all(t.startswith("<reasoning>") for t in taught)
    assert all(len(n) == 1 for r in trainer.sft_rows for n in operands(r["question"]))
    assert all(len(n) == 2 for r in trainer.rows for n in operands(r["question"]))
    sft_answers = {r["answer"] for r in trainer.sft_rows}
    assert all(any(f"<answer>\n{a}\n" in t for a in sft_answers) for t in taught)


@pytest.mark.slow
def test_training_run_on_generated_problems(tmp_path, tiny_model_dir):
    from test_e2e import read_metrics, run_cli

    out = tmp_path / "run"
    config_path = str(Path(__file__).resolve().parents[1] / "configs" / "reasoning_gym_chain_sum.yaml")
    example = load_config(config_path)  # the shipped example validates
    assert example.task.name == "reasoning_gym" and example.eval.enabled
    overrides = [
        f"model.name_or_path={tiny_model_dir}", "model.lora.enabled=false", "task.size=40",
        "grpo.max_completion_length=8", "optim.per_device_train_batch_size=8", "optim.max_steps=2",
        "eval.limit=4", f"output_dir={out}", "logging.progress_bar=false",
    ]  # fmt: skip
    proc = run_cli("train", "-c", config_path, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [r for r in read_metrics(out) if "reward" in r]
    assert [r["step"] for r in steps] == [1, 2] and "rewards/correctness/mean" in steps[-1]
    held_out = [json.loads(line) for line in (out / "eval" / "step-2.jsonl").read_text().splitlines()]
    assert len(held_out) == 4 and all("correct" in r for r in held_out)
    assert yaml.safe_load((out / "eval" / "step-2.json").read_text())["data"] == "reasoning_gym:chain_sum"
