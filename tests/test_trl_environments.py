"""Environments as TRL 1.16 takes them (issue 49, item 4): an environment with `get_reward` needs no
`reward_funcs`, and a single `environment_factory` needs no `train_dataset` (its `reset` gives the prompt,
`max_steps` the length)."""

from __future__ import annotations

import json

import pytest


class Counter:
    """Counts up; the count is the reward. Its reset gives the task."""

    def reset(self, **row):
        self.count = 0
        return "Count up with the tool."

    def increment(self, by: int) -> str:
        """Adds to the count.

        Args:
            by: how much
        """
        self.count += by
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count)


def test_an_environment_with_get_reward_trains_without_rewards_or_a_dataset(tmp_path, tiny_model_dir):
    from leangrpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, logging_steps=1, report_to="none", log_completions=True,
    )  # fmt: skip
    trainer = GRPOTrainer(str(tiny_model_dir), args=args, environment_factory=Counter)
    assert trainer.cfg.rewards.functions == []
    assert trainer._extras.train_rows == [{"prompt": [{"role": "user", "content": ""}]}] * 2  # TRL's rows
    trainer.train()
    (row,) = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "rewards/Counter/mean" in row
    record = json.loads((tmp_path / "run" / "completions.jsonl").read_text().splitlines()[0])
    assert "Count up with the tool." in json.dumps(record)  # the reset text is the prompt


@pytest.mark.parametrize(
    ("kwargs", "line"),
    [
        ({"environment_factory": Counter}, "max_steps: must be set without a train_dataset"),
        ({"environment_factory": {"a": Counter}, "max_steps": 1}, "required with a dict environment_factory"),
        ({"max_steps": 1, "reward_funcs": "strict_format"}, "train_dataset: required unless an environment"),
        ({"max_steps": 1, "train_dataset": [{"prompt": "x"}]}, "unless the environment_factory.s env"),
    ],
)
def test_what_trl_refuses_without_them_is_refused_in_one_line(kwargs, line, tiny_model_dir):
    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.core.errors import UserError

    args = GRPOConfig(max_steps=kwargs.pop("max_steps", -1))
    with pytest.raises(UserError, match=line):
        GRPOTrainer(str(tiny_model_dir), args=args, **kwargs)


class Unseeded(Counter):
    """An environment whose reset text differs from rollout to rollout (an unseeded OpenEnv environment)."""

    issued = 0

    def reset(self, **row):
        self.count = 0
        Unseeded.issued += 1
        return f" Count up to {Unseeded.issued}."


def test_a_reset_text_per_rollout_is_each_rollouts_own_prompt_as_trl(tmp_path, tiny_model_dir):
    """As TRL runs an environment whose reset differs per rollout: each rollout is sampled from, trained on
    and rewarded with its own prompt, in training and in evaluate(); the run's shared-prompt layout
    (2 completions a prompt copy) falls back to one prompt copy per completion for such a batch."""
    import torch

    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.engines.types import RolloutBatch

    seen = []

    def prompts_seen(prompts, completions, **kwargs):
        seen.extend(p[-1]["content"] for p in prompts)
        return [0.0] * len(completions)

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, logging_steps=1, report_to="none", beta=0.04,
    )  # fmt: skip
    chats = [{"prompt": [{"role": "user", "content": "Go."}]}] * 2
    trainer = GRPOTrainer(
        str(tiny_model_dir), prompts_seen, args, chats, eval_dataset=chats, environment_factory=Unseeded
    )
    trainer.train()
    assert len(seen) == len(set(seen)) == 4 and all(s.startswith("Go. Count up to ") for s in seen), seen
    seen.clear()
    assert trainer.evaluate()["eval_kl"] >= 0
    assert len(seen) == len(set(seen)) == 4 and all(s.startswith("Go. Count up to ") for s in seen), seen

    updater = trainer._run.updater
    assert updater.group == 2  # the run's shared-prompt layout
    sampled = trainer._run.source.rollout(2).batch  # each rollout sampled from its own prompt's tokens
    assert (
        len({tuple(row.tolist()) for row in sampled.prompt_ids}) == 4 and updater.prompt_group(sampled) == 1
    )
    ids = torch.tensor([[1, 2], [1, 2], [1, 3], [1, 3]])
    batch = RolloutBatch(
        ids, torch.ones_like(ids), ids, torch.ones_like(ids), torch.zeros(4, dtype=torch.bool), [""] * 4
    )
    assert updater.prompt_group(batch) == 2
    batch.prompt_ids = torch.tensor([[1, 2], [1, 3], [1, 3], [1, 3]])
    assert updater.prompt_group(batch) == 1
