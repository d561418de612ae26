"""OpenEnv (and Gymnasium-style) environments as TRL's `environment_factory`: each rollout gets one
environment, reset for its row, whose `step(action)` is the model's one tool; the rewards of its steps add
up to its `get_reward()`.

Duck-typed on the documented interfaces, so nothing is imported here: OpenEnv's `reset()` and `step(action)`
return a result with `observation`, `reward` and `done` (`pip install 'leangrpo[openenv]'`); Gymnasium's
return `(observation, info)` and `(observation, reward, terminated, truncated, info)`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class OpenEnvironment:
    """One rollout's environment: `reset(**row)` starts an episode (its observation is appended to the
    prompt), `step(action)` is the tool, `get_reward()` the sum of the episode's step rewards. `to_action`
    makes the environment's action from the model's text (OpenEnv's action dataclass); `to_text` shows an
    observation to the model; `reset_kwargs` picks reset's arguments from the row (e.g. a seed: every
    rollout of a row must start from the same observation)."""

    def __init__(
        self,
        env: Any,
        to_action: Callable[[str], Any] = str,
        to_text: Callable[[Any], str] = str,
        reset_kwargs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        self._env, self._to_action, self._to_text, self._reset_kwargs = env, to_action, to_text, reset_kwargs
        self._reward, self._done = 0.0, False

    def reset(self, **row: Any) -> str:
        result = self._env.reset(**(self._reset_kwargs(row) if self._reset_kwargs else {}))
        self._reward, self._done = 0.0, False
        observation = result[0] if isinstance(result, tuple) else getattr(result, "observation", result)
        return self._to_text(observation)

    def step(self, action: str) -> str:
        """Take one action in the environment and see what follows.

        Args:
            action: the action to take
        """
        if self._done:
            raise ValueError("the episode is over; answer now")
        result = self._env.step(self._to_action(action))
        if isinstance(result, tuple):  # Gymnasium: terminated and truncated; gym before 0.26: done
            observation, reward, *ends, _ = result
            done = any(ends)
        else:
            observation, reward, done = result.observation, result.reward, result.done
        self._reward += float(reward or 0.0)
        self._done = bool(done)
        return self._to_text(observation)

    def get_reward(self) -> float:
        return self._reward


def openenv_factory(
    make_env: Callable[[], Any],
    to_action: Callable[[str], Any] = str,
    to_text: Callable[[Any], str] = str,
    reset_kwargs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Callable[[], OpenEnvironment]:
    """An `environment_factory` (for `AgentSpec`, or named by `tools.environment`) that wraps a new
    environment from `make_env` for each rollout (see OpenEnvironment for the rest)."""
    return lambda: OpenEnvironment(make_env(), to_action, to_text, reset_kwargs)
