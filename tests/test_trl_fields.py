"""Every field of TRL 1.16's GRPOConfig is honoured, ignored with a notice, or refused with its reason;
the lists are checked against the installed TRL, and docs/trl.md shows them."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path

import pytest
import yaml

from leangrpo.config.schema import ConfigError
from leangrpo.config.trl import asks_nothing, field_table, from_trl, handling, precision_note
from leangrpo.config.trl_fields import TRL_DEFAULTS

DOCS = Path(__file__).resolve().parents[1] / "docs" / "trl.md"


def trl_fields() -> dict[str, object]:
    trl = pytest.importorskip("trl")
    return {
        f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        for f in dataclasses.fields(trl.GRPOConfig)
    }


def test_the_field_list_is_trl_1_16s():
    assert trl_fields() == TRL_DEFAULTS


@pytest.mark.parametrize("name", list(trl_fields()))
def test_every_field_is_honoured_or_noted(name, caplog):
    how, why = handling(name)
    assert why, name
    if how != "noted":
        return
    default = TRL_DEFAULTS[name]
    other = (
        {None: "x", True: False, False: True}.get(default, "other")
        if default in (None, True, False)
        else "other"
    )
    if isinstance(default, int | float) and not isinstance(default, bool):
        other = default + 1
    if asks_nothing(name, other):  # a value that asks for what leangrpo does: silent too
        other = "other"
    other = {"optim_args": "beta1=0.5"}.get(name, other)  # one transformers parses
    with caplog.at_level(logging.WARNING, logger="leangrpo.config.trl"):
        from_trl({name: other}, "t.yaml")
        assert f"{name}={other!r} ignored: {why}" in caplog.text
    caplog.clear()
    from_trl({name: TRL_DEFAULTS[name]}, "t.yaml")  # TRL's default passes silently
    assert [r.message for r in caplog.records if precision_note("float32") not in r.message] == []


@pytest.mark.parametrize(
    "fields, dtype, noted",
    [
        ({}, "float32", True),
        ({"dtype": "bfloat16"}, "bfloat16", True),
        ({"bf16": False}, "float32", False),
        ({"bf16": True}, "bfloat16", False),
        ({"fp16": True}, "float16", False),
    ],
)
def test_trl_precision_default_is_a_said_difference(fields, dtype, noted, caplog):
    """TRL 1.16's GRPOConfig leaves bf16 unset, which means bf16 mixed precision (autocast over fp32
    weights, on a GPU; on a CPU it refuses without use_cpu). leangrpo has no autocast: it computes in
    model.dtype, float32 by default, and says so in one start-up line; bf16/fp16 true set the dtype."""
    trl = pytest.importorskip("trl")
    assert trl.GRPOConfig(output_dir="x", use_cpu=True).bf16 is True  # TRL's effective default
    with caplog.at_level(logging.WARNING, logger="leangrpo.config.trl"):
        out = from_trl(fields, "t.yaml")
    assert out.get("model", {}).get("dtype", "float32") == dtype
    assert (f"t.yaml: {precision_note(dtype)}" in caplog.text) == noted
    assert ("bf16 unset" in caplog.text) == noted


def test_refusals_come_all_at_once_one_line_each():
    with pytest.raises(ConfigError) as e:
        from_trl(
            {"optim_args": "beta1", "loss_type": "x", "optim": "sgd", "no_such": 1},
            "t.yaml",
        )
    lines = str(e.value).splitlines()
    assert len(lines) == 4 and all(line.startswith("t.yaml: ") for line in lines)


def test_docs_table_is_current():
    from leangrpo.commands.configdoc import trl_table

    assert trl_table() in DOCS.read_text(), "docs/trl.md: python -m leangrpo.commands.configdoc --trl-table"
    assert len(field_table()) == len(TRL_DEFAULTS)


LLAMA_RECIPE = """
learning_rate: 5e-6
adam_beta1: 0.9
adam_beta2: 0.99
weight_decay: 0.1
warmup_ratio: 0.1
lr_scheduler_type: cosine
logging_steps: 1
bf16: true
per_device_train_batch_size: 1
gradient_accumulation_steps: 4
num_generations: 4
max_prompt_length: 256
max_completion_length: 786
num_train_epochs: 1
save_steps: 100
save_total_limit: 1
max_grad_norm: 0.1
log_on_each_node: false
"""

OPEN_R1_RECIPE = """
model_revision: main
torch_dtype: bfloat16
attn_implementation: sdpa
dataset_prompt_column: question
system_prompt: "You are a helpful AI Assistant."
bf16: true
use_vllm: false
do_eval: false
gradient_accumulation_steps: 4
gradient_checkpointing: true
gradient_checkpointing_kwargs:
  use_reentrant: false
hub_model_id: Qwen2.5-1.5B-Open-R1-GRPO
hub_strategy: every_save
learning_rate: 2.0e-05
log_completions: true
log_level: info
logging_first_step: true
logging_steps: 1
logging_strategy: steps
lr_scheduler_type: cosine_with_min_lr
lr_scheduler_kwargs:
  min_lr_rate: 0.1
max_prompt_length: 512
max_completion_length: 1024
max_steps: -1
num_generations: 16
num_train_epochs: 1
output_dir: data/Qwen2.5-1.5B-Open-R1-GRPO
overwrite_output_dir: true
per_device_eval_batch_size: 16
per_device_train_batch_size: 16
push_to_hub: true
report_to:
- none
reward_funcs:
- accuracy_reward
- think_format_reward
reward_weights:
- 1.0
- 1.0
save_strategy: "epoch"
save_steps: 0.1
save_total_limit: 1
seed: 42
temperature: 0.7
warmup_ratio: 0.1
"""


@pytest.mark.parametrize("recipe", [LLAMA_RECIPE, OPEN_R1_RECIPE], ids=["llama-1b", "open-r1"])
def test_widely_read_recipes_load_with_zero_edits(recipe, tmp_path, gsm8k_dir):
    from leangrpo.run.resolve import load_config

    path = tmp_path / "recipe.yaml"
    data = yaml.safe_load(recipe)
    script = {  # what the script itself names: the model, the data, the rewards
        "model_name_or_path": "some/model",
        "dataset_name": str(gsm8k_dir / "train.jsonl"),
        "reward_funcs": ["think_format_reward"],
    }
    path.write_text(yaml.safe_dump({**script, **data}))
    cfg = load_config(path)
    assert cfg.model.dtype == "bfloat16"
    if recipe is OPEN_R1_RECIPE:
        assert cfg.optim.lr_scheduler_kwargs == {"min_lr_rate": 0.1} and cfg.logging.save_steps == 0.1
        assert cfg.model.attn_implementation == "sdpa" and cfg.logging.report_to == []


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [LLAMA_RECIPE, OPEN_R1_RECIPE], ids=["llama-1b", "open-r1"])
def test_widely_read_recipes_train_with_zero_edits(recipe, tmp_path, tiny_model_dir):
    """The recipe as it is, beside what a script names (a model, a dataset with open-r1's `question` and
    `solution` columns, TRL's rewards), trains from the CLI: one step (max_steps and the run directory
    set on the command line, the recipe untouched)."""
    from test_e2e import run_cli

    rows = [{"question": f"What is {a} + {a}?", "solution": f"${2 * a}$"} for a in range(1, 9)]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tmp_path / "model"  # the tiny model with a real model's context: the recipes' lengths fit
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    script = {
        "model_name_or_path": str(model),
        "dataset_name": str(data),
        "reward_funcs": ["accuracy_reward", "think_format_reward"],
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({**script, **yaml.safe_load(recipe)}))
    out = tmp_path / "run"
    proc = run_cli("train", "-c", str(path), "optim.max_steps=1", f"output_dir={out}", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["step"] == 1
    assert {"rewards/accuracy_reward/mean", "rewards/think_format_reward/mean"} <= set(row)
    assert (out / "model" / "config.json").is_file()


def test_optim_args_and_target_modules_are_noted_where_transformers_adamw_ignores_them(caplog):
    """transformers' `get_optimizer_cls_and_kwargs` gives adamw_torch and bitsandbytes' AdamW the same
    optimizer with or without optim_args / optim_target_modules (they feed AnyPrecision, AdEMAMix, GaLore,
    APOLLO): leangrpo trains the same and says so in one line each. optim_args transformers cannot parse
    (its `_parse_optim_args` raises) is refused in one line."""
    from transformers import Trainer, TrainingArguments

    def optimizer(**fields):
        args = TrainingArguments(output_dir="unused", report_to="none", use_cpu=True, **fields)
        return Trainer.get_optimizer_cls_and_kwargs(args)

    extra = {"optim_args": "beta1=0.5, eps=1e-3", "optim_target_modules": ["attn"]}
    for name in ("adamw_torch", "adamw_torch_fused", "adamw_bnb_8bit", "adamw_8bit"):
        assert optimizer(optim=name, **extra) == optimizer(optim=name), name
        with caplog.at_level(logging.WARNING, logger="leangrpo.config.trl"):
            assert from_trl({"optim": name, **extra}, "t.yaml") == from_trl({"optim": name}, "t.yaml")
        notes = [r.message for r in caplog.records if "optim_" in r.message]
        assert notes == [
            "t.yaml: optim_args='beta1=0.5, eps=1e-3' ignored: " + handling("optim_args")[1],
            "t.yaml: optim_target_modules=['attn'] ignored: " + handling("optim_target_modules")[1],
        ]
        caplog.clear()
    for bad in ("beta1", "beta1=0.5,", "beta1=0.5=1"):
        with pytest.raises(ValueError):
            optimizer(optim="adamw_torch", optim_args=bad)
        with pytest.raises(ConfigError) as e:
            from_trl({"optim_args": bad}, "t.yaml")
        assert str(e.value) == (
            f"t.yaml: optim_args={bad!r}: must be comma-separated key=value pairs, as transformers parses it"
        )


def test_resume_from_checkpoint_is_read_where_trl_reads_it(tmp_path, caplog):
    """`trl grpo` passes a config's resume_from_checkpoint to `trainer.train()` (`trl_resume`: the run to
    resume); transformers' Trainer never reads `args.resume_from_checkpoint` itself, so the translation
    (a `GRPOConfig`'s too) takes it silently and changes nothing."""
    from leangrpo.run.resolve import trl_resume

    with caplog.at_level(logging.WARNING, logger="leangrpo.config.trl"):
        assert from_trl({"resume_from_checkpoint": "runs/x/checkpoint-4"}, "GRPOConfig") == from_trl({}, "t")
    assert "resume_from_checkpoint" not in caplog.text
    flat = tmp_path / "trl.yaml"
    for value, run in (
        ("runs/x/checkpoint-4", "runs/x"),
        ("runs/x", "runs/x"),
        (True, "latest"),
        (None, None),
    ):
        flat.write_text(yaml.safe_dump({"model_name_or_path": "m", "resume_from_checkpoint": value}))
        assert trl_resume(flat, []) == run
    assert trl_resume(flat, ["--resume_from_checkpoint", "runs/y/checkpoint-2"]) == "runs/y"
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}}))
    assert trl_resume(nested, []) is None and trl_resume(None, []) is None
