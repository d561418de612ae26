"""Tests for the typed run configuration (leangrpo.config.schema) and the light CLI entry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leangrpo.config.schema import Config, ConfigError
from leangrpo.run.resolve import load_config, resolve_steps, save_config, validate_config, with_model_path

MINIMAL = """\
model:
  name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct
data:
  path: data/train.jsonl
rewards:
  functions:
    - name: correctness
"""


@pytest.fixture
def minimal_yaml(tmp_path: Path) -> Path:
    p = tmp_path / "run.yaml"
    p.write_text(MINIMAL)
    return p


def config_error(path, overrides=None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    msg = str(info.value)
    assert "\n" not in msg, msg
    assert msg.strip(), "empty message"
    return msg


# --------------------------------------------------------------------------- loading


def test_minimal_yaml_loads_with_defaults(minimal_yaml):
    cfg = load_config(minimal_yaml)
    assert isinstance(cfg, Config)
    assert cfg.model.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert cfg.data.path == "data/train.jsonl"
    assert [f.name for f in cfg.rewards.functions] == ["correctness"]
    assert cfg.rewards.functions[0].weight == 1.0
    # defaults
    assert cfg.model.dtype == "float32"
    assert cfg.model.lora.enabled is False
    assert cfg.grpo.num_generations == 8
    assert cfg.grpo.loss_type == "dapo"
    assert cfg.grpo.scale_rewards == "group"
    assert cfg.grpo.epsilon == 0.2 and cfg.grpo.epsilon_high is None
    assert cfg.grpo.beta == 0.0
    assert cfg.optim.learning_rate == 1e-6
    assert cfg.optim.per_device_train_batch_size == 8
    assert cfg.generation_batch_size == 8
    assert cfg.prompts_per_step == 1
    assert cfg.seed == 42


def test_overrides_are_typed(minimal_yaml):
    cfg = load_config(
        minimal_yaml,
        [
            "grpo.num_generations=4",
            "optim.learning_rate=3e-6",
            "model.lora.enabled=true",
            "model.dtype=bf16",
            "grpo.scale_rewards=false",
        ],
    )
    assert cfg.grpo.num_generations == 4 and type(cfg.grpo.num_generations) is int
    assert cfg.optim.learning_rate == 3e-6 and type(cfg.optim.learning_rate) is float
    assert cfg.model.lora.enabled is True
    assert cfg.model.dtype == "bfloat16"
    assert cfg.grpo.scale_rewards == "none"
    assert cfg.prompts_per_step == 2  # 8 completions / 4 per prompt


def test_learning_rate_1e_minus_6_is_float(minimal_yaml):
    cfg = load_config(minimal_yaml, ["optim.learning_rate=1e-6"])
    assert type(cfg.optim.learning_rate) is float
    assert cfg.optim.learning_rate == pytest.approx(1e-6, rel=0, abs=1e-20)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("bf16", "bfloat16"), ("fp16", "float16"), ("fp32", "float32"), ("bfloat16", "bfloat16")],
)
def test_dtype_aliases(minimal_yaml, value, expected):
    assert load_config(minimal_yaml, [f"model.dtype={value}"]).model.dtype == expected


def test_scale_rewards_true_means_group(minimal_yaml):
    assert load_config(minimal_yaml, ["grpo.scale_rewards=true"]).grpo.scale_rewards == "group"
    assert load_config(minimal_yaml, ["grpo.scale_rewards=batch"]).grpo.scale_rewards == "batch"


def test_overrides_only_without_file():
    cfg = load_config(
        None,
        ["model.name_or_path=m", "data.path=d.jsonl", "rewards.functions=[{name: correctness}]"],
    )
    assert cfg.model.name_or_path == "m" and cfg.rewards.functions[0].name == "correctness"


def test_override_beats_file_value(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(MINIMAL + "grpo:\n  num_generations: 2\n  beta: 0.04\n")
    cfg = load_config(p, ["grpo.num_generations=4"])
    assert cfg.grpo.num_generations == 4
    assert cfg.grpo.beta == 0.04  # sibling from the file kept


def test_validate_config_dict():
    data = yaml.safe_load(MINIMAL)
    cfg = validate_config(data)
    assert cfg.model.name_or_path.startswith("HuggingFaceTB")
    data["grpo"] = {"loss_type": "nope"}
    with pytest.raises(ConfigError, match="grpo.loss_type"):
        validate_config(data, "mysrc")


# --------------------------------------------------------------------------- errors


def test_unknown_key_typo(minimal_yaml):
    msg = config_error(minimal_yaml, ["grpo.num_generation=4"])
    assert "grpo.num_generation" in msg
    assert "unknown key" in msg
    assert str(minimal_yaml) in msg


def test_unknown_top_level_key_in_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(MINIMAL + "optimizer:\n  learning_rate: 1.0e-6\n")
    msg = config_error(p)
    assert "optimizer" in msg and "unknown key" in msg


def test_wrong_type(minimal_yaml):
    msg = config_error(minimal_yaml, ["optim.learning_rate=abc"])
    assert "optim.learning_rate" in msg
    assert "abc" in msg


def test_num_generations_must_be_at_least_two(minimal_yaml):
    msg = config_error(minimal_yaml, ["grpo.num_generations=1"])
    assert "grpo.num_generations" in msg
    assert "2" in msg


def test_generation_batch_not_divisible(minimal_yaml):
    msg = config_error(minimal_yaml, ["optim.per_device_train_batch_size=6", "grpo.num_generations=4"])
    assert "grpo.num_generations" in msg
    assert "6" in msg


def test_generation_batch_counts_accumulation(minimal_yaml):
    # 6 x 2 = 12 is divisible by 4
    cfg = load_config(
        minimal_yaml,
        [
            "optim.per_device_train_batch_size=6",
            "optim.gradient_accumulation_steps=2",
            "grpo.num_generations=4",
        ],
    )
    assert cfg.generation_batch_size == 12 and cfg.prompts_per_step == 3


def test_epsilon_high_below_epsilon(minimal_yaml):
    msg = config_error(minimal_yaml, ["grpo.epsilon=0.2", "grpo.epsilon_high=0.1"])
    assert "grpo.epsilon_high" in msg
    # equal or above is fine
    assert load_config(minimal_yaml, ["grpo.epsilon_high=0.28"]).grpo.epsilon_high == 0.28
    assert load_config(minimal_yaml, ["grpo.epsilon_high=0.2"]).grpo.epsilon_high == 0.2


def test_cispo_and_sapo_options(minimal_yaml):
    cfg = load_config(minimal_yaml, ["grpo.loss_type=sapo", "grpo.sapo_temperature_neg=2"])
    assert cfg.grpo.loss_type == "sapo" and cfg.grpo.sapo_temperature_neg == 2.0
    msg = config_error(minimal_yaml, ["grpo.loss_type=cispo", "grpo.epsilon_high=5", "grpo.delta=8"])
    assert "grpo.delta clips the ratio, which loss_type cispo does not" in msg


def test_delta_must_exceed_the_upper_clip(minimal_yaml):
    msg = config_error(minimal_yaml, ["grpo.epsilon_high=0.28", "grpo.delta=1.2"])
    assert "grpo.delta=1.2 must exceed 1 + epsilon_high = 1.28" in msg
    assert "grpo.delta" in config_error(minimal_yaml, ["grpo.delta=0.5"])
    cfg = load_config(minimal_yaml, ["grpo.delta=4", "grpo.importance_sampling_level=sequence"])
    assert cfg.grpo.delta == 4.0 and cfg.grpo.importance_sampling_level == "sequence"
    assert "grpo.importance_sampling_level" in config_error(
        minimal_yaml, ["grpo.importance_sampling_level=seq"]
    )


def test_bad_loss_type(minimal_yaml):
    msg = config_error(minimal_yaml, ["grpo.loss_type=ppo"])
    assert "grpo.loss_type" in msg
    assert "ppo" in msg


def test_missing_required_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(MINIMAL.replace("  name_or_path: HuggingFaceTB/SmolLM2-135M-Instruct\n", "  dtype: bf16\n"))
    msg = config_error(p)
    assert "model.name_or_path" in msg
    assert "missing" in msg


def test_rewards_default_to_the_task_and_a_task_without_rewards_needs_them(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("model:\n  name_or_path: m\ndata:\n  path: d\n")
    cfg = load_config(p)
    assert [f.name for f in cfg.rewards.functions] == [
        "xmlcount",
        "soft_format",
        "strict_format",
        "int",
        "correctness",
    ]
    assert cfg.data.system_prompt.startswith("Respond in the following format")
    msg = config_error(p, ["task=dataset"])
    assert "rewards.functions" in msg and "task dataset has no default rewards" in msg


def test_task_names_and_options_are_checked_in_one_line(minimal_yaml):
    assert "unknown task 'gsm8' did you mean gsm8k" in config_error(minimal_yaml, ["task=gsm8"]).replace(
        ";", ""
    )
    msg = config_error(minimal_yaml, ["task.max_solution_step=2"])
    assert "task gsm8k has no option 'max_solution_step' (its options: max_solution_steps)" in msg
    assert "task option max_solution_steps" in config_error(minimal_yaml, ["task.max_solution_steps=0"])
    cfg = load_config(minimal_yaml, ["task.max_solution_steps=2"])
    assert cfg.task.name == "gsm8k" and cfg.task.options() == {"max_solution_steps": 2}
    assert cfg.model_dump(mode="json")["task"] == {"name": "gsm8k", "max_solution_steps": 2}


def test_an_explicit_null_system_prompt_means_none(minimal_yaml):
    assert load_config(minimal_yaml, ["data.system_prompt=null"]).data.system_prompt is None
    assert (
        load_config(minimal_yaml, ["task=dataset", "rewards.functions=[{name: int}]"]).data.system_prompt
        is None
    )


def test_override_without_equals(minimal_yaml):
    msg = config_error(minimal_yaml, ["grpo.num_generations"])
    assert "grpo.num_generations" in msg
    assert "=" in msg


def test_override_with_empty_key(minimal_yaml):
    config_error(minimal_yaml, ["=4"])


def test_override_into_non_section(minimal_yaml):
    msg = config_error(minimal_yaml, ["seed.x=1"])
    assert "seed" in msg


def test_invalid_yaml_names_file_and_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("model:\n  name_or_path: x\n data: [\n")  # bad indentation on line 3
    with pytest.raises(ConfigError) as info:
        load_config(p)
    msg = str(info.value)
    assert f"{p}:3" in msg
    assert "not valid YAML" in msg


def test_invalid_yaml_error_is_one_line(tmp_path):
    p = tmp_path / "broken.yaml"
    p.write_text("model:\n  name_or_path: x\n data: [\n")
    config_error(p)


def test_override_with_invalid_yaml_value_is_config_error(minimal_yaml):
    msg = config_error(minimal_yaml, ["data.path=[oops"])
    assert "data.path" in msg


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    msg = config_error(p)
    assert "not found" in msg and str(p) in msg


def test_yaml_list_is_not_a_mapping(tmp_path):
    p = tmp_path / "list.yaml"
    p.write_text("- a\n- b\n")
    msg = config_error(p)
    assert str(p) in msg and "mapping" in msg


def test_config_error_is_value_error():
    from leangrpo.core.errors import UserError

    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, UserError)


# --------------------------------------------------------------------------- save round-trip


def test_save_config_round_trip(minimal_yaml, tmp_path):
    cfg = load_config(
        minimal_yaml,
        [
            "grpo.num_generations=4",
            "grpo.epsilon_high=0.28",
            "grpo.beta=0.04",
            "model.lora.enabled=true",
            "model.lora.target_modules=[q_proj, v_proj]",
            "model.dtype=bf16",
            "data.limit=100",
            "rewards.functions=[{name: correctness, weight: 2.0}, {name: format, weight: 0.5}]",
        ],
    )
    out = tmp_path / "resolved.yaml"
    save_config(cfg, out)
    again = load_config(out)
    assert again == cfg
    assert again.model.lora.target_modules == ["q_proj", "v_proj"]
    assert again.rewards.functions[1].weight == 0.5
    # the saved file is complete: every section written out
    saved = yaml.safe_load(out.read_text())
    assert set(saved) >= {"model", "data", "rewards", "grpo", "optim", "logging", "output_dir", "seed"}
    assert saved["data"]["system_prompt"] == cfg.data.system_prompt


def test_the_resolved_config_is_frozen(minimal_yaml):
    from pydantic import ValidationError

    cfg = load_config(minimal_yaml)
    for section, key, value in [
        (cfg.optim, "max_steps", 3),
        (cfg.model, "name_or_path", "other"),
        (cfg.model.lora, "r", 4),
        (cfg.task, "name", "dataset"),
        (cfg, "output_dir", "elsewhere"),
    ]:
        with pytest.raises(ValidationError, match="frozen"):
            setattr(section, key, value)
    assert cfg.optim.max_steps != 3 and cfg.model.name_or_path != "other" and cfg.output_dir != "elsewhere"


def test_epochs_resolve_to_steps_in_a_new_config(minimal_yaml):
    # 2 epochs of 10 rows, 2 prompts per step per process (4 completions / 2 generations), 3 processes
    cfg = load_config(minimal_yaml, ["optim.num_train_epochs=2", "optim.per_device_train_batch_size=4",
                                     "grpo.num_generations=2"])  # fmt: skip
    resolved = resolve_steps(cfg, num_rows=10, num_processes=3)
    assert resolved.optim.max_steps == 4 and cfg.optim.max_steps == 100  # ceil(20 / 6); cfg unchanged
    assert resolved.grpo == cfg.grpo and resolved.optim.learning_rate == cfg.optim.learning_rate
    explicit = load_config(minimal_yaml, ["optim.num_train_epochs=2", "optim.max_steps=7"])
    assert resolve_steps(explicit, num_rows=10, num_processes=3) is explicit  # max_steps wins
    moved = with_model_path(cfg, "runs/x/base-model")
    assert (
        moved.model.name_or_path == "runs/x/base-model" and cfg.model.name_or_path != moved.model.name_or_path
    )
    assert moved.model.lora == cfg.model.lora


# --------------------------------------------------------------------------- CLI


def _run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, timeout=60, **kw)


def test_cli_import_does_not_load_torch():
    r = _run([sys.executable, "-c", "import leangrpo.cli, sys; print('torch' in sys.modules)"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"


def test_cli_bad_config_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(MINIMAL + "grpo:\n  num_generation: 4\n")
    r = _run([sys.executable, "-m", "leangrpo", "train", "-c", str(bad)])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error:")
    assert "grpo.num_generation" in lines[0]


def test_cli_bad_override_is_one_line_error(minimal_yaml):
    r = _run([sys.executable, "-m", "leangrpo", "train", "-c", str(minimal_yaml), "grpo.num_generations=1"])
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:")
    assert "grpo.num_generations" in lines[0]


def test_cli_missing_config_file(tmp_path):
    r = _run([sys.executable, "-m", "leangrpo", "train", "-c", str(tmp_path / "missing.yaml")])
    assert r.returncode == 2
    assert r.stderr.strip().startswith("error:") and "Traceback" not in r.stderr


def test_cli_help_lists_train():
    script = Path(sys.executable).parent / "leangrpo"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "leangrpo"]
    r = _run([*cmd, "--help"])
    assert r.returncode == 0, r.stderr
    assert "train" in r.stdout


def test_the_cold_start_needs_a_task_with_worked_solutions(minimal_yaml):
    msg = config_error(minimal_yaml, ["sft.steps=5", "task=dataset"])
    assert "sft.steps needs worked solutions, which task dataset does not have" in msg


def test_the_config_reference_in_docs_is_current():
    """docs/config.md is generated from the fields' descriptions: every field has one, and the file is
    regenerated when a field changes (python -m leangrpo.commands.configdoc > docs/config.md)."""
    from leangrpo.commands.configdoc import reference

    text = reference()
    assert "| `grpo.num_generations` | `8` | completions sampled per prompt" in text
    assert "| `task.max_solution_steps` |" in text
    assert not [line for line in text.splitlines() if line.startswith("| `") and line.endswith("|  |")]
    docs = Path(__file__).resolve().parents[1] / "docs" / "config.md"
    assert docs.read_text() == text, "docs/config.md is stale: python -m leangrpo.commands.configdoc > it"


@pytest.mark.parametrize(
    "override, expected",
    [
        ("grpo.vllm_gpu_memory_utilization=0", "grpo.vllm_gpu_memory_utilization: must be in (0, 1]"),
        ("grpo.vllm_gpu_memory_utilization=1.5", "grpo.vllm_gpu_memory_utilization: must be in (0, 1]"),
        ("grpo.vllm_mode=remote", "grpo.vllm_mode: Input should be 'colocate' or 'server'"),
        ("grpo.vllm_server_port=0", "grpo.vllm_server_port: Input should be greater than or equal to 1"),
        ("grpo.vllm_server_timeout=0", "grpo.vllm_server_timeout: Input should be greater than 0"),
        ("grpo.vllm_importance_sampling_mode=token", "grpo.vllm_importance_sampling_mode"),
        ("grpo.vllm_max_model_length=100", "vllm_max_model_length=100 is below max_prompt_length"),
    ],
)
def test_vllm_fields_are_checked_in_one_line(minimal_yaml, override, expected):
    assert expected in config_error(minimal_yaml, [override])


def test_vllm_context_window_is_derived_from_the_lengths(minimal_yaml):
    cfg = load_config(minimal_yaml, ["grpo.max_prompt_length=100", "grpo.max_completion_length=28"])
    assert (cfg.grpo.use_vllm, cfg.grpo.vllm_mode, cfg.grpo.vllm_gpu_memory_utilization) == (
        False,
        "colocate",
        None,  # the memory plan's, at start-up
    )
    assert cfg.grpo.max_model_length == 128
    assert load_config(minimal_yaml, ["grpo.vllm_max_model_length=1000"]).grpo.max_model_length == 1000


def test_the_cpu_fields_earlier_names_still_read_with_a_note(caplog):
    """model.cpu_matmul and grpo.packed_generation / packed_lm_head / reference_on_disk moved to `cpu:`;
    a config with the old names trains the same, says where each went, and is saved with the new ones."""
    old = {
        "model": {"name_or_path": "m", "cpu_matmul": "blas"},
        "data": {"path": "d.jsonl"},
        "rewards": {"functions": [{"name": "int"}]},
        "grpo": {"packed_generation": False, "packed_lm_head": False, "reference_on_disk": True},
    }
    with caplog.at_level("WARNING", logger="leangrpo.config"):
        cfg = validate_config(old)
    assert cfg.cpu.model_dump() == {
        "matmul": "blas", "packed_generation": False, "packed_lm_head": False, "reference_on_disk": True,
    }  # fmt: skip
    assert "model.cpu_matmul is now cpu.matmul" in caplog.text
    assert caplog.text.count("is now cpu.") == 4
    saved = cfg.model_dump(mode="json")
    assert "cpu_matmul" not in saved["model"] and "packed_generation" not in saved["grpo"]
