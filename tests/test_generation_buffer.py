"""TRL's generation buffer (issue 51): one generation of steps_per_generation × per_device_train_batch_size
completions feeds steps_per_generation micro-steps a pass, gradient_accumulation_steps of them an
optimizer step. The config (YAML, flat TRL config, GRPOConfig), the optimizer steps and their learning
rates against TRL 1.16's own run, and the old log-probs once the policy has moved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_trl import trl_loss

from leangrpo.config.schema import ConfigError
from leangrpo.core.errors import UserError
from leangrpo.run.resolve import validate_config

TESTS = Path(__file__).resolve().parent
REWARD = ["toy_rewards.vowel_share"]


def _config(tmp_path: Path, model: str = "m", data_path: str = "d.jsonl", **sections: dict) -> dict:
    """A nested config with the buffer on (4 slices of 4, 2 an optimizer step), `sections` merged in."""
    base = {
        "model": {"name_or_path": model, "gradient_checkpointing": False},
        "data": {"path": data_path},
        "grpo": {"num_generations": 4, "steps_per_generation": 4},
        "optim": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 1},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
    }
    merged = {k: {**base.get(k, {}), **sections.get(k, {})} for k in base.keys() | sections.keys()}
    return {**merged, "output_dir": str(tmp_path / "run")}


def test_yaml_key_sets_the_generation_and_its_optimizer_steps(tmp_path):
    cfg = validate_config(_config(tmp_path))
    assert cfg.grpo.steps_per_generation == cfg.steps_per_generation == 4
    assert (cfg.generation_batch_size, cfg.prompts_per_step, cfg.updates_per_step) == (16, 4, 2)
    two = validate_config(_config(tmp_path, grpo={"num_iterations": 2}))
    assert two.updates_per_step == 4  # 2 passes over 4 slices, 2 micro-steps an optimizer step
    default = validate_config(_config(tmp_path, grpo={"steps_per_generation": None}))
    assert (default.steps_per_generation, default.generation_batch_size, default.updates_per_step) == (
        2,
        8,
        1,
    )


def test_a_step_whose_optimizer_steps_outlast_its_generation_is_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        validate_config(
            _config(tmp_path, grpo={"steps_per_generation": 3}, optim={"gradient_accumulation_steps": 2})
        )
    assert len(str(e.value).splitlines()) == 1
    assert "grpo.steps_per_generation=3 × grpo.num_iterations=1 must be a multiple of" in str(e.value)


def _flat(**fields) -> dict:
    from leangrpo.config.trl import from_trl

    base = {"model_name_or_path": "m", "dataset_name": "d.jsonl", "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2, "num_generations": 4}  # fmt: skip
    return from_trl({**base, **fields}, "trl.yaml")


@pytest.mark.parametrize("given", [{"steps_per_generation": 4}, {"generation_batch_size": 16}])
def test_flat_trl_config_and_grpo_config_take_trls_names(tmp_path, given):
    trl = pytest.importorskip("trl")

    from leangrpo import GRPOConfig
    from leangrpo.config.trl import from_trl

    nested = _flat(max_steps=8, num_iterations=2, **given)
    assert nested["grpo"]["steps_per_generation"] == 4
    assert nested["optim"]["max_steps"] == 2  # 8 optimizer steps, 4 a generation (2 passes × 4 / 2)
    fields = dict(
        per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4, max_steps=4
    )
    ours = GRPOConfig(output_dir=str(tmp_path), **fields, **given)
    theirs = GRPOConfig.from_trl_args(
        trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, **fields, **given)
    )
    for args in (ours, theirs):  # a trl.GRPOConfig has both fields set, one derived from the other
        flat = {
            **args.trl_config(),
            "model_name_or_path": "m",
            "dataset_name": "d.jsonl",
            "reward_funcs": REWARD,
        }
        cfg = validate_config(from_trl(flat, "GRPOConfig"))
        assert (cfg.steps_per_generation, cfg.optim.max_steps, cfg.updates_per_step) == (4, 2, 2)


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"steps_per_generation": 2, "generation_batch_size": 16}, ".*disagree \\(it implies 4\\): set one"),
        ({"generation_batch_size": 18}, "generation_batch_size=18: must be a multiple of .* = 4"),
        ({"steps_per_generation": 4, "max_steps": 3}, "max_steps=3: .*must be a multiple of 2"),
    ],
)
def test_flat_trl_config_refuses_what_trl_refuses_in_one_line(given, message):
    with pytest.raises(UserError, match=f"trl.yaml: {message}") as e:
        _flat(**given)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize("iterations", [1, 2])
def test_optimizer_steps_and_learning_rates_are_trls(tmp_path, tiny_model_dir, iterations):
    """The same GRPOConfig (steps_per_generation 4 over gradient_accumulation_steps 2, a linear schedule
    with warm-up, 2 generations: 4 optimizer steps, 8 with num_iterations 2) under TRL 1.16 and leangrpo:
    the same optimizer steps with the same learning rates, the same generations (2 of 16 completions),
    global_step, and the logged learning rate and epoch at each generation's last optimizer step
    (leangrpo logs one row a generation: docs/trl.md)."""
    pytest.importorskip("trl")
    import generation_buffer_run

    import leangrpo

    updates = 2 * iterations  # a generation's optimizer steps
    changes = {"num_iterations": iterations, "max_steps": 2 * updates}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    command = [sys.executable, str(TESTS / "generation_buffer_run.py"), "trl", str(tiny_model_dir)]
    command += [str(tmp_path / "trl"), json.dumps(changes)]
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as trl:
        ours = generation_buffer_run.run(leangrpo, str(tiny_model_dir), tmp_path / "lean", **changes)
        _, stderr = trl.communicate(timeout=600)
    assert trl.returncode == 0, stderr[-3000:]
    theirs = json.loads((tmp_path / "trl" / "record.json").read_text())
    assert len(theirs["optimizer_lrs"]) == 2 * updates and theirs["scored"] == [16, 16]
    assert len(set(theirs["optimizer_lrs"])) > 2  # the schedule moves
    assert ours["optimizer_lrs"] == pytest.approx(theirs["optimizer_lrs"], rel=1e-12)
    assert ours["scored"] == theirs["scored"] and ours["global_step"] == theirs["global_step"] == 2 * updates
    for key in ("logged_lrs", "epochs"):
        logged = {int(k): v for k, v in theirs[key].items()}
        assert ours[key] == pytest.approx(
            {updates: logged[updates], 2 * updates: logged[2 * updates]}, rel=1e-12
        )


def test_later_slices_use_the_old_log_probs_once_the_policy_moved(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, capsys
):
    """One step: 4 slices of 4 completions, 2 optimizer steps. The first optimizer step's micro-batches see
    the policy that generated (ratio 1); the second's compare the moved policy against the log-probs taken
    before the first update (ratio ≠ 1). Each micro-batch's loss is TRL's `_compute_loss` on the same
    inputs, dapo's normaliser the generation's tokens × gradient_accumulation_steps / steps_per_generation.
    The slices keep whole groups in order (TRL shuffles first): said at start-up (docs/trl.md)."""
    import leangrpo.core.grpo as grpo_mod
    from leangrpo.train.trainer import Trainer

    calls = []
    real_loss = grpo_mod.grpo_loss

    def spy_loss(logp, old, ref, adv, mask, **kwargs):
        calls.append([t.detach().clone() for t in (logp, old, adv, mask, kwargs["entropy"])])
        return real_loss(logp, old, ref, adv, mask, **kwargs)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy_loss)
    eps, max_len = 0.2, 8
    cfg = validate_config(_config(
        tmp_path, str(tiny_model_dir), str(gsm8k_dir / "train.jsonl"),
        data={"limit": 8}, rewards={"functions": [{"name": "toy_rewards:vowel_share"}]},
        grpo={"max_completion_length": max_len, "beta": 0.0, "epsilon": eps, "loss_type": "dapo",
              "packed_generation": False},
        optim={"learning_rate": 3e-2},
    ))  # fmt: skip
    trainer = Trainer(cfg)
    assert "grpo.steps_per_generation: 4 slices of whole groups, in order" in capsys.readouterr().out
    metrics = trainer.step(1)

    assert len(calls) == 4  # 4 slices, one pass
    for logp, old, *_ in calls[:2]:
        assert (logp - old).abs().max() == 0  # the generating policy: old is its own detached log-prob
    for logp, old, _, mask, _ in calls[2:]:
        assert ((logp - old).abs() * mask).max() > 1e-3  # moved: TRL's old_per_token_logps
    generation_tokens = sum(float(c[3].sum()) for c in calls)
    losses = []
    for logp, old, adv, mask, entropy in calls:
        loss, _ = trl_loss(
            logp, old, None, adv, mask, loss_type="dapo", bias_correction_kl=False, accumulation_steps=2,
            num_items=generation_tokens * 2 / 4, max_len=max_len, eps=eps, eps_high=eps, beta=0.0,
            entropy=entropy,
        )  # fmt: skip
        losses.append(loss.item())
    assert metrics["loss"] == pytest.approx((sum(losses[:2]) + sum(losses[2:])) / 2, rel=1e-5, abs=1e-9)
    assert metrics["step_time"] == pytest.approx(metrics["step_seconds"] / 2)  # TRL's: per optimizer step


def test_plan_counts_the_whole_generation(tmp_path):
    """`leangrpo plan -c`: the KV cache of the generation batch (4 slices of 4 completions), and the old
    log-probs' pass of a step whose policy moves."""
    from leangrpo.commands import plan

    k = plan.knobs_from_config(validate_config(_config(tmp_path, grpo={"beta": 0.0})))
    assert k.generation_batch == 16 and k.steps_per_generation == 4
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    one_update = plan.replace(k, steps_per_generation=2)  # 8 completions, one optimizer step
    assert "reference" in plan.estimate(shape, k).phases
    assert "reference" not in plan.estimate(shape, one_update).phases
    kv = plan.estimate(shape, k).components["KV cache"]
    assert kv == 2 * plan.estimate(shape, one_update).components["KV cache"]
