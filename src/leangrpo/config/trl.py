"""A flat TRL YAML (`GRPOConfig` fields with `trl grpo`'s model, dataset and reward keys) as a leangrpo
config: `leangrpo train -c trl_config.yaml` reads it unchanged, and `leangrpo.GRPOConfig` goes through the
same translation.

Every field of TRL 1.16's `GRPOConfig` is in one of two lists (`field_table`, which docs/trl.md shows):
honoured (mapped to its leangrpo field, or translated so that the run trains as TRL would) or noted
(ignored with a one-line notice: ignoring it changes no trained weight). A noted field at TRL's default (or
at a value that asks for what leangrpo does anyway) passes silently. What a run cannot take (an unknown
key, a bad value, a script key leangrpo does not support) is reported at once, one line each.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from leangrpo.config.schema import Config, ConfigError
from leangrpo.config.trl_fields import TRL_DEFAULTS, TRL_DICT_FIELDS
from leangrpo.core.loss_types import LOSS_TYPES

logger = logging.getLogger("leangrpo.config.trl")

Handling = Literal["honoured", "noted"]

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
    "dataset_test_split": "eval.split",
    "dataset_prompt_column": "data.prompt_column",  # open-r1's recipes
    "per_device_eval_batch_size": "eval.batch_size",
    "vllm_importance_sampling_cap": "grpo.vllm_importance_sampling_clip_max",  # TRL's older name
    "tool_timeout_s": "tools.timeout_s",  # leangrpo's: TRL bounds neither tools nor rewards
    "reward_timeout_s": "rewards.timeout_s",
    "vllm_structured_outputs_regex": "grpo.structured_outputs_regex",  # the HF engine's too
}

_AMBIGUOUS = {
    "timeout_s": "not a TRL GRPOConfig field; say reward_timeout_s (rewards.timeout_s, a reward call's "
    "limit) or tool_timeout_s (tools.timeout_s, a tool call's)",
}
"""leangrpo field names that more than one section has: refused in a TRL config, with the names to use."""

_TOP_LEVEL = ("output_dir", "seed")

_SCRIPT_KEYS = {
    "model_revision": "main", "overwrite_output_dir": None, "gradient_checkpointing_use_reentrant": False,
    "dataset_streaming": False, "lora_task_type": "CAUSAL_LM", "use_rslora": False, "use_dora": False,
    "lora_modules_to_save": None, "load_in_8bit": False,
}  # fmt: skip
"""Keys of `trl grpo`'s script arguments (and fields recipes still carry from older releases) that are not
GRPOConfig fields, with the value that passes silently."""

_TRANSLATED = {
    "bf16": "`true`: model.dtype bfloat16 (fp32 master copy: optim.master_weights; log-softmax in fp32)",
    "fp16": "`true`: model.dtype float16, which training refuses (no loss scaling)",
    "optim": "adamw_torch(_fused) → optim.optimizer adamw, adamw_bnb_8bit / adamw_8bit → adamw_8bit",
    "log_completions": "`true`: logging.log_completions_steps = logging_steps (completions.jsonl); `false` "
    "(TRL's default): 0, none logged",
    "reward_weights": "rewards.functions[].weight",
    "max_steps": "optim.max_steps = max_steps × gradient_accumulation_steps / (num_iterations × "
    "steps_per_generation) (TRL counts optimizer steps; leangrpo, generations)",
    "num_train_epochs": "optim.num_train_epochs (a positive max_steps wins, as in TRL)",
    "steps_per_generation": "grpo.steps_per_generation (TRL's generation buffer; default "
    "gradient_accumulation_steps)",
    "generation_batch_size": "grpo.steps_per_generation = generation_batch_size / "
    "(per_device_train_batch_size × processes)",
    "save_strategy": "`steps`: as save_steps; `no`: logging.save_steps 0 and save_minutes 0",
    "eval_strategy": "`steps`: eval.enabled, every eval_steps (TRL's default: logging_steps); a "
    "`GRPOTrainer` with an `eval_dataset`: TRL's evaluation, `steps` or `epoch` (above)",
    "eval_steps": "eval.eval_steps (below 1, a ratio of the run)",
    "num_generations_eval": "with eval_strategy `steps`: eval.num_samples, completions sampled per eval "
    "prompt (default num_generations, as TRL)",
    "model_init_kwargs": "dtype / torch_dtype, attn_implementation, trust_remote_code → model.*",
    "disable_tqdm": "logging.progress_bar = not disable_tqdm",
    "resume_from_checkpoint": "`leangrpo train -c`: resumes that run (`true`: output_dir's) as --resume, as "
    "`trl grpo` passes it to train(); a `GRPOConfig`'s is read only by train(resume_from_checkpoint=...), as "
    "in TRL",
}
"""GRPOConfig fields honoured by a translation (`_translate_special`), as the table shows them."""

_NOTED = {
    "average_tokens_across_devices": "GRPO normalises its loss itself (loss_type)",
    "label_smoothing_factor": "GRPO's loss has no labels",
    "bf16_full_eval": "evaluation runs in the model's dtype",
    "fp16_full_eval": "evaluation runs in the model's dtype",
    "activation_checkpointing": "model.gradient_checkpointing recomputes activations",
    "activation_checkpointing_kwargs": "leangrpo picks its own checkpointing",
    "gradient_checkpointing_kwargs": "leangrpo always uses non-reentrant checkpointing",
    "torch_compile": "speed only",
    "torch_compile_backend": "speed only",
    "torch_compile_mode": "speed only",
    "use_liger_kernel": "Liger's fused loss computes the same loss (memory and speed only)",
    "liger_kernel_config": "Liger is not used",
    "use_cache": "rollouts always use the KV cache; the update never does",
    "torch_empty_cache_steps": "leangrpo frees cached memory after each phase",
    "auto_find_batch_size": "size batches with `leangrpo plan` instead",
    "logging_strategy": "metrics rows follow logging_steps",
    "logging_first_step": "leangrpo always logs step 1",
    "log_on_each_node": "leangrpo logs on the main process only",
    "logging_nan_inf_filter": "non-finite steps are skipped and counted (skipped_steps)",
    "include_num_input_tokens_seen": "num_tokens (TRL GRPO's count) is always logged",
    "log_level": "logging only",
    "log_level_replica": "logging only",
    "trackio_space_id": "trackio logs locally",
    "trackio_bucket_id": "trackio logs locally",
    "trackio_static_space_id": "trackio logs locally",
    "eval_delay": "evaluation follows eval_steps",
    "prediction_loss_only": "GRPO evaluation scores completions",
    "eval_on_start": "leangrpo evaluates before step 1 whenever evaluation is on",
    "eval_do_concat_batches": "GRPO evaluation scores completions",
    "eval_use_gather_object": "GRPO evaluation scores completions",
    "eval_accumulation_steps": "GRPO evaluation scores completions",
    "include_for_metrics": "GRPO evaluation scores completions",
    "batch_eval_metrics": "GRPO evaluation scores completions",
    "save_only_model": "checkpoints keep the optimizer state, so that a resume is exact",
    "save_on_each_node": "the main process saves",
    "enable_jit_checkpoint": "checkpoints follow save_steps and logging.save_minutes",
    "push_to_hub": "the run pushes nothing by itself: `trainer.push_to_hub()`, or `leangrpo export`, then "
    "upload",
    "hub_token": "nothing is pushed",
    "hub_private_repo": "nothing is pushed",
    "hub_model_id": "nothing is pushed",
    "hub_strategy": "nothing is pushed",
    "hub_always_push": "nothing is pushed",
    "hub_revision": "nothing is pushed",
    "load_best_model_at_end": "the final model is the last step's",
    "metric_for_best_model": "the final model is the last step's",
    "greater_is_better": "the final model is the last step's",
    "ignore_data_skip": "a resume continues the seeded prompt order exactly",
    "restore_callback_states_from_checkpoint": "callbacks keep no state in checkpoints",
    "full_determinism": "runs are seeded; CUDA kernels may still differ run to run",
    "data_seed": "the prompt order follows seed",
    "use_cpu": "CUDA is used when present; hide it with CUDA_VISIBLE_DEVICES=",
    "accelerator_config": "accelerate is configured by `accelerate launch`",
    "parallelism_config": "accelerate is configured by `accelerate launch`",
    "dataloader_drop_last": "prompts are drawn without a dataloader",
    "dataloader_num_workers": "prompts are drawn without a dataloader",
    "dataloader_pin_memory": "prompts are drawn without a dataloader",
    "dataloader_persistent_workers": "prompts are drawn without a dataloader",
    "dataloader_prefetch_factor": "prompts are drawn without a dataloader",
    "dataloader_multiprocessing_context": "prompts are drawn without a dataloader",
    "dataloader_in_order": "prompts are drawn without a dataloader",
    "remove_unused_columns": "every column reaches the rewards",
    "label_names": "GRPO has no labels",
    "train_sampling_strategy": "prompts are drawn in a seeded shuffled order",
    "length_column_name": "GRPO does not group by length",
    "ddp_find_unused_parameters": "DDP is set up by leangrpo",
    "ddp_bucket_cap_mb": "speed only",
    "ddp_broadcast_buffers": "DDP is set up by leangrpo",
    "ddp_static_graph": "speed only",
    "ddp_backend": "accelerate picks nccl (CUDA) or gloo (CPU)",
    "ddp_timeout": "accelerate's default",
    "fsdp": "shard with `accelerate launch --config_file` (docs/distributed.md): memory only",
    "fsdp_config": "shard with `accelerate launch --config_file` (docs/distributed.md): memory only",
    "deepspeed": "use FSDP2 through accelerate (docs/distributed.md): memory only",
    "debug": "debugging only",
    "skip_memory_metrics": "peak_memory_mb is always logged",
    "do_train": "`leangrpo train` trains",
    "do_eval": "evaluation follows eval_strategy",
    "do_predict": "GRPO has no prediction step",
    "local_rank": "set by the launcher",
    "cast_lm_head_to_fp32": "log-probs are always computed in fp32",
    "ds3_gather_for_generation": "DeepSpeed is not used",
    "pad_to_multiple_of": "padding shape only",
    "cache_implementation": "generation speed only",
    "vllm_model_impl": "speed only",
    "vllm_tensor_parallel_size": "one vLLM engine per process (memory and speed only)",
    "log_multimodal": "completions.jsonl logs the prompts' text, not their images",
    "num_completions_to_print": "samples go to completions.jsonl",
    "log_unique_prompts": "samples go to completions.jsonl",
    "log_completions_hub_repo": "nothing is pushed",
    "use_transformers_continuous_batching": "generation speed only",
    "transformers_continuous_batching_config": "generation speed only",
    "use_transformers_paged": "generation speed only",
    "optim_args": "transformers passes it to other optimizers (AnyPrecision, AdEMAMix, GaLore, ...), not to "
    "AdamW (adam_beta1, adam_beta2, adam_epsilon, weight_decay)",
    "optim_target_modules": "transformers reads it for GaLore and APOLLO only, not for AdamW",
}
"""GRPOConfig fields ignored with a notice when set to another value than TRL's default."""

_QUIET: dict[str, tuple[Any, ...]] = {
    "log_on_each_node": (False,), "logging_first_step": (True,), "logging_strategy": ("steps",),
    "gradient_checkpointing_kwargs": ({"use_reentrant": False},), "do_train": (True,),
    "overwrite_output_dir": (True, False), "use_cache": (True,), "save_only_model": (False,),
    "remove_unused_columns": (False, True), "debug": (None, []), "pad_to_multiple_of": (None,),
}  # fmt: skip
"""Values other than TRL's default that ask for what leangrpo does anyway: no notice."""

_TRL_DEFAULTS_APPLIED = (
    "max_completion_length", "adam_beta2", "logging_steps", "save_steps", "save_total_limit",
    "per_device_eval_batch_size", "project", "vllm_gpu_memory_utilization",
)  # fmt: skip
"""Fields whose leangrpo default differs from TRL's: a TRL config (flat YAML or `GRPOConfig`) that leaves
them unset gets TRL's default, so that `GRPOConfig().max_completion_length` reads what the run uses."""

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

_MODEL_INIT_KWARGS = {
    "dtype": "dtype", "torch_dtype": "dtype", "attn_implementation": "attn_implementation",
    "trust_remote_code": "trust_remote_code",
}  # fmt: skip


class TRLConfigError(ConfigError):
    """A flat TRL config with values leangrpo cannot honour: one line each."""


def _section_fields(section: str) -> dict[str, FieldInfo]:
    """The fields of one of Config's sections (each a pydantic model)."""
    from leangrpo.config.schema import Config

    model = Config.model_fields[section].annotation
    assert isinstance(model, type) and issubclass(model, BaseModel), section
    return model.model_fields


def _mapped(name: str) -> str | None:
    """The leangrpo field a flat key goes to unchanged (or renamed), if any."""
    if name in _RENAMED:
        return _RENAMED[name]
    if name in _AMBIGUOUS:
        return None
    if name in _TOP_LEVEL:
        return name
    return next((f"{s}.{name}" for s in _SECTIONS_SEARCHED if name in _section_fields(s)), None)


def handling(name: str) -> tuple[Handling, str]:
    """How a GRPOConfig field is handled, and its leangrpo field or the reason."""
    if name in _TRANSLATED:
        return "honoured", _TRANSLATED[name]
    if (target := _mapped(name)) is not None:
        return "honoured", target
    if name in _NOTED:
        return "noted", _NOTED[name]
    raise KeyError(name)


def trainer_attributes(cfg: Config) -> dict[str, Any]:
    """The attributes TRL's GRPOTrainer copies from its args, as the run has them: what a rollout_func
    reads of its `trainer` (`trainer.num_generations`, `.max_completion_length`, `.temperature`, ...)."""
    grpo = cfg.grpo
    return {
        "num_generations": grpo.num_generations, "max_completion_length": grpo.max_completion_length,
        "temperature": grpo.temperature, "top_p": grpo.top_p, "top_k": grpo.top_k, "min_p": grpo.min_p,
        "repetition_penalty": grpo.repetition_penalty,
        "chat_template_kwargs": cfg.data.chat_template_kwargs or {},
        "max_tool_calling_iterations": grpo.max_tool_calling_iterations, "use_vllm": grpo.use_vllm,
        "vllm_mode": grpo.vllm_mode, "beta": grpo.beta, "num_iterations": grpo.num_iterations,
        "loss_type": grpo.loss_type, "scale_rewards": grpo.scale_rewards, "epsilon_low": grpo.epsilon,
        "epsilon_high": grpo.epsilon if grpo.epsilon_high is None else grpo.epsilon_high,
        "importance_sampling_level": grpo.importance_sampling_level,
        "mask_truncated_completions": grpo.mask_truncated_completions,
    }  # fmt: skip


def field_table() -> list[tuple[str, Handling, str]]:
    """Every TRL 1.16 GRPOConfig field, how it is handled, and its leangrpo field or the reason."""
    return [(name, *handling(name)) for name in TRL_DEFAULTS]


def accepted_fields() -> set[str]:
    """Every flat key a TRL config (or `leangrpo.GRPOConfig`) may hold."""
    keys = {*TRL_DEFAULTS, *_RENAMED, *_TOP_LEVEL, *_SCRIPT_KEYS, "reward_funcs", "reward_model_name_or_path"}
    for section in _SECTIONS_SEARCHED:
        keys |= _section_fields(section).keys()
    return keys - _AMBIGUOUS.keys()


def unknown_field_hint(name: str) -> str:
    """Why a key is not a TRL config field, when leangrpo has something to say about it."""
    return f"{name}: {_AMBIGUOUS[name]}" if name in _AMBIGUOUS else ""


def is_trl_config(data: dict[str, Any]) -> bool:
    """A flat TRL config: no leangrpo section is a mapping, and some top-level key is a TRL field leangrpo
    maps (`model_name_or_path`, `learning_rate`, ...); a mere typo stays a leangrpo "unknown key"."""
    from leangrpo.config.schema import Config

    if any(isinstance(value, dict) for key, value in data.items() if key in Config.model_fields):
        return False
    return bool((data.keys() - Config.model_fields.keys()) & accepted_fields())


def asks_nothing(name: str, value: Any) -> bool:
    """A value that asks nothing leangrpo does not do: TRL's default, or one of `_QUIET`'s."""
    default = _SCRIPT_KEYS.get(name, TRL_DEFAULTS.get(name))
    return value == default or value in _QUIET.get(name, ())


def from_trl(
    flat: dict[str, Any], source: str, reward_specs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """The nested leangrpo config for a flat TRL one. Ignored values are logged, one notice each; values
    that cannot be honoured raise one TRLConfigError listing them all, one line each. `reward_specs`:
    `rewards.functions` entries standing in for `reward_funcs` (the Python API's), weighted by
    `reward_weights`."""
    flat = {**{name: TRL_DEFAULTS[name] for name in _TRL_DEFAULTS_APPLIED}, **flat}
    mixed_precision = flat.get("bf16") is None and not flat.get("fp16")  # TRL's default: bf16 autocast
    out: dict[str, Any] = {"task": "dataset", "data": {"system_prompt": None}}
    refused: list[str] = []

    def put(path: str, value: Any) -> None:
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value

    _read_json_fields(flat, refused)
    _translate_special(flat, put, refused)
    _translate_rewards(flat, put, refused, reward_specs)
    _translate_steps(flat, put, refused)
    for key, value in flat.items():
        if (target := _mapped(key)) is not None:
            put(target, value)
        elif asks_nothing(key, value):
            continue
        elif key in _NOTED:
            logger.warning(f"{source}: {key}={value!r} ignored: {_NOTED[key]}")
        elif key in _SCRIPT_KEYS:
            refused.append(f"{key}={value!r}: not supported")
        elif key in _AMBIGUOUS:
            refused.append(unknown_field_hint(key))
        else:
            refused.append(f"{key}: not a TRL 1.16 GRPOConfig field (docs/trl.md lists them all)")
    if refused:
        raise TRLConfigError("\n".join(f"{source}: {line}" for line in refused))
    if out.get("model", {}).get("dtype", "auto") == "auto":  # not leangrpo's auto (bf16 on a GPU): fp32
        out.setdefault("model", {})["dtype"] = "float32"
    if mixed_precision:
        logger.warning(f"{source}: {precision_note(out.get('model', {}).get('dtype', 'float32'))}")
    if out.get("grpo", {}).get("structured_outputs_regex") is not None and not out["grpo"].get("use_vllm"):
        logger.warning(f"{source}: {REGEX_WITHOUT_VLLM}")
    return out


REGEX_WITHOUT_VLLM = (
    "vllm_structured_outputs_regex without use_vllm: TRL's transformers generation ignores it, leangrpo's "
    "HF engine constrains every completion to it"
)
"""The start-up line for a TRL config whose regex TRL would not apply (docs/trl.md: deliberate)."""


def precision_note(dtype: str) -> str:
    """The start-up line for a TRL config that leaves bf16 unset: TRL 1.16 then trains in bf16 mixed
    precision (autocast over fp32 weights; on a CPU it refuses unless `use_cpu`), leangrpo has no autocast
    and computes in the model's dtype (docs/trl.md: a deliberate difference)."""
    return (
        f"bf16 unset: TRL trains in bf16 mixed precision (autocast over fp32 weights), leangrpo without "
        f"autocast in model.dtype {dtype}; bf16: true gives bfloat16 weights"
    )


def dict_field(name: str, value: Any) -> Any:
    """A TRL dict field's value: text starting with `{` is JSON, read into a dict as transformers'
    `TrainingArguments` reads it (a command line's or a YAML's). Bad JSON raises TRLConfigError, one line."""
    if name not in TRL_DICT_FIELDS or not isinstance(value, str) or not value.lstrip().startswith("{"):
        return value
    try:
        return json.loads(value)
    except ValueError as e:
        raise TRLConfigError(f"{name}: not valid JSON ({e}): {value!r}") from None


def _read_json_fields(flat: dict[str, Any], refused: list[str]) -> None:
    """TRL's dict fields given as JSON text, read into dicts in ``flat``; bad JSON joins ``refused``."""
    for name in TRL_DICT_FIELDS:
        if name in flat:
            try:
                flat[name] = dict_field(name, flat[name])
            except TRLConfigError as e:
                refused.append(str(e))


def _translate_special(flat: dict[str, Any], put: Any, refused: list[str]) -> None:
    """The fields whose TRL meaning needs a translation; each is popped from ``flat`` once handled."""
    for key, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):
        if flat.pop(key, None) is True:
            put("model.dtype", dtype)
    if "optim" in flat:
        name = flat.pop("optim")
        if name in _OPTIMIZERS:
            put("optim.optimizer", _OPTIMIZERS[name])
        else:
            refused.append(f"optim={name!r}: leangrpo has {', '.join(_OPTIMIZERS)}")
    optim_args = flat.get("optim_args")  # transformers' `_parse_optim_args` reads it before any optimizer
    if optim_args and any(item.count("=") != 1 for item in str(optim_args).replace(" ", "").split(",")):
        flat.pop("optim_args")
        refused.append(
            f"optim_args={optim_args!r}: must be comma-separated key=value pairs, as transformers parses it"
        )
    flat.pop("resume_from_checkpoint", None)  # `leangrpo train` reads it (`trl_resume`), as `trl grpo`
    if flat.get("use_peft") and "lora_target_modules" not in flat:
        put("model.lora.target_modules", None)  # `trl grpo`'s default: peft's targets for the architecture
    steps = flat.get("logging_steps", TRL_DEFAULTS["logging_steps"])  # TRL logs completions with each row
    put("logging.log_completions_steps", max(1, int(steps)) if flat.pop("log_completions", False) else 0)
    if "disable_tqdm" in flat:
        put("logging.progress_bar", not flat.pop("disable_tqdm"))
    for key, value in (flat.pop("model_init_kwargs", None) or {}).items():
        if value is None or (key, value) == ("revision", "main"):  # `trl grpo`'s: the defaults
            continue
        if key in _MODEL_INIT_KWARGS:
            put(f"model.{_MODEL_INIT_KWARGS[key]}", value)
        else:
            refused.append(
                f"model_init_kwargs.{key}: not supported (leangrpo reads {', '.join(_MODEL_INIT_KWARGS)})"
            )
    strategy = flat.pop("save_strategy", "steps")
    if strategy == "no":
        put("logging.save_steps", 0)
        put("logging.save_minutes", 0)
    elif strategy != "steps":
        logger.warning(f"save_strategy={strategy!r} ignored: checkpoints follow save_steps")
    evaluation = flat.pop("eval_strategy", "no")
    eval_steps = flat.pop("eval_steps", None)
    samples = flat.pop("num_generations_eval", None) or flat.get("num_generations", 8)  # TRL's default G
    if evaluation == "steps":
        put("eval.enabled", True)
        put("eval.eval_steps", eval_steps or flat.get("logging_steps", 10))
        put("eval.num_samples", samples)  # TRL's evaluation samples num_generations_eval per prompt
    elif evaluation != "no":
        logger.warning(f"eval_strategy={evaluation!r} ignored: set eval_strategy: steps to evaluate")
    if flat.get("loss_type", "dapo") not in LOSS_TYPES:
        refused.append(
            f"loss_type={flat.pop('loss_type')!r}: not supported (leangrpo has {', '.join(LOSS_TYPES)})"
        )


def _translate_rewards(
    flat: dict[str, Any], put: Any, refused: list[str], given: list[dict[str, Any]] | None
) -> None:
    """`reward_funcs` (TRL registry names or dotted import paths), `reward_weights` and
    `reward_model_name_or_path` as `rewards.functions`; `given` specs stand in for the first two."""
    names = flat.pop("reward_funcs", None) or []
    names = [names] if isinstance(names, str) else list(names)  # TRL takes one name as well as a list
    model = flat.pop("reward_model_name_or_path", None)
    weights = flat.pop("reward_weights", None)
    if weights is not None and not isinstance(weights, list):
        refused.append(f"reward_weights={weights!r}: must be a list of numbers, one per reward")
        weights = None
    specs: list[dict[str, Any]] = [{"name": model}] if model else []
    for name in names:
        path, kwargs = _TRL_REWARDS.get(name, (None, None))
        if path is None:
            module, _, func = name.rpartition(".")
            path = f"{module}:{func}" if module else name
        specs.append({"name": path, **({"kwargs": kwargs} if kwargs else {})})
    specs = [dict(spec) for spec in given] if given is not None else specs
    if weights is not None:
        if len(weights) != len(specs):
            refused.append(f"reward_weights: {len(weights)} entries for {len(specs)} rewards")
        for spec, weight in zip(specs, weights, strict=False):
            spec["weight"] = weight
    if specs:
        put("rewards.functions", specs)


def _translate_steps(flat: dict[str, Any], put: Any, refused: list[str]) -> None:
    """TRL's optimizer-step count and generation batch as leangrpo steps (one generation batch each, then
    its num_iterations × steps_per_generation micro-steps, gradient_accumulation_steps an optimizer step)."""
    iterations = int(flat.get("num_iterations", 1))
    per_device = int(flat.get("per_device_train_batch_size", 8))
    accumulation = int(flat.get("gradient_accumulation_steps", 1))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    steps_per_generation = flat.pop("steps_per_generation", None)
    generation_batch_size = flat.pop("generation_batch_size", None)
    if generation_batch_size is not None:
        implied = int(generation_batch_size) // (per_device * world)
        if int(generation_batch_size) % (per_device * world):
            refused.append(
                f"generation_batch_size={generation_batch_size}: must be a multiple of "
                f"per_device_train_batch_size × processes = {per_device * world} (as TRL requires)"
            )
        elif steps_per_generation is not None and int(steps_per_generation) != implied:
            # both are set in a trl.GRPOConfig, whose __post_init__ derives one from the other
            refused.append(
                f"generation_batch_size={generation_batch_size} and steps_per_generation="
                f"{steps_per_generation} disagree (it implies {implied}): set one of them"
            )
        steps_per_generation = implied if steps_per_generation is None else steps_per_generation
    if steps_per_generation is not None and int(steps_per_generation) != accumulation:  # else the default
        put("grpo.steps_per_generation", int(steps_per_generation))
    micro_steps = iterations * int(steps_per_generation or accumulation)
    whole = micro_steps // math.gcd(micro_steps, accumulation)  # optimizer steps of whole generations
    max_steps = flat.pop("max_steps", None)
    if max_steps is not None and int(max_steps) > 0:
        flat.pop("num_train_epochs", None)  # TRL: a positive max_steps wins over epochs
        if int(max_steps) % whole:
            refused.append(
                f"max_steps={max_steps}: TRL counts optimizer steps of gradient_accumulation_steps "
                f"micro-steps; leangrpo trains whole generations of num_iterations × steps_per_generation = "
                f"{micro_steps} micro-steps, so it must be a multiple of {whole}"
            )
        else:
            put("optim.max_steps", int(max_steps) * accumulation // micro_steps)
    elif "num_train_epochs" not in flat:
        put("optim.num_train_epochs", 3.0)  # TRL's default length
