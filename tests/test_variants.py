"""The GRPO variants wired through config → Trainer → loss on the tiny model (math: test_grpo.py)."""

from __future__ import annotations

from typing import Any

import pytest

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


def test_gspo_and_delta_reach_the_loss(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    seen: list[dict[str, Any]] = []
    real_loss = grpo.grpo_loss

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real_loss(*args, **kwargs)

    monkeypatch.setattr(grpo, "grpo_loss", spy)
    grpo_section = {
        "importance_sampling_level": "sequence",
        "delta": 4.0,
        "loss_type": "grpo",
        "num_iterations": 2,
    }
    trainer = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section)
    metrics = trainer.step(1)
    assert len(seen) == 2  # one micro-batch, two iterations
    assert {(k["importance_sampling_level"], k["delta"], k["loss_type"]) for k in seen} == {
        ("sequence", 4.0, "grpo")
    }
    assert metrics["loss"] == metrics["loss"] and metrics["grad_norm"] > 0  # finite, and it trained


def test_mask_truncated_completions_leaves_cut_off_completions_out(tmp_path, tiny_model_dir, gsm8k_dir):
    # ignore_eos cuts every completion off at max_completion_length: with the mask, nothing trains.
    grpo_section = {"ignore_eos": True, "mask_truncated_completions": True}
    masked = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section).step(1)
    assert masked["truncated_frac"] == 1.0
    assert masked["loss"] == 0.0 and masked["grad_norm"] == 0.0
    grpo_section["mask_truncated_completions"] = False
    unmasked = make_trainer(tmp_path / "b", tiny_model_dir, gsm8k_dir, grpo=grpo_section).step(1)
    assert unmasked["grad_norm"] > 0
