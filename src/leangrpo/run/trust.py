"""The trust boundary. What a run directory, checkpoint or export holds is data: its config, its
`leangrpo_export.json`, its files. Code such a config names (an import-path reward or task, a reward
model, a tool or environment, the model's own code) is run only when the user names it in their own config
or on the command line, or passes `--trust-run-code`.

Trust goes by location: a config file inside a run, checkpoint or export directory is the run's, whether it
comes by `-c`, `--resume` or `--model`, and whatever its shape. The import path follows one rule: the
current directory is on it only when the user's own config (or command line) names a module."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from leangrpo.config.schema import Config, ConfigError
from leangrpo.core.errors import UserError
from leangrpo.data.rewards.registry import foreign_rewards
from leangrpo.run.checkpoint import SHA_FILE, STATE_FILE, CheckpointError
from leangrpo.run.resolve import load_config
from leangrpo.run.rundir import LOCK_FILE, MANIFEST, REPLACED, is_run_dir
from leangrpo.run.trained import EXPORT_INFO

TRUST_FLAG = "--trust-run-code"
# Files only leangrpo writes, each marking the directory it is in as a run's, a checkpoint's or an export's
# (a run's directory also by its checkpoint-N/trainer_state.json or model/leangrpo_sha256.json).
RUN_MARKS = (MANIFEST, LOCK_FILE, REPLACED, STATE_FILE, SHA_FILE, EXPORT_INFO)


class UntrustedCodeError(UserError, RuntimeError):
    """A run's config names code the user has not allowed to run."""


def is_run_owned(path: str | Path) -> bool:
    """True for a path inside a run, checkpoint or export directory (or one itself), by where it is rather
    than what it holds: a directory on the way up holds a file only leangrpo writes, or a checkpoint or final
    model of a run; and a directory passed as a run (its config.yaml with a run's sections). A config file is
    not judged by its sections: a project's own config.yaml looks the same. Symlinks count where they are
    and where they point."""
    path = Path(path).expanduser()
    if path.is_dir() and is_run_dir(path):
        return True
    for where in {path.absolute(), path.resolve()}:
        start = where if where.is_dir() else where.parent
        if any(_holds_a_run(folder) for folder in (start, *start.parents)):
            return True
    return False


def _holds_a_run(folder: Path) -> bool:
    marks = [folder / mark for mark in RUN_MARKS] + [folder / "model" / SHA_FILE]
    return any(os.path.lexists(p) for p in marks) or any(folder.glob(f"checkpoint-*/{STATE_FILE}"))


def _code_by_key(cfg: Config) -> list[tuple[tuple[str, ...], list[str]]]:
    """What `cfg` would import or run beyond leangrpo's code, by the config keys that name it."""
    env = cfg.tools.environment
    envs = [env] if isinstance(env, str) else list((env or {}).values())
    return [
        (("rewards", "rewards.functions"), foreign_rewards(cfg.rewards.functions)),
        (("task", "task.name"), task_code(cfg)),
        (("tools", "tools.functions"), list(cfg.tools.functions)),
        (("tools", "tools.environment"), envs),
    ]


def code_named(cfg: Config, overrides: Sequence[str] = ()) -> list[str]:
    """What `cfg` would have leangrpo import or run beyond its own code, leaving out what the user set on
    the command line (`overrides`): import-path rewards and tasks, reward models, tools, and the model's
    own code."""
    named = [name for keys, names in _code_by_key(cfg) if not _overridden(overrides, *keys) for name in names]
    if cfg.model.trust_remote_code and not _overridden(overrides, "model", "model.trust_remote_code"):
        named.append(f"the model's own code ({cfg.model.name_or_path}, model.trust_remote_code)")
    return named


def tool_code(cfg: Config) -> list[str]:
    """The tools and environments `cfg` would import."""
    return [name for keys, names in _code_by_key(cfg) if keys[0] == "tools" for name in names]


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


def admit(
    cfg: Config,
    source: str | Path | None,
    overrides: Sequence[str] = (),
    granted: bool = False,
    users: bool | None = None,
) -> None:
    """The check of a config read from `source` (None: overrides only), before anything it names is
    imported: from a run, the code it names is refused unless `granted` or set in `overrides`; where the
    user names a module themselves, the current directory goes on the import path for it. `users`: whether
    `cfg` is the user's own beyond `overrides` (default: `source` is outside any run; a recipe of
    leangrpo's, the demo's, is not)."""
    owned = source is not None and is_run_owned(source)
    if owned and not granted and (named := code_named(cfg, overrides)):
        raise refusal(str(source), named)
    users = not owned if users is None else users
    mine = (names for keys, names in _code_by_key(cfg) if users or _overridden(overrides, *keys))
    if any(":" in name for names in mine for name in names):
        code_beside_the_user()


def load_admitted(path: str | Path | None, overrides: Sequence[str], granted: bool = False) -> Config:
    """`resolve.load_config` of `path` with `overrides`, through `admit`'s check."""
    return load_config(path, list(overrides), lambda cfg: admit(cfg, path, overrides, granted))


def resume_config(
    config_path: str | None, overrides: list[str], resume: str, trust_run_code: bool = False
) -> Config:
    """The config of a resumed run. `--resume RUN_DIR`: the run's own config.yaml (or `-c`), with the
    overrides on top and output_dir set to RUN_DIR. `--resume latest`: the run in the output_dir of `-c`.
    Either way the config is `admit`ted: code a config inside a run names runs only with `trust_run_code`."""
    if resume == "latest":
        if config_path is None:
            raise ConfigError(
                "--resume latest continues the output_dir of -c CONFIG; pass -c, or --resume RUN_DIR"
            )
        return load_admitted(config_path, overrides, trust_run_code)
    run_dir = Path(resume)
    if config_path is None and not is_run_dir(run_dir):
        raise CheckpointError(f"--resume {run_dir}: not a leangrpo run directory (no leangrpo config.yaml)")
    source = Path(config_path) if config_path else run_dir  # without -c, the run's own config
    path = source if config_path else run_dir / "config.yaml"
    cfg = load_config(path, overrides, lambda cfg: admit(cfg, source, overrides, trust_run_code))
    return cfg.model_copy(update={"output_dir": str(run_dir)})


def code_beside_the_user() -> None:
    """Let `module:function` names the user gives find modules in the current directory, as `trl grpo`
    does. Only then (`admit`): code a run's config names never comes from there."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
