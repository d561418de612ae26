"""Reward lookup by name: built-ins by short name, user functions by ``package.module:function``."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from leangrpo.errors import UserError
from leangrpo.rewards.builtin import (
    correctness_reward,
    int_reward,
    math_verify_reward,
    soft_format_reward,
    strict_format_reward,
    xmlcount_reward,
)

if TYPE_CHECKING:
    from leangrpo.config import RewardSpec
    from leangrpo.tasks import Task

RewardFunc = Callable[..., list[Any]]
"""TRL reward signature: ``f(prompts, completions, **columns) -> list[float | None]``."""


class RewardError(UserError, ValueError):
    """A reward could not be loaded, or a reward function misbehaved while scoring."""


BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "xmlcount": xmlcount_reward,
    "soft_format": soft_format_reward,
    "strict_format": strict_format_reward,
    "int": int_reward,
    "correctness": correctness_reward,
    "math_verify": math_verify_reward,
}


def load_reward(name: str, task_rewards: dict[str, RewardFunc] | None = None) -> RewardFunc:
    """Resolve a reward by name: one of the task's own, a built-in (``correctness`` or
    ``correctness_reward``), or an import path ``package.module:function``."""
    name = name.strip()
    if ":" in name:
        return _import_reward(name)
    known = {**BUILTIN_REWARDS, **(task_rewards or {})}
    func = known.get(name.removesuffix("_reward"))
    if func is None:
        raise RewardError(
            f"unknown reward {name!r}; known rewards are {', '.join(sorted(known))} "
            "(or give a user function as 'package.module:function')"
        )
    return func


def load_rewards(specs: list[RewardSpec], task: Task) -> list[tuple[str, RewardFunc, float]]:
    """The configured rewards as (name, function, weight)."""
    return [(s.name, load_reward(s.name, task.rewards()), s.weight) for s in specs]


def _import_reward(path: str) -> RewardFunc:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr or ":" in attr:
        raise RewardError(f"invalid reward import path {path!r}; expected 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardError(
            f"cannot import module {module_name!r} for reward {path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        func = getattr(module, attr)
    except AttributeError as exc:
        raise RewardError(f"module {module_name!r} has no attribute {attr!r} (reward {path!r})") from exc
    if not callable(func):
        raise RewardError(f"reward {path!r} is not callable (it is a {type(func).__name__})")
    return func
