"""What every engine shares: the RolloutBatch, the one type that crosses from rollout to update; Sampling;
the RolloutEngine and GenerateLevers protocols; and the helpers each engine builds its batches with
(prompt encoding, the EOS rule, the tool loop on a batch, a rollout_func's output)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor

from leangrpo.core.errors import UserError
from leangrpo.core.grpo import mask_after_eos
from leangrpo.engines.tools import Toolbox, ToolError, ToolUse, TurnGenerator, tool_loop, turn_message
from leangrpo.engines.vision import VisionInputs

if TYPE_CHECKING:
    from transformers import (
        DynamicCache,
        GenerationConfig,
        LogitsProcessor,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

    from leangrpo.config.schema import DataConfig, GRPOSection


@dataclass
class RolloutBatch:
    """N = prompts × G completions, laid out group by group (the G samples of a prompt are adjacent)."""

    prompt_ids: Tensor  # [N, P], left-padded
    prompt_mask: Tensor  # [N, P]
    completion_ids: Tensor  # [N, C]
    completion_mask: Tensor  # [N, C]: 1 up to and including the first EOS
    truncated: Tensor  # [N] bool: hit max_completion_length without an EOS
    completion_texts: list[str]  # decoded, with the assistant prefix (if any) in front
    sampling_logprobs: Tensor | None = None  # [N, C]: the sampler's own log-probs (vLLM), 0 past the end
    # [N, C]: 1 where the model wrote the token, 0 on a tool's or environment's (TRL's tool_mask); None: all
    # the model's (a single-turn rollout)
    model_mask: Tensor | None = None
    tool_use: ToolUse | None = None  # what each rollout did with its tools (rollouts with tools only)
    vision: VisionInputs | None = None  # the prompts' pixel inputs, one entry a completion (image prompts)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    @property
    def input_ids(self) -> Tensor:
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)

    @property
    def loss_mask(self) -> Tensor:
        """The tokens the model wrote: what the loss, KL, entropy and token counts cover."""
        return self.completion_mask if self.model_mask is None else self.completion_mask * self.model_mask

    def lengths(self) -> Tensor:
        """Tokens the model wrote in each completion (TRL's completion length: tool results excluded)."""
        return self.loss_mask.sum(dim=1)

    def to(self, device: torch.device) -> RolloutBatch:
        vision = None if self.vision is None else self.vision.to(device)
        return self._map(lambda t: t.to(device), self.completion_texts, self.tool_use, vision)

    def select(self, rows: Tensor) -> RolloutBatch:
        """The completions at `rows` [K], in that order."""
        indices = rows.tolist()
        use = None if self.tool_use is None else self.tool_use.select(indices)
        vision = None if self.vision is None else self.vision.select(indices)
        return self._map(lambda t: t[rows], [self.completion_texts[i] for i in indices], use, vision)

    def _map(
        self,
        f: Callable[[Tensor], Tensor],
        texts: list[str],
        use: ToolUse | None = None,
        vision: VisionInputs | None = None,
    ) -> RolloutBatch:
        """Every tensor through `f`, with `texts`, `use` and `vision`."""
        logp = None if self.sampling_logprobs is None else f(self.sampling_logprobs)
        model_mask = None if self.model_mask is None else f(self.model_mask)
        return RolloutBatch(
            f(self.prompt_ids), f(self.prompt_mask), f(self.completion_ids), f(self.completion_mask),
            f(self.truncated), texts, logp, model_mask, use, vision,
        )  # fmt: skip

    @staticmethod
    def cat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Batches one after another, prompts left-padded and completions right-padded to the widest."""
        P = max(b.prompt_ids.shape[1] for b in batches)
        C = max(b.completion_ids.shape[1] for b in batches)

        def cat(tensors: list[Tensor], width: int, left: bool) -> Tensor:
            pad = [(width - t.shape[1], 0) if left else (0, width - t.shape[1]) for t in tensors]
            return torch.cat([torch.nn.functional.pad(t, p) for t, p in zip(tensors, pad, strict=True)])

        logps = [b.sampling_logprobs for b in batches if b.sampling_logprobs is not None]
        uses = [b.tool_use for b in batches if b.tool_use is not None]
        visions = [b.vision for b in batches if b.vision is not None]
        multi_turn = any(b.model_mask is not None for b in batches)
        # a batch without a model mask: every token is the model's
        model_masks = [b.completion_mask if b.model_mask is None else b.model_mask for b in batches]
        return RolloutBatch(
            cat([b.prompt_ids for b in batches], P, left=True),
            cat([b.prompt_mask for b in batches], P, left=True),
            cat([b.completion_ids for b in batches], C, left=False),
            cat([b.completion_mask for b in batches], C, left=False),
            torch.cat([b.truncated for b in batches]),
            [text for b in batches for text in b.completion_texts],
            None if len(logps) < len(batches) else cat(logps, C, left=False),
            cat(model_masks, C, left=False) if multi_turn else None,
            ToolUse.cat(uses) if len(uses) == len(batches) else None,
            VisionInputs.cat(visions) if visions else None,
        )


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn, the same for every engine (HF generate, vLLM).

    The knobs apply in transformers' order (repetition penalty, temperature, top-k, top-p, min-p);
    `generation_kwargs` are further `GenerationConfig` fields for HF (their logits processors run first)
    or `SamplingParams` fields for vLLM, as TRL passes them. `ignore_eos` forces every completion to
    max_completion_length tokens (for benchmarks that must compare equal work).
    `max_tool_calling_iterations`: rounds of tool calls a rollout makes at most (None: no limit).
    `seed`: the rollout draws from its own generator seeded with it, not torch's global RNG, so that a
    rollout is the same whichever thread runs it and whatever else draws meanwhile (None: the global RNG).
    `chat_template_kwargs`: the data's, for the tool results rendered between turns, as for the prompts.
    `regex`: every completion (each turn of a tool-calling one) matches it (TRL's structured outputs)."""

    num_generations: int
    max_prompt_length: int | None
    max_completion_length: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] | None = None
    do_sample: bool = True
    assistant_prefix: str = ""
    ignore_eos: bool = False
    max_tool_calling_iterations: int | None = None
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    regex: str | None = None

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The rollout's own random stream on `device` (None without a seed: torch's global RNG)."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)

    @classmethod
    def from_config(cls, g: GRPOSection, data: DataConfig) -> Sampling:
        """The training rollout's: `grpo`'s sampling settings, each completion opened by the data's
        `assistant_prefix`, tool results rendered with its `chat_template_kwargs`."""
        return cls(
            num_generations=g.num_generations, max_prompt_length=g.max_prompt_length,
            max_completion_length=g.max_completion_length, temperature=g.temperature, top_p=g.top_p,
            top_k=g.top_k, min_p=g.min_p, repetition_penalty=g.repetition_penalty,
            generation_kwargs=g.generation_kwargs, assistant_prefix=data.assistant_prefix,
            ignore_eos=g.ignore_eos, max_tool_calling_iterations=g.max_tool_calling_iterations,
            chat_template_kwargs=data.chat_template_kwargs, regex=g.structured_outputs_regex,
        )  # fmt: skip


class EngineError(UserError, RuntimeError):
    """The engine failed while generating or taking weights (the trainer then checkpoints and stops)."""


@dataclass(frozen=True)
class SyncStats:
    """One weight sync into an engine holding its own copy: the bytes handed over (the adapter's tensors,
    or the weights sent merged or whole), the seconds it took, and which of the two it was."""

    bytes: int
    seconds: float
    adapter_only: bool

    def metrics(self) -> dict[str, float]:
        """The step's vllm/sync_* metrics (docs/vllm.md)."""
        return {
            "vllm/sync_bytes": float(self.bytes),
            "vllm/sync_seconds": self.seconds,
            "vllm/sync_adapter_only": float(self.adapter_only),
        }


class RolloutEngine(Protocol):
    """What the trainer generates with, and what it needs to know of it. `holds_weights`: the engine
    keeps a copy of the weights of its own, which `sync_weights` replaces with the model's current ones
    (`weights`: those weights as the caller streams them, when they are not whole in `model`, as under
    FSDP2); otherwise it reads the policy itself and `sync_weights` does nothing. `sampler_logprobs`: its
    batches carry the sampler's log-prob of each token (the importance-sampling correction weighs the gap
    to the trainer's). `last_sync`: what its latest `sync_weights` moved (None: nothing synced). `close`
    lets go of what the engine holds beyond its memory."""

    holds_weights: bool
    sampler_logprobs: bool
    last_sync: SyncStats | None

    def generate(
        self,
        prompt_texts: list[str],
        sampling: Sampling,
        toolboxes: list[Toolbox] | None = None,
        images: list[list[Any]] | None = None,
    ) -> RolloutBatch:
        """Completions of each prompt; with `toolboxes` (one per completion), multi-turn rollouts that
        call those tools; with `images` (one list a prompt), image prompts of a vision-language model."""
        ...

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None: ...

    def close(self) -> None: ...


class PolicyEngine:
    """The part of a RolloutEngine that generates with the policy itself: no weights of its own to sync,
    no sampler log-probs (the trainer's are the sampler's), nothing to close."""

    holds_weights = sampler_logprobs = False
    last_sync: SyncStats | None = None

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None:
        pass

    def close(self) -> None:
        pass


class GenerateLevers(Protocol):
    """A device's speed levers for the HF engine's `generate`, which leave what is sampled unchanged
    (leangrpo.cpu has the CPU's): a decode loop of its own, or a context around generate()."""

    def decode(
        self,
        model: PreTrainedModel,
        cache: DynamicCache,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        sampling: Sampling,
        processors: list[LogitsProcessor],
        eos: list[int],
        gen_cfg: GenerationConfig,
    ) -> Tensor | None:
        """The completion ids, or None where its loop does not apply (generate() then runs)."""
        ...

    def around_generate(self, model: PreTrainedModel, rows: int) -> AbstractContextManager[None]: ...


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


# No text averages more characters a token, so a text's last 64·N characters hold its last N tokens.
MAX_CHARS_PER_TOKEN = 64


def encode_rollout_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    sampling: Sampling,
    images: list[list[Any]] | None,
    processor: Any | None,
    toolboxes: list[Any] | None,
) -> tuple[Tensor, Tensor, VisionInputs | None]:
    """A rollout's left-padded prompt ids and mask, each prompt `sampling.num_generations` times, and with
    `images` (one list a prompt) their pixel inputs, which the model's `processor` encodes (no tools)."""
    from leangrpo.engines.vision import VisionError, encode

    if images is None:
        ids, mask = encode_prompts(
            tokenizer, prompt_texts, sampling.max_prompt_length, sampling.num_generations
        )
        return ids, mask, None
    if toolboxes is not None:
        raise VisionError(
            "image prompts with tools are not supported (docs/vlm.md): drop the tools or the images"
        )
    if processor is None:
        raise VisionError(
            "the prompts have images, but the model has no image processor: use a vision-language model (its "
            "folder holds preprocessor_config.json), or in Python pass its AutoProcessor as processing_class"
        )
    return encode(processor, prompt_texts, images, sampling.max_prompt_length, sampling.num_generations)


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompt_texts: list[str], max_prompt_length: int | None, repeat: int
) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and mask (whatever side the tokenizer pads), each prompt repeated `repeat`
    times (one row per completion), whole: a prompt longer than `max_prompt_length` was already cut as
    `PromptFormat.fit` cuts it, which keeps its question and generation header. Left truncation at the
    limit stays as a guard only."""
    limit = max_prompt_length
    enc = tokenizer(
        [text if limit is None else text[-MAX_CHARS_PER_TOKEN * limit :] for text in prompt_texts],
        return_tensors="pt",
        padding=True,
        padding_side="left",  # whatever the tokenizer's own side (a TRL script's may pad right), as TRL
        truncation=limit is not None,
        max_length=limit,
        add_special_tokens=False,
    )
    return enc.input_ids.repeat_interleave(repeat, dim=0), enc.attention_mask.repeat_interleave(repeat, dim=0)


def finish_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    eos: list[int],
    sampling: Sampling,
    sampling_logprobs: Tensor | None = None,
) -> RolloutBatch:
    """A RolloutBatch from generated ids: tokens after the first EOS masked, texts decoded."""
    if sampling.ignore_eos:
        completion_mask = torch.ones_like(completion_ids)
        truncated = torch.ones(len(completion_ids), dtype=torch.bool, device=completion_ids.device)
    else:
        completion_mask, has_eos = mask_after_eos(completion_ids, eos)
        truncated = ~has_eos
    texts = [
        sampling.assistant_prefix
        + cast(str, tokenizer.decode(ids[: int(n)], skip_special_tokens=True))  # one sequence
        for ids, n in zip(completion_ids, completion_mask.sum(dim=1), strict=True)
    ]
    if sampling_logprobs is not None:
        sampling_logprobs = sampling_logprobs * completion_mask
    return RolloutBatch(
        prompt_ids, prompt_mask, completion_ids, completion_mask, truncated, texts, sampling_logprobs
    )


def left_padded(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token lists as left-padded ids and their attention mask."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :], mask[row, width - len(seq) :] = torch.tensor(seq), 1
    return ids.to(device), mask.to(device)


def with_tools(
    first: RolloutBatch,
    tokenizer: PreTrainedTokenizerBase,
    toolboxes: list[Toolbox],
    sampling: Sampling,
    next_turns: TurnGenerator,
    eos: list[int],
    max_model_len: int | None,
) -> RolloutBatch:
    """The first turns `first` continued through their tool calls (`tool_loop`, TRL's contract): each
    completion holds the model's turns and the tool results between them, `model_mask` tells them apart,
    and a completion is truncated when its last token is not an EOS (TRL's test)."""
    if len(toolboxes) != len(first):
        raise ValueError(f"{len(toolboxes)} toolboxes for {len(first)} completions")
    prompts = [
        ids[mask.bool()].tolist() for ids, mask in zip(first.prompt_ids, first.prompt_mask, strict=True)
    ]
    lengths = first.completion_mask.sum(dim=1).tolist()
    logprobs = first.sampling_logprobs
    trajectories = tool_loop(
        tokenizer, prompts,
        [ids[:n].tolist() for ids, n in zip(first.completion_ids, lengths, strict=True)],
        None if logprobs is None else [lp[:n].tolist() for lp, n in zip(logprobs, lengths, strict=True)],
        toolboxes, next_turns, sampling.max_completion_length, sampling.max_tool_calling_iterations,
        max_model_len, sampling.chat_template_kwargs,
    )  # fmt: skip
    return batch_of_lists(
        tokenizer, first.prompt_ids, first.prompt_mask, trajectories.completion_ids, trajectories.model_mask,
        trajectories.logprobs, eos, sampling.assistant_prefix, trajectories.use,
    )  # fmt: skip


def batch_of_lists(
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completions: list[list[int]],
    model_mask: list[list[int]] | None,
    logprobs: list[list[float]] | None,
    eos: list[int],
    assistant_prefix: str,
    use: ToolUse | None,
) -> RolloutBatch:
    """A RolloutBatch of completions given as token lists (multi-turn rollouts, a rollout_func's), each
    whole: truncated when its last token is not an EOS (TRL's test)."""
    width, device = max(map(len, completions)), prompt_ids.device

    def padded(rows: list[list[Any]], value: float, dtype: torch.dtype) -> Tensor:
        out = torch.full((len(rows), width), value, dtype=dtype)
        for r, row in enumerate(rows):
            out[r, : len(row)] = torch.tensor(row, dtype=dtype)
        return out.to(device)

    return RolloutBatch(
        prompt_ids,
        prompt_mask,
        padded(completions, tokenizer.pad_token_id, torch.long),
        padded([[1] * len(row) for row in completions], 0, torch.long),
        torch.tensor([not row or row[-1] not in eos for row in completions], device=device),
        [
            assistant_prefix + cast(str, tokenizer.decode(row, skip_special_tokens=True))
            for row in completions
        ],
        None if logprobs is None else padded(logprobs, 0.0, torch.float32),
        None if model_mask is None else padded(model_mask, 0, torch.long),
        use,
    )


def rollout_func_batch(
    output: dict[str, Any], tokenizer: PreTrainedTokenizerBase, eos: list[int], device: torch.device,
    keep_logprobs: bool,
) -> RolloutBatch:  # fmt: skip
    """TRL's rollout_func output (`prompt_ids`, `completion_ids`, `logprobs`, optionally `env_mask`: 1 on
    the model's tokens; any other key, one value per rollout or one for all, goes to the rewards) as a
    RolloutBatch. `keep_logprobs`: the sampler's log-probs are kept (vLLM runs; TRL uses them only there)."""
    missing = sorted({"prompt_ids", "completion_ids", "logprobs"} - output.keys())
    if missing:
        raise ToolError(f"rollout_func must return the keys {missing} in its output dict")
    completions = [list(ids) for ids in output["completion_ids"]]
    n = len(completions)
    if len(output["prompt_ids"]) != n or not all(completions):
        raise ToolError(
            f"rollout_func returned {len(output['prompt_ids'])} prompts and {n} completions, some empty"
        )
    env_mask = output.get("env_mask")
    logprobs = output["logprobs"] if keep_logprobs else None
    for name, rows in (("env_mask", env_mask), ("logprobs", logprobs)):
        if rows is not None and [len(r) for r in rows] != [len(c) for c in completions]:
            raise ToolError(f"rollout_func's {name} must have one value per completion token")
    if logprobs is not None:
        logprobs = [[math.nan if lp is None else float(lp) for lp in row] for row in logprobs]
    prompt_ids, prompt_mask = left_padded(
        [list(p) for p in output["prompt_ids"]], tokenizer.pad_token_id, device
    )
    extra = {
        key: values if isinstance(values, list) else [values] * n
        for key, values in output.items()
        if key not in ("prompt_ids", "completion_ids", "logprobs", "env_mask")
    }
    prompts = [list(p) for p in output["prompt_ids"]]
    messages = [
        [turn_message(tokenizer, ids, prompt)] for ids, prompt in zip(completions, prompts, strict=True)
    ]
    use = ToolUse(messages, [1] * n, [Counter() for _ in range(n)], [Counter() for _ in range(n)], extra)
    model_mask = None if env_mask is None else [list(m) for m in env_mask]
    return batch_of_lists(tokenizer, prompt_ids, prompt_mask, completions, model_mask, logprobs, eos, "", use)
