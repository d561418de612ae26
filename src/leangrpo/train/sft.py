"""Supervised cold start, as DeepSeek-R1 did before RL: a few steps of next-token training on the
task's worked solutions, written in the answer format its rewards check (`Task.solution`).

A 135M model almost never writes a format it was not shown, so every completion in a group scores the
same and GRPO has nothing to learn from. A short cold start makes the format likely enough that groups
differ, and RL takes it from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from leangrpo.data.rows import Message, render_prompt
from leangrpo.engines.rollout import RolloutBatch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[Message]],
    solutions: list[str],
    *,
    assistant_prefix: str,
    max_prompt_length: int,
    max_completion_length: int,
    chat_template_kwargs: list[dict[str, Any]] | None = None,
) -> RolloutBatch:
    """Prompts (left-padded) and their solutions (right-padded, ending in EOS) as a RolloutBatch, so the
    cold start scores targets through the same log-prob path as GRPO. `chat_template_kwargs`: one per
    prompt (a run with tools shows each prompt with its rollout's tools, as GRPO will).

    The part of the target that the assistant prefix already prefills is not trained on.
    """
    kwargs = chat_template_kwargs or [{} for _ in prompts]
    texts = [render_prompt(tokenizer, p, assistant_prefix, k) for p, k in zip(prompts, kwargs, strict=True)]
    targets = [s.removeprefix(assistant_prefix) + tokenizer.eos_token for s in solutions]
    prompt = tokenizer(
        texts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_length,
        add_special_tokens=False,
    )  # fmt: skip
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        completion = tokenizer(targets, return_tensors="pt", padding=True, add_special_tokens=False)
    finally:
        tokenizer.padding_side = side
    truncated = completion.attention_mask.sum(dim=1) > max_completion_length
    ids = completion.input_ids[:, :max_completion_length]
    mask = completion.attention_mask[:, :max_completion_length]
    return RolloutBatch(prompt.input_ids, prompt.attention_mask, ids, mask, truncated, targets)


def nll_loss(logp: Tensor, mask: Tensor) -> Tensor:
    """Mean negative log-likelihood of the masked (real) target tokens."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1)
