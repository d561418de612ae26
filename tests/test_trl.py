"""Where leangrpo uses a TRL 1.16 name, it computes TRL's numbers: checked against TRL's own code.

`trl_loss` runs `GRPOTrainer._compute_loss` itself (the loss, its normalisation under gradient
accumulation, and the kl / clip_ratio metrics) on given log-probs, with every TRL feature that leangrpo
does not have switched off. TRL is a test dependency (the `dev` extra); importing it takes seconds, so
the TRL comparisons live in this one module.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from leangrpo.grpo import grpo_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

EPS, EPS_HIGH, BETA = 0.2, 0.28, 0.04


def trl_loss(
    logp, old, ref, adv, mask, *, loss_type, bias_correction_kl, accumulation_steps, num_items, max_len
):
    """TRL 1.16's `_compute_loss` on one micro-batch of one process: (loss, TRL's metrics dict)."""
    metrics = defaultdict(list)
    fake = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=BETA,
        args=SimpleNamespace(
            use_bias_correction_kl=bias_correction_kl, delta=None, steps_per_generation=accumulation_steps
        ),
        loss_type=loss_type,
        epsilon_low=EPS,
        epsilon_high=EPS_HIGH,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=accumulation_steps,
        max_completion_length=max_len,
        accelerator=SimpleNamespace(num_processes=1, reduce=lambda t, reduction: t, gather=lambda t: t),
        _entropy_bonus_enabled=False,
        aux_loss_enabled=False,
        _metrics={"train": metrics},
    )
    n, c = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(n, 0, dtype=torch.long),
        "completion_ids": torch.zeros(n, c, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "ref_per_token_logps": ref,
        "num_items_in_batch": torch.tensor(float(num_items)),
    }
    return trl_grpo.GRPOTrainer._compute_loss(fake, None, inputs), metrics


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
            loss_type=loss_type, epsilon=EPS, epsilon_high=EPS_HIGH, beta=BETA, num_sequences=n,
            num_tokens=float(mask.sum()), max_completion_length=c, accumulation_steps=2,
            bias_correction_kl=bias_correction_kl,
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


def test_bias_correction_changes_the_kl_gradient_even_on_policy():
    """On-policy the ratio is 1, so the loss is the same; its gradient adds beta · KL per token."""
    base, _, ref, adv, mask = _batch(1)
    grads, losses = [], []
    for flag in (False, True):
        logp = base.clone().requires_grad_()
        loss, _ = grpo_loss(
            logp, logp.detach(), ref, adv, mask, loss_type="dapo", epsilon=EPS, epsilon_high=EPS_HIGH,
            beta=BETA, num_sequences=6, num_tokens=float(mask.sum()), max_completion_length=7,
            bias_correction_kl=flag,
        )  # fmt: skip
        loss.backward()
        grads.append(logp.grad)
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)
    kl = torch.exp(ref - base) - (ref - base) - 1
    torch.testing.assert_close(grads[1] - grads[0], BETA * kl * mask / mask.sum(), atol=1e-12, rtol=0)
