"""Reward functions (TRL signature), their registry, and safe batch scoring.

Importing this package is cheap: torch and math-verify are only imported when first used.
"""

from leangrpo.data.rewards.builtin import (
    RewardError,
    RewardFunc,
    answers_match,
    completion_text,
    correctness_reward,
    extract_xml_answer,
    int_reward,
    math_verify_reward,
    predicted_answer,
    soft_format_reward,
    strict_format_reward,
    xmlcount_reward,
)
from leangrpo.data.rewards.registry import BUILTIN_REWARDS, load_reward, load_rewards
from leangrpo.data.rewards.scoring import (
    RewardContext,
    RewardsAbandoned,
    RewardScores,
    TrainerState,
    reward_inputs,
    score_completions,
)

__all__ = [
    "BUILTIN_REWARDS",
    "RewardError",
    "RewardContext",
    "RewardFunc",
    "RewardScores",
    "RewardsAbandoned",
    "TrainerState",
    "reward_inputs",
    "answers_match",
    "completion_text",
    "correctness_reward",
    "extract_xml_answer",
    "int_reward",
    "load_reward",
    "load_rewards",
    "math_verify_reward",
    "predicted_answer",
    "score_completions",
    "soft_format_reward",
    "strict_format_reward",
    "xmlcount_reward",
]
