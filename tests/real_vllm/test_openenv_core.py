"""The OpenEnv adapter with the real openenv-core: a guessing game written as an openenv `Environment`
(pydantic action and observation) plays through `openenv_factory` in-process, and over the network as
TRL's docs use OpenEnv: served by openenv's own app under uvicorn and reached with openenv's own
(async) client. It lives here because openenv-core's server stack (fastapi, uvicorn, websockets) is
installed in the second environment beside vLLM; it uses no vLLM and no model."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn
from openenv.core import EnvClient, Environment, create_fastapi_app
from openenv.core.client_types import StepResult
from openenv.core.env_server.types import Action, Observation, State

from leangrpo.engines.agents import AgentSpec
from leangrpo.engines.openenv import openenv_factory
from leangrpo.engines.tools import run_tool_calls


class GuessAction(Action):
    guess: int


class GuessObservation(Observation):
    message: str = ""


class GuessEnvironment(Environment[GuessAction, GuessObservation, State]):
    """Guess a digit: -0.1 per wrong guess, 1 for the right one, which ends the episode."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        super().__init__()
        self.secret, self._state = 0, State()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **_: Any) -> GuessObservation:
        self.secret, self._state = (seed or 0) % 10, State(episode_id=episode_id)
        return GuessObservation(message="Guess a digit.")

    def step(self, action: GuessAction, timeout_s: float | None = None, **_: Any) -> GuessObservation:
        self._state.step_count += 1
        right = action.guess == self.secret
        reward = 1.0 if right else -0.1
        return GuessObservation(message="right" if right else "wrong", reward=reward, done=right)

    @property
    def state(self) -> State:
        return self._state


class GuessClient(EnvClient[GuessAction, GuessObservation, State]):
    """The game's client, written as OpenEnv's environments write theirs."""

    def _step_payload(self, action: GuessAction) -> dict[str, Any]:
        return action.model_dump()

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[GuessObservation]:
        reward, done = payload.get("reward"), payload.get("done", False)
        return StepResult(GuessObservation(**payload["observation"], reward=reward, done=done), reward, done)

    def _parse_state(self, payload: dict[str, Any]) -> State:
        return State(**payload)


def guess(text: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "step", "arguments": {"action": text}}}


def play(make_env: Callable[[], Any]) -> AgentSpec:
    """Two rows (secrets 3 and 7), two rollouts each: the step rewards add up to each rollout's reward,
    a step after the end and a bad action are failed calls. Returns the agent (its pool holds the
    environments)."""
    factory = openenv_factory(
        make_env,
        lambda text: GuessAction(guess=int(text)),
        lambda observation: observation.message,
        reset_kwargs=lambda row: {"seed": row["seed"]},
    )
    agent = AgentSpec(environment_factory=factory)
    episodes = agent.start([{"prompt": "Play. ", "seed": 3}, {"prompt": "Go. ", "seed": 7}], group=2)
    assert episodes.prompts == ["Play. Guess a digit.", "Go. Guess a digit."]
    boxes = episodes.toolboxes
    calls = [(0, "1"), (0, "3"), (0, "3"), (1, "3"), (2, "x"), (3, "7")]
    results = run_tool_calls([(boxes[i], guess(text)) for i, text in calls])
    assert [r[1:] for r in results[:4]] + [results[5][1:]] == [
        ("wrong", False),
        ("right", False),
        (results[2][1], True),
        ("right", False),
        ("right", False),
    ]
    assert "episode is over" in results[2][1] and results[4][2]  # after the end; a bad action
    [(name, reward, _)] = agent.environment_rewards()
    assert name == "OpenEnvironment"
    assert reward(environments=episodes.environments) == pytest.approx([0.9, 1.0, 0.0, 1.0])
    return agent


def test_a_server_side_openenv_environment_plays_in_process():
    """An `Environment` itself: its reset and step return the observation, with reward and done on it."""
    play(GuessEnvironment)


@pytest.fixture
def server_url() -> Iterator[str]:
    """GuessEnvironment served by openenv's own app (a session per connection) under uvicorn, in a
    thread, on a free localhost port; shut down at the end."""
    app = create_fastapi_app(GuessEnvironment, GuessAction, GuessObservation, max_concurrent_envs=8)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the openenv server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()
    assert not thread.is_alive(), "the openenv server did not stop"


@pytest.mark.parametrize("sync", [False, True], ids=["async", "sync"])
def test_an_openenv_client_plays_over_the_server(server_url, sync):
    """openenv's async client, made as TRL's docs make it (`Client(base_url=...)`), or its `.sync()`
    wrapper: each rollout its own session on the server."""

    def connect() -> Any:
        client = GuessClient(base_url=server_url)
        return client.sync() if sync else client

    agent = play(connect)
    for environment in agent.pool[None]:
        environment.env.close()
