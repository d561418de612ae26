"""A flat TRL YAML (`GRPOConfig` fields with `trl grpo`'s model, dataset and reward keys) as a leangrpo
config: `leangrpo train -c trl_config.yaml` reads it unchanged.

Every field leangrpo has is mapped to its section; the fields whose meaning differs are translated so
that the run trains as TRL would (TRL's `max_steps` counts optimizer steps, leangrpo's steps are
generation batches of `num_iterations` optimizer steps each); any other field is refused in one line that
lists them all. The resolved, nested config is written to the run directory as usual (`config.yaml`).
"""

from __future__ import annotations

import os
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from leangrpo.core.errors import UserError

_SECTIONS_SEARCHED = ("grpo", "optim", "logging", "rewards", "data", "model")
"""Sections whose field names are TRL's: a flat key with one of their field names goes there."""

_RENAMED = {
    "model_name_or_path": "model.name_or_path",
    "torch_dtype": "model.dtype",
    "use_peft": "model.lora.enabled",
    "lora_r": "model.lora.r",
    "lora_alpha": "model.lora.alpha",
    "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    "dataset_name": "data.path",
    "dataset_config": "data.hub_config",
    "dataset_train_split": "data.split",
    "dataset_prompt_column": "data.prompt_column",  # open-r1's recipes
}

_TOP_LEVEL = ("output_dir", "seed")

_NEUTRAL = {
    "bf16": False, "fp16": False, "tf32": None, "push_to_hub": False, "use_vllm": False, "do_train": True,
    "use_liger_kernel": False, "logging_strategy": "steps", "save_strategy": "steps",
    "remove_unused_columns": False, "log_completions": True, "do_eval": False, "eval_strategy": "no",
    "model_revision": "main",
}  # fmt: skip
"""TRL fields whose value (here) asks for what leangrpo does anyway: accepted and dropped."""

_NO_EFFECT = (
    "log_level", "logging_first_step", "gradient_checkpointing_kwargs", "per_device_eval_batch_size",
    "overwrite_output_dir", "hub_model_id", "hub_strategy", "dataloader_num_workers",
)  # fmt: skip
"""TRL fields that change nothing a leangrpo run does, whatever their value (leangrpo logs step 1, picks
non-reentrant checkpointing, never overwrites a run without --overwrite, pushes nothing): dropped."""

_OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw",
    "adamw_bnb_8bit": "adamw_8bit", "adamw_8bit": "adamw_8bit",
}  # fmt: skip

_TRL_REWARDS = {  # `trl grpo`'s registry, as its script builds it
    "accuracy_reward": ("trl.rewards:accuracy_reward", None),
    "reasoning_accuracy_reward": ("trl.rewards:reasoning_accuracy_reward", None),
    "think_format_reward": ("trl.rewards:think_format_reward", None),
    "get_soft_overlong_punishment": (
        "trl.rewards:get_soft_overlong_punishment",
        {"max_completion_len": 1280, "soft_punish_cache": 256},
    ),
}


_SPECIAL = (
    "bf16", "fp16", "optim", "log_completions", "reward_funcs", "reward_weights", "reward_model_name_or_path",
    "steps_per_generation", "generation_batch_size", "max_steps", "num_train_epochs",
)  # fmt: skip
"""TRL fields translated by `_translate_special`."""


class TRLConfigError(UserError, ValueError):
    """A flat TRL config with fields leangrpo cannot honour."""


def is_trl_config(data: dict[str, Any]) -> bool:
    """A flat TRL config: no leangrpo section is a mapping, and some top-level key is a TRL field leangrpo
    maps (`model_name_or_path`, `learning_rate`, ...); a mere typo stays a leangrpo "unknown key"."""
    from leangrpo.config.schema import Config

    if any(isinstance(value, dict) for key, value in data.items() if key in Config.model_fields):
        return False
    unknown = data.keys() - Config.model_fields.keys()
    known = {*_RENAMED, *_SPECIAL}
    for section in _SECTIONS_SEARCHED:
        known |= _section_fields(section).keys()
    return bool(unknown & known) or isinstance(data.get("optim"), str)


def _section_fields(section: str) -> dict[str, FieldInfo]:
    """The fields of one of Config's sections (each a pydantic model)."""
    from leangrpo.config.schema import Config

    model = Config.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel), section
    return model.model_fields


def from_trl(flat: dict[str, Any], source: str) -> dict[str, Any]:
    """The nested leangrpo config for a flat TRL one; unsupported fields raise one TRLConfigError."""

    flat = dict(flat)
    out: dict[str, Any] = {"task": "dataset", "data": {"system_prompt": None}}
    refused: list[str] = []

    def put(path: str, value: Any) -> None:
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    _translate_special(flat, put, refused)
    fields = {s: _section_fields(s) for s in _SECTIONS_SEARCHED}
    for key, value in flat.items():
        if key in _RENAMED:
            put(_RENAMED[key], value)
        elif key in _TOP_LEVEL:
            out[key] = value
        elif section := next((s for s in _SECTIONS_SEARCHED if key in fields[s]), None):
            put(f"{section}.{key}", value)
        elif (key in _NEUTRAL and value == _NEUTRAL[key]) or key in _NO_EFFECT:
            continue
        else:
            refused.append(f"{key}={value!r}")
    if refused:
        raise TRLConfigError(
            f"{source}: TRL fields leangrpo does not support: {', '.join(refused)} "
            "(docs/trl.md lists every field and its leangrpo name)"
        )
    if out.get("model", {}).get("dtype") == "auto":
        del out["model"]["dtype"]
    return out


def _translate_special(flat: dict[str, Any], put: Any, refused: list[str]) -> None:
    """The fields whose TRL meaning needs a translation; each is popped from ``flat`` once handled."""
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        if flat.get(key) is True:
            flat.pop(key)
            put("model.dtype", dtype)
    if "optim" in flat:
        name = flat.pop("optim")
        if name in _OPTIMIZERS:
            put("optim.optimizer", _OPTIMIZERS[name])
        else:
            refused.append(f"optim={name!r} (leangrpo has {', '.join(_OPTIMIZERS)})")
    if flat.get("log_completions") is False:
        flat.pop("log_completions")
        put("logging.log_completions_steps", 0)
    _translate_rewards(flat, put)
    _translate_steps(flat, put, refused)


def _translate_rewards(flat: dict[str, Any], put: Any) -> None:
    """`reward_funcs` (TRL registry names or dotted import paths), `reward_weights` and
    `reward_model_name_or_path` as `rewards.functions`."""
    names = flat.pop("reward_funcs", None) or []
    names = [names] if isinstance(names, str) else list(names)  # TRL takes one name as well as a list
    model = flat.pop("reward_model_name_or_path", None)
    weights = flat.pop("reward_weights", None)
    if weights is not None and not isinstance(weights, list):
        raise TRLConfigError(f"reward_weights must be a list of numbers, one per reward (got {weights!r})")
    specs: list[dict[str, Any]] = [{"name": model}] if model else []
    for name in names:
        path, kwargs = _TRL_REWARDS.get(name, (None, None))
        if path is None:
            module, _, func = name.rpartition(".")
            path = f"{module}:{func}" if module else name
        specs.append({"name": path, **({"kwargs": kwargs} if kwargs else {})})
    if weights is not None:
        if len(weights) != len(specs):
            raise TRLConfigError(f"reward_weights has {len(weights)} entries for {len(specs)} rewards")
        for spec, weight in zip(specs, weights, strict=True):
            spec["weight"] = weight
    if specs:
        put("rewards.functions", specs)


def _translate_steps(flat: dict[str, Any], put: Any, refused: list[str]) -> None:
    """TRL's optimizer-step count and generation batch as leangrpo steps (one generation batch each,
    then `num_iterations` optimizer steps)."""
    iterations = int(flat.get("num_iterations", 1))
    per_device = int(flat.get("per_device_train_batch_size", 8))
    accumulation = int(flat.get("gradient_accumulation_steps", 1))
    steps_per_generation = flat.pop("steps_per_generation", None)
    if steps_per_generation is not None and int(steps_per_generation) != accumulation:
        refused.append(
            f"steps_per_generation={steps_per_generation} (leangrpo generates once per optimizer step: "
            f"it must equal gradient_accumulation_steps={accumulation})"
        )
    generation_batch_size = flat.pop("generation_batch_size", None)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if generation_batch_size is not None and int(generation_batch_size) != per_device * accumulation * world:
        refused.append(
            f"generation_batch_size={generation_batch_size} (it must be per_device_train_batch_size × "
            f"gradient_accumulation_steps × processes = {per_device * accumulation * world})"
        )
    max_steps = flat.pop("max_steps", None)
    if max_steps is not None and int(max_steps) > 0:
        flat.pop("num_train_epochs", None)  # TRL: a positive max_steps wins over epochs
        if int(max_steps) % iterations:
            refused.append(
                f"max_steps={max_steps} (TRL counts optimizer steps; leangrpo makes num_iterations="
                f"{iterations} of them per generation batch, so it must be a multiple of {iterations})"
            )
        else:
            put("optim.max_steps", int(max_steps) // iterations)
    elif "num_train_epochs" not in flat:
        put("optim.num_train_epochs", 3.0)  # TRL's default length
