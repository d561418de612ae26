"""TRL's entry points (issue 49, item 3): `GRPOConfig` through `TrlParser`, so that `trl/scripts/grpo.py`
runs with only its imports changed; a `trl.GRPOConfig` given to leangrpo's GRPOTrainer; TRL's `--flag value`
overrides on `leangrpo train`."""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TESTS = Path(__file__).resolve().parent
trl = pytest.importorskip("trl")

# A command line of TRL's, with a value of each kind (number, bool, string, JSON dict, list, `=` form).
ARGS = [
    "--output_dir", "out", "--learning_rate", "3e-5", "--bf16", "false", "--max_completion_length=16",
    "--num_generations", "4", "--per_device_train_batch_size", "4", "--lr_scheduler_type", "cosine",
    "--lr_scheduler_kwargs", '{"num_cycles": 0.5}', "--chat_template_kwargs", '{"enable_thinking": false}',
    "--temperature", "0.7", "--no_gradient_checkpointing", "--reward_weights", "1.0", "2.0",
    "--logging_steps", "2", "--include_num_input_tokens_seen", "false", "--report_to", "none",
]  # fmt: skip

DERIVED = {
    "report_to", "debug", "pad_to_multiple_of", "accelerator_config", "activation_checkpointing",
    "disable_tqdm", "generation_batch_size", "steps_per_generation",
}  # fmt: skip
"""Fields TRL's `__post_init__` derives from others (leangrpo reads them where the run is translated)."""


def _plain(value: object) -> object:
    return value.value if isinstance(value, enum.Enum) else value


def test_trl_parser_parses_leangrpos_config_as_trls():
    from trl import TrlParser

    from leangrpo import GRPOConfig

    assert dataclasses.is_dataclass(GRPOConfig)
    (ours,) = TrlParser((GRPOConfig,)).parse_args_and_config(ARGS)
    (theirs,) = TrlParser((trl.GRPOConfig,)).parse_args_and_config(ARGS)
    assert isinstance(ours, GRPOConfig)
    for f in dataclasses.fields(trl.GRPOConfig):
        if f.name not in DERIVED:
            assert getattr(ours, f.name) == _plain(getattr(theirs, f.name)), f.name
    assert ours.lr_scheduler_kwargs == {"num_cycles": 0.5} and ours.reward_weights == [1.0, 2.0]


def test_a_trl_grpo_config_trains_as_the_same_leangrpo_one(tiny_model_dir):
    """A `trl.GRPOConfig` is taken field by field (TRL's defaults too): the run's config is the one the same
    command line gives leangrpo's GRPOConfig."""
    from trl import TrlParser

    from leangrpo import GRPOConfig, GRPOTrainer

    rows = [{"prompt": "x"}]
    (ours,) = TrlParser((GRPOConfig,)).parse_args_and_config(ARGS)
    (theirs,) = TrlParser((trl.GRPOConfig,)).parse_args_and_config(ARGS)
    mine = GRPOTrainer(str(tiny_model_dir), ["strict_format", "strict_format"], ours, rows)
    converted = GRPOTrainer(str(tiny_model_dir), ["strict_format", "strict_format"], theirs, rows)
    assert converted.cfg == mine.cfg
    assert isinstance(converted.args, GRPOConfig) and converted.args.learning_rate == 3e-5
    assert mine.cfg.optim.lr_scheduler_type == "cosine" and mine.cfg.grpo.max_completion_length == 16
    assert mine.cfg.model.gradient_checkpointing is False


def test_trl_grpo_script_runs_with_only_its_imports_changed(tmp_path, tiny_model_dir):
    """`trl/scripts/grpo.py` as TRL ships it, `GRPOConfig` and `GRPOTrainer` imported from leangrpo: TrlParser
    builds the config, the trainer trains one step and saves the model, `trainer.end()` closes."""
    source = (Path(trl.__file__).parent / "scripts" / "grpo.py").read_text()
    imports = {
        "    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n": (
            "    from trl import get_dataset, get_peft_config, get_quantization_config\n\n"
            "    from leangrpo import GRPOTrainer\n"
        ),
        "    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser\n": (
            "    from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n\n"
            "    from leangrpo import GRPOConfig\n"
        ),
    }
    for theirs, ours in imports.items():
        assert source.count(theirs) == 1
        source = source.replace(theirs, ours)
    script = tmp_path / "grpo.py"
    script.write_text(source)
    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": [{"role": "user", "content": f"The sky is {i}"}]} for i in range(8)]
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"
    args = [
        "--model_name_or_path", str(tiny_model_dir), "--dataset_name", str(data), "--output_dir", str(out),
        "--reward_funcs", "think_format_reward", "--max_steps", "1", "--per_device_train_batch_size", "4",
        "--num_generations", "4", "--max_completion_length", "8", "--bf16", "false", "--learning_rate=1e-5",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent / "src"), "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    done = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Model saved to" in done.stdout
    run = yaml.safe_load((out / "config.yaml").read_text())
    assert run["optim"]["learning_rate"] == 1e-5 and run["grpo"]["max_completion_length"] == 8
    assert (out / "config.json").is_file()  # save_model(output_dir): TRL's layout


def _trl_yaml(tmp_path: Path, gsm8k_dir: Path) -> Path:
    path = tmp_path / "trl.yaml"
    flat = {"model_name_or_path": "some/model", "dataset_name": str(gsm8k_dir / "train.jsonl")}
    path.write_text(yaml.safe_dump({**flat, "max_steps": 4, "reward_funcs": ["think_format_reward"]}))
    return path


def test_train_takes_trls_flags_beside_overrides(tmp_path, gsm8k_dir):
    """`leangrpo train -c trl.yaml --learning_rate 1e-5 ...`: TRL's flags join the flat config before its
    translation (`--max_steps` counts optimizer steps), beside `section.key=value`."""
    from leangrpo.run.resolve import load_config

    path = _trl_yaml(tmp_path, gsm8k_dir)
    flags = [
        "--learning_rate", "1e-5", "--num_iterations=2", "--max_steps", "6", "--bf16", "--reward_funcs",
        "think_format_reward", "accuracy_reward", "grpo.beta=0.01", "--lora-r", "4",
    ]  # fmt: skip
    cfg = load_config(path, flags)
    assert (cfg.optim.learning_rate, cfg.optim.max_steps, cfg.grpo.num_iterations) == (1e-5, 3, 2)
    assert cfg.model.dtype == "bfloat16" and cfg.grpo.beta == 0.01 and cfg.model.lora.r == 4
    names = [f.name for f in cfg.rewards.functions]
    assert names == ["trl.rewards:think_format_reward", "trl.rewards:accuracy_reward"]
    assert load_config(None, ["--model_name_or_path", "m", "--dataset_name", str(gsm8k_dir / "train.jsonl"),
                              "--reward_funcs", "think_format_reward"]).model.name_or_path == "m"  # fmt: skip


def test_trl_flags_on_a_nested_config_set_their_field_or_are_refused(tmp_path, gsm8k_dir):
    from leangrpo.config.schema import ConfigError
    from leangrpo.run.resolve import load_config

    path = tmp_path / "nested.yaml"
    data = {"path": str(gsm8k_dir / "train.jsonl")}
    path.write_text(yaml.safe_dump({"model": {"name_or_path": "m"}, "data": data}))
    assert load_config(path, ["--learning_rate", "1e-5"]).optim.learning_rate == 1e-5
    with pytest.raises(ConfigError, match=r"^--max_steps: .*nested\.yaml is leangrpo's nested config"):
        load_config(path, ["--max_steps", "3"])


def test_a_bad_flag_is_one_line_naming_the_command_line(tmp_path, gsm8k_dir):
    from test_e2e import run_cli

    path = _trl_yaml(tmp_path, gsm8k_dir)
    proc = run_cli("train", "-c", str(path), "--learning_rate", "fast", timeout=120)
    assert proc.returncode != 0
    lines = [
        line for line in proc.stderr.strip().splitlines() if not line.startswith("WARNING")
    ]  # start-up notes
    assert len(lines) == 1 and "trl.yaml and the command line: optim.learning_rate" in lines[0], proc.stderr
    proc = run_cli("train", "-c", str(path), "--not_a_field", "1", timeout=120)
    assert "not_a_field: not a TRL 1.16 GRPOConfig field" in proc.stderr and proc.returncode != 0


def test_a_rollout_func_is_given_the_grpo_trainer_with_trls_attributes(tmp_path, tiny_model_dir):
    """As TRL calls `rollout_func(prompts, self)`: leangrpo's GRPOTrainer itself, with what TRL's examples
    read of it (the args, tokenizer, model, accelerator, state and the sampling settings copied from args)."""
    from leangrpo import GRPOConfig, GRPOTrainer

    seen = []

    def rollout_func(prompts, trainer):
        tok = trainer.processing_class
        seen.append({
            "trainer": trainer, "device": trainer.accelerator.device, "step": trainer.state.global_step,
            "trained": trainer.model is trainer._run.unwrapped.lm, "lr": trainer.args.learning_rate,
            "sampling": (trainer.num_generations, trainer.max_completion_length, trainer.temperature,
                         trainer.top_p, trainer.top_k, trainer.min_p, trainer.repetition_penalty),
            "vllm": (trainer.use_vllm, trainer.vllm_mode), "kwargs": trainer.chat_template_kwargs,
        })  # fmt: skip
        ids = tok("sunny<|im_end|>", add_special_tokens=False).input_ids
        n = len(prompts)
        return {
            "prompt_ids": [[10, 11]] * n,
            "completion_ids": [ids] * n,
            "logprobs": [[-1.0] * len(ids)] * n,
        }

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=8, temperature=0.9, top_k=5, learning_rate=2e-6, logging_steps=1,
    )  # fmt: skip
    rows = [{"prompt": f"The sky is {i}"} for i in range(4)]
    trainer = GRPOTrainer(str(tiny_model_dir), "strict_format", args, rows, rollout_func=rollout_func)
    trainer.train()
    first, second = seen
    assert first["trainer"] is trainer and first["trained"] and first["lr"] == 2e-6
    assert (first["step"], second["step"]) == (0, 1)
    assert first["sampling"] == (2, 8, 0.9, 1.0, 5, None, 1.0) and first["vllm"] == (False, "colocate")
    assert first["kwargs"] == {} and str(first["device"]) == "cpu"
    # TRL's vllm_generation has no counterpart: one line naming it, and getattr's default still works
    with pytest.raises(AttributeError, match=r"^trainer.vllm_generation: leangrpo has no TRL VLLMGeneration"):
        trainer.vllm_generation  # noqa: B018
    assert getattr(trainer, "vllm_generation", None) is None
