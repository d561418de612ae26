"""The one typed run configuration: YAML file + `a.b=value` overrides, validated before any model loads.

Field names follow TRL's `GRPOConfig` wherever the meaning is the same, so a TRL user can carry values
over unchanged. This module must stay light: the CLI imports it without importing torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import UserError

DEFAULT_SYSTEM_PROMPT = (
    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)


_LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")


class ConfigError(UserError, ValueError):
    """A one-line, user-facing configuration error that names the offending key."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    enabled: bool = False
    r: int = Field(16, ge=1)
    alpha: float = Field(32, gt=0)
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | str = "all-linear"


class ModelConfig(_Section):
    name_or_path: str = Field(..., min_length=1, description="hub id, local directory, or .gguf file")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    gradient_checkpointing: bool = True
    activation_offload: bool = Field(False, description="CUDA only: saved activations in pinned CPU RAM")
    trust_remote_code: bool = False
    lora: LoraConfig = LoraConfig()

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(v, v)


class DataConfig(_Section):
    path: str = Field(..., min_length=1, description="local .jsonl/.parquet, or a hub dataset id")
    hub_config: str | None = None
    split: str = "train"
    prompt_column: str = "question"
    answer_column: str = "answer"
    answer_format: Literal["gsm8k", "raw"] = "gsm8k"
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    assistant_prefix: str = ""
    limit: int | None = Field(None, ge=1)
    max_solution_steps: int | None = Field(
        None, ge=1, description="gsm8k: keep problems whose worked solution has at most this many lines"
    )
    on_bad_row: Literal["skip", "error"] = "skip"


class RewardSpec(_Section):
    name: str = Field(..., min_length=1, description="built-in name or 'package.module:function'")
    weight: float = 1.0


class RewardsConfig(_Section):
    functions: list[RewardSpec] = Field(..., min_length=1)
    on_error: Literal["raise", "missing"] = "raise"


class GRPOSection(_Section):
    num_generations: int = Field(8, ge=2)
    max_prompt_length: int = Field(512, ge=1)
    max_completion_length: int = Field(256, ge=1)
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    beta: float = Field(0.0, ge=0)
    epsilon: float = Field(0.2, gt=0)
    epsilon_high: float | None = Field(None, gt=0)
    num_iterations: int = Field(1, ge=1)
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    scale_rewards: Literal["group", "batch", "none"] = "group"
    logprob_chunk_size: int = Field(256, ge=1, description="token rows per log-prob chunk")
    share_prompt: bool = Field(
        True, description="the update reads each prompt once per micro-batch, not once per completion"
    )
    packed_generation: bool = Field(
        True,
        description="CPU rollouts with oneDNN-packed weights: faster, one weight copy more while generating",
    )
    ignore_eos: bool = Field(False, description="always generate max_completion_length tokens (benchmarks)")

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_bool(cls, v: Any) -> Any:
        # TRL also accepts booleans here.
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v


class OptimConfig(_Section):
    optimizer: Literal["adamw", "adamw_8bit"] = "adamw"
    learning_rate: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.99, ge=0, lt=1)
    max_grad_norm: float = Field(1.0, gt=0)
    max_nonfinite_steps: int = Field(3, ge=1, description="stop after this many skipped steps in a row")
    per_device_train_batch_size: int = Field(8, ge=1)
    gradient_accumulation_steps: int = Field(1, ge=1)
    warmup_ratio: float = Field(0.0, ge=0, le=1)
    lr_scheduler_type: Literal["linear", "cosine", "constant"] = "linear"
    max_steps: int = Field(100, ge=1)

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per step on each process; one optimizer step consumes them."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps


class SFTConfig(_Section):
    """Supervised cold start before GRPO, on the dataset's worked solutions in the reward format."""

    steps: int = Field(0, ge=0, description="0 = no cold start")
    learning_rate: float = Field(1e-4, gt=0)
    batch_size: int = Field(8, ge=1, description="examples per step on each process")


class LoggingConfig(_Section):
    logging_steps: int = Field(1, ge=1)
    save_steps: int = Field(0, ge=0, description="0 saves only the final model")
    save_total_limit: int | None = Field(None, ge=1, description="keep the newest N checkpoints")
    log_completions_steps: int = Field(10, ge=0, description="0 disables sample logging")
    progress_bar: bool = True
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=list, description="experiment trackers: none, one name, or a list"
    )
    project: str = Field("leangrpo", min_length=1, description="W&B / trackio project")
    run_name: str | None = None

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v: Any) -> Any:
        # TRL style: "none", "wandb", "tensorboard,wandb" or a list.
        if v is None or v == "none":
            return []
        return [s.strip() for s in v.split(",")] if isinstance(v, str) else v


class EvalConfig(_Section):
    """Evaluation during training: before step 1, every `eval_steps`, and after the last step, on the
    first `limit` rows of a held-out split (the same rows each time)."""

    enabled: bool = False
    path: str | None = Field(
        None,
        description="held-out .jsonl/.parquet, a directory with {split}.jsonl, "
        "or a hub id; default: data.path (hub datasets only)",
    )
    split: str = "test"
    limit: int = Field(64, ge=1)
    eval_steps: int = Field(0, ge=0, description="0: only before training and at the end")
    max_new_tokens: int | None = Field(None, ge=1, description="default: grpo.max_completion_length")
    batch_size: int = Field(16, ge=1, description="prompts per generate call")
    num_samples: int = Field(
        0, ge=0, description="k for pass@k (sampled at grpo.temperature); 0: greedy only"
    )


class Config(_Section):
    model: ModelConfig
    data: DataConfig
    rewards: RewardsConfig
    grpo: GRPOSection = GRPOSection()
    optim: OptimConfig = OptimConfig()
    sft: SFTConfig = SFTConfig()
    logging: LoggingConfig = LoggingConfig()
    eval: EvalConfig = EvalConfig()
    output_dir: str = "runs/leangrpo"
    seed: int = 42

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        gen_batch = self.optim.generation_batch_size
        if gen_batch % self.grpo.num_generations:
            raise ValueError(
                f"grpo.num_generations={self.grpo.num_generations} must divide the generation batch "
                f"(optim.per_device_train_batch_size × optim.gradient_accumulation_steps = {gen_batch})"
            )
        if self.grpo.epsilon_high is not None and self.grpo.epsilon_high < self.grpo.epsilon:
            raise ValueError(
                f"grpo.epsilon_high={self.grpo.epsilon_high} is below grpo.epsilon={self.grpo.epsilon}"
            )
        needs_solutions = {
            "sft.steps": self.sft.steps,
            "data.max_solution_steps": self.data.max_solution_steps,
        }
        for key, value in needs_solutions.items():
            if value and self.data.answer_format != "gsm8k":
                raise ValueError(f"{key} needs worked solutions: set data.answer_format: gsm8k")
        if self.eval.enabled and self.eval.path is None and Path(self.data.path).suffix in _LOCAL_SUFFIXES:
            raise ValueError(
                "eval.enabled needs eval.path (a held-out file, or a directory holding "
                f"{self.eval.split}.jsonl): data.path is a local file, the training data itself"
            )
        return self

    @property
    def prompts_per_step(self) -> int:
        """Distinct prompts each process draws per step."""
        return self.optim.generation_batch_size // self.grpo.num_generations


def _yaml_problem(e: yaml.YAMLError) -> str:
    return getattr(e, "problem", None) or str(e).splitlines()[0]


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "missing":
        msg = "required key is missing"
    elif first["loc"] and not isinstance(first.get("input"), dict):
        msg = f"{msg} (got {first['input']!r})"
    more = f" (+{err.error_count() - 1} more)" if err.error_count() > 1 else ""
    return f"config error in {source}: {key + ': ' if key else ''}{msg}{more}"


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split `a.b=value` into a key path and a YAML-typed value."""
    if "=" not in item:
        raise ConfigError(f"config override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"config override {item!r} has an empty key")
    try:
        return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"config override {item!r}: value is not valid YAML ({_yaml_problem(e)})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `a.b=value` into a nested dict (copying nothing else); validation happens later."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"config override {item!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (optional), apply overrides, validate. Raises ConfigError with one line."""
    data: dict[str, Any] = {}
    source = str(path) if path else "overrides"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f":{mark.line + 1}" if mark else ""
            raise ConfigError(f"config file {p}{where} is not valid YAML: {_yaml_problem(e)}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(data)}")
    apply_overrides(data, overrides or [])
    return validate_config(data, source)


def validate_config(data: dict[str, Any], source: str = "config") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_one_line(e, source)) from None


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
