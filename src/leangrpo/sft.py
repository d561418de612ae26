"""Supervised cold start, as DeepSeek-R1 did before RL: a few steps of next-token training on the
dataset's own worked solutions, rewritten into the reward format.

A 135M model almost never writes the `<reasoning>`/`<answer>` tags by itself, so every completion in a
group scores the same and GRPO has nothing to learn from. A short cold start makes the format likely
enough that groups differ, and RL takes it from there.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from torch import Tensor

from .data import render_prompt
from .rollout import RolloutBatch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_CALCULATOR_NOTE = re.compile(r"<<[^>]*>>")  # GSM8K's "48/2 = <<48/2=24>>24" annotations


def tagged_solution(solution: str, answer: str) -> str:
    """A GSM8K worked solution in the recipe's format, without its calculator annotations."""
    steps = _CALCULATOR_NOTE.sub("", solution.rpartition("####")[0]).strip()
    return f"<reasoning>\n{steps}\n</reasoning>\n<answer>\n{answer}\n</answer>\n"


def sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    *,
    assistant_prefix: str,
    max_prompt_length: int,
    max_completion_length: int,
) -> RolloutBatch:
    """Prompts (left-padded) and their tagged solutions (right-padded, ending in EOS) as a RolloutBatch,
    so the cold start scores targets through the same log-prob path as GRPO.

    The part of the target that the assistant prefix already prefills is not trained on.
    """
    prompts, targets = [], []
    for row in rows:
        target = tagged_solution(row["solution"], row["answer"])
        prompts.append(render_prompt(tokenizer, row["prompt"], assistant_prefix))
        targets.append(target.removeprefix(assistant_prefix) + tokenizer.eos_token)
    prompt = tokenizer(
        prompts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_length,
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
