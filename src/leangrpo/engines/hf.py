"""Generation: prompts → G sampled completions each → a RolloutBatch, the one type that crosses from
rollout to update. A RolloutEngine runs it: HF generate here (the default), vLLM in engines/vllm.py."""

from __future__ import annotations

import copy
import inspect
import math
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import Tensor
from transformers import DynamicCache, GenerationConfig, GenerationMixin, LogitsProcessor, LogitsProcessorList
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from leangrpo.core.grpo import mask_after_eos
from leangrpo.engines.tools import Toolbox, ToolError, ToolUse, TurnGenerator, tool_loop, turn_message
from leangrpo.models.load import is_peft, peft_base

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import GRPOSection


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
        return self._map(lambda t: t.to(device), self.completion_texts, self.tool_use)

    def select(self, rows: Tensor) -> RolloutBatch:
        """The completions at `rows` [K], in that order."""
        indices = rows.tolist()
        use = None if self.tool_use is None else self.tool_use.select(indices)
        return self._map(lambda t: t[rows], [self.completion_texts[i] for i in indices], use)

    def _map(
        self, f: Callable[[Tensor], Tensor], texts: list[str], use: ToolUse | None = None
    ) -> RolloutBatch:
        """Every tensor through `f`, with `texts` and `use`."""
        logp = None if self.sampling_logprobs is None else f(self.sampling_logprobs)
        model_mask = None if self.model_mask is None else f(self.model_mask)
        return RolloutBatch(
            f(self.prompt_ids), f(self.prompt_mask), f(self.completion_ids), f(self.completion_mask),
            f(self.truncated), texts, logp, model_mask, use,
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
    rollout is the same whichever thread runs it and whatever else draws meanwhile (None: the global RNG)."""

    num_generations: int
    max_prompt_length: int
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

    def generator(self, device: torch.device) -> torch.Generator | None:
        """The rollout's own random stream on `device` (None without a seed: torch's global RNG)."""
        return None if self.seed is None else torch.Generator(device).manual_seed(self.seed)

    @classmethod
    def from_config(cls, g: GRPOSection, assistant_prefix: str) -> Sampling:
        """The training rollout's: `grpo`'s sampling settings, each completion opened by the data's
        `assistant_prefix`."""
        return cls(
            num_generations=g.num_generations, max_prompt_length=g.max_prompt_length,
            max_completion_length=g.max_completion_length, temperature=g.temperature, top_p=g.top_p,
            top_k=g.top_k, min_p=g.min_p, repetition_penalty=g.repetition_penalty,
            generation_kwargs=g.generation_kwargs, assistant_prefix=assistant_prefix,
            ignore_eos=g.ignore_eos, max_tool_calling_iterations=g.max_tool_calling_iterations,
        )  # fmt: skip


class RolloutEngine(Protocol):
    """What the trainer generates with; `sync_weights` makes the next rollout use the model's current
    weights (`weights`: those weights as the caller streams them, when they are not whole in `model`,
    as under FSDP2)."""

    def generate(
        self, prompt_texts: list[str], sampling: Sampling, toolboxes: list[Toolbox] | None = None
    ) -> RolloutBatch:
        """Completions of each prompt; with `toolboxes` (one per completion), multi-turn rollouts that
        call those tools."""
        ...

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None: ...


class GenerateLevers(Protocol):
    """A device's speed levers for `generate`, which leave what is sampled unchanged (leangrpo.cpu has the
    CPU's): a decode loop of its own, or a context around generate()."""

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


class HFEngine:
    """transformers' generate on the policy itself: the weights are shared, so there is nothing to sync
    (and no gap between sampler and trainer to correct: its batches carry no sampler log-probs)."""

    sampler_logprobs = False

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, levers: GenerateLevers | None = None
    ):
        self.model, self.tokenizer, self.levers = model, tokenizer, levers

    def generate(
        self, prompt_texts: list[str], sampling: Sampling, toolboxes: list[Toolbox] | None = None
    ) -> RolloutBatch:
        return generate(
            self.model, self.tokenizer, prompt_texts, sampling, levers=self.levers, toolboxes=toolboxes,
            sampler_logprobs=self.sampler_logprobs,
        )  # fmt: skip

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None:
        pass


class SnapshotEngine(HFEngine):
    """transformers' generate on a copy of the policy that changes only at `sync_weights`, so that it can
    generate in another thread while the update writes the policy (async rollouts). Only the trainable
    tensors are copied (full fine-tuning: every weight; LoRA: the adapter); the frozen ones (a LoRA base,
    buffers) are the policy's own, which nothing writes. Its batches carry the sampler's log-probs: the
    policy has moved on when it trains on them, and the importance-sampling correction weighs that gap."""

    sampler_logprobs = True

    def __init__(
        self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, levers: GenerateLevers | None = None
    ):
        frozen = {id(t): t for t in (*model.parameters(), *model.buffers()) if not t.requires_grad}
        snapshot = copy.deepcopy(model, frozen).eval()
        super().__init__(snapshot.requires_grad_(False), tokenizer, levers)

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None:
        """Copy `model`'s trainable tensors into the snapshot (the caller makes sure neither the update nor
        a rollout runs meanwhile). `weights` is for engines that load streamed weights; the snapshot reads
        `model` itself (async rollouts refuse FSDP, so it is never sharded here)."""
        mine = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, param in model.named_parameters():
                if param.requires_grad:
                    mine[name].copy_(param)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS and the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    gen_eos = getattr(model.generation_config, "eos_token_id", None)
    ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
    return sorted(i for i in ids if i is not None)


@torch.no_grad()
def generate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    sampling: Sampling,
    *,
    levers: GenerateLevers | None = None,
    toolboxes: list[Toolbox] | None = None,
    sampler_logprobs: bool = False,
    reuse_cache: bool = True,
) -> RolloutBatch:
    """Sample `sampling.num_generations` completions per prompt. Tokens after the first EOS are masked out.
    `levers`: the device's speed levers (leangrpo.cpu's on CPU), which sample the same distribution.
    `toolboxes` (one per completion): rollouts go on after each turn that calls tools (`with_tools`), each
    turn resumed from the KV cache of the turns before (`ResumedTurns`) unless `reuse_cache` is False.
    `sampler_logprobs`: the batch carries each sampled token's log-prob under the distribution it was
    drawn from (what vLLM returns), for the importance-sampling correction."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = encode_prompts(
        tokenizer, prompt_texts, sampling.max_prompt_length, sampling.num_generations
    )
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    eos = eos_token_ids(tokenizer, model)
    rng = sampling.generator(device)  # one stream for every turn of the rollout
    reuse = reuse_cache and toolboxes is not None
    turns = ResumedTurns(model, tokenizer, sampling, eos, levers, reuse, rng, sampler_logprobs)
    completion_ids, logprobs = turns.first(prompt_ids, prompt_mask)
    batch = finish_batch(tokenizer, prompt_ids, prompt_mask, completion_ids, eos, sampling, logprobs)
    if toolboxes is None:
        return batch
    return with_tools(batch, tokenizer, toolboxes, sampling, turns, eos, model_length(model))


class ResumedTurns:
    """The HF engine's turns of tool-calling rollouts. With `reuse`, the KV cache of each turn is kept, and a
    later turn encodes only what its cache does not hold (the tool results and the next assistant header):
    each row's cached keys and values are gathered, right-aligned, into a fresh cache, and the new tokens
    follow with a hole of padding between them, which the attention mask hides and the positions skip, so
    the model reads the sequence it would read re-encoded. Without `reuse` (or for a model that takes no
    cache of `PreallocatedLayer`s: sliding windows, recurrent states) every turn re-encodes its whole
    sequence."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        sampling: Sampling,
        eos: list[int],
        levers: GenerateLevers | None,
        reuse: bool,
        generator: torch.Generator | None = None,
        logprobs: bool = False,
    ):
        """`generator`: the rollout's one random stream, for every turn; `logprobs`: each turn also gives
        its sampled tokens' log-probs (when sampling)."""
        self.model, self.tokenizer, self.sampling, self.eos = model, tokenizer, sampling, eos
        self.levers, self.reuse, self.generator = levers, reuse, generator
        self.logprobs = logprobs and sampling.do_sample
        self.cache: DynamicCache | None = None
        self.tokens: list[list[int]] = []  # each cache row's real tokens, in order
        self.slots: list[Tensor] = []  # and the cache positions that hold them
        self.encoded = 0  # positions run through the model so far (prefill and decode)

    def first(self, prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor | None]:
        """The first turns' completion ids and their log-probs, the rows' cache kept (with `reuse`)."""
        capacity = prompt_ids.shape[1] + self.sampling.max_completion_length
        return self._sample(prompt_ids, prompt_mask, self.sampling, self._new_cache(capacity))

    def __call__(
        self, sequences: list[list[int]], max_new: int
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """The next turn of each sequence (a TurnGenerator): at most `max_new` tokens, up to its EOS."""
        sampling = replace(self.sampling, num_generations=1, max_completion_length=max_new)
        device = next(self.model.parameters()).device
        if self.cache is None:
            ids, mask = left_padded(sequences, self.tokenizer.pad_token_id, device)
            return self._turns(*self._sample(ids, mask, sampling, None))
        rows = self._match(sequences)
        cached = [0 if row is None else len(self.tokens[row]) for row in rows]
        width, new = max(cached), max(len(s) - k for s, k in zip(sequences, cached, strict=True))
        ids = torch.full((len(sequences), width + new), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, (seq, k) in enumerate(zip(sequences, cached, strict=True)):
            ids[r, width - k : width], ids[r, width + new - (len(seq) - k) :] = (
                torch.tensor(seq[:k], dtype=torch.long), torch.tensor(seq[k:], dtype=torch.long)
            )  # fmt: skip
            mask[r, width - k : width] = mask[r, width + new - (len(seq) - k) :] = 1
        cache = self._new_cache(width + new + max_new)
        if cache is not None and width > 0:
            self._carry(cache, rows, cached, width)
        return self._turns(*self._sample(ids.to(device), mask.to(device), sampling, cache))

    def _turns(
        self, out: Tensor, logprobs: Tensor | None
    ) -> tuple[list[list[int]], list[list[float]] | None]:
        """Each row's turn up to its EOS, and its tokens' log-probs (None without `logprobs`)."""
        turns = ended_at_eos(out, self.eos)
        if logprobs is None:
            return turns, None
        return turns, [lp[: len(t)].tolist() for lp, t in zip(logprobs, turns, strict=True)]

    def _new_cache(self, capacity: int) -> DynamicCache | None:
        if not self.reuse:
            return None
        cache = kv_cache(self.model, capacity)
        if cache is None or not all(type(layer) is PreallocatedLayer for layer in cache.layers):
            self.reuse = False  # a cache that cannot be gathered row by row: re-encode every turn
            return None
        return cache

    def _sample(
        self, ids: Tensor, mask: Tensor, sampling: Sampling, cache: DynamicCache | None
    ) -> tuple[Tensor, Tensor | None]:
        """Completion ids after `ids` (their first tokens possibly in `cache`) and their log-probs (with
        `logprobs`); the rows' cache kept."""
        start = 0 if cache is None else cache.get_seq_length()
        drawn: list[Tensor] | None = [] if self.logprobs else None
        out = sample(
            self.model,
            self.tokenizer,
            ids,
            mask,
            sampling,
            self.eos,
            self.levers,
            self.generator,
            drawn,
            cache,
        )
        # each step but the last fed its token: the cache holds that many positions (the lean decode loop
        # writes them into the buffers without moving the layers' own length)
        held = ids.shape[1] + max(out.shape[1] - 1, 0)
        self.encoded += len(ids) * (held - start)
        if cache is not None:
            self._keep(cache, held, torch.cat([ids, out], dim=1), torch.cat([mask, self._real(out)], dim=1))
        if drawn is None:
            return out, None
        return out, torch.cat(drawn, dim=1) if drawn else torch.zeros(len(out), 0, device=out.device)

    def _real(self, completion_ids: Tensor) -> Tensor:
        """1 on each completion's tokens up to its first EOS (those after it are padding)."""
        return mask_after_eos(completion_ids, self.eos)[0].to(completion_ids.dtype)

    def _keep(self, cache: DynamicCache, held: int, ids: Tensor, mask: Tensor) -> None:
        """Remember `cache`, whose first `held` positions are filled, and for each of its rows the real
        tokens it holds and where."""
        real = mask[:, :held].bool().cpu()
        self.cache, self.slots = cache, [row.nonzero().squeeze(1) for row in real]
        self.tokens = [row[keep].tolist() for row, keep in zip(ids[:, :held].cpu(), real, strict=True)]

    def _match(self, sequences: list[list[int]]) -> list[int | None]:
        """For each sequence, a cache row whose tokens begin it (None: none does). The tool loop asks for
        rows in order, a subset of the last turn's, so the search only moves forward."""
        rows: list[int | None] = []
        at = 0
        for seq in sequences:
            found = next(
                (j for j in range(at, len(self.tokens)) if seq[: len(self.tokens[j])] == self.tokens[j]), None
            )
            rows.append(found)
            at = at if found is None else found + 1
        return rows

    def _carry(self, cache: DynamicCache, rows: list[int | None], cached: list[int], width: int) -> None:
        """Fill `cache`'s first `width` positions with each row's cached keys and values, right-aligned
        (positions left of them hold copies that the attention mask hides)."""
        if self.cache is None:
            raise ValueError("no turn to resume")
        src_row = torch.zeros(len(rows), width, dtype=torch.long)
        src_slot = torch.zeros(len(rows), width, dtype=torch.long)
        for r, (row, k) in enumerate(zip(rows, cached, strict=True)):
            if row is not None and k:
                src_row[r], src_slot[r, width - k :] = row, self.slots[row]
        for old, new in zip(self.cache.layers, cache.layers, strict=True):  # PreallocatedLayers (_new_cache)
            old, new = cast(PreallocatedLayer, old), cast(PreallocatedLayer, new)
            index = src_row.to(old.key_buffer.device), src_slot.to(old.key_buffer.device)
            keys, values = (
                b.transpose(1, 2)[index].transpose(1, 2) for b in (old.key_buffer, old.value_buffer)
            )
            new.update(keys, values)  # [rows, heads, width, dim]


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: Sampling,
    eos: list[int],
    levers: GenerateLevers | None = None,
    generator: torch.Generator | None = None,
    drawn: list[Tensor] | None = None,
    cache: DynamicCache | None = None,
) -> Tensor:
    """The completion ids generate() samples after left-padded prompts (each group's rows adjacent), padded
    after their EOS; drawn from `generator` (None: torch's global RNG). `drawn`: each position's sampled
    log-probs ([rows, 1]) are appended to it (sampling only). `cache`: a KV cache of room enough, possibly
    holding the prompts' first tokens (a resumed turn); by default a fresh one."""
    processors = logits_processors(sampling, generator, drawn)
    gen_cfg = GenerationConfig(
        max_new_tokens=sampling.max_completion_length,
        min_new_tokens=sampling.max_completion_length if sampling.ignore_eos else 0,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        **(sampling.generation_kwargs or {}),
    )
    was_training = model.training
    model.eval()  # uses the KV cache (disabled under gradient checkpointing in train mode), no dropout
    if cache is None:
        cache = kv_cache(model, prompt_ids.shape[1] + sampling.max_completion_length)
    own_loop = cache is not None and prompt_ids.shape[1] > 1 and not sampling.generation_kwargs
    with only_generation_config(model, gen_cfg):
        completion_ids = None
        if levers is not None and own_loop and cache is not None:
            completion_ids = levers.decode(
                model, cache, prompt_ids, prompt_mask, sampling, processors, eos, gen_cfg
            )
        if completion_ids is None:
            with levers.around_generate(model, len(prompt_ids)) if levers is not None else nullcontext():
                if cache is not None and sampling.num_generations > 1:
                    prefill_once_per_group(model, prompt_ids, prompt_mask, sampling.num_generations, cache)
                # generate(): a causal LM (or the peft model standing in for one) has it, PreTrainedModel
                # does not declare it
                out = cast("GenerationMixin", model).generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=gen_cfg,
                    logits_processor=LogitsProcessorList(processors),
                    **({CACHE_KWARG: cache} if cache is not None else {}),
                )
            completion_ids = out[:, prompt_ids.shape[1] :]
    model.train(was_training)
    return completion_ids


def model_length(model: PreTrainedModel) -> int | None:
    """The most positions the model takes (its config's max_position_embeddings), if it says."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def left_padded(sequences: list[list[int]], pad_id: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """Token lists as left-padded ids and their attention mask."""
    width = max(map(len, sequences))
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, width - len(seq) :], mask[row, width - len(seq) :] = torch.tensor(seq), 1
    return ids.to(device), mask.to(device)


def ended_at_eos(completion_ids: Tensor, eos: list[int]) -> list[list[int]]:
    """Each row's tokens up to and including its first EOS."""
    mask, _ = mask_after_eos(completion_ids, eos)
    return [row[: int(n)].tolist() for row, n in zip(completion_ids, mask.sum(dim=1), strict=True)]


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
        max_model_len,
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


def logits_processors(
    sampling: Sampling, generator: torch.Generator | None = None, drawn: list[Tensor] | None = None
) -> list[LogitsProcessor]:
    """Sampling as logits processors ending in InverseCDFSampler, whose token greedy decoding then picks:
    generate()'s own sampling draws with torch.multinomial, which costs far more per token on a CPU
    (benchmarks/RESULTS.md)."""
    processors: list[LogitsProcessor] = []
    if sampling.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(sampling.repetition_penalty))
    if sampling.do_sample:
        processors += [TemperatureLogitsWarper(sampling.temperature)] if sampling.temperature != 1.0 else []
        processors += [TopKLogitsWarper(sampling.top_k)] if sampling.top_k > 0 else []
        processors += [TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1.0 else []
        processors += [MinPLogitsWarper(sampling.min_p)] if sampling.min_p else []
        processors.append(InverseCDFSampler(generator, drawn))
    return processors


# No text averages more characters a token, so a text's last 64·N characters hold its last N tokens.
MAX_CHARS_PER_TOKEN = 64


def encode_prompts(
    tokenizer: PreTrainedTokenizerBase, prompt_texts: list[str], max_prompt_length: int, repeat: int
) -> tuple[Tensor, Tensor]:
    """Left-padded prompt ids and mask, each prompt repeated `repeat` times (one row per completion).
    Left truncation keeps the last `max_prompt_length` tokens, so only the text's end is tokenized: a
    50 MB question costs no more memory than a long one."""
    enc = tokenizer(
        [text[-MAX_CHARS_PER_TOKEN * max_prompt_length :] for text in prompt_texts],
        return_tensors="pt",
        padding=True,
        truncation=True,
        max_length=max_prompt_length,
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


@contextmanager
def only_generation_config(model: PreTrainedModel, gen_cfg: GenerationConfig) -> Iterator[None]:
    """Make `gen_cfg` the model's own generation_config for the duration of a generate() call.

    generate() fills every field its config leaves unset from the model's generation_config (the
    checkpoint's generation_config.json: repetition_penalty, min_length, no_repeat_ngram_size, ...), and
    each of those adds a logits processor; GRPO must sample from exactly softmax(logits / T) after the
    configured top-p, the distribution the log-probs are computed for, so nothing may be inherited."""
    base = peft_base(model) if is_peft(model) else model
    saved, base.generation_config = base.generation_config, gen_cfg
    try:
        yield
    finally:
        base.generation_config = saved


class InverseCDFSampler(LogitsProcessor):
    """Draws each row's next token from softmax(scores) and leaves only that token finite, so that greedy
    decoding then picks it. One uniform number per row against the cumulative distribution: the same
    distribution as torch.multinomial, which draws an exponential number for every vocabulary entry.
    `generator`: where the uniform numbers come from (None: torch's global RNG); `drawn`: where each
    draw's log-probs ([rows, 1], under softmax(scores)) are appended, if given."""

    def __init__(self, generator: torch.Generator | None = None, drawn: list[Tensor] | None = None):
        self.generator, self.drawn = generator, drawn

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        token = self.draw(scores, self.generator)
        if self.drawn is not None:
            self.drawn.append(scores.float().log_softmax(dim=-1).gather(1, token))
        return torch.full_like(scores, -torch.inf).scatter_(1, token, 0.0)

    @staticmethod
    def draw(scores: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """One token id per row, [rows, 1], drawn from softmax(scores)."""
        cdf = torch.softmax(scores, dim=-1).cumsum_(dim=-1)
        u = torch.rand(len(cdf), 1, device=cdf.device, dtype=cdf.dtype, generator=generator) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)


class PreallocatedLayer(DynamicLayer):
    """A full-attention KV-cache layer whose keys and values are views of buffers of `capacity` positions,
    allocated once: DynamicLayer appends each token with torch.cat, copying the layer's whole cache."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.key_buffer, self.value_buffer = (
            t.new_empty(*t.shape[:2], self.capacity, t.shape[3]) for t in (key_states, value_states)
        )

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row `repeats` times in a row, buffers included (after a prefill shared by a group)."""
        if self.is_initialized:
            end = self.get_seq_length()
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]


# generate()'s and forward()'s name for the KV cache: `cache` in newer transformers (5.24 here, where the
# old `past_key_values` still works with a FutureWarning), `past_key_values` before.
CACHE_KWARG = (
    "cache"
    if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)


def kv_cache(model: PreTrainedModel, capacity: int) -> DynamicCache | None:
    """A KV cache for generate() whose full-attention layers are PreallocatedLayers of `capacity` positions;
    None (generate() builds its own) for models that take no DynamicCache."""
    # a GenerationMixin classmethod, whose `cls` transformers types as its own private Protocol
    if not cast("GenerationMixin", model)._supports_default_dynamic_cache():  # type: ignore[misc]
        return None
    cache = DynamicCache(config=model.config.get_text_config(decoder=True))
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache


@torch.no_grad()
def prefill_once_per_group(
    model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, group: int, cache: DynamicCache
) -> None:
    """Fill `cache` with all but the last prompt token, running each group's prompt once instead of
    `group` times, then repeat its entries for the group's rows; generate() then starts from the last
    prompt token. The rows of a group hold the same prompt (encode_prompts repeats them), so this is the
    same cache for 1/`group` of the prefill's work (benchmarks/RESULTS.md, "CPU speed-ups, on and off").
    A cache that holds the first tokens already (a resumed turn, `group` 1) gets the rest only."""
    start = cache.get_seq_length()
    if prompt_ids.shape[1] - 1 <= start:
        return
    ids, mask = prompt_ids[::group, :-1], prompt_mask[::group, :-1]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
    model(
        input_ids=ids[:, start:], attention_mask=mask, position_ids=positions[:, start:], use_cache=True,
        **{CACHE_KWARG: cache},
    )  # fmt: skip
    if group > 1:
        cache.batch_repeat_interleave(group)


def as_reward_inputs(
    prompts: list[Any], completion_texts: list[str], conversational: bool
) -> tuple[list[Any], list[Any]]:
    """Prompts and completions in TRL's shapes: chat-message lists when the prompts are chats rendered
    by a chat template, plain strings otherwise (text prompts: TRL's standard format). Each prompt is
    repeated for each of its completions."""
    per_prompt = len(completion_texts) // len(prompts)
    repeated = [p for p in prompts for _ in range(per_prompt)]
    if conversational and not isinstance(prompts[0], str):
        return repeated, [[{"role": "assistant", "content": t}] for t in completion_texts]
    return repeated, completion_texts
