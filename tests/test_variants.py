"""The GRPO variants wired through config → Trainer → loss on the tiny model (math: test_grpo.py)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from leangrpo.core import grpo
from leangrpo.data.rewards import RewardScores
from leangrpo.engines.types import RolloutBatch, SyncStats
from leangrpo.run.resolve import validate_config
from leangrpo.train.scoring import Scorer
from leangrpo.train.trainer import Trainer
from leangrpo.train.update import Updater


def test_rollouts_cat_and_select_pad_and_pick_rows():
    # Batch a: prompts 2 wide, completions 1 wide; batch b: 1 and 3 (left- and right-padded with 0).
    a = RolloutBatch(
        torch.tensor([[5, 6], [0, 7]]), torch.tensor([[1, 1], [0, 1]]), torch.tensor([[8], [9]]),
        torch.tensor([[1], [1]]), torch.tensor([True, True]), ["a0", "a1"],
    )  # fmt: skip
    b = RolloutBatch(
        torch.tensor([[4]]), torch.tensor([[1]]), torch.tensor([[1, 2, 3]]), torch.tensor([[1, 1, 0]]),
        torch.tensor([False]), ["b0"],
    )  # fmt: skip
    both = RolloutBatch.cat([a, b])
    assert both.prompt_ids.tolist() == [[5, 6], [0, 7], [0, 4]]
    assert both.prompt_mask.tolist() == [[1, 1], [0, 1], [0, 1]]
    assert both.completion_ids.tolist() == [[8, 0, 0], [9, 0, 0], [1, 2, 3]]
    assert both.completion_mask.tolist() == [[1, 0, 0], [1, 0, 0], [1, 1, 0]]
    picked = both.select(torch.tensor([2, 0]))
    assert picked.completion_texts == ["b0", "a0"] and picked.truncated.tolist() == [False, True]
    assert picked.prompt_ids.tolist() == [[0, 4], [5, 6]] and picked.sampling_logprobs is None


def test_reward_scores_cat_and_select():
    nan = float("nan")
    a = RewardScores(
        torch.tensor([[1.0], [nan]]), torch.tensor([1.0, 0.0]), torch.tensor([False, False]), ["r"],
        {"m": 2.0}, {"note": ["x", "y"]},
    )  # fmt: skip
    b = RewardScores(torch.tensor([[3.0]]), torch.tensor([3.0]), torch.tensor([True]), ["r"], {"m": 4.0})
    both = RewardScores.cat([a, b])
    assert both.total.tolist() == [1.0, 0.0, 3.0] and both.failed.tolist() == [False, False, True]
    assert both.metrics == {"m": 3.0} and both.extra == {"note": ["x", "y", None]}
    picked = both.select(torch.tensor([2, 1]))
    assert picked.total.tolist() == [3.0, 0.0] and picked.extra == {"note": [None, "y"]}
    assert torch.isnan(picked.per_func[1, 0])


def make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, **sections: dict[str, Any]) -> Trainer:
    cfg = {
        "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 16},
        "rewards": {"functions": [{"name": "toy_rewards:vowel_share"}]},
        "grpo": {"num_generations": 4, "max_completion_length": 8, "max_prompt_length": 128},
        "optim": {"learning_rate": 1e-3, "per_device_train_batch_size": 8, "max_steps": 2},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(tmp_path / "run"),
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return Trainer(validate_config(cfg))


@pytest.mark.slow
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
        (s.importance_sampling_level, s.delta, s.loss_type, s.top_entropy_quantile)
        for s in (k["spec"] for k in seen)
    }
    assert options == {("sequence", 4.0, "grpo", 0.2)}
    assert metrics["loss"] == metrics["loss"] and metrics["grad_norm"] > 0  # finite, and it trained
    # The entropy metric: the mean over completion tokens, between 0 and log(vocabulary).
    vocab = trainer.unwrapped.base.config.vocab_size
    assert 0 < metrics["entropy"] < math.log(vocab)
    assert seen[0]["entropy"].shape[0] == 8


@pytest.mark.slow
def test_sapo_temperatures_reach_the_loss(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    seen: list[dict[str, Any]] = []
    real_loss = grpo.grpo_loss
    monkeypatch.setattr(grpo, "grpo_loss", lambda *a, **k: seen.append(k) or real_loss(*a, **k))
    grpo_section = {"loss_type": "sapo", "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.2}
    metrics = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section).step(1)
    assert [(k["spec"].loss_type, k["spec"].sapo_temperatures) for k in seen] == [("sapo", (0.9, 1.2))]
    assert metrics["grad_norm"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["luspo", "vespo"])
def test_luspo_vespo_entropy_bonus_and_off_policy_mask_train(tmp_path, tiny_model_dir, gsm8k_dir, loss_type):
    """TRL's luspo and vespo, with the adaptive entropy bonus and the off-policy mask, through config →
    Trainer for 2 steps of 2 optimizer steps each: TRL's metrics, the coefficient moved after each
    optimizer step (entropy below the target: up by delta, from the second one with a bonus), the weights
    trained, and the control's state in the checkpoint's counters."""
    level = "sequence" if loss_type == "luspo" else "token"
    grpo_section = {
        "loss_type": loss_type, "num_iterations": 2, "importance_sampling_level": level,
        "use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_coef_delta": 0.005,
        "entropy_target": 100.0, "off_policy_mask_threshold": 0.5, "vespo_k_pos": 1.5,
    }  # fmt: skip
    trainer = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    first, second = trainer.step(1), trainer.step(2)
    assert first["entropy_coef"] == pytest.approx((0.015 + 0.02) / 2)
    assert second["entropy_coef"] == pytest.approx((0.025 + 0.03) / 2)
    own = "vespo/phi_seq_mean" if loss_type == "vespo" else "clip_ratio/region_mean"
    for m in (first, second):
        assert all(math.isfinite(m[k]) for k in ("loss", "policy_loss", "grad_norm", own, "entropy"))
    assert any((a != b.detach()).any() for a, b in zip(before, trainer.policy.parameters(), strict=True))
    control = trainer.updater.state()["entropy_control"]
    assert control["coef"] == pytest.approx(0.03) and 0 < control["last_entropy"] <= 100


@pytest.mark.slow
@pytest.mark.parametrize("on_disk", [False, True])
def test_sync_ref_model_mixes_the_reference_toward_the_policy(tmp_path, tiny_model_dir, gsm8k_dir, on_disk):
    """TR-DPO's sync (TRL's SyncRefModelCallback): every ref_model_sync_steps = 3 optimizer steps (2 per
    step here) ref = alpha·policy + (1 - alpha)·ref, in memory or in its file on disk: after step 1 the
    reference is still the start, after step 2 (optimizer step 4, no sync at 3) it is the mix with the
    policy of optimizer step 3."""
    grpo_section = {
        "beta": 0.04, "num_iterations": 2, "sync_ref_model": True, "ref_model_mixup_alpha": 0.25,
        "ref_model_sync_steps": 3,
    }  # fmt: skip
    trainer = make_trainer(
        tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section, cpu={"reference_on_disk": on_disk}
    )
    assert (trainer.updater.ref_pages is not None) == on_disk
    ref = trainer.updater.ref_policy
    start = {n: p.detach().clone() for n, p in ref.named_parameters()}
    trainer.step(1)
    assert all(torch.equal(p, start[n]) for n, p in ref.named_parameters())
    seen = []
    real_step = Updater._optimizer_step

    def spy(self, *args):
        out = real_step(self, *args)
        seen.append({n: p.detach().clone() for n, p in self.unwrapped.named_parameters()})
        return out

    with pytest.MonkeyPatch.context() as m:
        m.setattr(Updater, "_optimizer_step", spy)
        trainer.step(2)
    policy_at_3 = seen[0]
    moved = 0
    for n, p in ref.named_parameters():
        torch.testing.assert_close(p, 0.25 * policy_at_3[n].to(p.dtype) + 0.75 * start[n])
        moved += not torch.equal(p, start[n])
    assert moved > 0 and trainer.updater.optimizer_steps == 4


def test_sync_ref_model_needs_a_reference_copy():
    """As TRL: beta = 0 (no reference) and LoRA (the reference is the adapter off) are refused."""
    base = {"model": {"name_or_path": "x"}, "data": {"path": "x.jsonl"}}
    for grpo_section, lora in (
        ({"sync_ref_model": True}, False),
        ({"sync_ref_model": True, "beta": 0.1}, True),
    ):
        with pytest.raises(ValueError, match="grpo.sync_ref_model moves the reference copy"):
            validate_config(
                {**base, "grpo": grpo_section, "model": {"name_or_path": "x", "lora": {"enabled": lora}}}
            )


@pytest.mark.slow
def test_mask_truncated_completions_leaves_cut_off_completions_out(tmp_path, tiny_model_dir, gsm8k_dir):
    # ignore_eos cuts every completion off at max_completion_length: with the mask, nothing trains.
    grpo_section = {"ignore_eos": True, "mask_truncated_completions": True}
    masked = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, grpo=grpo_section).step(1)
    assert masked["completions/clipped_ratio"] == 1.0
    assert masked["loss"] == 0.0 and masked["grad_norm"] == 0.0
    grpo_section["mask_truncated_completions"] = False
    unmasked = make_trainer(tmp_path / "b", tiny_model_dir, gsm8k_dir, grpo=grpo_section).step(1)
    assert unmasked["grad_norm"] > 0


@pytest.mark.slow
def test_normalize_then_sum_makes_the_advantages(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    seen: dict[str, Any] = {}
    real_score, real_update = Scorer.score, Updater.update

    def score(self, *args):
        seen["scores"] = real_score(self, *args)
        return seen["scores"]

    def update(self, rollout, advantages, *args):
        seen["advantages"] = advantages
        return real_update(self, rollout, advantages, *args)

    monkeypatch.setattr(Scorer, "score", score)
    monkeypatch.setattr(Updater, "update", update)
    functions = [{"name": "toy_rewards:vowel_share"}, {"name": "toy_rewards:length_share", "weight": 3.0}]
    rewards = {"functions": functions, "multi_objective_aggregation": "normalize_then_sum"}
    make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, rewards=rewards).step(1)
    scores = seen["scores"]
    expected, _ = grpo.normalize_then_sum(scores.per_func, torch.tensor([1.0, 3.0]), scores.total.isnan(), 4)
    torch.testing.assert_close(seen["advantages"].cpu(), expected)
    summed_first, _ = grpo.group_advantages(scores.total, 4)
    assert not torch.allclose(summed_first, expected, atol=1e-3)


@pytest.mark.slow
def test_dynamic_sampling_trains_on_informative_groups(tmp_path, tiny_model_dir, gsm8k_dir):
    rewards = {"functions": [{"name": "toy_rewards:vowel_share_some_questions"}]}
    grpo_section = {"dynamic_sampling": True, "max_resample_rounds": 8}
    trainer = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, rewards=rewards, grpo=grpo_section)
    first = [trainer.rows[i]["question"] for i in trainer.source.sampler.indices(0)]
    assert any(len(q) % 3 for q in first)  # the first draw holds an uninformative group
    seen = []
    real_score = trainer.scorer.score

    def score(step, rollout, stop):
        seen.append([r["question"] for r in rollout.rows])
        return real_score(step, rollout, stop)

    trainer.scorer.score = score
    metrics = trainer.step(1)
    rounds = metrics["dynamic_sampling/rounds"]
    assert len(seen) == rounds + 1 and seen[0] == first and 1 <= rounds <= 8
    assert metrics["dynamic_sampling/prompts_drawn"] == 2 * (rounds + 1)
    drawn = [q for batch in seen for q in batch]
    assert metrics["dynamic_sampling/groups_dropped"] == sum(len(q) % 3 != 0 for q in drawn)
    assert metrics["dynamic_sampling/filled"] == 0 and metrics["frac_reward_zero_std"] == 0.0
    # The extra rounds' prompts come from their own seeded order, a pure function of seed, step and round.
    assert seen[1] == [trainer.rows[i]["question"] for i in trainer.source.resampler.indices(0)]


@pytest.mark.slow
def test_dynamic_sampling_stops_after_max_resample_rounds(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    monkeypatch.setenv("LEANGRPO_TEST_OUT", str(tmp_path))
    rewards = {"functions": [{"name": "toy_rewards:record_prompts"}]}  # always 0: no group is informative
    grpo_section = {"dynamic_sampling": True, "max_resample_rounds": 2}
    trainer = make_trainer(tmp_path, tiny_model_dir, gsm8k_dir, rewards=rewards, grpo=grpo_section)
    # an engine holding weights reports its step's sync on the first batch; resampling keeps it
    trainer.source.engine.last_sync = SyncStats(bytes=1234, seconds=0.5, adapter_only=True)
    metrics = trainer.step(1)
    assert metrics["vllm/sync_bytes"] == 1234.0 and metrics["vllm/sync_adapter_only"] == 1.0
    assert metrics["dynamic_sampling/rounds"] == 2 and metrics["dynamic_sampling/prompts_drawn"] == 6
    assert metrics["dynamic_sampling/filled"] == 2 and metrics["dynamic_sampling/groups_dropped"] == 4
    assert metrics["frac_reward_zero_std"] == 1.0 and metrics["loss"] == 0.0


@pytest.mark.slow
def test_dapo_recipe_example_trains_from_the_cli(tmp_path, tiny_model_dir, gsm8k_dir):
    from test_e2e import read_metrics, run_cli

    from leangrpo.run.resolve import load_config

    example = load_config("configs/dapo_gsm8k.yaml")  # the shipped example validates
    g = example.grpo
    assert g.dynamic_sampling and g.beta == 0 and g.loss_type == "dapo" and g.epsilon_high == 0.28
    out = tmp_path / "run"
    overlong = "{max_completion_len: 8, soft_punish_cache: 4}"  # the completions here are 8 tokens at most
    functions = (
        f"[{{name: xmlcount}}, {{name: trl.rewards:get_soft_overlong_punishment, kwargs: {overlong}}}]"
    )
    overrides = [
        f"model.name_or_path={tiny_model_dir}", "model.lora.enabled=false", "model.dtype=float32",
        f"data.path={gsm8k_dir / 'train.jsonl'}", "data.limit=16", f"rewards.functions={functions}",
        "grpo.num_generations=4", "grpo.max_completion_length=8", "grpo.max_resample_rounds=1",
        "optim.per_device_train_batch_size=8", "optim.gradient_accumulation_steps=1", "optim.max_steps=1",
        f"output_dir={out}", "logging.progress_bar=false",
    ]  # fmt: skip
    proc = run_cli("train", "-c", "configs/dapo_gsm8k.yaml", *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1]
    assert rows[0]["dynamic_sampling/rounds"] <= 1 and "time/resample" in rows[0]
    assert "rewards/soft_overlong_punishment_reward/mean" in rows[0]


@pytest.mark.slow
def test_dynamic_sampling_with_two_processes(tmp_path, tiny_model_dir, gsm8k_dir):
    """Ranks may need different numbers of rounds; they run the same number (a hang otherwise) and end with
    the same weights."""
    from test_e2e import TESTS, read_metrics, torchrun, write_config

    cfg = write_config(
        tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "run",
        rewards={"functions": [{"name": "toy_rewards:vowel_share_some_questions"}]},
        optim={"max_steps": 1, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        grpo={"num_generations": 4, "dynamic_sampling": True, "max_resample_rounds": 3},
    )  # fmt: skip
    proc = torchrun(
        TESTS / "ddp_worker.py", str(cfg), port=29531, env_extra={"LEANGRPO_TEST_OUT": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0, w1 = ((tmp_path / f"weights-rank{r}.sha256").read_text() for r in (0, 1))
    assert w0 == w1
    (row,) = read_metrics(tmp_path / "run")
    assert row["dynamic_sampling/rounds"] >= 1
    assert row["dynamic_sampling/prompts_drawn"] == 2 * 2 * (row["dynamic_sampling/rounds"] + 1)
