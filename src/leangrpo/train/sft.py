"""Supervised cold start, as DeepSeek-R1 did before RL: a few steps of next-token training on the
task's worked solutions, written in the answer format its rewards check (`Task.solution`).

A 135M model almost never writes a format it was not shown, so every completion in a group scores the
same and GRPO has nothing to learn from. A short cold start makes the format likely enough that groups
differ, and RL takes it from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from leangrpo.data.rows import Message, render_prompt
from leangrpo.engines.types import RolloutBatch

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

    The part of the target that the assistant prefix already prefills is not trained on, nor are the tool
    results of a tool-use trace (`target_ids`): they are out of `loss_mask`, as in GRPO.
    """
    kwargs = chat_template_kwargs or [{} for _ in prompts]
    texts = [render_prompt(tokenizer, p, assistant_prefix, k) for p, k in zip(prompts, kwargs, strict=True)]
    targets = [s.removeprefix(assistant_prefix) + tokenizer.eos_token for s in solutions]
    prompt = tokenizer(
        texts, return_tensors="pt", padding=True, truncation=True, max_length=max_prompt_length,
        add_special_tokens=False,
    )  # fmt: skip
    header = generation_header(tokenizer)
    encoded = [target_ids(tokenizer, t, header) for t in targets]
    truncated = torch.tensor([len(ids) > max_completion_length for ids, _ in encoded])
    width = max(min(len(ids), max_completion_length) for ids, _ in encoded)
    ids = torch.full((len(encoded), width), tokenizer.pad_token_id, dtype=torch.long)
    mask, model_mask = torch.zeros_like(ids), torch.zeros_like(ids)
    for row, (tokens, written) in enumerate(encoded):
        n = min(len(tokens), width)
        ids[row, :n], mask[row, :n], model_mask[row, :n] = (
            torch.tensor(tokens[:n]),
            1,
            torch.tensor(written[:n]),
        )
    multi_turn = not bool(model_mask[mask.bool()].all())
    return RolloutBatch(
        prompt.input_ids, prompt.attention_mask, ids, mask, truncated, targets,
        model_mask=model_mask if multi_turn else None,
    )  # fmt: skip


def generation_header(tokenizer: PreTrainedTokenizerBase) -> str | None:
    """The text the chat template puts before an assistant's turn (ChatML: "<|im_start|>assistant\n");
    None without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    chat: list[Any] = [{"role": "user", "content": "x"}]
    bare = str(tokenizer.apply_chat_template(chat, tokenize=False))
    opened = str(tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))
    return opened.removeprefix(bare) or None


def target_ids(
    tokenizer: PreTrainedTokenizerBase, target: str, header: str | None
) -> tuple[list[int], list[int]]:
    """A target's token ids, and 1 on those the model writes: a tool-use trace's tool results (from the end
    of each turn, its EOS, to the next assistant header included) get 0, as the GRPO loss masks the tool
    loop's results (TRL's tool_mask). Each part is encoded on its own, as the tool loop encodes it."""
    eos = tokenizer.eos_token
    ids: list[int] = []
    written: list[int] = []
    at = 0
    while at < len(target):
        end = target.find(eos, at)
        opens = -1 if end < 0 or header is None else target.find(header, end + len(eos))
        if opens < 0:  # no tool result follows: the rest is the model's
            parts, at = [(target[at:], 1)], len(target)
        else:
            parts = [
                (target[at : end + len(eos)], 1),
                (target[end + len(eos) : opens + len(header or "")], 0),
            ]
            at = opens + len(header or "")
        for text, mine in parts:
            part = tokenizer(text, add_special_tokens=False).input_ids
            ids, written = ids + part, written + [mine] * len(part)
    return ids, written


def nll_loss(logp: Tensor, mask: Tensor) -> Tensor:
    """Mean negative log-likelihood of the masked (real) target tokens."""
    return -(logp * mask).sum() / mask.sum().clamp(min=1)
