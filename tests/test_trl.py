"""Where leangrpo uses a TRL 1.16 name, it computes TRL's numbers: checked against TRL's own code.

`trl_loss` runs `GRPOTrainer._compute_loss` itself (the loss, its normalisation under gradient
accumulation, and the kl / clip_ratio metrics) on given log-probs, with every TRL feature that leangrpo
does not have switched off. TRL is a test dependency (the `dev` extra); importing it takes seconds, so
the TRL comparisons live in this one module.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from contextlib import nullcontext
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from leangrpo.core.grpo import BatchTotals, LossSpec, grpo_loss, micro_batch_means, sampler_importance_weights

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def trl_loss(
    logp, old, ref, adv, mask, *, loss_type, bias_correction_kl, accumulation_steps, num_items, max_len,
    eps=EPS, eps_high=EPS_HIGH, beta=BETA,
    importance_sampling_level="token", delta=None, entropy=None, top_entropy_quantile=1.0,
    sapo_temperatures=(1.0, 1.05), tool_mask=None, off_policy_mask_threshold=None, sampling=None,
    is_ratio=None, vespo=(2.0, 3.0, 3.0, 2.0), control=None, model=None, ids=None, router_aux_loss_coef=0.0,
):  # fmt: skip
    """TRL 1.16's `_compute_loss` on one micro-batch of one process: (loss, TRL's metrics dict).

    `sampling`: the sampler's log-probs; `is_ratio`: vLLM's importance-sampling weights (TRL's use_vllm
    path); `control`: the entropy bonus's state (entropy_coef, use_adaptive_entropy, its bounds and
    TRL's window), read and written back, so that a sequence of calls runs TRL's adaptive control.
    `model` (with `add_fused_lm_head`) and `ids` (prompt ids, prompt mask, completion ids): the log-probs,
    entropies and MoE aux loss come from TRL's own forward of it instead (`logp` and `entropy` unused)."""
    metrics = defaultdict(list)
    entropy = torch.zeros_like(mask, dtype=torch.float) if entropy is None else entropy
    control = {} if control is None else control
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, entropy, None),
        top_entropy_quantile=top_entropy_quantile,
        off_policy_mask_threshold=off_policy_mask_threshold,
        importance_sampling_level=importance_sampling_level,
        beta=beta,
        args=SimpleNamespace(
            use_bias_correction_kl=bias_correction_kl,
            delta=delta,
            steps_per_generation=accumulation_steps,
            sapo_temperature_pos=sapo_temperatures[0],
            sapo_temperature_neg=sapo_temperatures[1],
            vespo_k_pos=vespo[0],
            vespo_lambda_pos=vespo[1],
            vespo_k_neg=vespo[2],
            vespo_lambda_neg=vespo[3],
            entropy_target=control.get("entropy_target", 0.2),
            entropy_coef_min=control.get("min", 0.0),
            entropy_coef_max=control.get("max", 1.0),
            entropy_coef_delta=control.get("delta", 0.005),
        ),
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        use_vllm=is_ratio is not None,
        vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation_steps,
        max_completion_length=max_len,
        accelerator=SimpleNamespace(
            num_processes=1,
            reduce=lambda t, reduction: t,
            gather=lambda t: t,
            pad_across_processes=lambda t, dim, pad_index: t,
            sync_gradients=control.get("sync_gradients", True),
        ),
        entropy_coef=control.get("entropy_coef", 0.0),
        use_adaptive_entropy=control.get("adaptive", False),
        _last_world_entropy=control.get("last", float("inf")),
        _entropy_window_stats=control.get("window"),
        _entropy_bonus_enabled=control.get("entropy_coef", 0.0) != 0.0 or control.get("adaptive", False),
        aux_loss_enabled=router_aux_loss_coef != 0.0,
        router_aux_loss_coef=router_aux_loss_coef,
        _metrics={"train": metrics},
    )
    if model is not None:
        fake.accelerator.autocast = nullcontext
        fake.accelerator.gather_for_metrics = lambda t: t
        forward = trl_grpo.GRPOTrainer._get_per_token_logps_and_entropies.__wrapped__  # not profiled
        fake._get_per_token_logps_and_entropies = partial(forward, fake)
    fake.get_high_entropy_mask = lambda *a: trl_grpo.GRPOTrainer.get_high_entropy_mask(fake, *a)
    fake.get_gamma_weights = trl_grpo.GRPOTrainer.get_gamma_weights
    fake.get_off_policy_mask = trl_grpo.GRPOTrainer.get_off_policy_mask
    n, c = mask.shape
    prompt_ids, prompt_mask, completion_ids = ids or (torch.zeros(n, 0, dtype=torch.long),) * 2 + (
        torch.zeros(n, c, dtype=torch.long),
    )
    inputs = {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(num_items)),
        **({} if tool_mask is None else {"tool_mask": tool_mask}),
        **({} if sampling is None else {"sampling_per_token_logps": sampling}),
        **({} if is_ratio is None else {"importance_sampling_ratio": is_ratio}),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(fake, model, inputs)
    control.update(
        entropy_coef=fake.entropy_coef, last=fake._last_world_entropy, window=fake._entropy_window_stats
    )
    return loss, metrics


def _batch(seed: int = 0):
    """Two micro-batches of 3 completions with very different token counts, off-policy (old ≠ logp)."""
    g = torch.Generator().manual_seed(seed)
    n, c = 6, 7
    base = -torch.rand(n, c, generator=g, dtype=torch.float64) * 3
    old = base + torch.randn(n, c, generator=g, dtype=torch.float64) * 0.3
    ref = base + torch.randn(n, c, generator=g, dtype=torch.float64) * 0.5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 6, 7, 1, 2, 1])
    mask = (torch.arange(c)[None, :] < lengths[:, None]).long()
    return base, old, ref, adv, mask


@pytest.mark.parametrize("bias_correction_kl", [True, False])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_loss_and_gradient_under_accumulation_match_trl(loss_type, bias_correction_kl):
    """GA = 2 micro-batches, off-policy, beta > 0: the summed loss and the gradient equal TRL's."""
    base, old, ref, adv, mask = _batch()
    n, c = base.shape
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    ours_total = theirs_total = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        loss, _ = grpo_loss(
            ours[rows], old[rows], ref[rows], adv[rows], mask[rows],
            LossSpec(loss_type, EPS, EPS_HIGH, c, beta=BETA, bias_correction_kl=bias_correction_kl),
            BatchTotals(n, float(mask.sum()), accumulation_steps=2),
        )  # fmt: skip
        loss.backward()
        ours_total += loss.item()
        ref_loss, _ = trl_loss(
            theirs[rows], old[rows], ref[rows], adv[rows], mask[rows], loss_type=loss_type,
            bias_correction_kl=bias_correction_kl, accumulation_steps=2, num_items=mask.sum(), max_len=c,
        )  # fmt: skip
        ref_loss.backward()
        theirs_total += ref_loss.item()
    assert ours_total == pytest.approx(theirs_total, abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)


VARIANTS = {
    "gspo": {"importance_sampling_level": "sequence"},
    "delta": {"delta": 1.5},
    "top_entropy_quantile": {"top_entropy_quantile": 0.3},
    "all": {"importance_sampling_level": "sequence", "delta": 1.5, "top_entropy_quantile": 0.5},
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_variants_match_trl(loss_type, variant):
    """GSPO, two-sided clipping, the entropy mask; off-policy, GA = 2, beta > 0: TRL's loss and gradient."""
    base, old, ref, adv, mask = _batch(2)
    old = base + (old - base) * 3  # ratios far enough from 1 for delta and the sequence clip to act
    entropy = torch.rand(base.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 4
    n, c = base.shape
    options = VARIANTS[variant]
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    plain = base.clone().requires_grad_()  # without the variant: it must change the gradient
    for rows in (slice(0, 3), slice(3, 6)):
        for logp, opts in ((plain, {}), (ours, options)):  # ours last: `loss` is compared below
            loss, _ = grpo_loss(
                logp[rows], old[rows], ref[rows], adv[rows], mask[rows],
                LossSpec(loss_type, EPS, EPS_HIGH, c, beta=BETA, bias_correction_kl=True, **opts),
                BatchTotals(n, float(mask.sum()), accumulation_steps=2), entropy=entropy[rows],
            )  # fmt: skip
            loss.backward()
        ref_loss, _ = trl_loss(
            theirs[rows], old[rows], ref[rows], adv[rows], mask[rows], loss_type=loss_type,
            bias_correction_kl=True, accumulation_steps=2, num_items=mask.sum(), max_len=c,
            entropy=entropy[rows], **options,
        )  # fmt: skip
        ref_loss.backward()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
    assert (ours.grad - plain.grad).abs().max() > 1e-3


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_cispo_and_sapo_match_trl(loss_type, level):
    """TRL's other two cheap loss types, token and sequence level, with the entropy mask, off-policy,
    GA = 2, beta > 0: the same loss and gradient (cispo's cap epsilon_high = 1.5 clips some tokens)."""
    base, old, ref, adv, mask = _batch(5)
    old = base + (old - base) * 3
    entropy = torch.rand(base.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64) * 4
    n, c = base.shape
    options = {"importance_sampling_level": level, "top_entropy_quantile": 0.6}
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    for rows in (slice(0, 3), slice(3, 6)):
        loss, _ = grpo_loss(
            ours[rows], old[rows], ref[rows], adv[rows], mask[rows],
            LossSpec(loss_type, EPS, 1.5, c, beta=BETA, bias_correction_kl=True, sapo_temperatures=(0.9, 1.2),
                     **options),
            BatchTotals(n, float(mask.sum()), accumulation_steps=2), entropy=entropy[rows],
        )  # fmt: skip
        loss.backward()
        ref_loss, _ = trl_loss(
            theirs[rows], old[rows], ref[rows], adv[rows], mask[rows], loss_type=loss_type,
            bias_correction_kl=True, accumulation_steps=2, num_items=mask.sum(), max_len=c, eps_high=1.5,
            entropy=entropy[rows], sapo_temperatures=(0.9, 1.2), **options,
        )  # fmt: skip
        ref_loss.backward()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
    assert ours.grad.abs().sum() > 0


def _against_trl(loss_type, seed, spec=None, trl=None, entropy_coef=0.0, is_ratio=None, sampling=None):
    """GA = 2 micro-batches, off-policy, beta > 0, per-token entropy with a gradient: leangrpo's loss and
    TRL's, micro-batch by micro-batch; returns the gradients (log-probs, entropy) of both sides, our stats
    and TRL's metrics."""
    base, old, ref, adv, mask = _batch(seed)
    old = base + (old - base) * 3
    entropy = (
        torch.rand(base.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64) * 4
    )
    n, c = base.shape
    ours = [base.clone().requires_grad_(), entropy.clone().requires_grad_()]
    theirs = [base.clone().requires_grad_(), entropy.clone().requires_grad_()]
    spec, trl = spec or {}, trl or {}
    control = {"entropy_coef": entropy_coef} if spec.get("entropy_bonus") else None
    stats, metrics = [], defaultdict(list)
    for rows in (slice(0, 3), slice(3, 6)):
        cut = [None if t is None else t[rows] for t in (is_ratio, sampling)]
        loss, mb_stats = grpo_loss(
            ours[0][rows], old[rows], ref[rows], adv[rows], mask[rows],
            LossSpec(loss_type, EPS, EPS_HIGH, c, beta=BETA, bias_correction_kl=True, **spec),
            BatchTotals(n, float(mask.sum()), accumulation_steps=2), entropy=ours[1][rows],
            sampler_weights=cut[0], sampling_logp=cut[1], entropy_coef=entropy_coef,
        )  # fmt: skip
        loss.backward()
        ref_loss, m = trl_loss(
            theirs[0][rows], old[rows], ref[rows], adv[rows], mask[rows], loss_type=loss_type,
            bias_correction_kl=True, accumulation_steps=2, num_items=mask.sum(), max_len=c,
            entropy=theirs[1][rows], is_ratio=cut[0], sampling=cut[1], control=control, **trl,
        )  # fmt: skip
        ref_loss.backward()
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
        stats.append(mb_stats)
        for k, v in m.items():
            metrics[k] += v
    for mine, its in zip(ours, theirs, strict=True):
        assert (mine.grad is None) == (its.grad is None)
        if mine.grad is not None:
            torch.testing.assert_close(mine.grad, its.grad, atol=1e-12, rtol=0)
    assert ours[0].grad.abs().sum() > 0
    return ours, stats, metrics


def _trl_mean(metrics, name):
    """TRL's logged value of a metric: the mean of what its micro-batches appended."""
    return sum(metrics[name]) / len(metrics[name])


@pytest.mark.parametrize(
    ("loss_type", "level", "entropy_quantile"),
    [("luspo", "sequence", 1.0), ("luspo", "token", 0.6), ("vespo", "token", 1.0), ("vespo", "token", 0.6)],
)
def test_luspo_and_vespo_match_trl(loss_type, level, entropy_quantile):
    """TRL's last two loss types, off-policy, GA = 2, beta > 0 (with and without the entropy mask): the
    same loss, gradient and metrics (luspo's clip_ratio/*, vespo's vespo/phi_seq_mean), vespo with
    non-default gamma shapes."""
    vespo = (1.5, 2.5, 2.0, 1.0)
    opts = {"importance_sampling_level": level, "top_entropy_quantile": entropy_quantile}
    _, stats, metrics = _against_trl(loss_type, 7, {**opts, "vespo_shape": vespo}, {**opts, "vespo": vespo})
    means = micro_batch_means(stats)
    # clip_ratio/* at the sequence level: TRL counts completions, leangrpo tokens (docs/trl.md)
    clip = ["clip_ratio/low_mean", "clip_ratio/high_mean"] if level == "token" else ["kl"]
    names = ["vespo/phi_seq_mean"] if loss_type == "vespo" else clip
    for name in [*names, "entropy", "kl"]:
        assert means[name] == pytest.approx(_trl_mean(metrics, name), rel=1e-6, abs=1e-12), name
    assert means[names[0]] > 0


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
def test_vespo_takes_the_sampler_weights_into_its_gamma_weight_as_trl(mode):
    """With vLLM's importance sampling, vespo folds the sampler's token weights into its sequence ratio
    instead of scaling the loss by them (TRL): same loss, gradient and phi metric."""
    base, old, _, _, mask = _batch(9)
    sampling = (
        old + torch.randn(old.shape, generator=torch.Generator().manual_seed(10), dtype=torch.float64) * 0.2
    )
    weights, _ = sampler_importance_weights(old, sampling, mask, mode, 0.5, 1.5)
    _, stats, metrics = _against_trl("vespo", 9, is_ratio=weights, sampling=sampling)
    name = "vespo/phi_seq_mean"
    assert micro_batch_means(stats)[name] == pytest.approx(_trl_mean(metrics, name), rel=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_cispo_logs_trls_cispo_clip_ratio(level):
    """cispo's `cispo_clip_ratio` (TRL's name, per token or per completion as TRL counts it) equals TRL's."""
    opts = {"importance_sampling_level": level}
    _, stats, metrics = _against_trl("cispo", 5, opts, opts)
    means = micro_batch_means(stats)
    assert means["cispo_clip_ratio"] == pytest.approx(_trl_mean(metrics, "cispo_clip_ratio"), rel=1e-6)
    assert means["cispo_clip_ratio"] > 0


@pytest.mark.parametrize("sampler", [False, True])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "vespo"])
def test_off_policy_mask_matches_trl(loss_type, sampler):
    """DeepSeek-V3.2's off-policy sequence mask: against the old policy's log-probs, or the sampler's when
    given (vLLM), a NaN one among them; the same loss and gradient as TRL, and it drops some completions."""
    base, old, _, _, _ = _batch(11)
    sampling = None
    if sampler:
        sampling = base + torch.rand(  # a mean KL from 0.24 to 0.62 from the policy
            old.shape, generator=torch.Generator().manual_seed(12), dtype=torch.float64
        )
        sampling[1, 2] = torch.nan
    opts = {"off_policy_mask_threshold": 0.3 if sampler else 0.05}
    masked, _, _ = _against_trl(loss_type, 11, opts, opts, sampling=sampling)
    plain, _, _ = _against_trl(loss_type, 11, sampling=sampling)
    assert (masked[0].grad - plain[0].grad).abs().max() > 1e-6


@pytest.mark.parametrize("entropy_quantile", [1.0, 0.5])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"])
def test_entropy_bonus_matches_trl(loss_type, entropy_quantile):
    """entropy_coef > 0, every loss type, with and without the entropy mask: TRL's loss, its gradient
    through the log-probs and through the entropy, and its `policy_loss` metric."""
    opts = {"top_entropy_quantile": entropy_quantile}
    ours, stats, metrics = _against_trl(
        loss_type, 13, {**opts, "entropy_bonus": True}, opts, entropy_coef=0.3
    )
    assert ours[1].grad is not None and ours[1].grad.abs().sum() > 0
    means = micro_batch_means(stats)
    assert means["policy_loss"] == pytest.approx(_trl_mean(metrics, "policy_loss"), rel=1e-6)


def test_adaptive_entropy_control_matches_trl():
    """use_adaptive_entropy over six optimizer steps of GA = 2 micro-batches whose entropy crosses the
    target both ways: each step's loss and gradient, and the coefficient after it, are TRL's (no bonus at
    the first step, the coefficient clamped at its bounds)."""
    from leangrpo.config.schema import GRPOSection
    from leangrpo.train.loss import EntropyControl

    g = GRPOSection(
        entropy_coef=0.02, use_adaptive_entropy=True, entropy_target=1.0, entropy_coef_min=0.01,
        entropy_coef_max=0.04, entropy_coef_delta=0.015,
    )  # fmt: skip
    ours_ctl = EntropyControl.of(g, {})
    theirs_ctl = {"entropy_coef": 0.02, "adaptive": True, "entropy_target": 1.0, "min": 0.01, "max": 0.04,
                  "delta": 0.015}  # fmt: skip
    base, old, ref, adv, mask = _batch(14)
    n, c = base.shape
    spec = LossSpec("dapo", EPS, EPS_HIGH, c, beta=BETA, bias_correction_kl=True, entropy_bonus=True)
    coefs = []
    for step, scale in enumerate([0.3, 0.3, 0.3, 0.8, 0.8, 0.3]):
        entropy = torch.rand(base.shape, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
        entropy = entropy * 4 * scale  # mean 0.6 or 1.6 against the target 1
        ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
        applied, window = ours_ctl.applied(), []
        for rows, last in ((slice(0, 3), False), (slice(3, 6), True)):
            loss, mb_stats = grpo_loss(
                ours[rows], old[rows], ref[rows], adv[rows], mask[rows], spec,
                BatchTotals(n, float(mask.sum()), accumulation_steps=2), entropy=entropy[rows],
                entropy_coef=applied,
            )  # fmt: skip
            loss.backward()
            window.append(mb_stats.bonus_entropy)
            theirs_ctl["sync_gradients"] = last
            ref_loss, metrics = trl_loss(
                theirs[rows], old[rows], ref[rows], adv[rows], mask[rows], loss_type="dapo",
                bias_correction_kl=True, accumulation_steps=2, num_items=mask.sum(), max_len=c,
                entropy=entropy[rows], control=theirs_ctl,
            )  # fmt: skip
            ref_loss.backward()
            assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
        totals = torch.stack(window).sum(0)
        ours_ctl.observe(float(totals[0] / totals[1]))
        torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
        assert ours_ctl.coef == pytest.approx(theirs_ctl["entropy_coef"], abs=1e-15)
        assert metrics["entropy_coef"] == [pytest.approx(ours_ctl.coef, abs=1e-15)]
        assert ours_ctl.last_entropy == pytest.approx(theirs_ctl["last"], rel=1e-12)
        coefs.append((applied, ours_ctl.coef))
    assert coefs[0][0] == 0.0  # no measurement yet: no bonus
    after = [c for _, c in coefs]  # both bounds reached, and the bonus applied at some steps
    assert (min(after), max(after)) == (pytest.approx(0.01), pytest.approx(0.04)) and any(
        a > 0 for a, _ in coefs
    )


def test_bias_correction_changes_the_kl_gradient_even_on_policy():
    """On-policy the ratio is 1, so the loss is the same; its gradient adds beta · KL per token."""
    base, _, ref, adv, mask = _batch(1)
    grads, losses = [], []
    for flag in (False, True):
        logp = base.clone().requires_grad_()
        loss, _ = grpo_loss(
            logp, logp.detach(), ref, adv, mask,
            LossSpec("dapo", EPS, EPS_HIGH, 7, beta=BETA, bias_correction_kl=flag),
            BatchTotals(6, float(mask.sum())),
        )  # fmt: skip
        loss.backward()
        grads.append(logp.grad)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    kl = torch.exp(ref - base) - (ref - base) - 1
    torch.testing.assert_close(grads[1] - grads[0], BETA * kl * mask / mask.sum(), atol=1e-12, rtol=0)


def test_kl_clip_ratio_and_entropy_are_means_of_micro_batch_means_as_in_trl():
    """Micro-batches with 20 and 4 tokens: each one's token mean counts once, as in TRL's metrics."""
    base, old, ref, adv, mask = _batch(2)
    entropy = torch.rand(base.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64) * 4
    ours, theirs = [], defaultdict(list)
    for rows in (slice(0, 3), slice(3, 6)):
        _, stats = grpo_loss(
            base[rows], old[rows], ref[rows], adv[rows], mask[rows],
            LossSpec("dapo", EPS, EPS_HIGH, 7, beta=BETA, bias_correction_kl=True),
            BatchTotals(6, float(mask.sum())), entropy=entropy[rows],
        )  # fmt: skip
        ours.append(stats)
        _, metrics = trl_loss(
            base[rows], old[rows], ref[rows], adv[rows], mask[rows], loss_type="dapo",
            bias_correction_kl=True, accumulation_steps=2, num_items=mask.sum(), max_len=7,
            entropy=entropy[rows],
        )  # fmt: skip
        for k, v in metrics.items():
            theirs[k] += v
    means = micro_batch_means(ours)
    clip = ("clip_ratio/region_mean", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/low_min")
    for name in ("entropy", "kl", *clip, "clip_ratio/high_max"):
        assert means[name] == pytest.approx(sum(theirs[name]) / 2, rel=1e-6, abs=1e-12), name
    assert means["clip_ratio/low_mean"] > 0 and means["clip_ratio/high_mean"] > 0  # both kinds occur
    assert means["clip_ratio/high_max"] > means["clip_ratio/high_mean"]  # the most clipped completion
    clip_ratio = means["clip_ratio/region_mean"]
    token_weighted = float(sum(s.clipped_tokens for s in ours) / sum(s.tokens for s in ours))
    assert clip_ratio != pytest.approx(token_weighted, rel=1e-3)  # the example tells the two apart


def test_clip_ratio_extremes_over_processes_are_trls_nanmin_and_nanmax():
    """clip_ratio/low_min and /high_max over two processes (the second's ratios all e): per micro-batch the
    least (most) clipped completion of either process, as TRL's nanmin/nanmax of the gathered
    completions; completions without tokens count for nothing, and none anywhere gives no value (None)."""
    base, old, ref, adv, mask = _batch(2)
    spec = LossSpec("dapo", EPS, EPS_HIGH, 7, beta=BETA)
    second = mask.clone()
    second[3:] = 0  # the second process's second micro-batch: no tokens
    processes = [(old, mask), (base - 1.0, second)]
    halves = (slice(0, 3), slice(3, 6))
    stats = [
        [grpo_loss(base[r], o[r], ref[r], adv[r], m[r], spec, BatchTotals(6, 1.0))[1] for r in halves]
        for o, m in processes
    ]
    theirs = defaultdict(list)
    for r in halves:  # TRL: one micro-batch of both processes' completions, those with tokens
        keep = torch.cat([m[r] for _, m in processes]).sum(1) > 0
        both = [torch.cat([x[r], x[r]])[keep] for x in (base, ref, adv)]
        _, metrics = trl_loss(
            both[0], torch.cat([o[r] for o, _ in processes])[keep], both[1], both[2],
            torch.cat([m[r] for _, m in processes])[keep], loss_type="dapo", bias_correction_kl=True,
            accumulation_steps=2, num_items=1, max_len=7,
        )  # fmt: skip
        for k, v in metrics.items():
            theirs[k] += v
    other = torch.stack([torch.stack([s.low_min, s.high_max]) for s in stats[1]]).double()
    means = micro_batch_means(stats[0], gather_over_processes=lambda t: torch.cat([t, other]))
    alone = micro_batch_means(stats[0])
    for name in ("clip_ratio/low_min", "clip_ratio/high_max"):
        assert means[name] == pytest.approx(sum(theirs[name]) / 2, rel=1e-6), name
    assert means["clip_ratio/high_max"] > alone["clip_ratio/high_max"]  # the other process's counted
    empty = grpo_loss(base, old, ref, adv, torch.zeros_like(mask), spec, BatchTotals(6, 1.0))[1]
    assert micro_batch_means([empty])["clip_ratio/high_max"] is None


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_multi_turn_loss_and_gradient_match_trl(loss_type):
    """A multi-turn batch (tool tokens inside completions): leangrpo's loss over `RolloutBatch.loss_mask`
    equals TRL's over completion_mask × tool_mask, and so does the gradient."""
    from leangrpo.engines.types import RolloutBatch

    base, old, ref, adv, mask = _batch(1)
    n, c = base.shape
    tool_mask = torch.ones(n, c, dtype=torch.long)
    tool_mask[0, 2:4] = tool_mask[2, 1:5] = tool_mask[4, 1] = 0
    batch = RolloutBatch(
        torch.zeros(n, 1, dtype=torch.long),
        torch.ones(n, 1, dtype=torch.long),
        torch.zeros(n, c, dtype=torch.long),
        mask,
        torch.zeros(n, dtype=torch.bool),
        [""] * n,
        None,
        tool_mask,
    )
    loss_mask = batch.loss_mask
    ours, theirs = base.clone().requires_grad_(), base.clone().requires_grad_()
    for rows in (slice(0, 3), slice(3, 6)):
        loss, _ = grpo_loss(
            ours[rows], old[rows], ref[rows], adv[rows], loss_mask[rows],
            LossSpec(loss_type, EPS, EPS_HIGH, c, beta=BETA, bias_correction_kl=False),
            BatchTotals(n, float(loss_mask.sum()), accumulation_steps=2),
        )  # fmt: skip
        ref_loss, _ = trl_loss(
            theirs[rows],
            old[rows],
            ref[rows],
            adv[rows],
            mask[rows],
            loss_type=loss_type,
            bias_correction_kl=False,
            accumulation_steps=2,
            num_items=loss_mask.sum(),
            max_len=c,
            tool_mask=tool_mask[rows],
        )
        assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
        loss.backward()
        ref_loss.backward()
    torch.testing.assert_close(ours.grad, theirs.grad, atol=1e-12, rtol=0)
    assert (ours.grad[tool_mask == 0] == 0).all()


def test_trainer_step_matches_trl(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    """One real step with GA = 2 micro-batches, num_iterations = 2, beta > 0 and bnpo: the logged loss,
    kl, clip_ratio, reward_std and frac_reward_zero_std are TRL's, computed from what the trainer fed its
    loss.
    The rewards are tiny (weight 1e-6), so every group's std lies between TRL's zero test (isclose 0)
    and 1e-6."""
    from trl.trainer.utils import nanstd

    import leangrpo.core.grpo as grpo_mod
    from leangrpo.run.resolve import validate_config
    from leangrpo.train.trainer import Trainer

    calls, rewards = [], []
    real_loss, real_advantages = grpo_mod.grpo_loss, grpo_mod.group_advantages

    def spy_loss(logp, old, ref, adv, mask, **kwargs):
        calls.append([t.detach().clone() for t in (logp, old, ref, adv, mask, kwargs["entropy"])])
        return real_loss(logp, old, ref, adv, mask, **kwargs)

    def spy_advantages(r, *args, **kwargs):
        rewards.append(r.clone())
        return real_advantages(r, *args, **kwargs)

    monkeypatch.setattr(grpo_mod, "grpo_loss", spy_loss)
    monkeypatch.setattr(grpo_mod, "group_advantages", spy_advantages)
    eps, beta, max_len = 1e-3, 0.04, 8
    cfg = validate_config({
        "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 8},
        "rewards": {"functions": [{"name": "toy_rewards:vowel_share", "weight": 1e-6}]},
        "grpo": {"num_generations": 4, "max_completion_length": max_len, "beta": beta, "epsilon": eps,
                 "num_iterations": 2, "loss_type": "bnpo", "packed_generation": False},
        "optim": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 2, "max_steps": 1,
                  "learning_rate": 1e-3},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip
    metrics = Trainer(cfg).step(1)

    assert len(calls) == 4  # 2 iterations x 2 micro-batches
    losses, theirs = [], defaultdict(list)
    for logp, old, ref, adv, mask, entropy in calls:
        loss, m = trl_loss(
            logp, old, ref, adv, mask, loss_type="bnpo", bias_correction_kl=True, accumulation_steps=2,
            num_items=0, max_len=max_len, eps=eps, eps_high=eps, beta=beta, entropy=entropy,
        )  # fmt: skip
        losses.append(loss.item())
        for k, v in m.items():
            theirs[k] += v
    assert metrics["loss"] == pytest.approx((sum(losses[:2]) + sum(losses[2:])) / 2, rel=1e-5, abs=1e-9)
    assert metrics["kl"] == pytest.approx(sum(theirs["kl"]) / 4, rel=1e-5)
    assert metrics["clip_ratio/region_mean"] == pytest.approx(
        sum(theirs["clip_ratio/region_mean"]) / 4, rel=1e-5
    )
    assert metrics["entropy"] == pytest.approx(sum(theirs["entropy"]) / 4, rel=1e-5)
    assert metrics["clip_ratio/region_mean"] > 0 and metrics["kl"] > 0 and metrics["entropy"] > 0

    (r,) = rewards
    assert metrics["reward_std"] == pytest.approx(nanstd(r).item(), rel=1e-5)
    group_std = nanstd(r.view(-1, 4), dim=1)
    assert (
        metrics["frac_reward_zero_std"]
        == torch.isclose(group_std, torch.zeros_like(group_std)).float().mean()
    )
    assert metrics["frac_reward_zero_std"] < 1.0 and (group_std < 1e-6).all()


def test_batch_statistics_span_every_process(tmp_path):
    """Two gloo processes whose rewards differ tenfold in scale: with scale_rewards=batch (and with
    normalize_then_sum) the batch std is over both processes' rewards, as TRL's nanstd of the gathered
    rewards, not each process's own; groups stay within a process."""
    import socket

    import torch.multiprocessing as mp
    from gloo_advantages import AGGREGATIONS, advantages_on_rank
    from trl.trainer.utils import nanstd

    from leangrpo.core import grpo

    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(16, 2, generator=g)
    rewards[8:] *= 10  # process 1
    rewards[3] = torch.nan  # unscorable: advantage 0, out of the statistics
    rewards[9, 0] = torch.nan  # one function not applicable
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(advantages_on_rank, args=(port, rewards, str(tmp_path)), nprocs=2)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))

    total = torch.where(rewards.isnan().all(1), torch.nan, rewards.nansum(1))
    centred = (total.view(-1, 4) - total.view(-1, 4).nanmean(1, keepdim=True)).view(-1)
    trl_batch = torch.nan_to_num(centred / (nanstd(total) + 1e-4), nan=0.0)  # TRL's batch scaling
    expected = {
        "sum_then_normalize": grpo.group_advantages(total, 4, "batch"),
        "normalize_then_sum": grpo.normalize_then_sum(rewards, torch.ones(2), total.isnan(), 4),
    }
    torch.testing.assert_close(expected["sum_then_normalize"][0], trl_batch)
    for aggregation in AGGREGATIONS:
        (a0, s0), (a1, s1) = rank0[aggregation], rank1[aggregation]
        advantages, group_std = expected[aggregation]
        torch.testing.assert_close(torch.cat([a0, a1]), advantages)
        torch.testing.assert_close(s0, group_std)
        torch.testing.assert_close(s1, group_std)
    own_scale = grpo.group_advantages(total[:8], 4, "batch")[0]  # what process 0 alone would compute
    assert not torch.allclose(rank0["sum_then_normalize"][0], own_scale, atol=1e-2)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_packed_update_matches_trl(tiny_model_dir, loss_type):
    """Padding-free (grpo.padding_free, with a shared prompt): the loss and every weight's gradient from
    leangrpo's packed pass equal TRL's `_compute_loss` on log-probs that TRL's way computes from a padded
    batch (the model's logits over prompt + completion, `selective_log_softmax`). Completions of 1 to 7
    tokens; prompts without left padding, whose positions TRL would count from the pad."""
    from test_models import assert_grads_close, load_tiny
    from trl.trainer.utils import selective_log_softmax

    from leangrpo.engines.types import RolloutBatch
    from leangrpo.train.policy import Policy, micro_batch_logprobs

    g = torch.Generator().manual_seed(0)
    n, c, temperature = 6, 7, 0.7
    prompt_ids = torch.randint(5, 1000, (2, 5), generator=g).repeat_interleave(3, 0)
    completion_ids = torch.randint(5, 1000, (n, c), generator=g)
    mask = (torch.arange(c) < torch.tensor([[7], [6], [7], [1], [2], [1]])).long()
    prompt_mask = torch.ones_like(prompt_ids)
    rollout = RolloutBatch(
        prompt_ids, prompt_mask, completion_ids, mask, torch.zeros(n, dtype=torch.bool), [""] * n
    )
    ours_model, trl_model = load_tiny(tiny_model_dir), load_tiny(tiny_model_dir)
    policy = Policy(ours_model, temperature, share_prompt=True)
    logp, _ = micro_batch_logprobs(policy, rollout, slice(None), group=3, packed=True)
    logits = trl_model(
        input_ids=torch.cat([prompt_ids, completion_ids], 1), attention_mask=torch.cat([prompt_mask, mask], 1)
    ).logits[:, -c - 1 : -1]
    theirs = selective_log_softmax(logits / temperature, completion_ids)
    old = (theirs.detach() + torch.randn(n, c, generator=g) * 0.3) * mask
    ref = (theirs.detach() + torch.randn(n, c, generator=g) * 0.5) * mask
    adv = torch.randn(n, generator=g)
    loss, _ = grpo_loss(
        logp,
        old,
        ref,
        adv,
        mask,
        LossSpec(loss_type, EPS, EPS_HIGH, c, beta=BETA),
        BatchTotals(n, float(mask.sum())),
    )
    trl, _ = trl_loss(
        theirs, old, ref, adv, mask, loss_type=loss_type, bias_correction_kl=False, accumulation_steps=1,
        num_items=mask.sum(), max_len=c,
    )  # fmt: skip
    assert loss.item() == pytest.approx(trl.item(), rel=1e-5)
    loss.backward()
    trl.backward()
    named = dict(trl_model.named_parameters())
    for name, p in ours_model.named_parameters():
        assert_grads_close(p.grad, named[name].grad, name)


def tiny_moe(arch: str):
    """A tiny random Mixture-of-Experts model (4 experts, 2 a token), its config's own router_aux_loss_coef
    (0.001)."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = {
        "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_experts_per_tok": 2,
        "tie_word_embeddings": False,
    }  # fmt: skip
    torch.manual_seed(0)
    if arch == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4))
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**common, head_dim=8, moe_intermediate_size=16, num_experts=4))


@pytest.mark.parametrize("coef", [None, 0.5])
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_router_aux_loss_matches_trl(arch, coef):
    """router_aux_loss_coef on a tiny random MoE model (None: the architecture's own coefficient): each
    micro-batch's loss under gradient accumulation, and every weight's gradient, equal TRL's `_compute_loss`
    with its own forward (`add_fused_lm_head`, `_get_per_token_logps_and_entropies`): the policy term plus
    coef × the model's load-balancing loss over the real tokens / gradient_accumulation_steps. Prompts
    without left padding, whose positions TRL would count from the pad."""
    from trl.trainer.utils import add_fused_lm_head

    from leangrpo.engines.types import RolloutBatch
    from leangrpo.train.policy import Policy, micro_batch_logprobs, router_aux_loss_coef
    from leangrpo.train.update import Updater

    ours_model = tiny_moe(arch)
    trl_model = copy.deepcopy(ours_model)
    weight = router_aux_loss_coef(ours_model, coef)
    assert weight == (0.001 if coef is None else coef)
    temperature, accumulation = 0.7, 2
    add_fused_lm_head(trl_model, temperature=temperature, outputs=("log_probs", "entropy"))
    policy = Policy(ours_model, temperature, router_aux_coef=weight).train()
    trl_model.train()
    updater = SimpleNamespace(unwrapped=policy, aux_losses=[], cfg=SimpleNamespace(optim=SimpleNamespace(
        gradient_accumulation_steps=accumulation)))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    n, c = 6, 7
    prompt_ids = torch.randint(1, 97, (n, 5), generator=g)
    completion_ids = torch.randint(1, 97, (n, c), generator=g)
    mask = (torch.arange(c) < torch.tensor([[7], [3], [5], [1], [7], [2]])).long()
    prompt_mask = torch.ones_like(prompt_ids)
    old = torch.randn(n, c, generator=g) * 0.1 - 2
    adv = torch.randn(n, generator=g)
    rollout = RolloutBatch(
        prompt_ids, prompt_mask, completion_ids, mask, torch.zeros(n, dtype=torch.bool), [""] * n
    )
    for rows in (slice(0, 3), slice(3, 6)):
        logp, _, entropy = micro_batch_logprobs(policy, rollout, rows, with_entropy=True)
        loss, _ = grpo_loss(
            logp, old[rows], None, adv[rows], mask[rows], LossSpec("dapo", EPS, EPS_HIGH, c, beta=0.0),
            BatchTotals(n, float(mask.sum()), accumulation), entropy=entropy,
        )  # fmt: skip
        loss = Updater._with_router_aux(updater, loss)  # type: ignore[arg-type]
        assert policy.aux_loss is None  # taken by this micro-batch's loss
        ids = (prompt_ids[rows], prompt_mask[rows], completion_ids[rows])
        trl, metrics = trl_loss(
            None, old[rows], None, adv[rows], mask[rows], loss_type="dapo", bias_correction_kl=False,
            accumulation_steps=accumulation, num_items=mask.sum(), max_len=c, beta=0.0, model=trl_model,
            ids=ids, router_aux_loss_coef=weight,
        )  # fmt: skip
        assert len(metrics["aux_loss"]) == 1 and metrics["aux_loss"][0] > 0
        assert updater.aux_losses.pop().item() == pytest.approx(metrics["aux_loss"][0], rel=1e-6)
        assert loss.item() == pytest.approx(trl.item(), rel=1e-5, abs=1e-7)
        loss.backward()
        trl.backward()
    named = dict(trl_model.named_parameters())
    for name, p in ours_model.named_parameters():
        torch.testing.assert_close(p.grad, named[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    with torch.no_grad():  # the reference and old-policy passes route nothing
        micro_batch_logprobs(policy, rollout, slice(0, 3))
    assert policy.aux_loss is None


def test_router_aux_loss_coef_is_trls_and_keeps_each_completions_prompt(tiny_model_dir):
    """TRL's reading of router_aux_loss_coef: a flat config's value is grpo.router_aux_loss_coef; a nonzero
    one for a model that returns no router logits is refused in one line (TRL's ValueError), None and 0 are
    silent. With the loss on, every completion reads its own prompt copy, padded (the tokens TRL routes);
    at 0 the layouts are the run's."""
    from test_models import load_tiny

    from leangrpo.config.schema import GRPOSection
    from leangrpo.config.trl import from_trl
    from leangrpo.core.errors import TrainingError
    from leangrpo.train.policy import padding_free, router_aux_loss_coef, shared_prompt_group

    assert from_trl({"router_aux_loss_coef": 0.5}, "t.yaml")["grpo"]["router_aux_loss_coef"] == 0.5
    llama = load_tiny(tiny_model_dir)
    assert router_aux_loss_coef(llama, None) == router_aux_loss_coef(llama, 0.0) == 0.0
    with pytest.raises(
        TrainingError, match="^grpo.router_aux_loss_coef is 0.5 but LlamaForCausalLM is not a "
    ):
        router_aux_loss_coef(llama, 0.5)
    moe = tiny_moe("qwen3_moe")
    on, off = GRPOSection(num_generations=3), GRPOSection(num_generations=3, router_aux_loss_coef=0.0)
    reason = "the MoE router's load-balancing loss (router_aux_loss_coef) counts each completion's prompt"
    assert shared_prompt_group(moe, 6, on) == (1, reason) and padding_free(moe, on) == (False, reason)
    assert shared_prompt_group(moe, 6, off) == (3, None) and padding_free(moe, off) == (True, None)


@pytest.mark.slow
def test_a_flat_trl_config_trains_a_tiny_moe_with_its_router_aux_loss(tmp_path, real_tokenizer_dir):
    """`leangrpo train -c` on a flat TRL config and a tiny random Qwen3-MoE: one step at the architecture's
    coefficient (0.5 here) and one at router_aux_loss_coef 0: the first's loss is higher (the load-balancing
    term is positive), and only its start-up lines say that each completion reads its own prompt copy."""
    import json

    import yaml
    from click.testing import CliRunner
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from leangrpo.cli import main

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, moe_intermediate_size=16, head_dim=8,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_experts=4,
        num_experts_per_tok=2, router_aux_loss_coef=0.5, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    ))  # fmt: skip
    model.save_pretrained(tmp_path / "moe")
    tok.save_pretrained(tmp_path / "moe")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(4)))
    losses = {}
    for name, coef in (("own", None), ("off", 0.0)):
        flat = {
            "model_name_or_path": str(tmp_path / "moe"), "dataset_name": str(data), "max_steps": 1,
            "reward_funcs": ["toy_rewards.vowel_share"], "gradient_checkpointing": False,
            "num_generations": 4, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 2,
            "max_completion_length": 6, "logging_steps": 1, "output_dir": str(tmp_path / name),
            "report_to": "none", "disable_tqdm": True, "save_strategy": "no", "router_aux_loss_coef": coef,
        }  # fmt: skip
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(flat))
        result = CliRunner().invoke(main, ["train", "-c", str(tmp_path / f"{name}.yaml")])
        assert result.exit_code == 0, result.output
        assert ("grpo.share_prompt: off, the MoE router's" in result.output) == (coef is None)
        [row] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = row["loss"]
        assert ("aux_loss" in row) == (coef is None)  # TRL's metric, with the loss
    assert losses["own"] > losses["off"]
