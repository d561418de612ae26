"""The GRPO math as pure functions on tensors: masks, advantages, KL and the loss.

The loss is a per-token objective (OBJECTIVES: the clipped surrogate, cispo, sapo, vespo) on the
importance ratio, per token or (GSPO) per completion, plus the KL term, then an aggregation (AGGREGATIONS)
into the micro-batch's share of the batch loss, less the entropy bonus; a `LossSpec` names both through
TRL's loss_type (LOSS_TYPES, from loss_types.py: the one list of the names, which the config validates
against).
Nothing here touches a model object, so every quantity can be checked against numbers computed by hand.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeVar

import torch
from torch import Tensor

from leangrpo.core.loss_types import LOSS_TYPES

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


# A metric's (sum, count) over one micro-batch of one process: TRL's mean of it is sum / count over every
# process, then the mean over micro-batches. Tensors, so that the loss path waits for no device.
Parts = tuple[Tensor, Tensor]


@dataclass
class LossStats:
    """Token sums from one micro-batch of one process, for the kl, clip_ratio and entropy metrics:
    `clipped_tokens` every token a clip zeroed, `low_clipped` / `high_clipped` those below 1 - epsilon
    (negative advantage) and above 1 + epsilon_high (positive advantage), as TRL splits them. Each is a
    0-dim float32 tensor on the loss's device: reading them is one host sync a step
    (`micro_batch_means`), not several a micro-batch. `extra`: the metrics only some runs log
    (cispo_clip_ratio, vespo/phi_seq_mean, policy_loss), by TRL's name, as (sum, count) tensors;
    `bonus_entropy`: the entropy bonus's [entropy sum, tokens], which adaptive entropy control reads.
    `low_min` / `high_max`: the least low-clipped and the most high-clipped completion's share of its
    tokens (NaN when no completion has a token), for TRL's `clip_ratio/low_min` and `/high_max`."""

    kl_sum: Tensor
    clipped_tokens: Tensor
    tokens: Tensor
    entropy_sum: Tensor
    low_clipped: Tensor
    high_clipped: Tensor
    low_min: Tensor
    high_max: Tensor
    extra: dict[str, Parts] = field(default_factory=dict)
    bonus_entropy: Tensor | None = None


def micro_batch_means(
    stats: list[LossStats],
    sum_over_processes: Callable[[Tensor], Tensor] = lambda t: t,
    gather_over_processes: Callable[[Tensor], Tensor] = lambda t: t,
) -> dict[str, float | None]:
    """The `kl`, `entropy` and `clip_ratio/{region,low,high}_mean` metrics (and the `extra` ones) as TRL
    defines them: each micro-batch's token mean over every process, then the mean over micro-batches (not
    weighted by their token counts). `clip_ratio/low_min` and `/high_max` as TRL's: each micro-batch's
    least (most) clipped completion over every process (`gather_over_processes` concatenates each
    process's rows in process order), then the mean over the micro-batches that had one (None if none)."""
    names = ("kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean")
    rows = [
        torch.stack([s.kl_sum, s.entropy_sum, s.clipped_tokens, s.low_clipped, s.high_clipped, s.tokens])
        for s in stats
    ]
    sums = sum_over_processes(torch.stack(rows).double())
    means = (sums[:, :-1] / sums[:, -1:].clamp(min=1)).mean(dim=0)
    extra = sorted(stats[0].extra) if stats else []
    if extra:
        parts = torch.stack([torch.stack([torch.stack(s.extra[n]).double() for n in extra]) for s in stats])
        parts = sum_over_processes(parts)  # [micro-batches, names, (sum, count)]
        means = torch.cat([means, (parts[..., 0] / parts[..., 1].clamp(min=1)).mean(dim=0)])
    extremes = torch.stack([torch.stack([s.low_min, s.high_max]) for s in stats]).double()
    extremes = gather_over_processes(extremes)
    extremes = extremes.view(-1, len(stats), 2)  # [processes, micro-batches, (low_min, high_max)]
    low, high = _nan_extreme(extremes[..., 0], largest=False), _nan_extreme(extremes[..., 1], largest=True)
    means = torch.cat([means, torch.stack([low.nanmean(), high.nanmean()])])
    values = means.tolist()  # the one host sync
    out: dict[str, float | None] = dict(zip([*names, *extra], values, strict=False))
    low_min, high_max = values[-2:]  # None: no micro-batch had a completion with tokens, as TRL's
    out["clip_ratio/low_min"] = None if math.isnan(low_min) else low_min
    out["clip_ratio/high_max"] = None if math.isnan(high_max) else high_max
    return out


def _nan_extreme(values: Tensor, largest: bool) -> Tensor:
    """The max (`largest`) or min over dim 0 ignoring NaNs, NaN where every value is (TRL's nanmax/nanmin)."""
    fill = -math.inf if largest else math.inf
    filled = values.nan_to_num(nan=fill)
    extreme = filled.amax(dim=0) if largest else filled.amin(dim=0)
    return extreme.masked_fill(extreme.isinf(), math.nan)


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """The tokens of `mask` whose entropy is in the top `top_quantile` of theirs: at or above the
    (1 - top_quantile) quantile ("Beyond the 80/20 rule": the forking tokens carry the learning)."""
    keep = mask.bool()
    values = entropy[keep]
    if values.numel() == 0:
        return keep
    return keep & (entropy >= torch.quantile(values.float(), 1 - top_quantile))


@dataclass(frozen=True)
class LossSpec:
    """The loss of a run, fixed by its config: TRL's loss_type (`LOSS_TYPES`) and the constants it uses.

    `importance_sampling_level="sequence"` is GSPO (one ratio per completion, `sequence_log_ratio`);
    `delta` caps the clip objective's ratio for negative advantages too (two-sided clipping, INTELLECT-2);
    `bias_correction_kl` multiplies the per-token KL by the ratio (TRL's `use_bias_correction_kl`: the
    unbiased KL gradient); with `top_entropy_quantile` < 1 only the micro-batch's highest-entropy tokens
    keep their policy term (`high_entropy_mask`; the KL term stays on every token, and the normalisation
    is unchanged, as in TRL). `sapo_temperatures`: sapo's (positive, non-positive advantage) temperatures;
    `vespo_shape`: vespo's gamma weight's (k_pos, lambda_pos, k_neg, lambda_neg). With
    `off_policy_mask_threshold`, a completion with a negative advantage whose mean KL from the sampler
    exceeds it keeps no policy term (DeepSeek-V3.2). `entropy_bonus`: the loss subtracts the entropy
    coefficient times the mean token entropy (TRL's entropy_coef != 0 or use_adaptive_entropy).
    """

    loss_type: str  # a key of LOSS_TYPES
    epsilon: float
    epsilon_high: float
    max_completion_length: int
    beta: float = 0.0
    importance_sampling_level: ImportanceSamplingLevel = "token"
    delta: float | None = None
    bias_correction_kl: bool = False
    top_entropy_quantile: float = 1.0
    sapo_temperatures: tuple[float, float] = (1.0, 1.05)
    vespo_shape: tuple[float, float, float, float] = (2.0, 3.0, 3.0, 2.0)
    off_policy_mask_threshold: float | None = None
    entropy_bonus: bool = False

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"unknown loss_type {self.loss_type!r} (known: {', '.join(LOSS_TYPES)})")


@dataclass(frozen=True)
class BatchTotals:
    """The accumulated batch a micro-batch belongs to, which its loss is normalised by."""

    num_sequences: int  # completions in it, on this process
    num_tokens: float  # its loss tokens over every process, divided by the number of processes (dapo)
    accumulation_steps: int = 1  # its micro-batches (bnpo)


Fn = TypeVar("Fn", bound=Callable[..., Any])


class Registry(dict[str, Fn]):
    """Functions by name, added with the `register` decorator; an unknown name is a one-line ValueError."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str) -> Callable[[Fn], Fn]:
        """Decorator: add the function under `name`."""

        def add(fn: Fn) -> Fn:
            self[name] = fn
            return fn

        return add

    def __missing__(self, name: str) -> Fn:
        raise ValueError(f"unknown {self.kind} {name!r} (known: {', '.join(self)})")


class Clipped(NamedTuple):
    """Where a clip zeroes the gradient (with GSPO's sequence-level ratio, every token of a clipped
    completion): `low` below 1 - epsilon with a negative advantage, `high` above the upper bound with a
    positive one (TRL's split), `region` every clipped token (delta's cap included)."""

    low: Tensor
    high: Tensor
    region: Tensor


class Ratio(NamedTuple):
    """The importance ratio policy / old policy: `value` at the spec's level ([N, C], or [N, 1] for GSPO),
    `token_log` its per-token log (0 at masked positions), and the sampler's correction weights (None
    without one), which vespo folds into its own weight."""

    value: Tensor
    token_log: Tensor
    sampler: Tensor | None = None


# (ratio, advantages [N, 1], logp, keep, spec) -> the per-token loss, where a clip acted, and the
# objective's own metrics (`LossStats.extra`).
Objective = Callable[[Ratio, Tensor, Tensor, Tensor, LossSpec], tuple[Tensor, Clipped, dict[str, Parts]]]
OBJECTIVES: Registry[Objective] = Registry("objective")

# (per-token loss with masked positions 0, keep, spec, batch) -> the micro-batch's share of the loss.
Aggregation = Callable[[Tensor, Tensor, LossSpec, BatchTotals], Tensor]
AGGREGATIONS: Registry[Aggregation] = Registry("aggregation")


def masked_mean_parts(x: Tensor, keep: Tensor) -> Parts:
    """TRL's `global_masked_mean` parts of per-token [N, C] values (over `keep`) or per-completion [N, 1]
    ones (over the completions)."""
    x = x.float()
    if x.shape[1] == 1:
        return x.sum(), x.new_tensor(float(x.shape[0]))
    return torch.where(keep, x, 0.0).sum(), keep.sum().float()


@OBJECTIVES.register("clip")
def clipped_surrogate(
    r: Ratio, adv: Tensor, logp: Tensor, keep: Tensor, spec: LossSpec
) -> tuple[Tensor, Clipped, dict[str, Parts]]:
    """PPO's clipped surrogate -min(r·A, clip(r, 1 - epsilon, 1 + epsilon_high)·A), with r also capped
    at `delta` when set, so that a negative advantage's ratio is bounded too."""
    ratio = r.value
    lower, upper = 1 - spec.epsilon, 1 + spec.epsilon_high
    clipped_ratio = torch.clamp(ratio, lower, upper)
    capped_ratio = ratio if spec.delta is None else torch.clamp(ratio, max=spec.delta)
    per_token = -torch.min(capped_ratio * adv, clipped_ratio * adv)
    low, high = (ratio < lower) & (adv < 0), (ratio > upper) & (adv > 0)
    region = low | high
    if spec.delta is not None:
        region |= (ratio > spec.delta) & (adv < 0)
    return per_token, Clipped(low, high, region), {}


@OBJECTIVES.register("cispo")
def cispo(
    r: Ratio, adv: Tensor, logp: Tensor, keep: Tensor, spec: LossSpec
) -> tuple[Tensor, Clipped, dict[str, Parts]]:
    """CISPO (MiniMax-M1): each token's log-prob weighted by its ratio capped at `epsilon_high`, a
    constant (no gradient through the weight), so a capped token still has a gradient. Logs TRL's
    `cispo_clip_ratio`: the share of capped ratios with a positive advantage."""
    weight = torch.clamp(r.value, max=spec.epsilon_high).detach()
    per_token = -weight * adv * torch.where(keep, logp, 0.0)
    high = (r.value > spec.epsilon_high) & (adv > 0)
    metrics = {"cispo_clip_ratio": masked_mean_parts(high, keep)}
    return per_token, Clipped(torch.zeros_like(high), high, high), metrics


@OBJECTIVES.register("sapo")
def sapo(
    r: Ratio, adv: Tensor, logp: Tensor, keep: Tensor, spec: LossSpec
) -> tuple[Tensor, Clipped, dict[str, Parts]]:
    """SAPO (Qwen): a sigmoid gate on the ratio in place of the clip, with `sapo_temperatures`; no token
    counts as clipped."""
    tau = torch.where(adv > 0, *spec.sapo_temperatures)
    per_token = -torch.sigmoid(tau * (r.value - 1)) * 4 / tau * adv
    none = torch.zeros_like(adv, dtype=torch.bool)
    return per_token, Clipped(none, none, none), {}


_LOG_1E_8 = math.log(1e-8)


@torch.no_grad()
def gamma_weights(
    adv: Tensor, token_log_ratio: Tensor, keep: Tensor, sampler: Tensor | None, shape: tuple[float, ...]
) -> Tensor:
    """VESPO's per-completion weight phi(w) = e^lambda · w^k · e^(-lambda·w) [N, 1] (phi(1) = 1), w the
    completion's importance ratio: the product of its token ratios (each log clamped to ±20), times the
    sampler's token weights when given; (k, lambda) by the sign of the advantage. Computed in log space,
    with TRL's clamps; a constant (no gradient)."""
    k_pos, lambda_pos, k_neg, lambda_neg = shape
    seq_log = (token_log_ratio.clamp(-20.0, 20.0) * keep).sum(-1, keepdim=True)
    if sampler is not None:
        seq_log = seq_log + torch.log(sampler).clamp(_LOG_1E_8, 20.0).sum(-1, keepdim=True)
    log_w = seq_log.clamp(_LOG_1E_8, 20.0)
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


@OBJECTIVES.register("vespo")
def vespo(
    r: Ratio, adv: Tensor, logp: Tensor, keep: Tensor, spec: LossSpec
) -> tuple[Tensor, Clipped, dict[str, Parts]]:
    """VESPO: each token's log-prob weighted by its completion's gamma weight (`gamma_weights`), a smooth
    and bounded stand-in for the clip; no token counts as clipped. Logs TRL's `vespo/phi_seq_mean`."""
    phi = gamma_weights(adv, r.token_log, keep, r.sampler, spec.vespo_shape)
    per_token = -phi * adv * torch.where(keep, logp, 0.0)
    none = torch.zeros_like(adv, dtype=torch.bool)
    return per_token, Clipped(none, none, none), {"vespo/phi_seq_mean": masked_mean_parts(phi, keep)}


@AGGREGATIONS.register("grpo")
def sequence_mean(per_token: Tensor, keep: Tensor, spec: LossSpec, batch: BatchTotals) -> Tensor:
    """Each completion's token mean, averaged over the batch's completions."""
    return (per_token.sum(1) / keep.sum(1).clamp(min=1)).sum() / batch.num_sequences


@AGGREGATIONS.register("bnpo")
def micro_batch_token_mean(per_token: Tensor, keep: Tensor, spec: LossSpec, batch: BatchTotals) -> Tensor:
    """The micro-batch's own token mean, divided by the batch's micro-batches (TRL's bnpo): unlike the
    others, the gradient then depends on how the batch is split."""
    return per_token.sum() / keep.sum().clamp(min=1) / batch.accumulation_steps


@AGGREGATIONS.register("luspo")
def sequence_sum_mean(per_token: Tensor, keep: Tensor, spec: LossSpec, batch: BatchTotals) -> Tensor:
    """Each completion's token sum, averaged over the batch's completions (LUSPO: a sequence-level loss
    scaled by its length, so long completions are not under-weighted)."""
    return per_token.sum() / batch.num_sequences


@AGGREGATIONS.register("dapo")
def token_mean(per_token: Tensor, keep: Tensor, spec: LossSpec, batch: BatchTotals) -> Tensor:
    """The token sum over the batch's tokens (every process's: DDP then averages the gradients)."""
    return per_token.sum() / max(batch.num_tokens, 1.0)


@AGGREGATIONS.register("dr_grpo")
def constant_length_mean(per_token: Tensor, keep: Tensor, spec: LossSpec, batch: BatchTotals) -> Tensor:
    """The token sum over completions × max_completion_length: no length bias (Dr. GRPO)."""
    return per_token.sum() / (batch.num_sequences * spec.max_completion_length)


def importance_ratio(
    logp: Tensor,
    old_logp: Tensor,
    keep: Tensor,
    level: ImportanceSamplingLevel,
    sampler: Tensor | None = None,
) -> Ratio:
    """exp(logp - old_logp) per token [N, C], or per completion [N, 1] at GSPO's `sequence` level (with
    the per-token log-ratio and the `sampler` weights, as `Ratio`).

    Masked positions (after EOS) hold arbitrary log-probs: they are selected out before the exp, since
    multiplying by the mask afterwards turns an overflow there into 0 · inf = NaN (loss and gradient)."""
    token_log = torch.where(keep, logp - old_logp, 0.0)
    log_ratio = sequence_log_ratio(token_log, keep) if level == "sequence" else token_log
    return Ratio(torch.exp(log_ratio), token_log, sampler)


def off_policy_mask(
    adv: Tensor, logp: Tensor, sampling_logp: Tensor, keep: Tensor, threshold: float
) -> Tensor:
    """DeepSeek-V3.2's off-policy sequence mask [N, 1] (TRL's `get_off_policy_mask`): a completion keeps
    its policy term when its advantage is >= 0 or its mean KL from the sampler, sampler log-prob minus
    the policy's over its tokens (NaN tokens, which the sampler could not score, counted 0), is at most
    `threshold`."""
    kl = torch.nan_to_num(sampling_logp - logp.detach(), nan=0.0)
    mean_kl = torch.where(keep, kl, 0.0).sum(1, keepdim=True) / keep.sum(1, keepdim=True).clamp(min=1)
    return (adv >= 0) | (mean_kl <= threshold)


def masked_kl(logp: Tensor, ref_logp: Tensor, keep: Tensor, ratio: Tensor, bias_correction: bool) -> Tensor:
    """k3 KL to the reference per token, 0 (and no gradient) at masked positions; with `bias_correction`,
    times the importance ratio."""
    kl = kl_k3(logp, torch.where(keep, ref_logp, logp.detach()))
    return kl * ratio if bias_correction else kl


def loss_stats(
    keep: Tensor, kl: Tensor | None, clipped: Clipped, entropy: Tensor | None, extra: dict[str, Parts]
) -> LossStats:
    """The micro-batch's token sums for the metrics, left on the device (masked by `where`, not by
    boolean indexing, which would wait for the device to count the selected tokens)."""

    def masked_sum(values: Tensor | None) -> Tensor:
        if values is None:
            return keep.new_zeros((), dtype=torch.float32)
        return torch.where(keep, values, 0).sum().float()

    def completion_extreme(flags: Tensor, largest: bool) -> Tensor:
        """The least or most clipped completion's share of its tokens (NaN: no completion has one)."""
        shares = torch.where(keep, flags, 0).sum(1).float() / keep.sum(1)  # 0/0: NaN, left out
        return _nan_extreme(shares, largest).float()

    with torch.no_grad():
        return LossStats(
            kl_sum=masked_sum(kl),
            clipped_tokens=masked_sum(clipped.region),
            tokens=masked_sum(keep),
            entropy_sum=masked_sum(entropy),
            low_clipped=masked_sum(clipped.low),
            high_clipped=masked_sum(clipped.high),
            low_min=completion_extreme(clipped.low, largest=False),
            high_max=completion_extreme(clipped.high, largest=True),
            extra={name: (total.detach(), count.detach()) for name, (total, count) in extra.items()},
        )


def grpo_loss(
    logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, mask: Tensor, spec: LossSpec,
    batch: BatchTotals, entropy: Tensor | None = None, sampler_weights: Tensor | None = None,
    sampling_logp: Tensor | None = None, entropy_coef: float = 0.0,
) -> tuple[Tensor, LossStats]:  # fmt: skip
    """One micro-batch's loss: `spec`'s objective per token (+ beta × k3 KL), aggregated so that summing
    it over the micro-batches of `batch` gives that batch's loss, as TRL 1.16 computes it.

    `entropy` [N, C] (per token) is summed into the stats and picks the entropy mask's tokens; with
    `spec.entropy_bonus`, the loss less `entropy_coef` × its mean (`_less_entropy_bonus`).
    `sampler_weights` ([N, C] or [N, 1], from `sampler_importance_weights`) scale the policy term, not
    the KL term (TRL's vLLM importance-sampling correction; vespo folds them into its weight instead).
    `sampling_logp`: the sampler's log-probs, for the off-policy mask (without them, `old_logp`'s).
    """
    keep = mask.bool()
    objective, aggregation = LOSS_TYPES[spec.loss_type]
    ratio = importance_ratio(logp, old_logp, keep, spec.importance_sampling_level, sampler_weights)
    adv = advantages[:, None]
    per_token, clipped, extra = OBJECTIVES[objective](ratio, adv, logp, keep, spec)
    if spec.off_policy_mask_threshold is not None:
        behaviour = old_logp if sampling_logp is None else sampling_logp
        per_token = per_token * off_policy_mask(adv, logp, behaviour, keep, spec.off_policy_mask_threshold)
    policy_tokens = _policy_tokens(keep, entropy, spec)
    if policy_tokens is not keep:
        per_token = per_token * policy_tokens
    if sampler_weights is not None and objective != "vespo":
        per_token = per_token * sampler_weights
    kl = None if ref_logp is None else masked_kl(logp, ref_logp, keep, ratio.value, spec.bias_correction_kl)
    if kl is not None and spec.beta:
        per_token = per_token + spec.beta * kl
    per_token = torch.where(keep, per_token, 0.0)
    loss = AGGREGATIONS[aggregation](per_token, keep, spec, batch)
    stats = loss_stats(keep, kl, clipped, entropy, extra)
    if spec.entropy_bonus:
        loss = _less_entropy_bonus(loss, stats, entropy, policy_tokens, entropy_coef, aggregation, batch)
    return loss, stats


def _less_entropy_bonus(
    loss: Tensor, stats: LossStats, entropy: Tensor | None, tokens: Tensor, coef: float, aggregation: str,
    batch: BatchTotals,
) -> Tensor:  # fmt: skip
    """The micro-batch's loss less `coef` × the mean entropy of `tokens`, divided by the batch's
    micro-batches (TRL's, whatever the loss type); records `policy_loss` and the bonus's entropy sums."""
    if entropy is None:
        raise ValueError("the entropy bonus needs the per-token entropy")
    stats.extra["policy_loss"] = (policy_loss(loss, aggregation, batch), loss.new_tensor(1.0).detach())
    bonus = torch.stack([torch.where(tokens, entropy, 0.0).sum(), tokens.sum().float()])
    stats.bonus_entropy = bonus.detach()
    return loss - coef * bonus[0] / bonus[1].clamp(min=1) / batch.accumulation_steps


def _policy_tokens(keep: Tensor, entropy: Tensor | None, spec: LossSpec) -> Tensor:
    """The tokens the policy term (and the entropy bonus) acts on: `keep`, or its highest-entropy ones."""
    if spec.top_entropy_quantile == 1.0:
        return keep
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
    return high_entropy_mask(entropy, keep, spec.top_entropy_quantile)


def policy_loss(share: Tensor, aggregation: str, batch: BatchTotals) -> Tensor:
    """TRL's `policy_loss` metric of a micro-batch: its loss before the entropy bonus, not divided by the
    micro-batches (dapo's share of the batch's tokens already is the micro-batch's loss)."""
    return (share if aggregation == "dapo" else share * batch.accumulation_steps).detach()
