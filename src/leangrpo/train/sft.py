"""Supervised cold start, as DeepSeek-R1 did before RL: a few steps of next-token training on the
task's worked solutions, written in the answer format its rewards check (`Task.solution`).

A 135M model almost never writes a format it was not shown, so every completion in a group scores the
same and GRPO has nothing to learn from. A short cold start makes the format likely enough that groups
differ, and RL takes it from there.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from leangrpo.config.schema import step_interval
from leangrpo.data.rows import Message, PromptFormat
from leangrpo.data.sources import PromptSampler
from leangrpo.engines.types import RolloutBatch
from leangrpo.train.optim import build_optimizer
from leangrpo.train.policy import micro_batch_logprobs

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

    from leangrpo.config.schema import Config
    from leangrpo.data.tasks import Task
    from leangrpo.train.rollouts import Generation


def cold_start(
    cfg: Config,
    acc: Accelerator,
    gen: Generation,
    task: Task,
    rows: list[dict[str, Any]],
    write: Callable[[str], None],
) -> None:
    """`sft.steps` supervised steps on `task`'s worked solutions of `rows`, before the first GRPO step, with
    an optimizer of their own; each prompt is shown as rollouts show it (with its tools, in a run that
    has them)."""
    from tqdm import trange

    s, g, policy, agent = cfg.sft, cfg.grpo, gen.policy, gen.agent
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = build_optimizer(params, cfg.optim, learning_rate=s.learning_rate)
    order = PromptSampler(len(rows), s.batch_size, cfg.seed + 1, acc.process_index, acc.num_processes)
    fmt = PromptFormat.from_config(cfg.data, g.max_prompt_length)
    policy.train()
    show = acc.is_main_process and cfg.logging.progress_bar
    cut, shown = 0, 0  # solutions longer than the completion budget, of those shown (said at the end)
    for step in trange(s.steps, desc="SFT cold start", disable=not show, dynamic_ncols=True):
        batch_rows = [rows[i] for i in order.indices(step)]
        prompts, tools = [r["prompt"] for r in batch_rows], None
        if agent is not None and agent.uses_tools:  # the prompts as rollouts show them
            episodes = agent.start(batch_rows, 1)
            prompts, tools = episodes.prompts, [box.schemas for box in episodes.toolboxes]
        batch = sft_batch(
            gen.tokenizer, prompts, [task.solution(r) for r in batch_rows], prompt_format=fmt, tools=tools,
            max_prompt_length=g.max_prompt_length, max_completion_length=g.max_completion_length,
        ).to(acc.device)  # fmt: skip
        cut, shown = cut + int(batch.truncated.sum()), shown + len(batch_rows)
        logp, _ = micro_batch_logprobs(policy, batch, slice(None), temperature=1.0)
        loss = nll_loss(logp, batch.loss_mask[:, : logp.shape[1]])  # a trace's tool results: out
        acc.backward(loss)
        gen.dist.clip_grad_norm(policy, cfg.optim.max_grad_norm or math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % step_interval(cfg.logging.logging_steps, s.steps) == 0 or step + 1 == s.steps:
            write(f"sft step {step + 1:>4} | loss={loss.item():.4g}")
    if cut:  # their ends (the answer, often) were not trained on
        write(
            f"sft: {cut} of {shown} worked solutions ran past grpo.max_completion_length="
            f"{g.max_completion_length} tokens and were cut there; raise it to train on their ends"
        )


def sft_batch(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[Message]],
    solutions: list[str],
    *,
    prompt_format: PromptFormat,
    max_prompt_length: int | None,
    max_completion_length: int,
    tools: list[list[Any]] | None = None,
) -> RolloutBatch:
    """Prompts (left-padded) and their solutions (right-padded, ending in EOS) as a RolloutBatch, so the
    cold start scores targets through the same log-prob path as GRPO. `tools`: each prompt's tool schemas
    (a run with tools shows each prompt with its rollout's tools, as GRPO will).

    The part of the target that the assistant prefix already prefills is not trained on, nor are the tool
    results of a tool-use trace (`target_ids`): they are out of `loss_mask`, as in GRPO.
    """
    schemas: list[list[Any] | None] = list(tools) if tools else [None] * len(prompts)
    texts = [prompt_format.render(tokenizer, p, t) for p, t in zip(prompts, schemas, strict=True)]
    assistant_prefix = prompt_format.assistant_prefix
    targets = [s.removeprefix(assistant_prefix) + tokenizer.eos_token for s in solutions]
    prompt = tokenizer(
        texts, return_tensors="pt", padding=True, padding_side="left",
        truncation=max_prompt_length is not None, max_length=max_prompt_length,
        add_special_tokens=False,
    )  # fmt: skip
    header = prompt_format.generation_header(tokenizer)
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
