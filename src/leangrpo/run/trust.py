"""The trust boundary. What a run directory, checkpoint or export holds is data: its config, its
`leangrpo_export.json`, its files. Code such a config names (an import-path reward or task, a reward
model, a tool or environment, the model's own code) is run only when the user names it in their own config
or on the command line, or passes `--trust-run-code`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from leangrpo.config.schema import Config
from leangrpo.core.errors import UserError
from leangrpo.data.rewards.registry import foreign_rewards
from leangrpo.run.rundir import is_run_dir

TRUST_FLAG = "--trust-run-code"


class UntrustedCodeError(UserError, RuntimeError):
    """A run's config names code the user has not allowed to run."""


def is_run_owned(path: str | Path) -> bool:
    """True for a run directory or checkpoint, and for the config.yaml inside one: a config the user got
    with a run, not one they wrote."""
    path = Path(path)
    return is_run_dir(path) or (path.name == "config.yaml" and is_run_dir(path.parent))


def code_named(cfg: Config, overrides: Sequence[str] = ()) -> list[str]:
    """What `cfg` would have leangrpo import or run beyond its own code, leaving out what the user set on
    the command line (`overrides`): import-path rewards and tasks, reward models, tools, and the model's
    own code."""
    named = [] if _overridden(overrides, "rewards.functions") else foreign_rewards(cfg.rewards.functions)
    named += [] if _overridden(overrides, "task", "task.name") else task_code(cfg)
    named += tool_code(cfg)
    if cfg.model.trust_remote_code and not _overridden(overrides, "model.trust_remote_code"):
        named.append(f"the model's own code ({cfg.model.name_or_path}, model.trust_remote_code)")
    return named


def tool_code(cfg: Config) -> list[str]:
    """The tools and environments `cfg` would import."""
    env = cfg.tools.environment
    return [*cfg.tools.functions, *([env] if isinstance(env, str) else (env or {}).values())]


def task_code(cfg: Config) -> list[str]:
    """The task `cfg` would import, when it names one by import path (`task: package.module:MyTask`)."""
    return [cfg.task.name] if ":" in cfg.task.name else []


def _overridden(overrides: Sequence[str], *keys: str) -> bool:
    return any(o.split("=", 1)[0].strip() in keys for o in overrides)


def refusal(source: str, named: list[str]) -> UntrustedCodeError:
    """The one-line error for code a run's config names: what it would run and how to allow it."""
    return UntrustedCodeError(
        f"{source} names code that would run: {', '.join(named)}; a run directory cannot grant itself "
        f"that. Pass {TRUST_FLAG} if you trust where the run came from, or name the code in your own -c"
    )
