"""OpenEnv (and Gymnasium-style) environments as TRL's `environment_factory`: each rollout gets one
environment, reset for its row, whose `step(action)` is the model's one tool; the rewards of its steps add
up to its `get_reward()`.

Duck-typed on the documented interfaces, so nothing is imported here (`pip install 'leangrpo[openenv]'`
for openenv-core). OpenEnv's client (`EnvClient`) returns a `StepResult` with `observation`, `reward` and
`done`; it is async, so it is used through its `sync()` wrapper. OpenEnv's server-side `Environment`,
used in-process, returns the `Observation` itself, with `reward` and `done` on it. Gymnasium's return
`(observation, info)` and `(observation, reward, terminated, truncated, info)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any


class OpenEnvironment:
    """One rollout's environment: `reset(**row)` starts an episode (its observation is appended to the
    prompt), `step(action)` is the tool, `get_reward()` the sum of the episode's step rewards. `to_action`
    makes the environment's action from the model's text (OpenEnv's action model); `to_text` shows an
    observation to the model; `reset_kwargs` picks reset's arguments from the row (e.g. a seed, so that
    every rollout of a row starts from the same observation; without one each starts from its own).
    `env` is the environment (an async client's sync wrapper), e.g. to close it."""

    def __init__(
        self,
        env: Any,
        to_action: Callable[[str], Any] = str,
        to_text: Callable[[Any], str] = str,
        reset_kwargs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ):
        # OpenEnv's EnvClient is async; its sync() runs it on an event loop of its own, as tools run sync
        self.env = env.sync() if inspect.iscoroutinefunction(getattr(env, "step", None)) else env
        self._to_action, self._to_text, self._reset_kwargs = to_action, to_text, reset_kwargs
        self._reward, self._done = 0.0, False

    def reset(self, **row: Any) -> str:
        result = self.env.reset(**(self._reset_kwargs(row) if self._reset_kwargs else {}))
        self._reward, self._done = 0.0, False
        return self._to_text(result[0] if isinstance(result, tuple) else _observation(result))

    def step(self, action: str) -> str:
        """Take one action in the environment and see what follows.

        Args:
            action: the action to take
        """
        if self._done:
            raise ValueError("the episode is over; answer now")
        result = self.env.step(self._to_action(action))
        if isinstance(result, tuple):  # Gymnasium: terminated and truncated; gym before 0.26: done
            observation, reward, *ends, _ = result
            done = any(ends)
        else:
            observation, reward, done = _observation(result), result.reward, result.done
        self._reward += float(reward or 0.0)
        self._done = bool(done)
        return self._to_text(observation)

    def get_reward(self) -> float:
        return self._reward


def _observation(result: Any) -> Any:
    """A client's StepResult holds the observation; a server-side Environment returns it bare."""
    return getattr(result, "observation", result)


def openenv_factory(
    make_env: Callable[[], Any],
    to_action: Callable[[str], Any] = str,
    to_text: Callable[[Any], str] = str,
    reset_kwargs: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> Callable[[], OpenEnvironment]:
    """An `environment_factory` (for `AgentSpec`, or named by `tools.environment`) that wraps a new
    environment from `make_env` for each rollout (see OpenEnvironment for the rest)."""
    return lambda: OpenEnvironment(make_env(), to_action, to_text, reset_kwargs)
