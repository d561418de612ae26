"""Agents, as TRL's GRPOTrainer takes them: an `AgentSpec` holds a run's tools, environment factories or
rollout_func; each step it hands out `Episodes`, a toolbox per rollout and, with environments, an instance
per rollout, reset for its row, whose public methods are its tools (engines/tools.py runs the calls)."""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from leangrpo.config.schema import ToolsConfig
from leangrpo.data.rewards.registry import import_object
from leangrpo.engines.tools import Toolbox, ToolError

EnvironmentFactory = Callable[[], Any]
RolloutFunc = Callable[[list[Any], Any], dict[str, Any]]


class AgentSpec:
    """What makes rollouts multi-turn, as TRL's GRPOTrainer takes it: `tools` for every rollout, an
    `environment_factory` (a callable, or a dict of them picked by each row's `environment` column; one
    instance per rollout, whose public methods are its tools), or a `rollout_func(prompts, trainer)` that
    generates by itself. Instances are pooled across steps and reset for each rollout, as TRL does."""

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]] = (),
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
        rollout_func: RolloutFunc | None = None,
        timeout_s: float | None = 30.0,
    ):
        self.tools, self.rollout_func, self.timeout_s = list(tools), rollout_func, timeout_s
        for tool in self.tools:
            if not callable(tool):
                raise ToolError(f"tool {tool!r:.60} is not callable")
        self.multi_environment = isinstance(environment_factory, dict)
        self.factories: dict[str | None, EnvironmentFactory] | None = (
            None
            if environment_factory is None
            else dict(environment_factory.items())
            if isinstance(environment_factory, dict)
            else {None: environment_factory}
        )
        self.pool: dict[str | None, list[Any]] = {}
        for name, factory in (self.factories or {}).items():
            instance = _instance(name, factory)
            if not callable(getattr(instance, "reset", None)):
                raise ToolError(f"environment {type(instance).__name__}: defines no reset method")
            self.pool[name] = [instance]
        # a tool without a JSON schema stops the run here, before the model loads
        for tools in [self.tools, *(environment_tools(pool[0]) for pool in self.pool.values())]:
            _ = Toolbox(tools).schemas

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools or self.factories)

    def schemas(self, row: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The tool schemas a row's rollouts are shown (the run's tools and its environment's), as
        `start` gives them; None without tools."""
        if not self.uses_tools:
            return None
        name = row.get("environment") if self.factories is not None and self.multi_environment else None
        pool = self.pool.get(name) if self.factories is not None else None
        return Toolbox(self.tools + (environment_tools(pool[0]) if pool else [])).schemas

    def environment_rewards(self) -> list[tuple[str, Callable[..., Any], float]]:
        """Each environment class's `get_reward` as a reward named after the class, weight 1, as TRL adds
        it: a rollout is scored by its own environment when that is of exactly this class, else None."""
        classes = dict.fromkeys(type(pool[0]) for pool in self.pool.values())
        return [
            (cls.__name__, _environment_reward(cls), 1.0)
            for cls in classes
            if callable(getattr(cls, "get_reward", None))
        ]

    def start(self, rows: list[dict[str, Any]], group: int) -> Episodes:
        """One environment instance (if any) and toolbox per rollout, `group` rollouts per row, each reset
        with its row's columns; the prompts with what reset returned appended to the last user message (an
        environment whose reset text differs from rollout to rollout gives each rollout its own, as TRL)."""
        prompts = [row.get("prompt", [{"role": "user", "content": ""}]) for row in rows]
        if self.factories is None:
            box = Toolbox(self.tools, self.timeout_s)
            return Episodes(prompts, [box] * (len(rows) * group), None)
        names = [row.get("environment") if self.multi_environment else None for row in rows]
        unknown = sorted({str(n) for n in names if n not in self.factories})
        if unknown:
            raise ToolError(f"rows name environments {unknown}; known: {sorted(map(str, self.factories))}")
        handed: Counter[str | None] = Counter()
        environments, toolboxes, rollout_prompts = [], [], []
        for index, (row, name) in enumerate(zip(rows, names, strict=True)):
            columns = {k: v for k, v in row.items() if k != "environment"} if self.multi_environment else row
            observations = []
            for _ in range(group):
                pool = self.pool[name]
                if handed[name] == len(pool):
                    pool.append(_instance(name, self.factories[name]))
                environment = pool[handed[name]]
                handed[name] += 1
                try:
                    observations.append(environment.reset(**columns))
                except Exception as e:
                    raise ToolError(
                        f"environment {type(environment).__name__}.reset failed on row {index} "
                        f"({str(prompts[index])[:80]!r}): {type(e).__name__}: {e}"
                    ) from None
                environments.append(environment)
                toolboxes.append(Toolbox(self.tools + environment_tools(environment), self.timeout_s))
            rollout_prompts += [
                prompts[index] if o is None else with_observation(prompts[index], o) for o in observations
            ]
            prompts[index] = rollout_prompts[-group]
        varied = any(p != rollout_prompts[i - i % group] for i, p in enumerate(rollout_prompts))
        return Episodes(prompts, toolboxes, environments, rollout_prompts if varied else None)


@dataclass
class Episodes:
    """A step's rollouts with tools: each row's prompt (after its environment's reset: its first rollout's),
    each rollout's toolbox and environment instance (None without environments), and each rollout's own
    prompt where some row's rollouts got different reset texts (None when each row's share one)."""

    prompts: list[Any]
    toolboxes: list[Toolbox]
    environments: list[Any] | None
    rollout_prompts: list[Any] | None = None


def environment_tools(environment: Any) -> list[Callable[..., Any]]:
    """An environment's public methods other than reset and get_reward: its tools (TRL's rule)."""
    return [
        getattr(environment, name)
        for name, _ in inspect.getmembers(type(environment), predicate=inspect.isfunction)
        if name not in ("reset", "get_reward") and not name.startswith("_")
    ]


def with_observation(prompt: Any, observation: str) -> Any:
    """`prompt` with the environment's reset text appended to its last message (or to a text prompt)."""
    if isinstance(prompt, str):
        return prompt + observation
    return [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + observation}]


def _environment_reward(cls: type[Any]) -> Callable[..., Any]:
    """A reward function calling `get_reward` (sync or async) on the environments of class `cls`."""
    if inspect.iscoroutinefunction(getattr(cls, "get_reward", None)):

        async def reward_async(environments: list[Any], **_: Any) -> list[float | None]:
            return [await e.get_reward() if type(e) is cls else None for e in environments]

        return reward_async

    def reward(environments: list[Any], **_: Any) -> list[float | None]:
        return [e.get_reward() if type(e) is cls else None for e in environments]

    return reward


def _instance(name: str | None, factory: EnvironmentFactory) -> Any:
    try:
        return factory()
    except Exception as e:
        label = "environment_factory" if name is None else f"environment {name!r}"
        raise ToolError(f"{label} failed to make an instance: {type(e).__name__}: {e}") from None


def agent_from_config(cfg: ToolsConfig) -> AgentSpec | None:
    """The `tools:` section's tools and environment, imported like rewards; None when it names none."""
    if not cfg.enabled:
        return None
    tools = [import_object(path, "tool") for path in cfg.functions]
    for path, tool in zip(cfg.functions, tools, strict=True):
        if not callable(tool):
            raise ToolError(f"tool {path!r} is not callable (it is a {type(tool).__name__})")
    env = cfg.environment
    factories = (
        None
        if env is None
        else import_object(env, "environment")
        if isinstance(env, str)
        else {name: import_object(path, "environment") for name, path in env.items()}
    )
    return AgentSpec(tools, factories, timeout_s=cfg.timeout_s)
