"""Reward lookup by name: built-ins by short name, user functions by ``package.module:function`` (a
factory when given ``kwargs``), and reward models by hub id or local directory."""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from leangrpo.data.rewards.builtin import (
    RewardError,
    RewardFunc,
    correctness_reward,
    int_reward,
    math_verify_reward,
    soft_format_reward,
    soft_overlong_punishment,
    strict_format_reward,
    xmlcount_reward,
)

if TYPE_CHECKING:
    from leangrpo.config.schema import RewardSpec

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class RewardSource(Protocol):
    """What offers rewards of its own by name (a task)."""

    def rewards(self) -> dict[str, RewardFunc]: ...


BUILTIN_REWARDS: dict[str, RewardFunc] = {
    "xmlcount": xmlcount_reward,
    "soft_format": soft_format_reward,
    "strict_format": strict_format_reward,
    "int": int_reward,
    "correctness": correctness_reward,
    "math_verify": math_verify_reward,
}
# Built-in factories: configured by the spec's `kwargs`, which they require.
BUILTIN_FACTORIES: dict[str, Callable[..., RewardFunc]] = {
    "soft_overlong_punishment": soft_overlong_punishment,
}


def load_reward(
    name: str, task_rewards: dict[str, RewardFunc] | None = None, kwargs: dict[str, Any] | None = None
) -> RewardFunc:
    """Resolve a reward by name: one of the task's own, a built-in (``correctness`` or
    ``correctness_reward``), an import path ``package.module:function``, or a reward model (a local
    directory or an ``owner/name`` hub id). With ``kwargs`` the named object is a factory, called with
    them (TRL's ``get_soft_overlong_punishment``); for a reward model they go to ``from_pretrained``."""
    name = name.strip()
    if ":" in name:
        func = _import_reward(name)
    elif Path(name).expanduser().is_dir() or _HUB_ID.match(name):
        from leangrpo.data.rewards.model import RewardModel

        return RewardModel(
            str(Path(name).expanduser()) if Path(name).expanduser().is_dir() else name, **(kwargs or {})
        )
    elif name in BUILTIN_FACTORIES:
        if kwargs is None:
            raise RewardError(
                f"reward {name!r} needs kwargs, e.g. {{max_completion_len: 512, soft_punish_cache: 128}}"
            )
        return _from_factory(name, BUILTIN_FACTORIES[name], kwargs)
    else:
        known = {**BUILTIN_REWARDS, **(task_rewards or {})}
        if name.removesuffix("_reward") not in known:
            names = ", ".join(sorted({**known, **BUILTIN_FACTORIES}))
            raise RewardError(
                f"unknown reward {name!r}; known rewards are {names} "
                "(or give a user function as 'package.module:function', or a reward model's path or hub id)"
            )
        func = known[name.removesuffix("_reward")]
    return func if kwargs is None else _from_factory(name, func, kwargs)


def _from_factory(name: str, factory: Callable[..., Any], kwargs: dict[str, Any]) -> RewardFunc:
    """The reward function a factory makes from ``kwargs``; a failing call is a one-line RewardError."""
    try:
        func = factory(**kwargs)
    except Exception as exc:
        raise RewardError(
            f"reward {name!r} called with kwargs {kwargs}: {type(exc).__name__}: {exc}"
        ) from exc
    if not callable(func):
        raise RewardError(
            f"reward {name!r} called with kwargs returned a {type(func).__name__}, not a reward function"
        )
    return func


def load_rewards(
    specs: list[RewardSpec], task: RewardSource, given: Mapping[str, RewardFunc] | None = None
) -> list[tuple[str, RewardFunc, float]]:
    """The configured rewards as (metric name, function, weight). ``given``: functions handed over in
    memory (the Python API's callables), by the name their spec carries. The metric name is TRL's: the
    function's ``__name__``, or a reward model's basename."""
    given = given or {}
    loaded = [
        (s, given[s.name] if s.name in given else load_reward(s.name, task.rewards(), s.kwargs))
        for s in specs
    ]
    return [(reward_name(s.name, func), func, s.weight) for s, func in loaded]


def reward_name(spec_name: str, func: RewardFunc) -> str:
    """What TRL logs a reward as (`rewards/<name>/mean`): a function's ``__name__``, a reward model's last
    path part; the spec's own name for an object without either (a ``functools.partial``)."""
    from leangrpo.data.rewards.model import RewardModel

    if isinstance(func, RewardModel):
        return func.__name__.rstrip("/").split("/")[-1]
    return str(getattr(func, "__name__", spec_name))


def _import_reward(path: str) -> RewardFunc:
    func = import_object(path, "reward")
    if not callable(func):
        raise RewardError(f"reward {path!r} is not callable (it is a {type(func).__name__})")
    return func


def import_object(path: str, what: str) -> Any:
    """The object user code names as ``package.module:object`` (a reward, a tool, an environment); every
    import of user code by name goes through here. A bad path is a one-line RewardError naming `what`."""
    module_name, _, attr = path.strip().partition(":")
    if not module_name or not attr or ":" in attr:
        raise RewardError(f"invalid {what} import path {path!r}; expected 'package.module:object'")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RewardError(
            f"cannot import module {module_name!r} for {what} {path!r}: {type(exc).__name__}: {exc}"
        ) from exc
    try:
        return getattr(module, attr)
    except AttributeError as exc:
        raise RewardError(f"module {module_name!r} has no attribute {attr!r} ({what} {path!r})") from exc
