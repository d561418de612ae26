"""The GRPO math as pure functions on tensors: masks, advantages, KL and the loss.

Nothing here touches a model object, so every quantity can be checked against numbers computed by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"]
ScaleRewards = Literal["group", "batch", "none"]
ImportanceSamplingLevel = Literal["token", "sequence"]
MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def mask_after_eos(completion_ids: Tensor, eos_token_ids: list[int]) -> tuple[Tensor, Tensor]:
    """Mask [N, C] that keeps tokens up to and including the first EOS; also whether each row has one."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_token_ids, device=completion_ids.device))
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), completion_ids.shape[1])
    positions = torch.arange(completion_ids.shape[1], device=completion_ids.device)
    return (positions[None, :] <= first[:, None]).long(), has_eos


def shuffle_within_groups(num_rows: int, num_generations: int, generator: torch.Generator) -> Tensor:
    """Row indices that put each group's rows (laid out group by group) in a random order: indexing the
    rewards with them is the random-reward control, where the same rewards reach a group but not the
    completions that earned them."""
    groups = num_rows // num_generations
    order = torch.rand(groups, num_generations, generator=generator).argsort(dim=1)
    return (order + torch.arange(groups).unsqueeze(1) * num_generations).flatten()


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


def normalize_then_sum(
    per_func: Tensor, weights: Tensor, unscored: Tensor, num_generations: int, eps: float = 1e-4
) -> tuple[Tensor, Tensor]:
    """GDPO's advantages for several rewards: each reward [N, F] normalised within its group (a NaN one
    left out and then 0), their weighted sum normalised over the batch. A reward with a large spread so
    no longer drowns the others, as it does when the sum is normalised. `unscored` [N] rows get advantage
    0 and stay out of the batch statistics. Returns the advantages [N] and each group's std of the sum.
    """
    columns = [
        group_advantages(per_func[:, k], num_generations, "group", eps)[0] for k in range(per_func.shape[1])
    ]
    summed = torch.where(unscored, torch.nan, (torch.stack(columns, 1) * weights).sum(1))
    valid = summed[~unscored]
    batch_std = valid.std() if valid.numel() > 1 else summed.new_tensor(0.0)
    advantages = torch.where(unscored, 0.0, (summed - valid.mean()) / (batch_std + eps))
    return advantages, group_advantages(summed, num_generations, "none")[1]


def informative_groups(group_std: Tensor) -> Tensor:
    """Groups whose rewards differ (std not `isclose` to 0, TRL's zero test): the only ones with an
    advantage, so the only ones DAPO's dynamic sampling trains on."""
    return ~torch.isclose(group_std, torch.zeros_like(group_std))


def fill_groups(informative: Tensor, wanted: int) -> Tensor:
    """DAPO's dynamic sampling: the indices, in draw order, of the `wanted` groups a step trains on among
    those drawn (`informative` [drawn], in draw order): the first informative ones, and when fewer were
    drawn, the earliest uninformative ones to fill the batch (they teach nothing but keep its size)."""
    informative_first = torch.argsort((~informative).int(), stable=True)
    return informative_first[:wanted].sort().values


def mask_truncated(mask: Tensor, truncated: Tensor) -> Tensor:
    """The loss mask without the completions cut off at max_completion_length (DAPO): their missing end
    says nothing about whether they were good, so they teach nothing (they still count in advantages)."""
    return mask * ~truncated[:, None]


def sequence_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    """GSPO's importance weight per completion, as a log: the mean per-token log-ratio over its tokens,
    [N, C] -> [N, 1] (so that one ratio, and one clip, applies to every token of the completion)."""
    return ((log_ratio * mask).sum(1) / mask.sum(1).clamp(min=1))[:, None]


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Schulman's k3 estimator of KL(policy || reference), per token; always >= 0."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


@dataclass
class SamplerMismatch:
    """How far the sampler's log-probs are from the trainer's, and what the correction did (TRL's metrics)."""

    logprob_diff_mean: float  # mean |trainer - sampler| log-prob over completion tokens
    logprob_diff_max: float
    is_ratio_mean: float  # mean importance weight after clipping/masking (per token or per sequence)
    is_clipped_frac: float  # share of ratios clipped (truncate) or zeroed (mask)


def sampler_importance_weights(
    old_logp: Tensor,
    sampling_logp: Tensor,
    mask: Tensor,
    mode: ISMode,
    clip_min: float | None,
    clip_max: float | None,
) -> tuple[Tensor, SamplerMismatch]:
    """Truncated (or masked) importance weights that correct for sampling with another engine (vLLM).

    The ratio is exp(trainer log-prob - sampler log-prob), per token ([N, C]) or, for sequence modes,
    of the summed log-probs over each completion ([N, 1]). *_truncate clips it to [clip_min, clip_max];
    *_mask sets ratios outside that range to 0, so those tokens or sequences teach nothing. TRL's rule.
    """
    mask = mask.bool()
    diff = torch.where(mask, old_logp - sampling_logp, 0.0)
    sequence = mode.startswith("sequence")
    ratio = torch.exp(diff.sum(dim=1, keepdim=True) if sequence else diff)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    outside = (ratio < low) | (ratio > high)
    weights = ratio.clamp(low, high) if mode.endswith("truncate") else ratio.masked_fill(outside, 0.0)
    counted = torch.ones_like(outside) if sequence else mask
    abs_diff = diff.abs()[mask]
    stats = SamplerMismatch(
        logprob_diff_mean=float(abs_diff.mean()) if abs_diff.numel() else 0.0,
        logprob_diff_max=float(abs_diff.max()) if abs_diff.numel() else 0.0,
        is_ratio_mean=float(weights[counted].mean()),
        is_clipped_frac=float(outside[counted].float().mean()),
    )
    return weights, stats


@dataclass
class LossStats:
    """Token sums from one micro-batch of one process, for the kl, clip_ratio and entropy metrics:
    `clipped_tokens` every token a clip zeroed, `low_clipped` / `high_clipped` those below 1 - epsilon
    (negative advantage) and above 1 + epsilon_high (positive advantage), as TRL splits them."""

    kl_sum: float = 0.0
    clipped_tokens: float = 0.0
    tokens: float = 0.0
    entropy_sum: float = 0.0
    low_clipped: float = 0.0
    high_clipped: float = 0.0


def micro_batch_means(
    stats: list[LossStats], sum_over_processes: Callable[[Tensor], Tensor] = lambda t: t
) -> dict[str, float]:
    """The `kl`, `entropy` and `clip_ratio/{region,low,high}_mean` metrics as TRL defines them: each
    micro-batch's token mean over every process, then the mean over micro-batches (not weighted by their
    token counts)."""
    names = ("kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")
    rows = [
        [s.kl_sum, s.entropy_sum, s.clipped_tokens, s.low_clipped, s.high_clipped, s.tokens] for s in stats
    ]
    sums = sum_over_processes(torch.tensor(rows))
    means = (sums[:, :-1] / sums[:, -1:].clamp(min=1)).mean(dim=0).tolist()
    return dict(zip(names, means, strict=True))


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """The tokens of `mask` whose entropy is in the top `top_quantile` of theirs: at or above the
    (1 - top_quantile) quantile ("Beyond the 80/20 rule": the forking tokens carry the learning)."""
    keep = mask.bool()
    values = entropy[keep]
    if values.numel() == 0:
        return keep
    return keep & (entropy >= torch.quantile(values.float(), 1 - top_quantile))


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
    importance_sampling_level: ImportanceSamplingLevel = "token",
    delta: float | None = None,
    accumulation_steps: int = 1,
    bias_correction_kl: bool = False,
    entropy: Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    sampler_weights: Tensor | None = None,
    sapo_temperatures: tuple[float, float] = (1.0, 1.05),
) -> tuple[Tensor, LossStats]:
    """The clipped GRPO surrogate (+ beta × k3 KL) of one micro-batch, scaled so that summing it over
    the micro-batches of an accumulated batch gives that batch's loss, as TRL 1.16 computes it.

    `num_sequences` counts the whole accumulated batch, `num_tokens` its tokens over every process
    (dapo). grpo, dr_grpo and dapo give the same gradient whether the batch is processed at once or in
    micro-batches; bnpo, as in TRL, normalises each micro-batch by its own token count and divides by
    the `accumulation_steps` micro-batches of an optimizer step. `bias_correction_kl` multiplies the
    per-token KL by the importance ratio (TRL's `use_bias_correction_kl`): the unbiased KL gradient.
    `importance_sampling_level="sequence"` is GSPO (one ratio per completion, `sequence_log_ratio`);
    `delta` caps the ratio from above for negative advantages too (two-sided clipping, INTELLECT-2).
    `entropy` [N, C] (per token, no gradient) is summed into the stats; with `top_entropy_quantile` < 1
    only the micro-batch's highest-entropy tokens keep their policy term (`high_entropy_mask`; the KL
    term stays on every token, and the normalisation is unchanged, as in TRL).
    `sampler_weights` ([N, C] or [N, 1], from `sampler_importance_weights`) scale the surrogate, not
    the KL term (TRL's vLLM importance-sampling correction).
    cispo (MiniMax-M1) weights each token's log-prob by its ratio capped at `epsilon_high`, a constant
    (no gradient through the weight), normalised as dapo; sapo (Qwen) replaces the clip by a sigmoid gate
    with `sapo_temperatures` (positive, non-positive advantages), normalised as grpo. As in TRL.
    """
    # Masked positions (after EOS) hold arbitrary log-probs: they are selected out before any exp, since
    # multiplying by the mask afterwards turns an overflow there into 0 · inf = NaN (loss and gradient).
    keep = mask.bool()
    log_ratio = torch.where(keep, logp - old_logp, 0.0)
    if importance_sampling_level == "sequence":
        log_ratio = sequence_log_ratio(log_ratio, keep)
    ratio = torch.exp(log_ratio)
    adv = advantages[:, None]
    # is_clipped: where a clip zeroes the gradient (with GSPO, every token of a clipped completion).
    if loss_type == "cispo":
        weight = torch.clamp(ratio, max=epsilon_high).detach()
        per_token = -weight * adv * torch.where(keep, logp, 0.0)
        is_clipped = is_high = (ratio > epsilon_high) & (adv > 0)
        is_low = torch.zeros_like(is_clipped)
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, *sapo_temperatures)
        per_token = -torch.sigmoid(tau * (ratio - 1)) * 4 / tau * adv
        is_clipped = is_low = is_high = torch.zeros_like(adv, dtype=torch.bool)  # a gate, no clip
    else:
        clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)
        capped_ratio = ratio if delta is None else torch.clamp(ratio, max=delta)
        per_token = -torch.min(capped_ratio * adv, clipped_ratio * adv)
        is_low, is_high = (ratio < 1 - epsilon) & (adv < 0), (ratio > 1 + epsilon_high) & (adv > 0)
        is_clipped = is_low | is_high
        if delta is not None:
            is_clipped |= (ratio > delta) & (adv < 0)
    if top_entropy_quantile < 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
        per_token = per_token * high_entropy_mask(entropy, keep, top_entropy_quantile)
    if sampler_weights is not None:
        per_token = per_token * sampler_weights
    kl = kl_k3(logp, torch.where(keep, ref_logp, logp.detach())) if ref_logp is not None else None
    if kl is not None and bias_correction_kl:
        kl = kl * ratio
    if kl is not None and beta:
        per_token = per_token + beta * kl
    per_token = torch.where(keep, per_token, 0.0)

    if loss_type in ("grpo", "sapo"):
        loss = (per_token.sum(1) / keep.sum(1).clamp(min=1)).sum() / num_sequences
    elif loss_type == "bnpo":
        loss = per_token.sum() / keep.sum().clamp(min=1) / accumulation_steps
    elif loss_type in ("dapo", "cispo"):
        loss = per_token.sum() / max(num_tokens, 1.0)
    elif loss_type == "dr_grpo":
        loss = per_token.sum() / (num_sequences * max_completion_length)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    with torch.no_grad():
        stats = LossStats(
            kl_sum=float(kl[keep].sum()) if kl is not None else 0.0,
            clipped_tokens=float((is_clipped & keep).sum()),
            tokens=float(keep.sum()),
            entropy_sum=float(entropy[keep].sum()) if entropy is not None else 0.0,
            low_clipped=float((is_low & keep).sum()),
            high_clipped=float((is_high & keep).sum()),
        )
    return loss, stats
