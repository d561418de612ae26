"""HF generation: transformers' generate on the policy (HFEngine) or on a copy of it (SnapshotEngine, for
async rollouts), drawing by inverse CDF into a KV cache allocated once, each group's prompt prefilled once
(and a prefix every prompt shares, once for all), and tool-calling turns resumed from the cache
(ResumedTurns)."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

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

from leangrpo.core.errors import UserError
from leangrpo.core.grpo import mask_after_eos
from leangrpo.engines.structured import RegexConstraint
from leangrpo.engines.tools import Toolbox
from leangrpo.engines.types import (
    GenerateLevers,
    PolicyEngine,
    RolloutBatch,
    Sampling,
    encode_rollout_prompts,
    eos_token_ids,
    finish_batch,
    left_padded,
    with_tools,
)
from leangrpo.engines.vision import VisionInputs
from leangrpo.models import neftune
from leangrpo.models.load import is_peft, peft_base

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class HFEngine(PolicyEngine):
    """transformers' generate on the policy itself: the weights are shared, so there is nothing to sync
    (and no gap between sampler and trainer to correct: its batches carry no sampler log-probs)."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        levers: GenerateLevers | None = None,
        processor: Any | None = None,
    ):
        """`processor`: a vision-language model's, which encodes image prompts."""
        self.model, self.tokenizer, self.levers, self.processor = model, tokenizer, levers, processor

    def generate(
        self,
        prompt_texts: list[str],
        sampling: Sampling,
        toolboxes: list[Toolbox] | None = None,
        images: list[list[Any]] | None = None,
    ) -> RolloutBatch:
        return generate(
            self.model, self.tokenizer, prompt_texts, sampling, levers=self.levers, toolboxes=toolboxes,
            sampler_logprobs=self.sampler_logprobs, images=images, processor=self.processor,
        )  # fmt: skip


class SnapshotEngine(HFEngine):
    """transformers' generate on a copy of the policy that changes only at `sync_weights`, so that it can
    generate in another thread while the update writes the policy (async rollouts). Only the trainable
    tensors are copied (full fine-tuning: every weight; LoRA: the adapter); the frozen ones (a LoRA base,
    buffers) are the policy's own, which nothing writes. Its batches carry the sampler's log-probs: the
    policy has moved on when it trains on them, and the importance-sampling correction weighs that gap."""

    holds_weights = sampler_logprobs = True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        levers: GenerateLevers | None = None,
        processor: Any | None = None,
    ):
        frozen = {id(t): t for t in (*model.parameters(), *model.buffers()) if not t.requires_grad}
        snapshot = copy.deepcopy(model, frozen).eval()
        super().__init__(snapshot.requires_grad_(False), tokenizer, levers, processor)

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
    images: list[list[Any]] | None = None,
    processor: Any | None = None,
) -> RolloutBatch:
    """Sample `sampling.num_generations` completions per prompt. Tokens after the first EOS are masked out.
    `levers`: the device's speed levers (leangrpo.cpu's on CPU), which sample the same distribution.
    `toolboxes` (one per completion): rollouts go on after each turn that calls tools (`with_tools`), each
    turn resumed from the KV cache of the turns before (`ResumedTurns`) unless `reuse_cache` is False.
    `sampler_logprobs`: the batch carries each sampled token's log-prob under the distribution it was
    drawn from (what vLLM returns), for the importance-sampling correction. `images` (one list a prompt):
    image prompts, which `processor` encodes; each group's images are encoded once into the KV cache
    (`prefill_images_once_per_group`), and the lean decode loop is off (it runs the text decoder alone)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask, vision = encode_rollout_prompts(
        tokenizer, prompt_texts, sampling, images, processor, toolboxes
    )
    vision = None if vision is None else vision.to(device)
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    eos = eos_token_ids(tokenizer, model)
    rng = sampling.generator(device)  # one stream for every turn of the rollout
    reuse = reuse_cache and toolboxes is not None and not neftune.noised(model)  # TRL re-noises each turn
    turns = ResumedTurns(model, tokenizer, sampling, eos, levers, reuse, rng, sampler_logprobs)
    completion_ids, logprobs = turns.first(prompt_ids, prompt_mask, vision)
    batch = finish_batch(tokenizer, prompt_ids, prompt_mask, completion_ids, eos, sampling, logprobs)
    batch.vision = vision
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

    def first(
        self, prompt_ids: Tensor, prompt_mask: Tensor, vision: VisionInputs | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """The first turns' completion ids and their log-probs, the rows' cache kept (with `reuse`);
        `vision`: the prompts' pixel inputs."""
        capacity = prompt_ids.shape[1] + self.sampling.max_completion_length
        check_room(self.model, prompt_ids.shape[0], capacity)
        return self._sample(prompt_ids, prompt_mask, self.sampling, self._new_cache(capacity), vision)

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
        self,
        ids: Tensor,
        mask: Tensor,
        sampling: Sampling,
        cache: DynamicCache | None,
        vision: VisionInputs | None = None,
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
            vision,
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
    vision: VisionInputs | None = None,
) -> Tensor:
    """The completion ids generate() samples after left-padded prompts (each group's rows adjacent), padded
    after their EOS; drawn from `generator` (None: torch's global RNG). `drawn`: each position's sampled
    log-probs ([rows, 1]) are appended to it (sampling only). `cache`: a KV cache of room enough, possibly
    holding the prompts' first tokens (a resumed turn); by default a fresh one. `vision`: the rows' pixel
    inputs (image prompts): each group's images are encoded once (`prefill`), not by the lean decode loop."""
    if cache is None:
        check_room(model, prompt_ids.shape[0], prompt_ids.shape[1] + sampling.max_completion_length)
    processors = logits_processors(sampling, generator, drawn)
    if sampling.regex is not None:  # first: vLLM masks its logits before it samples (engines/structured.py)
        processors.insert(0, RegexConstraint(tokenizer, sampling.regex, eos))
    gen_cfg = generation_config(tokenizer, sampling, eos)
    was_training = model.training
    model.eval()  # uses the KV cache (disabled under gradient checkpointing in train mode), no dropout
    if cache is None:
        cache = kv_cache(model, prompt_ids.shape[1] + sampling.max_completion_length)
    noised = neftune.noised(model)  # each row's prompt prefilled apart: its own noise draw, as in TRL
    own_loop = cache is not None and prompt_ids.shape[1] > 1 and not sampling.generation_kwargs and not vision
    own_loop &= not noised
    with only_generation_config(model, gen_cfg):
        completion_ids = None
        if levers is not None and own_loop and cache is not None:
            completion_ids = levers.decode(
                model, cache, prompt_ids, prompt_mask, sampling, processors, eos, gen_cfg
            )
        if completion_ids is None:
            with levers.around_generate(model, len(prompt_ids)) if levers is not None else nullcontext():
                prefilled = None if noised else cache  # NEFTune: generate() prefills every row
                pixels = prefill(model, prompt_ids, prompt_mask, sampling.num_generations, prefilled, vision)
                # generate(): a causal LM (or the peft model standing in for one) has it, PreTrainedModel
                # does not declare it
                out = cast("GenerationMixin", model).generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    generation_config=gen_cfg,
                    logits_processor=LogitsProcessorList(processors),
                    **({CACHE_KWARG: cache} if cache is not None else {}),
                    **pixels,
                )
            completion_ids = out[:, prompt_ids.shape[1] :]
    model.train(was_training)
    return completion_ids


def generation_config(
    tokenizer: PreTrainedTokenizerBase, sampling: Sampling, eos: list[int]
) -> GenerationConfig:
    """generate()'s config for `sampling`: greedy over the logits processors' choice (`InverseCDFSampler`
    samples), `ignore_eos` as a minimum length."""
    return GenerationConfig(
        max_new_tokens=sampling.max_completion_length,
        min_new_tokens=sampling.max_completion_length if sampling.ignore_eos else 0,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
        **(sampling.generation_kwargs or {}),
    )


class GenerationLengthError(UserError, ValueError):
    """A generation longer than the model's context, or whose KV cache the device could never hold."""


def check_room(model: PreTrainedModel, rows: int, positions: int) -> None:
    """Refuse, in one line and before its KV cache is allocated, a generation of `rows` sequences of
    `positions` (prompt + new tokens): more than the model's context (max_position_embeddings), or a cache
    larger than the device's whole memory (the RAM, or the card's). A huge `--max-new-tokens` or
    `grpo.max_completion_length` otherwise dies in the allocator with a traceback."""
    fix = "lower --max-new-tokens (chat, eval) or grpo.max_completion_length / max_prompt_length"
    context = model_length(model)
    if context is not None and positions > context:
        raise GenerationLengthError(
            f"generation needs {positions} positions (prompt + new tokens), more than the model's context of "
            f"{context} (max_position_embeddings); {fix}"
        )
    text = model.config.get_text_config(decoder=True)
    heads = getattr(text, "num_key_value_heads", None) or getattr(text, "num_attention_heads", 0)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // max(text.num_attention_heads, 1)
    per_position = 2 * text.num_hidden_layers * heads * head_dim * model.dtype.itemsize
    need, device = rows * positions * per_position, model.device
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory
    else:
        import psutil

        memory = psutil.virtual_memory().total
    if need > memory:
        raise GenerationLengthError(
            f"the KV cache of {rows} sequences × {positions} positions needs {need / 2**30:.1f} GiB, more "
            f"than the {memory / 2**30:.1f} GiB of {device.type.upper()} memory; {fix} (or the batch)"
        )


def model_length(model: PreTrainedModel) -> int | None:
    """The most positions the model takes (its config's max_position_embeddings), if it says."""
    return getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)


def ended_at_eos(completion_ids: Tensor, eos: list[int]) -> list[list[int]]:
    """Each row's tokens up to and including its first EOS."""
    mask, _ = mask_after_eos(completion_ids, eos)
    return [row[: int(n)].tolist() for row, n in zip(completion_ids, mask.sum(dim=1), strict=True)]


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


def prefill(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group: int,
    cache: DynamicCache | None,
    vision: VisionInputs | None,
) -> dict[str, Tensor]:
    """Fill `cache` before generate() as far as it pays (`prefill_once_per_group`, and for image prompts
    `prefill_images_once_per_group`); returns what generate() must still be given: the rows' pixel inputs
    when there is no cache to fill (generate() then encodes each row's images)."""
    if vision is not None:
        if cache is None:
            return vision.collate(slice(None), prompt_ids, prompt_ids.shape[1])
        prefill_images_once_per_group(model, prompt_ids, prompt_mask, group, cache, vision)
    elif cache is not None and (group > 1 or shared_prefix(prompt_ids[:, :-1], prompt_mask[:, :-1])):
        prefill_once_per_group(model, prompt_ids, prompt_mask, group, cache)
    return {}


@torch.no_grad()
def prefill_images_once_per_group(
    model: PreTrainedModel,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group: int,
    cache: DynamicCache,
    vision: VisionInputs,
) -> None:
    """`prefill_once_per_group` for image prompts: the vision-language model's inner model (vision tower,
    projector, decoder) runs each group's prompt but its last token once, so its images are encoded once,
    not once a completion; the cache is then repeated for the group's rows, and so is the state the model
    keeps for the decode steps (Qwen-VL's `rope_deltas`, one offset a row). generate() then runs from the
    last prompt token without pixel inputs, the images already in the cache. Positions as in
    `Policy._vision_states`."""
    base = peft_base(model) if is_peft(model) else model
    ids, mask = prompt_ids[::group, :-1], prompt_mask[::group, :-1]
    firsts = vision.select(list(range(0, len(vision.rows), group)))
    inputs = firsts.collate(slice(None), ids, ids.shape[1])
    if not firsts.token_types:
        inputs["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
    base.model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: cache}, **inputs)
    if group > 1:
        cache.batch_repeat_interleave(group)
        deltas = getattr(base.model, "rope_deltas", None)
        if deltas is not None:
            base.model.rope_deltas = deltas.repeat_interleave(group, dim=0)


# The fewest prompt tokens all rows must share before `prefill_once_per_group` runs them once for the batch:
# below it, the extra batch-1 forward and the copy of its keys and values to every row would not pay.
MIN_SHARED_PREFIX = 32


def shared_prefix(prompt_ids: Tensor, prompt_mask: Tensor) -> int:
    """How many leading real tokens every left-padded row shares; 0 when fewer than MIN_SHARED_PREFIX, or
    fewer than two rows."""
    if len(prompt_ids) < 2:
        return 0
    lengths = prompt_mask.sum(dim=1)
    most = int(lengths.min())
    if most < MIN_SHARED_PREFIX:
        return 0
    # each row's real tokens, from its first: the columns right of its left padding
    columns = (prompt_ids.shape[1] - lengths)[:, None] + torch.arange(most, device=prompt_ids.device)
    real = prompt_ids.gather(1, columns)
    differs = (real != real[:1]).any(dim=0).nonzero()
    length = most if len(differs) == 0 else int(differs[0])
    return length if length >= MIN_SHARED_PREFIX else 0


@torch.no_grad()
def prefill_shared_prefix(
    model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, cache: DynamicCache
) -> None:
    """Fill an empty `cache`'s first L columns for left-padded prompts whose first L real tokens are the same
    (`shared_prefix`: a system prompt, tool schemas), running those L tokens once instead of once a row.

    Row r's real tokens start at column s_r (its left padding); its prefix token k sits at column s_r + k
    and position k in every row, so its keys and values are the batch-1 pass's k-th. Column j < L of row r
    gets the prefix's entry j - s_r; the columns left of s_r are padding, which the attention mask hides
    (they get entry 0). The prefix tokens right of column L are run again with the rest of the prompt, as
    the rows of the longest prompt start at column 0. A cache of other layers (sliding windows) is left
    alone."""
    length = shared_prefix(prompt_ids, prompt_mask)
    if (
        not length
        or cache.get_seq_length()
        or any(type(layer) is not PreallocatedLayer for layer in cache.layers)
    ):
        return
    prefix = DynamicCache()
    prefix.layers = [PreallocatedLayer(length) for _ in cache.layers]
    start = prompt_ids.shape[1] - int(prompt_mask[0].sum())
    model.get_decoder()(
        input_ids=prompt_ids[:1, start : start + length], use_cache=True, **{CACHE_KWARG: prefix}
    )
    shift = prompt_ids.shape[1] - prompt_mask.sum(dim=1)
    source = (torch.arange(length, device=shift.device) - shift[:, None]).clamp_(min=0)  # [rows, L]
    for own, shared in zip(cache.layers, prefix.layers, strict=True):
        own, shared = cast(PreallocatedLayer, own), cast(PreallocatedLayer, shared)
        keys, values = (
            b[0].transpose(0, 1)[source].transpose(1, 2) for b in (shared.key_buffer, shared.value_buffer)
        )
        own.update(keys, values)  # [rows, heads, L, dim]


@torch.no_grad()
def prefill_once_per_group(
    model: PreTrainedModel, prompt_ids: Tensor, prompt_mask: Tensor, group: int, cache: DynamicCache
) -> None:
    """Fill `cache` with all but the last prompt token, running each group's prompt once instead of
    `group` times, then repeat its entries for the group's rows; generate() then starts from the last
    prompt token. The rows of a group hold the same prompt (encode_prompts repeats them), so this is the
    same cache for 1/`group` of the prefill's work (benchmarks/RESULTS.md, "CPU speed-ups, on and off").
    A prefix that every prompt shares is run once for all (`prefill_shared_prefix`). A cache that holds
    the first tokens already (a resumed turn, `group` 1) gets the rest only.
    Only the decoder runs (the cache is all this pass is for): the lm_head would build [rows, P - 1, V]
    logits that nobody reads."""
    ids, mask = prompt_ids[::group, :-1], prompt_mask[::group, :-1]
    prefill_shared_prefix(model, ids, mask, cache)
    start = cache.get_seq_length()
    if start < ids.shape[1]:  # else the shared prefix was all of it (every prompt the same)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # as generate() numbers left-padded prompts
        model.get_decoder()(
            input_ids=ids[:, start:], attention_mask=mask, position_ids=positions[:, start:], use_cache=True,
            **{CACHE_KWARG: cache},
        )  # fmt: skip
    if group > 1:
        cache.batch_repeat_interleave(group)
