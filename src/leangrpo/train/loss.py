"""The loss a run's config asks for, as core's `LossSpec`: its grpo section, read in one place."""

from __future__ import annotations

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
    )
