"""The OpenEnv adapter on small local environments written to OpenEnv's client interface and Gymnasium's
(the openenv-core package itself is not needed; tests/real_vllm/test_openenv_core.py runs it with the real
package's Environment, server and client)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from leangrpo.engines.agents import AgentSpec
from leangrpo.engines.openenv import openenv_factory
from leangrpo.engines.tools import run_tool_calls


@dataclass
class GuessAction:
    guess: int


@dataclass
class StepResult:  # OpenEnv's client returns it: observation, reward, done
    observation: str
    reward: float | None
    done: bool


class GuessEnv:
    """OpenEnv-style: guess a number; -0.1 per wrong guess, 1 for the right one, which ends the episode."""

    def reset(self, seed: int = 0) -> StepResult:
        self.secret = seed % 10
        return StepResult("Guess a digit.", None, False)

    def step(self, action: GuessAction) -> StepResult:
        right = action.guess == self.secret
        return StepResult("right" if right else "wrong", 1.0 if right else -0.1, right)


class GymGuessEnv(GuessEnv):
    """The same game with Gymnasium's tuples."""

    def reset(self, seed: int = 0):
        return super().reset(seed).observation, {}

    def step(self, action: GuessAction):
        r = super().step(action)
        return r.observation, r.reward, r.done, False, {}


def guess(text: str) -> dict:
    return {"type": "function", "function": {"name": "step", "arguments": {"action": text}}}


@pytest.mark.parametrize("env", [GuessEnv, GymGuessEnv])
def test_an_openenv_environment_serves_as_environment_factory(env):
    """Each rollout gets its own environment, reset from its row; `step` is the tool (with a schema), the
    step rewards add up to the environment's reward, and a step after the end is a failed call."""
    factory = openenv_factory(
        env, lambda text: GuessAction(int(text)), reset_kwargs=lambda row: {"seed": row["seed"]}
    )
    agent = AgentSpec(environment_factory=factory)
    rows = [{"prompt": [{"role": "user", "content": "Play. "}], "seed": 3}, {"prompt": "Go. ", "seed": 7}]
    episodes = agent.start(rows, group=2)
    assert episodes.prompts[1] == "Go. Guess a digit."
    assert [s["function"]["name"] for s in episodes.toolboxes[0].schemas] == ["step"]
    boxes = episodes.toolboxes
    results = run_tool_calls([(boxes[0], guess("1")), (boxes[0], guess("3")), (boxes[0], guess("3")),
                              (boxes[1], guess("3")), (boxes[2], guess("x"))])  # fmt: skip
    assert [r[1:] for r in results[:4]] == [
        ("wrong", False),
        ("right", False),
        (results[2][1], True),
        ("right", False),
    ]
    assert "episode is over" in results[2][1] and results[4][2]  # after the end; a bad action
    [(name, reward, weight)] = agent.environment_rewards()
    assert (name, weight) == ("OpenEnvironment", 1.0)
    assert reward(environments=episodes.environments) == pytest.approx([0.9, 1.0, 0.0, 0.0])
