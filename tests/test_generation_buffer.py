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
from typing import Any

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


def test_an_optimizer_step_may_span_two_generations(tmp_path):
    """spg 3 × num_iterations 1 over accumulation 2 (TRL runs it): 1.5 optimizer steps a step, the run ending
    on a whole one (max_steps even; an epoch count's steps rounded up to it), said in one line otherwise."""
    spanning = {
        "grpo": {"steps_per_generation": 3},
        "optim": {"gradient_accumulation_steps": 2, "max_steps": 2},
    }
    cfg = validate_config(_config(tmp_path, **spanning))
    assert (cfg.generation_batch_size, cfg.updates_per_step, cfg.whole_steps) == (12, 1.5, 2)
    assert [cfg.optimizer_steps(s) for s in range(5)] == [0, 1, 3, 4, 6]
    fewer = {"grpo": {"steps_per_generation": 2}, "optim": {"gradient_accumulation_steps": 3, "max_steps": 3}}
    fewer = validate_config(_config(tmp_path, **fewer))
    assert [fewer.optimizer_steps(s) for s in range(4)] == [0, 0, 1, 2]  # step 1 ends none
    with pytest.raises(ConfigError) as e:
        validate_config(_config(tmp_path, grpo=spanning["grpo"], optim={**spanning["optim"], "max_steps": 3}))
    assert len(str(e.value).splitlines()) == 1
    assert "optim.max_steps=3 must be a multiple of 2" in str(e.value)
    by_epochs = _config(tmp_path, grpo=spanning["grpo"], optim={"num_train_epochs": 1.0})
    del by_epochs["optim"]["max_steps"]
    epochs = validate_config(by_epochs)
    from leangrpo.run.resolve import resolve_steps

    assert resolve_steps(epochs, 9, 1).optim.max_steps == 4  # 3 steps of 3 prompts, rounded up to 4


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


def test_flat_trl_config_takes_an_optimizer_step_spanning_generations():
    """TRL's max_steps 3 over spg 3 and accumulation 2: 6 micro-steps, 2 generations."""
    nested = _flat(max_steps=3, steps_per_generation=3)
    assert (nested["grpo"]["steps_per_generation"], nested["optim"]["max_steps"]) == (3, 2)
    assert (
        _flat(max_steps=4, steps_per_generation=2, gradient_accumulation_steps=3)["optim"]["max_steps"] == 6
    )


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"steps_per_generation": 2, "generation_batch_size": 16}, ".*disagree \\(it implies 4\\): set one"),
        ({"generation_batch_size": 18}, "generation_batch_size=18: must be a multiple of .* = 4"),
        ({"steps_per_generation": 4, "max_steps": 3}, "max_steps=3: .*must be a multiple of 2"),
        ({"steps_per_generation": 3, "max_steps": 2}, "max_steps=2: .*must be a multiple of 3"),
    ],
)
def test_flat_trl_config_refuses_what_trl_refuses_in_one_line(given, message):
    with pytest.raises(UserError, match=f"trl.yaml: {message}") as e:
        _flat(**given)
    assert len(str(e.value).splitlines()) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    ("changes", "generations"),
    [
        ({"num_iterations": 1, "max_steps": 4}, [16, 16]),
        ({"num_iterations": 2, "max_steps": 8}, [16, 16]),
        # an optimizer step spanning two generations: the 2nd of 3 slices + 2 accumulated
        ({"steps_per_generation": 3, "max_steps": 3}, [12, 12]),
        # 2 slices, 3 accumulated: the 1st generation ends no optimizer step; 6 rows, so that TRL's epoch
        # (3 generations) ends on an optimizer step (docs/trl.md, "optimizer steps across generations")
        ({"steps_per_generation": 2, "gradient_accumulation_steps": 3, "max_steps": 4, "rows": 6}, [8] * 6),
    ],
    ids=["iterations1", "iterations2", "spg3_accumulation2", "spg2_accumulation3"],
)
def test_optimizer_steps_and_learning_rates_are_trls(tmp_path, tiny_model_dir, changes, generations):
    """The same GRPOConfig (steps_per_generation over gradient_accumulation_steps, a linear schedule with
    warm-up) under TRL 1.16 and leangrpo: the same optimizer steps with the same learning rates, the same
    generations, global_step, and the logged learning rate and epoch after each step that ends an
    optimizer step, at its global_step (leangrpo logs one row a generation: docs/trl.md); TRL runs an
    optimizer step over two generations when accumulation does not divide their micro-steps, and so does
    leangrpo."""
    pytest.importorskip("trl")
    import generation_buffer_run

    import leangrpo

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])}
    command = [sys.executable, str(TESTS / "generation_buffer_run.py"), "trl", str(tiny_model_dir)]
    command += [str(tmp_path / "trl"), json.dumps(changes)]
    with subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True) as trl:
        ours = generation_buffer_run.run(leangrpo, str(tiny_model_dir), tmp_path / "lean", **changes)
        _, stderr = trl.communicate(timeout=600)
    assert trl.returncode == 0, stderr[-3000:]
    theirs = json.loads((tmp_path / "trl" / "record.json").read_text())
    max_steps = changes["max_steps"]
    assert len(theirs["optimizer_lrs"]) == max_steps and theirs["scored"] == generations
    assert len(set(theirs["optimizer_lrs"])) > 2  # the schedule moves
    assert ours["optimizer_lrs"] == pytest.approx(theirs["optimizer_lrs"], rel=1e-12)
    assert ours["scored"] == theirs["scored"] and ours["global_step"] == theirs["global_step"] == max_steps
    steps = len(generations)  # each step's global_step, TRL logging each optimizer step (logging_steps 1)
    ends = sorted({max_steps * s // steps for s in range(1, steps + 1)} - {0})
    for key in ("logged_lrs", "epochs"):
        logged = {int(k): v for k, v in theirs[key].items()}
        assert ours[key] == pytest.approx({e: logged[e] for e in ends}, rel=1e-12)


EPS, MAX_LEN = 0.2, 8  # the spied trainers' clip and completion length


def _spied_trainer(monkeypatch, tmp_path, model_dir, data_dir, grpo: dict, optim: dict) -> tuple[list, Any]:
    """A Trainer on the tiny model (dapo, beta 0) whose grpo_loss calls are recorded, each as its
    (logp, old, advantages, mask, entropy)."""
    import leangrpo.core.grpo as grpo_mod
    from leangrpo.train.trainer import Trainer

    calls = []
    real_loss = grpo_mod.grpo_loss

    def spy_loss(logp, old, ref, adv, mask, **kwargs):
        calls.append([t.detach().clone() for t in (logp, old, adv, mask, kwargs["entropy"])])
        return real_loss(logp, old, ref, adv, mask, **kwargs)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy_loss)
    cfg = validate_config(_config(
        tmp_path, str(model_dir), str(data_dir / "train.jsonl"),
        data={"limit": 8}, rewards={"functions": [{"name": "toy_rewards:vowel_share"}]},
        grpo={"max_completion_length": MAX_LEN, "beta": 0.0, "epsilon": EPS, "loss_type": "dapo",
              "packed_generation": False, **grpo},
        optim={"learning_rate": 3e-2, **optim},
    ))  # fmt: skip
    return calls, Trainer(cfg)


def _trl_dapo_loss(call: list, num_items: float) -> float:
    """TRL's `_compute_loss` (dapo, accumulation 2) on a recorded call, with dapo's normaliser `num_items`."""
    logp, old, adv, mask, entropy = call
    loss, _ = trl_loss(
        logp, old, None, adv, mask, loss_type="dapo", bias_correction_kl=False, accumulation_steps=2,
        num_items=num_items, max_len=MAX_LEN, eps=EPS, eps_high=EPS, beta=0.0, entropy=entropy,
    )  # fmt: skip
    return loss.item()


def test_later_slices_use_the_old_log_probs_once_the_policy_moved(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, capsys
):
    """One step: 4 slices of 4 completions, 2 optimizer steps. The first optimizer step's micro-batches see
    the policy that generated (ratio 1); the second's compare the moved policy against the log-probs taken
    before the first update (ratio ≠ 1). Each micro-batch's loss is TRL's `_compute_loss` on the same
    inputs, dapo's normaliser the generation's tokens × gradient_accumulation_steps / steps_per_generation.
    The slices keep whole groups in order (TRL shuffles first): said at start-up (docs/trl.md)."""
    calls, trainer = _spied_trainer(monkeypatch, tmp_path, tiny_model_dir, gsm8k_dir, {}, {})
    assert "grpo.steps_per_generation: 4 slices of whole groups, in order" in capsys.readouterr().out
    metrics = trainer.step(1)

    assert len(calls) == 4  # 4 slices, one pass
    for logp, old, *_ in calls[:2]:
        assert (logp - old).abs().max() == 0  # the generating policy: old is its own detached log-prob
    for logp, old, _, mask, _ in calls[2:]:
        assert ((logp - old).abs() * mask).max() > 1e-3  # moved: TRL's old_per_token_logps
    generation_tokens = sum(float(c[3].sum()) for c in calls)
    losses = [_trl_dapo_loss(call, num_items=generation_tokens * 2 / 4) for call in calls]
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


def test_an_optimizer_step_spanning_two_generations_is_trls(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, capsys
):
    """spg 3 over accumulation 2, two steps: step 1's third micro-batch leaves its gradient pending, which
    step 2's first completes (3 optimizer steps in all, as TRL's). Each micro-batch's loss is TRL's
    `_compute_loss` on the same inputs, dapo's normaliser its own generation's tokens × 2 / 3; the old
    log-probs are taken before each generation's first update (TRL: 2 % 3 != 0), so the third micro-batch
    of step 1 sees the moved policy and step 2's first the policy it generated with. That windows run on
    over epoch ends (TRL cuts them there) is said at start-up (docs/trl.md)."""
    calls, trainer = _spied_trainer(
        monkeypatch, tmp_path, tiny_model_dir, gsm8k_dir, {"steps_per_generation": 3}, {"max_steps": 2}
    )
    said = (
        "optimizer steps span generations: 3 micro-steps a step, 2 an optimizer step, across steps and epoch "
    )
    assert said + "ends alike (TRL ends one early at an epoch's end: docs/trl.md)" in capsys.readouterr().out
    stepped = []
    trainer.optimizer.register_step_post_hook(lambda *a: stepped.append(len(calls)))
    first = trainer.step(1)
    assert stepped == [2] and trainer.updater.carry.micro_steps == 1  # the 3rd micro-batch's gradient waits
    assert any(p.grad is not None for p in trainer.policy.parameters())
    second = trainer.step(2)
    assert stepped == [2, 4, 6] and trainer.updater.carry.micro_steps == 0

    assert len(calls) == 6  # 3 slices a step
    moved = [float(((logp - old).abs() * mask).max()) for logp, old, _, mask, _ in calls]
    assert max(moved[:2] + moved[3:4]) < 1e-5 and moved[2] > 1e-3  # old: taken before each generation
    generations = [calls[:3], calls[3:]]  # each micro-batch's dapo normaliser: its own generation's tokens
    tokens = [sum(float(c[3].sum()) for c in generation) for generation in generations]
    losses = [_trl_dapo_loss(call, num_items=tokens[i // 3] * 2 / 3) for i, call in enumerate(calls)]
    # a row's loss: its micro-batches' summed loss per optimizer step (1.5 a step)
    assert first["loss"] == pytest.approx(sum(losses[:3]) / 1.5, rel=1e-5, abs=1e-9)
    assert second["loss"] == pytest.approx(sum(losses[3:]) / 1.5, rel=1e-5, abs=1e-9)


def test_plan_keeps_an_optimizer_step_spanning_generations(tmp_path):
    """`leangrpo plan` on spg 3 over accumulation 2: the old log-probs' pass (TRL's condition, 2 % 3 != 0),
    and a search for what fits keeps 1.5 optimizer steps a generation with a smaller micro-batch."""
    from fractions import Fraction

    from leangrpo.commands import plan

    grpo = {"steps_per_generation": 3, "beta": 0.0, "num_generations": 8, "max_completion_length": 2048}
    spanning = _config(tmp_path, grpo=grpo, optim={"per_device_train_batch_size": 8, "max_steps": 2})
    k = plan.knobs_from_config(validate_config(spanning))
    shape = plan.resolve_shape("Qwen/Qwen2.5-0.5B")
    assert k.updates_per_generation == Fraction(3, 2) and "reference" in plan.estimate(shape, k).phases
    fit = plan.search_fit(shape, k, 6 * 2**30, 0.1).knobs
    assert fit is not None and fit.per_device_train_batch_size < 8
    assert fit.updates_per_generation == Fraction(3, 2) and fit.generation_batch == k.generation_batch


def test_fsdp_refuses_a_pending_gradient_in_one_line(tmp_path):
    """Under FSDP a checkpoint could not keep a pending gradient (the shards' no-sync accumulation is
    FSDP's own): refused in one line before anything loads."""
    from leangrpo.train.preflight import World, preflight

    spanning = {"grpo": {"steps_per_generation": 3}, "optim": {"max_steps": 2}}
    cfg = validate_config(_config(tmp_path, **spanning))
    preflight(cfg, World(2, "cpu", sharded=False))
    with pytest.raises(UserError) as e:
        preflight(cfg, World(2, "cpu", sharded=True))
    assert len(str(e.value).splitlines()) == 1
    assert "an optimizer step spans two generations, whose pending gradient" in str(e.value)


def test_a_resumed_grpo_trainer_reads_rows_of_optimizer_steps_only(tmp_path):
    """spg 2 over accumulation 3: step 1 ends no optimizer step, so its metrics row is no log_history row
    (as the run itself logged none, TRL logging per optimizer step), and the others sit at global_step."""
    from leangrpo.commands.trl_api import _logged_rows

    fewer = {"grpo": {"steps_per_generation": 2}, "optim": {"gradient_accumulation_steps": 3, "max_steps": 3}}
    cfg = validate_config(_config(tmp_path, **fewer))
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "loss": 0.5}) + "\n" for s in (1, 2, 3))
    )
    assert [r["step"] for r in _logged_rows(tmp_path, cfg.optimizer_steps)] == [1, 2]
