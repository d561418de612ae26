"""The GRPO math as pure functions on tensors: masks, advantages, chunked log-probs, KL and the loss.

Nothing here touches a model object, so every quantity can be checked against numbers computed by hand.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo"]
ScaleRewards = Literal["group", "batch", "none"]
# Token rows per log-prob chunk: 256 × a 49k vocabulary is 50 MB of fp32 logits, and smaller chunks cost
# time (benchmarks/RESULTS.md, "Log-prob chunk size").
LOGPROB_CHUNK_SIZE = 256


def mask_after_eos(completion_ids: Tensor, eos_token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask [N, C] that keeps tokens up to and including the first EOS; also whether each row has one."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.shape[1])
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return (positions[None, :] <= first[:, None]).long(), has_eos


def group_advantages(
    rewards: Tensor,
    num_generations: int,
    scale_rewards: ScaleRewards = "group",
    eps: float = 1e-4,
) -> tuple[Tensor, Tensor]:
    """Group-relative advantages `(r - mean_group) / (std + eps)` for rewards laid out group by group.

    NaN rewards (a completion whose scoring failed) are left out of their group's statistics and get
    advantage 0, so they teach nothing. Returns the advantages [N] and each group's std [N / G]
    (a std of 0 marks a group that carries no signal).
    """
    grouped = rewards.view(-1, num_generations)
    valid = ~torch.isnan(grouped)
    filled = torch.where(valid, grouped, 0.0)
    count = valid.sum(dim=1, keepdim=True)
    mean = filled.sum(dim=1, keepdim=True) / count.clamp(min=1)
    sq_dev = torch.where(valid, (grouped - mean) ** 2, 0.0)
    group_std = (sq_dev.sum(dim=1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
    advantages = torch.where(valid, grouped - mean, 0.0)
    if scale_rewards == "group":
        advantages = advantages / (group_std + eps)
    elif scale_rewards == "batch":
        flat = rewards[~torch.isnan(rewards)]
        batch_std = flat.std() if flat.numel() > 1 else rewards.new_tensor(0.0)
        advantages = advantages / (batch_std + eps)
    return advantages.reshape(-1), group_std.squeeze(1)


def _chunk_logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """fp32 logits of some rows, divided by the sampling temperature in place (no second copy)."""
    return (hidden @ weight.T).float().div_(temperature)


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(h @ W.T / T)[target] computed chunk by chunk; backward recomputes each chunk.

    Only one chunk's logits ([chunk, vocab]) exists at any time, in the forward and in the backward,
    so memory does not grow with batch × length × vocab; every step on a chunk works in place.
    """

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk_size):  # noqa: D102
        logps = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        lses = torch.empty_like(logps)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight, temperature)
            logps[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1)
            top = logits.amax(dim=-1, keepdim=True)  # logsumexp, in place: log(sum(exp(x - max))) + max
            lses[rows] = logits.sub_(top).exp_().sum(dim=-1).log_().add_(top.squeeze(-1))
            logps[rows] -= lses[rows]
            del logits  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, targets, lses)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return logps

    @staticmethod
    def backward(ctx, grad_logps):  # noqa: D102
        hidden, weight, targets, lses = ctx.saved_tensors
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            rows = slice(start, start + ctx.chunk_size)
            g = grad_logps[rows, None].float()
            # d logp[target] / d logits = onehot(target) - softmax(logits), then the 1/T of the scaling.
            grad_logits = _chunk_logits(hidden[rows], weight, ctx.temperature)
            grad_logits.sub_(lses[rows, None]).exp_().mul_(-g)
            grad_logits.scatter_add_(-1, targets[rows, None], g).div_(ctx.temperature)
            if want_hidden:
                grad_hidden[rows] = grad_logits.to(hidden.dtype) @ weight
            if want_weight:
                grad_weight.addmm_(grad_logits.T, hidden[rows].float())
            del grad_logits  # before the next chunk's logits exist
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = LOGPROB_CHUNK_SIZE,
) -> Tensor:
    """Per-token log-probs of `targets` [B, T] from hidden states [B, T, H] and the lm_head weight [V, H].

    Equal to `log_softmax(hidden @ weight.T / temperature).gather(targets)` without ever holding the
    [B, T, V] logits. Returned in float32.
    """
    flat = _ChunkedTokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), temperature, chunk_size
    )
    return flat.view(targets.shape)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference), per token; always >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


@dataclass
class LossStats:
    """Token sums from one micro-batch, summed by the trainer across micro-batches."""

    kl_sum: float = 0.0
    clipped_tokens: float = 0.0
    tokens: float = 0.0

    def __add__(self, other: LossStats) -> LossStats:
        return LossStats(
            self.kl_sum + other.kl_sum,
            self.clipped_tokens + other.clipped_tokens,
            self.tokens + other.tokens,
        )


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    loss_type: LossType,
    epsilon: float,
    epsilon_high: float,
    beta: float,
    num_sequences: int,
    num_tokens: float,
    max_completion_length: int,
) -> tuple[Tensor, LossStats]:
    """The clipped GRPO surrogate (+ beta × k3 KL) of one micro-batch, scaled so that summing it over
    the micro-batches of an accumulated batch gives that whole batch's loss.

    `num_sequences` and `num_tokens` count the whole accumulated batch (`num_tokens` over every
    process for dapo, over this process's generation batch for bnpo), so every loss type gets the
    same gradient whether the batch is processed at once or in micro-batches.
    """
    mask = mask.to(logp.dtype)
    ratio = torch.exp(logp - old_logp)
    adv = advantages[:, None]
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
    per_token = -torch.min(ratio * adv, clipped_ratio * adv)
    kl = kl_k3(logp, ref_logp) if ref_logp is not None else None
    if kl is not None and beta:
        per_token = per_token + beta * kl

    if loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    elif loss_type in ("bnpo", "dapo"):
        loss = (per_token * mask).sum() / max(num_tokens, 1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token * mask).sum() / (num_sequences * max_completion_length)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    with torch.no_grad():
        is_clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + epsilon_high) & (adv > 0))
        stats = LossStats(
            kl_sum=float((kl * mask).sum()) if kl is not None else 0.0,
            clipped_tokens=float((is_clipped * mask).sum()),
            tokens=float(mask.sum()),
        )
    return loss, stats
