"""The loss a run's config asks for, as core's `LossSpec`: its grpo section, read in one place; and the
entropy bonus's coefficient, which adaptive entropy control moves from step to step."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from leangrpo.config.schema import GRPOSection
from leangrpo.core.grpo import LossSpec


def loss_spec(g: GRPOSection) -> LossSpec:
    """The grpo section's loss: TRL's loss_type and the constants it uses (epsilon_high defaults to
    epsilon)."""
    return LossSpec(
        loss_type=g.loss_type,
        epsilon=g.epsilon,
        epsilon_high=g.epsilon_high or g.epsilon,
        max_completion_length=g.max_completion_length,
        beta=g.beta,
        importance_sampling_level=g.importance_sampling_level,
        delta=g.delta,
        bias_correction_kl=g.use_bias_correction_kl,
        top_entropy_quantile=g.top_entropy_quantile,
        sapo_temperatures=(g.sapo_temperature_pos, g.sapo_temperature_neg),
        vespo_shape=(g.vespo_k_pos, g.vespo_lambda_pos, g.vespo_k_neg, g.vespo_lambda_neg),
        off_policy_mask_threshold=g.off_policy_mask_threshold,
        entropy_bonus=g.entropy_coef != 0.0 or g.use_adaptive_entropy,
    )


@dataclass
class EntropyControl:
    """The entropy bonus's coefficient (TRL's `entropy_coef`): constant, or with `use_adaptive_entropy`
    Skywork-OR1's control, which TRL 1.16 runs after each optimizer step: up by `entropy_coef_delta` when
    that step's entropy was at or below `entropy_target`, else down, within [min, max]; the bonus applies
    only while the last step's entropy was at or below the target (none before the first step)."""

    g: GRPOSection
    coef: float
    last_entropy: float = math.inf

    @classmethod
    def of(cls, g: GRPOSection, state: dict[str, Any]) -> EntropyControl:
        """The control of a run, where a resumed run's checkpoint `state` left it."""
        saved = state.get("entropy_control") or {}
        last = saved.get("last_entropy")
        return cls(g, saved.get("coef", g.entropy_coef), math.inf if last is None else last)

    def applied(self) -> float:
        """The coefficient every micro-batch of the next optimizer step uses."""
        if self.g.use_adaptive_entropy and not self.last_entropy <= self.g.entropy_target:
            return 0.0
        return self.coef

    def observe(self, entropy: float) -> None:
        """After an optimizer step: its mean token entropy over every process moves the coefficient."""
        g = self.g
        if not g.use_adaptive_entropy:
            return
        if entropy <= g.entropy_target:
            self.coef = min(self.coef + g.entropy_coef_delta, g.entropy_coef_max)
        else:
            self.coef = max(self.coef - g.entropy_coef_delta, g.entropy_coef_min)
        self.last_entropy = entropy

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (JSON: an infinite entropy is None)."""
        last = None if math.isinf(self.last_entropy) else self.last_entropy
        return {"coef": self.coef, "last_entropy": last}
