"""A flat TRL YAML and TRL's command-line flags mean what they mean to TRL 1.16 and to the Python API
(issue 49's leftovers): completions are logged only with log_completions, num_generations_eval samples per
eval prompt, dict fields take JSON text, and an environment's get_reward stands for rewards.functions."""

from __future__ import annotations

import json

import pytest
import yaml

from leangrpo.config.schema import ConfigError
from leangrpo.run.resolve import load_config


class Scored:
    """An environment whose get_reward scores the rollouts (TRL adds it as a reward)."""

    def reset(self, **_: object) -> str:
        return "Say hi."

    def get_reward(self) -> float:
        return 1.0


class Unscored:
    """An environment without get_reward: the run still needs rewards."""

    def reset(self, **_: object) -> str:
        return "Say hi."


@pytest.fixture
def flat(tmp_path):
    """Write a flat TRL YAML (a model, TRL-formatted data, a reward, and `fields`) and return its path."""
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(4)))

    def write(reward: bool = True, **fields: object) -> str:
        doc = {"model_name_or_path": "some/model", "dataset_name": str(data), **fields}
        if reward:
            doc["reward_funcs"] = ["think_format_reward"]
        path = tmp_path / "trl.yaml"
        path.write_text(yaml.safe_dump(doc))
        return str(path)

    write.data = data  # type: ignore[attr-defined]
    return write


def test_completions_are_logged_only_with_log_completions(flat, tmp_path, tiny_model_dir):
    """TRL's default (false) logs none, as `GRPOConfig().log_completions` reads; true logs them with each
    metrics row (logging_steps), as TRL does."""
    from leangrpo import GRPOConfig, GRPOTrainer

    assert load_config(flat()).logging.log_completions_steps == 0
    assert load_config(flat(log_completions=True, logging_steps=5)).logging.log_completions_steps == 5
    assert load_config(flat(log_completions=True, log_completions_steps=3)).logging.log_completions_steps == 3
    rows = [{"prompt": "q"}] * 4
    for args, steps in ((GRPOConfig(), 0), (GRPOConfig(log_completions=True, logging_steps=2), 2)):
        args.output_dir = str(tmp_path / "run")
        trainer = GRPOTrainer(str(tiny_model_dir), reward_funcs=len, args=args, train_dataset=rows)
        assert trainer.cfg.logging.log_completions_steps == steps


def test_num_generations_eval_is_completions_per_eval_prompt(flat):
    """As in TRL and the Python API's evaluate(): evaluation samples num_generations_eval completions of
    each prompt, num_generations when unset."""
    on = {"eval_strategy": "steps", "eval_steps": 2, "num_generations": 4, "per_device_train_batch_size": 4}
    held_out = [f"eval.path={flat.data}"]  # the eval split: the training rows will do here
    assert load_config(flat(**on), held_out).eval.num_samples == 4
    assert load_config(flat(**on, num_generations_eval=2), held_out).eval.num_samples == 2
    assert not load_config(flat(num_generations_eval=2)).eval.enabled  # no eval_strategy: no evaluation


def test_dict_fields_take_json_text(flat):
    """TRL's dict fields as JSON text (as transformers reads them), in a flat YAML and as flags; bad JSON
    is one line naming the field."""
    cfg = load_config(
        flat(lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs='{"min_lr_rate": 0.1}',
             chat_template_kwargs='{"enable_thinking": false}')
    )  # fmt: skip
    assert cfg.optim.lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    assert cfg.data.chat_template_kwargs == {"enable_thinking": False}
    cfg = load_config(flat(), ["--model_init_kwargs", '{"attn_implementation": "sdpa"}'])
    assert cfg.model.attn_implementation == "sdpa"
    for bad in (flat(chat_template_kwargs='{"enable_thinking": fals}'), None):
        overrides = [] if bad else ["--chat_template_kwargs", '{"enable_thinking": false']
        with pytest.raises(ConfigError) as e:
            load_config(bad or flat(), overrides)
        (line,) = str(e.value).splitlines()
        assert "chat_template_kwargs: not valid JSON" in line


def test_dict_field_json_in_the_python_api_is_one_line():
    from leangrpo import GRPOConfig

    assert GRPOConfig(lr_scheduler_kwargs='{"min_lr_rate": 0.1}').lr_scheduler_kwargs == {"min_lr_rate": 0.1}
    with pytest.raises(ConfigError, match=r"^lr_scheduler_kwargs: not valid JSON [^\n]*$"):
        GRPOConfig(lr_scheduler_kwargs='{"min_lr_rate": }')


def test_an_environment_with_get_reward_needs_no_rewards(flat):
    """As the Python API's environment_factory: the environment's get_reward is the run's reward."""
    cfg = load_config(flat(reward=False), ["tools.environment=test_trl_yaml:Scored"])
    assert cfg.rewards.functions == [] and cfg.tools.environment == "test_trl_yaml:Scored"
    with pytest.raises(ConfigError, match="rewards.functions: required .*no tools.environment defines get_r"):
        load_config(flat(reward=False), ["tools.environment=test_trl_yaml:Unscored"])
    with pytest.raises(ConfigError, match="tools.environment: .*has no attribute 'Missing'"):
        load_config(flat(reward=False), ["tools.environment=test_trl_yaml:Missing"])


@pytest.mark.slow
def test_a_yaml_environment_with_get_reward_trains_without_rewards(tmp_path, tiny_model_dir):
    """End to end from the CLI: the environment's get_reward is the step's reward."""
    from test_e2e import run_cli

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"q{i}"}) + "\n" for i in range(4)))
    doc = {
        "model": {"name_or_path": str(tiny_model_dir)}, "data": {"path": str(data)},
        "tools": {"environment": "test_trl_yaml:Scored"},
        "grpo": {"num_generations": 2, "max_completion_length": 4},
        "optim": {"per_device_train_batch_size": 2, "max_steps": 1},
        "logging": {"progress_bar": False}, "output_dir": str(tmp_path / "run"),
    }  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(doc))
    proc = run_cli("train", "-c", str(path))  # the tests' folder on PYTHONPATH: the environment's module
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["rewards/Scored/mean"] == 1.0
