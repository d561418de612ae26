"""The GRPO variants wired through config → Trainer → loss on the tiny model (math: test_grpo.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from leangrpo import grpo
from leangrpo.config import validate_config
from leangrpo.trainer import Trainer

pytestmark = pytest.mark.slow


def make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, **sections: dict[str, Any]) -> Trainer:
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 16},
        "rewards": {"functions": [{"name": "toy_rewards:vowel_share"}]},
        "grpo": {"num_generations": 4, "max_completion_length": 8, "max_prompt_length": 96},
        "optim": {"learning_rate": 1e-3, "per_device_train_batch_size": 8, "max_steps": 2},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(tmp_path / "run"),
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return Trainer(validate_config(cfg))


def test_gspo_delta_and_entropy_reach_the_loss(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    seen: list[dict[str, Any]] = []
    real_loss = grpo.grpo_loss

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(grpo, "grpo_loss", spy)
    grpo_section = {
        "importance_sampling_level": "sequence", "delta": 4.0, "loss_type": "grpo", "num_iterations": 2,
        "top_entropy_quantile": 0.2,
    }  # fmt: skip
    trainer = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section)
    metrics = trainer.step(1)
    assert len(seen) == 2  # one micro-batch, two iterations
    options = {
        (k["importance_sampling_level"], k["delta"], k["loss_type"], k["top_entropy_quantile"]) for k in seen
    }
    assert options == {("sequence", 4.0, "grpo", 0.2)}
    assert metrics["loss"] == metrics["loss"] and metrics["grad_norm"] > 0  # finite, and it trained
    # The entropy metric: the mean over completion tokens, between 0 and log(vocabulary).
    vocab = trainer.unwrapped.base.config.vocab_size
    assert 0 < metrics["entropy"] < math.log(vocab)
    assert seen[0]["entropy"].shape[0] == 8 and not seen[0]["entropy"].requires_grad


def test_mask_truncated_completions_leaves_cut_off_completions_out(tmp_path, tiny_model_dir, gsm8k_dir):
    # ignore_eos cuts every completion off at max_completion_length: with the mask, nothing trains.
    grpo_section = {"ignore_eos": True, "mask_truncated_completions": True}
    masked = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section).step(1)
    assert masked["truncated_frac"] == 1.0
    assert masked["loss"] == 0.0 and masked["grad_norm"] == 0.0
    grpo_section["mask_truncated_completions"] = False
    unmasked = make_trainer(tmp_path / "b", tiny_model_dir, gsm8k_dir, grpo=grpo_section).step(1)
    assert unmasked["grad_norm"] > 0


def test_normalize_then_sum_makes_the_advantages(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    seen: dict[str, Any] = {}
    real_score, real_update = Trainer.score, Trainer.update

    def score(self, rows, rollout):
        seen["scores"] = real_score(self, rows, rollout)
        return seen["scores"]

    def update(self, rollout, advantages, ref_logp, old_logp):
        seen["advantages"] = advantages
        return real_update(self, rollout, advantages, ref_logp, old_logp)

    monkeypatch.setattr(Trainer, "score", score)
    monkeypatch.setattr(Trainer, "update", update)
    functions = [{"name": "toy_rewards:vowel_share"}, {"name": "toy_rewards:length_share", "weight": 3.0}]
    rewards = {"functions": functions, "multi_objective_aggregation": "normalize_then_sum"}
    make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, rewards=rewards).step(1)
    scores = seen["scores"]
    expected, _ = grpo.normalize_then_sum(scores.per_func, torch.tensor([1.0, 3.0]), scores.total.isnan(), 4)
    torch.testing.assert_close(seen["advantages"].cpu(), expected)
    summed_first, _ = grpo.group_advantages(scores.total, 4)
    assert not torch.allclose(summed_first, expected, atol=1e-3)
