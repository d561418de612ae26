"""Unit tests for the pure GRPO math in leangrpo.core.grpo, checked against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from leangrpo.core.grpo import (
    BatchTotals,
    LossSpec,
    fill_groups,
    group_advantages,
    grpo_loss,
    high_entropy_mask,
    informative_groups,
    kl_k3,
    mask_after_eos,
    mask_truncated,
    normalize_then_sum,
    sampler_importance_weights,
    sequence_log_ratio,
)
from leangrpo.core.logprobs import token_logprobs

LOSS_TYPES = ["grpo", "bnpo", "dr_grpo", "dapo"]


def close(actual, expected, atol=1e-6, rtol=1e-6):
    torch.testing.assert_close(
        torch.as_tensor(actual, dtype=torch.float64),
        torch.as_tensor(expected, dtype=torch.float64),
        atol=atol,
        rtol=rtol,
    )


# --------------------------------------------------------------------------- mask_after_eos


def test_mask_after_eos_in_middle_keeps_eos_and_masks_rest():
    ids = torch.tensor([[5, 6, 2, 7, 2, 8]])
    mask, has_eos = mask_after_eos(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0, 0]]
    assert has_eos.tolist() == [True]


def test_mask_after_eos_without_eos_is_all_ones():
    ids = torch.tensor([[5, 6, 7, 8], [9, 9, 9, 9]])
    mask, has_eos = mask_after_eos(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert has_eos.tolist() == [False, False]


def test_mask_after_eos_at_position_zero():
    ids = torch.tensor([[2, 5, 6, 7]])
    mask, has_eos = mask_after_eos(ids, [2])
    assert mask.tolist() == [[1, 0, 0, 0]]
    assert has_eos.tolist() == [True]


def test_mask_after_eos_multiple_eos_ids_first_one_wins():
    ids = torch.tensor(
        [
            [5, 3, 6, 2, 7],  # id 3 first, at position 1
            [5, 6, 2, 3, 7],  # id 2 first, at position 2
            [5, 6, 7, 8, 9],  # none
            [5, 6, 7, 8, 3],  # last position
        ]
    )
    mask, has_eos = mask_after_eos(ids, [2, 3])
    assert mask.tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
    ]
    assert has_eos.tolist() == [True, True, False, True]


# --------------------------------------------------------------------------- group_advantages


def test_group_advantages_scale_group_hand_computed():
    # Group 1: [0, 1, 2] -> mean 1, unbiased std sqrt((1 + 0 + 1) / 2) = 1.
    # Group 2: [1, 1, 1] -> mean 1, std 0 -> all-zero advantages.
    rewards = torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0, 1.0])
    adv, std = group_advantages(rewards, num_generations=3, scale_rewards="group")
    a = 1.0 / (1.0 + 1e-4)  # 0.99990001
    close(adv, [-a, 0.0, a, 0.0, 0.0, 0.0])
    close(std, [1.0, 0.0])
    assert adv.shape == (6,) and std.shape == (2,)


def test_group_advantages_scale_group_uses_unbiased_std_and_eps():
    # [1, 2]: mean 1.5, unbiased std sqrt(0.5) = 0.70710678 (biased would be 0.5).
    rewards = torch.tensor([1.0, 2.0, 3.0, 4.0])
    adv, std = group_advantages(rewards, num_generations=2)
    a = 0.7070067953  # 0.5 / (0.70710678 + 1e-4)
    close(adv, [-a, a, -a, a])
    close(std, [0.7071067812, 0.7071067812])


def test_group_advantages_custom_eps():
    rewards = torch.tensor([0.0, 2.0])  # mean 1, unbiased std sqrt(2)
    adv, _ = group_advantages(rewards, num_generations=2, eps=0.5)
    a = 1.0 / (math.sqrt(2.0) + 0.5)  # 0.52241
    close(adv, [-a, a])


def test_group_advantages_scale_batch_hand_computed():
    # Centred by group mean, scaled by the std of the whole batch:
    # batch [0, 1, 2, 1, 1, 1] has mean 1 and unbiased std sqrt(2 / 5) = 0.63245553.
    rewards = torch.tensor([0.0, 1.0, 2.0, 1.0, 1.0, 1.0])
    adv, std = group_advantages(rewards, num_generations=3, scale_rewards="batch")
    a = 1.5808888696  # 1 / (0.63245553 + 1e-4)
    close(adv, [-a, 0.0, a, 0.0, 0.0, 0.0])
    close(std, [1.0, 0.0])  # the group std is still reported


def test_group_advantages_scale_none_only_centres():
    rewards = torch.tensor([0.0, 1.0, 2.0, 5.0, 1.0, 3.0])
    adv, std = group_advantages(rewards, num_generations=3, scale_rewards="none")
    # group means 1 and 3
    close(adv, [-1.0, 0.0, 1.0, 2.0, -2.0, 0.0])
    close(std, [1.0, 2.0])


def test_group_advantages_equal_rewards_give_zero():
    rewards = torch.tensor([0.7, 0.7, 0.7, 0.7, -3.0, -3.0, -3.0, -3.0])
    for scale in ("group", "batch", "none"):
        adv, std = group_advantages(rewards, num_generations=4, scale_rewards=scale)
        close(adv, [0.0] * 8)
        close(std, [0.0, 0.0])
        assert torch.isfinite(adv).all()


def test_group_advantages_nan_rewards_are_excluded_and_get_zero():
    # Valid rewards of group 1 are [1, 3, 5]: mean 3, unbiased std 2 (with the NaN included as 0
    # the mean would be 2.25). Group 2: [2, 4, 4] with a NaN.
    nan = float("nan")
    rewards = torch.tensor([nan, 1.0, 3.0, 5.0, 2.0, nan, 4.0, 4.0])
    adv, std = group_advantages(rewards, num_generations=4, scale_rewards="none")
    # group 2 valid values [2, 4, 4]: mean 10/3
    m2 = 10.0 / 3.0
    close(adv, [0.0, -2.0, 0.0, 2.0, 2.0 - m2, 0.0, 4.0 - m2, 4.0 - m2])
    s2 = math.sqrt(((2 - m2) ** 2 + 2 * (4 - m2) ** 2) / 2)
    close(std, [2.0, s2])

    adv_g, _ = group_advantages(rewards, num_generations=4, scale_rewards="group")
    assert not torch.isnan(adv_g).any()
    assert adv_g[0] == 0.0 and adv_g[5] == 0.0
    close(adv_g[:4], [0.0, -2.0 / 2.0001, 0.0, 2.0 / 2.0001])


def test_group_advantages_nan_batch_std_ignores_nan():
    nan = float("nan")
    rewards = torch.tensor([nan, 1.0, 3.0, 5.0])  # batch std of [1, 3, 5] = 2
    adv, _ = group_advantages(rewards, num_generations=4, scale_rewards="batch")
    close(adv, [0.0, -2.0 / 2.0001, 0.0, 2.0 / 2.0001])


def test_group_advantages_single_valid_or_all_nan_group():
    nan = float("nan")
    rewards = torch.tensor([nan, 7.0, nan, nan])
    adv, std = group_advantages(rewards, num_generations=2)
    close(adv, [0.0, 0.0, 0.0, 0.0])
    close(std, [0.0, 0.0])


# --------------------------------------------------------------------------- normalize_then_sum (GDPO)


def test_normalize_then_sum_hand_computed():
    # G = 2, two groups, rewards r1 (weight 1) and r2 (weight 0.5):
    #   group 1: r1 [0, 1] -> ±0.5 / (sqrt(0.5) + 1e-4) = ±a;  r2 [10, 30] -> ±10 / (sqrt(200) + 1e-4) = ±b
    #   group 2: r1 [1, 1] -> 0;                            r2 [0, 4] -> ±2 / (sqrt(8) + 1e-4) = ±c
    # summed: [-a - b/2, a + b/2, -c/2, c/2]: batch mean 0, unbiased batch std sqrt(sum of squares / 3).
    per_func = torch.tensor([[0.0, 10.0], [1.0, 30.0], [1.0, 0.0], [1.0, 4.0]])
    a, b, c = 0.5 / (math.sqrt(0.5) + 1e-4), 10 / (math.sqrt(200) + 1e-4), 2 / (math.sqrt(8) + 1e-4)
    summed = [-a - b / 2, a + b / 2, -c / 2, c / 2]
    std = math.sqrt(sum(x * x for x in summed) / 3)
    unscored = torch.zeros(4, dtype=torch.bool)
    adv, group_std = normalize_then_sum(per_func, torch.tensor([1.0, 0.5]), unscored, num_generations=2)
    close(adv, [x / (std + 1e-4) for x in summed], atol=1e-5)
    close(group_std, [math.sqrt(2) * (a + b / 2), math.sqrt(2) * c / 2], atol=1e-5)
    # Summing first: the totals [5, 16, 1, 3] give group 2 the same ±0.7071 as group 1.
    summed_first, _ = group_advantages((per_func * torch.tensor([1.0, 0.5])).sum(1), 2)
    close(summed_first.abs(), [math.sqrt(0.5)] * 4, atol=1e-4)
    assert abs(float(adv[2])) < 0.7 * abs(float(adv[0]))


def test_normalize_then_sum_none_and_unscored():
    # One group of 3: r1 [0, 1, 2] -> [-1, 0, 1] / 1.0001 = [-d1, 0, d1]; r2 [None, 2, 4] -> [0, -d2, d2].
    nan = float("nan")
    per_func = torch.tensor([[0.0, nan], [1.0, 2.0], [2.0, 4.0]], dtype=torch.float64)
    d1, d2 = 1 / 1.0001, 1 / (math.sqrt(2) + 1e-4)
    summed = [-d1, -d2, d1 + d2]
    std = math.sqrt(sum(x * x for x in summed) / 2)
    weights = torch.ones(2, dtype=torch.float64)
    adv, _ = normalize_then_sum(per_func, weights, torch.tensor([False, False, False]), num_generations=3)
    close(adv, [x / (std + 1e-4) for x in summed])
    # Row 0 unscored: advantage 0, out of the batch mean (d1 / 2) and std.
    adv, _ = normalize_then_sum(per_func, weights, torch.tensor([True, False, False]), num_generations=3)
    rest = [-d2 - d1 / 2, d1 + d2 - d1 / 2]
    std = math.sqrt(sum(x * x for x in rest))
    close(adv, [0.0, rest[0] / (std + 1e-4), rest[1] / (std + 1e-4)])


# --------------------------------------------------------------------------- dynamic sampling


def test_informative_groups_uses_trls_zero_test():
    std = torch.tensor([0.0, 1e-9, 0.5, 1e-7])  # isclose(x, 0): |x| <= 1e-8
    assert informative_groups(std).tolist() == [False, False, True, True]


def test_fill_groups_takes_the_first_informative_groups_then_fills():
    flags = torch.tensor([False, True, False, True, True, False])
    assert fill_groups(flags, 3).tolist() == [1, 3, 4]
    assert fill_groups(flags, 2).tolist() == [1, 3]  # the later informative group is not needed
    # Only one informative group drawn: the earliest uninformative ones fill the batch, in draw order.
    assert fill_groups(torch.tensor([False, True, False, False]), 3).tolist() == [0, 1, 2]
    assert fill_groups(torch.tensor([True, True, True]), 3).tolist() == [0, 1, 2]


# --------------------------------------------------------------------------- kl_k3


def test_kl_k3_hand_computed():
    logp = torch.tensor([math.log(0.5), math.log(0.25), math.log(0.3)])
    ref = torch.tensor([math.log(0.25), math.log(0.5), math.log(0.3)])
    # d = ref - logp: -log 2 -> 0.5 + log 2 - 1; +log 2 -> 2 - log 2 - 1; 0 -> 0
    close(kl_k3(logp, ref), [math.log(2) - 0.5, 1 - math.log(2), 0.0], atol=1e-6)


def test_kl_k3_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(4)
    logp = torch.randn(100, generator=g) * 3
    ref = torch.randn(100, generator=g) * 3
    assert (kl_k3(logp, ref) >= 0).all()
    assert torch.equal(kl_k3(logp, logp), torch.zeros(100))


# --------------------------------------------------------------------------- grpo_loss

# Two sequences x three tokens, old_logp = 0 so ratio = exp(logp). eps = 0.2, eps_high = 0.28.
#   seq 0 (A = +1): ratios [1.1, 1.5, 0.5]
#       per-token -min(r, clip(r)) = [-1.1, -1.28 (clipped: r > 1.28, A > 0), -0.5]   sum -2.88
#   seq 1 (A = -1): ratios [0.5, 1.1, 0.1 (padded)]
#       per-token max(r, clip(r)) = [0.8 (clipped: r < 0.8, A < 0), 1.1]              sum  1.9
# Totals: 5 active tokens, 2 clipped, sum -0.98.
RATIOS = [[1.1, 1.5, 0.5], [0.5, 1.1, 0.1]]
MASK = [[1, 1, 1], [1, 1, 0]]
EPS, EPS_HIGH, MAX_LEN = 0.2, 0.28, 4

EXPECTED_LOSS = {
    "grpo": (-2.88 / 3 + 1.9 / 2) / 2,  # -0.005
    "bnpo": -0.98 / 5,  # -0.196
    "dapo": -0.98 / 5,
    "dr_grpo": -0.98 / (2 * MAX_LEN),  # -0.1225
}
# d per_token / d logp: -A * r where the un-clipped term is the min, 0 where the clipped term wins.
TOKEN_GRAD = [[-1.1, 0.0, -0.5], [0.0, 1.1, 0.0]]
GRAD_SCALE = {
    "grpo": [[1 / (3 * 2)] * 3, [1 / (2 * 2)] * 3],
    "bnpo": [[1 / 5] * 3] * 2,
    "dapo": [[1 / 5] * 3] * 2,
    "dr_grpo": [[1 / 8] * 3] * 2,
}


def _tiny(ref_offsets=None):
    logp = torch.tensor(RATIOS, dtype=torch.float64).log().requires_grad_()
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    mask = torch.tensor(MASK)
    ref = None
    if ref_offsets is not None:
        ref = logp.detach() + torch.tensor(ref_offsets, dtype=torch.float64)
    return logp, old, ref, adv, mask


def _loss(
    logp, old, ref, adv, mask, loss_type, beta=0.0, num_sequences=2, num_tokens=5.0, entropy=None, **variants
):
    spec = LossSpec(loss_type, EPS, EPS_HIGH, MAX_LEN, beta=beta, **variants)
    return grpo_loss(logp, old, ref, adv, mask, spec, BatchTotals(num_sequences, num_tokens), entropy)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_hand_computed(loss_type):
    logp, old, ref, adv, mask = _tiny()
    loss, stats = _loss(logp, old, ref, adv, mask, loss_type)
    close(loss, EXPECTED_LOSS[loss_type], atol=1e-9)
    assert (stats.kl_sum, stats.clipped_tokens, stats.tokens) == (0.0, 2.0, 5.0)
    assert stats.low_clipped + stats.high_clipped == stats.clipped_tokens
    loss.backward()
    expected_grad = torch.tensor(TOKEN_GRAD) * torch.tensor(GRAD_SCALE[loss_type])
    close(logp.grad, expected_grad, atol=1e-9)


def test_grpo_loss_clipping_low_side_is_eps_not_eps_high():
    # A < 0, r = 0.75: below 1 - eps = 0.8 -> clipped to 0.8 (if eps_high were used on both sides,
    # or eps ignored, this would differ).  A > 0, r = 1.25: inside [0.8, 1.28] -> not clipped.
    logp = torch.tensor([[math.log(0.75)], [math.log(1.25)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 1, dtype=torch.float64)
    adv = torch.tensor([-2.0, 3.0], dtype=torch.float64)
    mask = torch.ones(2, 1)
    loss, stats = _loss(logp, old, None, adv, mask, "dapo", num_tokens=2.0)
    # per-token: max(-2*0.75, -2*0.8) negated -> 1.6 ; -3*1.25 = -3.75
    close(loss, (1.6 - 3.75) / 2, atol=1e-9)
    assert stats.clipped_tokens == 1.0
    loss.backward()
    close(logp.grad, [[0.0], [-3.0 * 1.25 / 2]], atol=1e-9)


def test_grpo_loss_ratio_on_favourable_side_is_not_clipped():
    # A > 0 with r < 1 - eps and A < 0 with r > 1 + eps_high: the un-clipped term is the min,
    # so the gradient flows and the token does not count as clipped.
    logp = torch.tensor([[math.log(0.5)], [math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 1, dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = _loss(logp, old, None, adv, torch.ones(2, 1), "bnpo", num_tokens=2.0)
    close(loss, (-0.5 + 2.0) / 2, atol=1e-9)
    assert stats.clipped_tokens == 0.0
    loss.backward()
    close(logp.grad, [[-0.25], [1.0]], atol=1e-9)


# ref_logp = logp + log 2 on every active token -> k3 = 2 - log 2 - 1 = 1 - log 2 per token,
# and d k3 / d logp = 1 - exp(ref - logp) = -1. The padded token gets a different KL (log 4 offset:
# 4 - log 4 - 1) that must not show up anywhere.
KL_TOK = 1 - math.log(2)
REF_OFFSETS = [[math.log(2)] * 3, [math.log(2), math.log(2), math.log(4)]]


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_beta_adds_k3(loss_type):
    beta = 0.1
    logp, old, ref, adv, mask = _tiny(REF_OFFSETS)
    loss, stats = _loss(logp, old, ref, adv, mask, loss_type, beta=beta)
    kl_term = {
        "grpo": KL_TOK,  # per-sequence mean KL_TOK, averaged over sequences
        "bnpo": 5 * KL_TOK / 5,
        "dapo": 5 * KL_TOK / 5,
        "dr_grpo": 5 * KL_TOK / 8,
    }[loss_type]
    close(loss, EXPECTED_LOSS[loss_type] + beta * kl_term, atol=1e-9)
    close(stats.kl_sum, 5 * KL_TOK, atol=1e-9)
    assert stats.clipped_tokens == 2.0 and stats.tokens == 5.0
    loss.backward()
    token_grad = torch.tensor(TOKEN_GRAD) + beta * -1.0 * torch.tensor(MASK, dtype=torch.float64)
    expected_grad = token_grad * torch.tensor(GRAD_SCALE[loss_type]) * torch.tensor(MASK)
    close(logp.grad, expected_grad, atol=1e-9)


def test_grpo_loss_beta_zero_reports_kl_but_does_not_add_it():
    logp, old, ref, adv, mask = _tiny(REF_OFFSETS)
    loss, stats = _loss(logp, old, ref, adv, mask, "dapo", beta=0.0)
    close(loss, EXPECTED_LOSS["dapo"], atol=1e-9)
    close(stats.kl_sum, 5 * KL_TOK, atol=1e-9)


# GSPO on the tiny example: one ratio per completion, exp(mean token log-ratio).
#   seq 0 (A = +1): s0 = (1.1 * 1.5 * 0.5) ** (1/3) = 0.825 ** (1/3) = 0.93795, inside [0.8, 1.28]:
#       every token's loss is -s0, and d(-s0)/d logp_t = -s0 / 3 from each of the 3 tokens -> -s0 per token
#   seq 1 (A = -1): s1 = (0.5 * 1.1) ** (1/2) = 0.74162 < 0.8: clipped to 0.8 on both tokens, no gradient
#       (the padded third token's ratio 0.1 is not in the mean).
S0 = 0.825 ** (1 / 3)
GSPO_LOSS = {
    "grpo": (-S0 + 0.8) / 2,
    "bnpo": (-3 * S0 + 2 * 0.8) / 5,
    "dapo": (-3 * S0 + 2 * 0.8) / 5,
    "dr_grpo": (-3 * S0 + 2 * 0.8) / 8,
}
GSPO_GRAD_SCALE = {"grpo": 1 / (3 * 2), "bnpo": 1 / 5, "dapo": 1 / 5, "dr_grpo": 1 / 8}


def test_sequence_log_ratio_is_the_masked_mean():
    log_ratio = torch.tensor([[0.3, -0.6, 9.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    close(sequence_log_ratio(log_ratio, mask), [[-0.15], [0.0]])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_gspo_sequence_level_hand_computed(loss_type):
    logp, old, ref, adv, mask = _tiny()
    loss, stats = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        LossSpec(loss_type, EPS, EPS_HIGH, MAX_LEN, importance_sampling_level="sequence"),
        BatchTotals(num_sequences=2, num_tokens=5.0),
    )
    close(loss, GSPO_LOSS[loss_type], atol=1e-9)
    assert (stats.kl_sum, stats.clipped_tokens, stats.tokens) == (0.0, 2.0, 5.0)  # both tokens of seq 1
    loss.backward()
    close(logp.grad, [[-S0 * GSPO_GRAD_SCALE[loss_type]] * 3, [0.0, 0.0, 0.0]], atol=1e-9)


def test_gspo_on_policy_grpo_gradient_equals_token_level():
    # At ratio 1 (one update per generation batch), loss_type grpo gives GSPO the token-level gradient.
    g = torch.Generator().manual_seed(7)
    base = -torch.rand(4, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    mask = (torch.arange(5)[None, :] < torch.tensor([5, 2, 4, 1])[:, None]).long()
    grads = []
    for level in ("token", "sequence"):
        logp = base.clone().requires_grad_()
        loss, _ = grpo_loss(
            logp,
            logp.detach(),
            None,
            adv,
            mask,
            LossSpec("grpo", 0.2, 0.2, 5, importance_sampling_level=level),
            BatchTotals(num_sequences=4, num_tokens=12.0),
        )
        loss.backward()
        grads.append(logp.grad)
    close(grads[0], grads[1], atol=1e-12)


def test_delta_caps_the_ratio_for_negative_advantages():
    # eps_high 0.28, delta 4. One token each:
    #   A = -1, r = 5: -min(-4, -1.28) = 4, clipped (no gradient); without delta 5, gradient -A * r = 5
    #   A = -1, r = 2: below delta: 2, gradient 2, not clipped
    #   A = +1, r = 5: the usual upper clip: -1.28, no gradient, clipped
    def run(delta):
        logp = torch.tensor([[math.log(5.0)], [math.log(2.0)], [math.log(5.0)]], dtype=torch.float64)
        logp.requires_grad_()
        adv = torch.tensor([-1.0, -1.0, 1.0], dtype=torch.float64)
        loss, stats = grpo_loss(
            logp, torch.zeros(3, 1, dtype=torch.float64), None, adv,
            torch.ones(3, 1), LossSpec("dapo", EPS, EPS_HIGH, 1, delta=delta), BatchTotals(3, 3.0),
        )  # fmt: skip
        loss.backward()
        return loss, stats, logp.grad

    loss, stats, grad = run(4.0)
    close(loss, (4.0 + 2.0 - 1.28) / 3, atol=1e-9)
    close(grad, [[0.0], [2.0 / 3], [0.0]], atol=1e-9)
    assert stats.clipped_tokens == 2.0
    loss, stats, grad = run(None)
    close(loss, (5.0 + 2.0 - 1.28) / 3, atol=1e-9)
    close(grad, [[5.0 / 3], [2.0 / 3], [0.0]], atol=1e-9)
    assert stats.clipped_tokens == 1.0


def test_high_entropy_mask_hand_computed():
    # Real tokens' entropies sorted: [0.1, 0.2, 0.3, 0.5, 0.7, 0.9] (the padded 9.9 is not one of them).
    # Top half: the 0.5 quantile at position 2.5 is 0.3 + 0.5 · (0.5 - 0.3) = 0.4 -> 0.5, 0.9, 0.7 stay.
    entropy = torch.tensor([[0.1, 0.5, 0.9, 0.3], [0.7, 0.2, 9.9, 9.9]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert high_entropy_mask(entropy, mask, 0.5).tolist() == [
        [False, True, True, False],
        [True, False, False, False],
    ]
    assert high_entropy_mask(entropy, mask, 0.0).sum() == 1  # only the highest real token, 0.9
    assert torch.equal(high_entropy_mask(entropy, mask, 1.0), mask.bool())
    assert not high_entropy_mask(entropy, torch.zeros_like(mask), 0.2).any()


def test_top_entropy_quantile_keeps_the_policy_term_of_high_entropy_tokens_only():
    # Real tokens' entropies sorted [0.1, 0.2, 0.7, 0.8, 0.9]; top 0.4: the 0.6 quantile at position 2.4 is
    # 0.74 -> seq 0's tokens 1 and 2 (per-token -1.28, clipped, and -0.5). dapo: (-1.28 - 0.5) / 5; the KL
    # (beta 0.1, 1 - log 2 per token) stays on all 5 tokens; the normalisation is unchanged.
    logp, old, ref, adv, mask = _tiny(REF_OFFSETS)
    entropy = torch.tensor([[0.1, 0.9, 0.8], [0.7, 0.2, 5.0]], dtype=torch.float64)
    loss, stats = _loss(
        logp, old, ref, adv, mask, "dapo", beta=0.1, entropy=entropy, top_entropy_quantile=0.4
    )
    close(loss, (-1.28 - 0.5) / 5 + 0.1 * KL_TOK, atol=1e-9)
    close(stats.entropy_sum, 2.7, atol=1e-9)
    loss.backward()
    kept = torch.tensor([[0.0, 0.0, -0.5], [0.0, 0.0, 0.0]])  # TOKEN_GRAD where the mask keeps the token
    close(logp.grad, (kept - 0.1 * torch.tensor(MASK)) / 5, atol=1e-9)
    with pytest.raises(ValueError, match="entropy"):
        _loss(logp, old, ref, adv, mask, "dapo", top_entropy_quantile=0.4)


def test_cispo_hand_computed():
    # Cap epsilon_high = 1.28 on the tiny example: weights seq 0 [1.1, 1.28 (capped, A > 0: clipped), 0.5],
    # seq 1 [0.5, 1.1]; per token -w · A · logp with logp = log r; dapo: / 5. The weight is a constant:
    # d/dlogp = -w · A / 5.
    logp, old, ref, adv, mask = _tiny()
    loss, stats = grpo_loss(
        logp, old, ref, adv, mask, LossSpec("cispo", EPS, 1.28, MAX_LEN), BatchTotals(2, 5.0)
    )
    w = [[1.1, 1.28, 0.5], [0.5, 1.1, 0.0]]
    lr = [[math.log(r) for r in row] for row in RATIOS]
    expected = -sum(w[0][t] * lr[0][t] for t in range(3)) + sum(w[1][t] * lr[1][t] for t in range(2))
    close(loss, expected / 5, atol=1e-9)
    assert stats.clipped_tokens == 1.0
    loss.backward()
    close(logp.grad, [[-x / 5 for x in w[0]], [x / 5 for x in w[1]]], atol=1e-9)


def test_sapo_hand_computed():
    # Per token -sigmoid(tau (r - 1)) · 4 / tau · A, tau = 1 for A > 0 and 1.05 otherwise; grpo normalisation;
    # d/dlogp = -4 A · s (1 - s) · r with s the sigmoid. No clipping.
    logp, old, ref, adv, mask = _tiny()
    loss, stats = _loss(logp, old, ref, adv, mask, "sapo")

    def sig(x):
        return 1 / (1 + math.exp(-x))

    terms, grads = [], []
    for ratios, a, n, tau in ((RATIOS[0], 1.0, 3, 1.0), (RATIOS[1][:2], -1.0, 2, 1.05)):
        terms.append(sum(-sig(tau * (r - 1)) * 4 / tau * a for r in ratios) / n)
        grads.append([-4 * a * sig(tau * (r - 1)) * (1 - sig(tau * (r - 1))) * r / (n * 2) for r in ratios])
    close(loss, sum(terms) / 2, atol=1e-9)
    assert stats.clipped_tokens == 0.0
    loss.backward()
    close(logp.grad, [grads[0], grads[1] + [0.0]], atol=1e-9)


def test_mask_truncated_drops_cut_off_rows():
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    out = mask_truncated(mask, torch.tensor([True, False, False]))
    assert out.tolist() == [[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]


def test_the_config_takes_every_registered_loss_type_and_refuses_others(tmp_path):
    """grpo.loss_type is checked against core's LOSS_TYPES itself: a loss registered there is accepted by
    the config with nothing else to change, and an unknown one is a one-line error naming the key and
    the registered names."""
    from leangrpo.config.schema import ConfigError, GRPOSection
    from leangrpo.core.loss_types import LOSS_TYPES
    from leangrpo.run.resolve import validate_config

    base = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}}
    for name in LOSS_TYPES:
        assert validate_config({**base, "grpo": {"loss_type": name}}).grpo.loss_type == name
    with pytest.raises(ConfigError) as info:
        validate_config({**base, "grpo": {"loss_type": "ppo"}})
    assert str(info.value) == (
        f"config error in config: grpo.loss_type: unknown loss type; one of {', '.join(LOSS_TYPES)} "
        "(got 'ppo')"
    )
    assert ", ".join(LOSS_TYPES) in (GRPOSection.model_fields["loss_type"].description or "")


def test_loss_type_names_are_listed_only_in_core_loss_types():
    """A second list of the loss names (a Literal, a tuple, a dict) anywhere in the package would have to
    be kept in step with LOSS_TYPES by hand: any collection naming two or more of them is refused."""
    import ast
    from pathlib import Path

    from leangrpo.core.loss_types import LOSS_TYPES

    src = Path(__file__).resolve().parents[1] / "src" / "leangrpo"
    found = []
    for path in src.rglob("*.py"):
        if path == src / "core" / "loss_types.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            items = node.keys if isinstance(node, ast.Dict) else getattr(node, "elts", [])
            names = [i.value for i in items if isinstance(i, ast.Constant) and i.value in LOSS_TYPES]
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and len(names) > 1:
                found.append(f"{path.relative_to(src)}:{node.lineno}: {names}")
    assert not found, found


def test_grpo_loss_unknown_type_raises():
    logp, old, ref, adv, mask = _tiny()
    with pytest.raises(ValueError, match="loss_type"):
        _loss(logp, old, ref, adv, mask, "ppo")


def test_every_loss_type_is_a_registered_objective_and_aggregation():
    from leangrpo.core import grpo

    objectives, aggregations = zip(*grpo.LOSS_TYPES.values(), strict=True)
    assert set(objectives) == set(grpo.OBJECTIVES) == {"clip", "cispo", "sapo", "vespo"}
    assert set(aggregations) == set(grpo.AGGREGATIONS) == {"grpo", "bnpo", "dapo", "dr_grpo", "luspo"}
    with pytest.raises(ValueError, match=r"^unknown objective 'ppo' \(known: clip, cispo, sapo, vespo\)$"):
        grpo.OBJECTIVES["ppo"]
    with pytest.raises(
        ValueError, match=r"^unknown aggregation 'mean' \(known: grpo, bnpo, luspo, dapo, dr_grpo\)$"
    ):
        grpo.AGGREGATIONS["mean"]


def test_vespo_gamma_weight_hand_computed():
    """phi(w) = e^lambda · w^k · e^(-lambda·w): 1 at w = 1; at w = 2 with (k, lambda) = (2, 3) for a
    positive advantage e^3 · 4 · e^-6, and (3, 2) for a negative one e^2 · 8 · e^-4; w is the product of
    the completion's token ratios (masked tokens left out), times the sampler's weights."""
    from leangrpo.core.grpo import gamma_weights

    shape = (2.0, 3.0, 3.0, 2.0)
    log2 = math.log(2)
    token_log = torch.tensor([[0.0, 0.0], [log2 / 2, log2 / 2], [log2, 5.0]], dtype=torch.float64)
    keep = torch.tensor([[True, True], [True, True], [True, False]])
    adv = torch.tensor([[1.0], [1.0], [-1.0]], dtype=torch.float64)
    phi = gamma_weights(adv, token_log, keep, None, shape)
    expected = [[1.0], [math.exp(3) * 4 * math.exp(-6)], [math.exp(2) * 8 * math.exp(-4)]]
    torch.testing.assert_close(phi, torch.tensor(expected, dtype=torch.float64))
    sampler = torch.tensor([[2.0, 1.0]], dtype=torch.float64)  # w = 2 from the sampler alone
    phi = gamma_weights(adv[:1], token_log[:1], keep[:1], sampler, shape)
    torch.testing.assert_close(phi, torch.tensor([[expected[1][0]]], dtype=torch.float64))


# --------------------------------------------------------------------------- micro-batch equivalence


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "luspo"])  # bnpo: test_trl
def test_micro_batches_sum_to_full_batch_gradient(loss_type):
    g = torch.Generator().manual_seed(5)
    N, C = 8, 6
    base = -torch.rand(N, C, generator=g, dtype=torch.float64) * 3
    old = base + torch.randn(N, C, generator=g, dtype=torch.float64) * 0.3
    ref = base + torch.randn(N, C, generator=g, dtype=torch.float64) * 0.3
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 6, 2, 5, 4, 6])
    mask = (torch.arange(C)[None, :] < lengths[:, None]).long()
    num_tokens = float(mask.sum())
    spec, batch = LossSpec(loss_type, 0.2, 0.28, C, beta=0.04), BatchTotals(N, num_tokens)

    full = base.clone().requires_grad_()
    full_loss, full_stats = grpo_loss(full, old, ref, adv, mask, spec, batch)
    full_loss.backward()
    assert full_stats.clipped_tokens > 0  # the example exercises clipping

    micro = base.clone().requires_grad_()
    total_loss = 0.0
    micro_stats = []
    for rows in (slice(0, 3), slice(3, 5), slice(5, 8)):
        loss, stats = grpo_loss(micro[rows], old[rows], ref[rows], adv[rows], mask[rows], spec, batch)
        loss.backward()
        total_loss += float(loss.detach())
        micro_stats.append(stats)

    torch.testing.assert_close(micro.grad, full.grad, atol=1e-6, rtol=0)
    assert abs(total_loss - float(full_loss.detach())) < 1e-6
    assert sum(s.tokens for s in micro_stats) == full_stats.tokens == num_tokens
    assert sum(s.clipped_tokens for s in micro_stats) == full_stats.clipped_tokens
    assert abs(sum(s.kl_sum for s in micro_stats) - full_stats.kl_sum) < 1e-6
    # masked positions get no gradient
    assert (full.grad[mask == 0] == 0).all()


# --------------------------------------------------------------------------- EOS end-to-end


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_tokens_after_eos_get_exactly_zero_gradient(loss_type):
    g = torch.Generator().manual_seed(6)
    eos = 2
    completion_ids = torch.tensor([[5, 6, 2, 7, 8], [3, 2, 9, 2, 4], [4, 5, 6, 7, 8]])
    mask, has_eos = mask_after_eos(completion_ids, [eos])
    assert has_eos.tolist() == [True, True, False]
    N, C, H, V = 3, 5, 8, 10
    hidden = torch.randn(N, C, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g, requires_grad=True)
    logp = token_logprobs(hidden, weight, completion_ids, temperature=0.7, chunk_size=4)
    logp.retain_grad()
    old = logp.detach() + torch.randn(N, C, generator=g) * 0.2
    ref = logp.detach() + torch.randn(N, C, generator=g) * 0.2
    adv = torch.tensor([1.0, -0.5, 0.3])
    loss, stats = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        LossSpec(loss_type, 0.2, 0.28, C, beta=0.04),
        BatchTotals(N, float(mask.sum())),
    )
    loss.backward()
    after_eos = mask == 0
    assert after_eos.sum() == 5
    assert stats.tokens == 10.0
    assert (logp.grad[after_eos] == 0).all()
    assert (logp.grad[~after_eos] != 0).all()
    assert (hidden.grad[after_eos] == 0).all()
    assert (hidden.grad[~after_eos].abs().sum(-1) > 0).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_masked_positions_with_extreme_logprobs_do_not_make_nan(loss_type):
    """A position after EOS with ref - logp > 88 overflows exp in float32; the mask must select it out,
    not multiply it (0 · inf = NaN), in the loss, its gradient and the KL/clip statistics."""
    logp = torch.tensor([[-1.0, -0.5, -120.0]], requires_grad=True)
    ref = torch.tensor([[-1.1, -0.4, -5.0]])
    old = torch.tensor([[-1.0, -0.5, 10.0]])  # logp - old is also extreme at the masked position
    mask = torch.tensor([[1, 1, 0]])
    spec, batch = LossSpec(loss_type, 0.2, 0.28, 3, beta=0.04), BatchTotals(1, 2.0)
    loss, stats = grpo_loss(logp, old, ref, torch.tensor([1.0]), mask, spec, batch)
    loss.backward()
    # Same batch with an ordinary value at the masked position: the masked value must not matter.
    tame = torch.tensor([[-1.0, -0.5, -1.0]], requires_grad=True)
    tame_loss, tame_stats = grpo_loss(tame, old.clamp(max=0), ref, torch.tensor([1.0]), mask, spec, batch)
    tame_loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    close(loss.item(), tame_loss.item())
    close(logp.grad, tame.grad)
    assert logp.grad[0, 2] == 0
    assert stats == tame_stats and math.isfinite(stats.kl_sum)


# ------------------------------------------------------------------ vLLM importance-sampling correction

LN2 = math.log(2)
# trainer - sampler log-prob per token: row 0 ratios 2, 1 (third token masked), row 1 ratios 0.5, 8.
IS_OLD = torch.tensor([[LN2, 0.0, 100.0], [-LN2, 3 * LN2, 5.0]])
IS_SAMPLER = torch.zeros(2, 3)
IS_MASK = torch.tensor([[1, 1, 0], [1, 1, 0]])


@pytest.mark.parametrize(
    "mode, clip_min, weights, ratio_mean, clipped_frac",
    [
        ("token_truncate", None, [[2, 1, 1], [0.5, 3, 1]], (2 + 1 + 0.5 + 3) / 4, 1 / 4),
        ("token_truncate", 0.6, [[2, 1, 1], [0.6, 3, 1]], (2 + 1 + 0.6 + 3) / 4, 2 / 4),
        ("token_mask", None, [[2, 1, 1], [0.5, 0, 1]], (2 + 1 + 0.5) / 4, 1 / 4),
        ("token_mask", 0.6, [[2, 1, 1], [0, 0, 1]], (2 + 1) / 4, 2 / 4),
        # sequence ratios: exp(ln 2) = 2 and exp(-ln 2 + 3 ln 2) = 4
        ("sequence_truncate", None, [[2], [3]], 2.5, 1 / 2),
        ("sequence_mask", None, [[2], [0]], 1.0, 1 / 2),
        ("sequence_mask", 2.5, [[0], [0]], 0.0, 1.0),
    ],
)
def test_sampler_importance_weights_hand_computed(mode, clip_min, weights, ratio_mean, clipped_frac):
    w, stats = sampler_importance_weights(IS_OLD, IS_SAMPLER, IS_MASK, mode, clip_min, 3.0)
    close(w, weights)
    close(stats.is_ratio_mean, ratio_mean)
    close(stats.is_clipped_frac, clipped_frac)
    close(stats.logprob_diff_mean, (LN2 + 0 + LN2 + 3 * LN2) / 4)  # masked tokens left out
    close(stats.logprob_diff_max, 3 * LN2)


def test_sampler_weights_scale_the_surrogate_not_the_kl():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]])
    args = (logp, logp.detach(), ref, torch.tensor([1.5]), torch.ones(1, 2))
    surrogate = -1.5  # ratio 1 everywhere: per token -A
    kl = float(kl_k3(logp.detach(), ref).mean())
    weights = torch.tensor([[2.0, 0.0]])
    loss, _ = grpo_loss(
        *args, LossSpec("bnpo", 0.2, 0.2, 2, beta=0.1), BatchTotals(1, 2.0), sampler_weights=weights
    )
    close(loss.item(), (2 * surrogate + 0 * surrogate) / 2 + 0.1 * kl)


def test_shuffle_within_groups_permutes_each_group_only():
    import torch

    from leangrpo.core.grpo import shuffle_within_groups

    rows = shuffle_within_groups(12, 4, torch.Generator().manual_seed(0))
    groups = rows.view(3, 4)
    assert [sorted(g.tolist()) for g in groups] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert rows.tolist() != list(range(12))  # (seed 0 does move rows)
    again = shuffle_within_groups(12, 4, torch.Generator().manual_seed(0))
    assert torch.equal(rows, again)
