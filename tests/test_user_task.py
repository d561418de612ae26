"""`task: package.module:MyTask`: a Task subclass of the user's, imported by the loader rewards use, its
one-line errors, and the trust rules a run's own config meets (refused before the module is imported)."""

from __future__ import annotations

import sys

import pytest
import yaml

from leangrpo.config.schema import ConfigError
from leangrpo.data.tasks import load_task
from leangrpo.run.resolve import load_config, save_config, validate_config
from leangrpo.run.trust import UntrustedCodeError

TASK = "toy_task:TaggedTask"


def _data(tmp_path, gsm8k_dir, task, **extra) -> dict:
    return {
        "model": {"name_or_path": "m"},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        "task": task,
        "output_dir": str(tmp_path / "run"),
        **extra,
    }


@pytest.mark.parametrize("form", ["short", "mapping"])
def test_a_task_named_by_import_path_loads_with_its_options(tmp_path, gsm8k_dir, form):
    from toy_task import SYSTEM_PROMPT, TaggedTask

    task = TASK if form == "short" else {"name": TASK, "tag": "mine"}
    cfg = validate_config(_data(tmp_path, gsm8k_dir, task))
    assert cfg.task.name == TASK and cfg.data.system_prompt == SYSTEM_PROMPT
    assert [s.name for s in cfg.rewards.functions] == ["saw_tag"]
    loaded = load_task(cfg.task)
    assert type(loaded) is TaggedTask and loaded.name == TASK  # named by its path: it has no name
    assert loaded.options.tag == ("toy" if form == "short" else "mine")
    # the resolved config keeps the path, so the run's config.yaml loads the same task again
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml").task.name == TASK


@pytest.mark.parametrize(
    "name, needle",
    [
        ("no_such_module_xyz:Task", "cannot import module 'no_such_module_xyz' for task"),
        ("toy_task:Missing", "module 'toy_task' has no attribute 'Missing' (task 'toy_task:Missing')"),
        ("toy_task:saw_tag", "task 'toy_task:saw_tag' is not a Task subclass (it is a function)"),
        ("toy_task:NotATask", "task 'toy_task:NotATask' is not a Task subclass (it is class NotATask)"),
        ("toy_task:", "invalid task import path 'toy_task:'"),
    ],
)
def test_a_bad_task_import_path_is_one_line(tmp_path, gsm8k_dir, name, needle):
    with pytest.raises(ConfigError) as info:
        validate_config(_data(tmp_path, gsm8k_dir, name))
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("config error in config: task: ") and needle in msg, msg


def test_an_unknown_task_name_mentions_import_paths(tmp_path, gsm8k_dir):
    with pytest.raises(ConfigError, match=r"did you mean gsm8k\? \(or give your own Task subclass"):
        validate_config(_data(tmp_path, gsm8k_dir, "gsm8kk"))


def test_a_task_named_by_import_path_trains_a_step(tmp_path, tiny_model_dir, gsm8k_dir):
    """The task's own reward scores, seeing the task's system prompt in the prompts and the column its
    `prepare` added in the rows."""
    from leangrpo.train.trainer import Trainer

    cfg = validate_config({
        **_data(tmp_path, gsm8k_dir, TASK),
        "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
        "grpo": {"num_generations": 2, "max_completion_length": 8},
        "optim": {"per_device_train_batch_size": 4, "max_steps": 1},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
    })  # fmt: skip
    metrics = Trainer(cfg).step(1)
    assert metrics["rewards/saw_tag/mean"] == 1.0


# ------------------------------------------------------------------------ a run's own config (run.trust)


@pytest.fixture
def run_naming_a_task(tmp_path, gsm8k_dir, monkeypatch):
    """A run directory whose config.yaml names the task by import path; toy_task not yet imported."""
    run = tmp_path / "run"
    run.mkdir()
    save_config(validate_config(_data(tmp_path, gsm8k_dir, TASK)), run / "config.yaml")
    monkeypatch.delitem(sys.modules, "toy_task", raising=False)
    return run


def test_resume_refuses_a_runs_task_by_import_path_before_importing_it(run_naming_a_task):
    from leangrpo.run.trust import resume_config

    run = run_naming_a_task
    with pytest.raises(UntrustedCodeError, match=r"toy_task:TaggedTask.*--trust-run-code") as info:
        resume_config(None, [], str(run))
    assert "\n" not in str(info.value)
    assert "toy_task" not in sys.modules
    assert resume_config(None, [], str(run), trust_run_code=True).task.name == TASK
    # the user's own choice on the command line is theirs to make
    assert resume_config(None, [f"task.name={TASK}"], str(run)).task.name == TASK


def test_eval_refuses_a_runs_task_by_import_path_before_importing_it(run_naming_a_task, tmp_path, gsm8k_dir):
    from leangrpo.commands.evaluate import run_eval

    data = yaml.safe_load((run_naming_a_task / "config.yaml").read_text())
    assert data["task"]["name"] == TASK
    with pytest.raises(UntrustedCodeError, match=r"the run's config names code that would run: toy_task:"):
        run_eval(str(tmp_path / "no-model"), config=str(run_naming_a_task), data=str(gsm8k_dir),
                 out=str(tmp_path / "e.json"))  # fmt: skip
    assert "toy_task" not in sys.modules
