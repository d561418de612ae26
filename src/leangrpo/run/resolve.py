"""Reading a run's configuration: YAML file (leangrpo's nested sections, or a flat TRL config) +
`a.b=value` overrides -> the schema's checks -> what the task decides filled in. One function,
`load_config`, does it all, before any model loads. Two values need the run itself, and the trainer
resolves them as new config objects: the step count of an epoch-based run (`resolve_steps`: the rows and
processes) and where the model now lives (`with_model_path`). The result is the run's config.yaml.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from leangrpo.config.schema import Config, ConfigError, RewardSpec, TaskConfig, ToolsConfig
from leangrpo.config.trl import from_trl, is_trl_config
from leangrpo.config.trl_flags import split_flags, with_flags
from leangrpo.core.errors import UserError
from leangrpo.data.rewards.registry import import_object
from leangrpo.data.sources import default_task
from leangrpo.data.tasks import Task, TaskError, TaskOptions, task_class
from leangrpo.data.tasks.reasoning_gym import ReasoningGym
from leangrpo.run.rundir import RunDirError, kind, read_yaml, write_text_atomic


def _yaml_problem(e: yaml.YAMLError) -> str:
    return getattr(e, "problem", None) or str(e).splitlines()[0]


def _problem_lines(err: ValidationError, source: str) -> str:
    """Every problem the schema found, one line each, naming its key."""
    lines = []
    for problem in err.errors():
        key = ".".join(str(p) for p in problem["loc"])
        msg = problem["msg"].removeprefix("Value error, ")
        if problem["type"] == "extra_forbidden":
            msg = "unknown key"
        elif problem["type"] == "missing":
            msg = "required key is missing"
        elif problem["loc"] and not isinstance(problem.get("input"), dict):
            msg = f"{msg} (got {problem['input']!r})"
        lines.append(f"config error in {source}: {key + ': ' if key else ''}{msg}")
    return "\n".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """Split `a.b=value` into a key path and a YAML-typed value."""
    if "=" not in item:
        raise ConfigError(f"config override {item!r} must look like section.key=value")
    key, raw = item.split("=", 1)
    if not key.strip():
        raise ConfigError(f"config override {item!r} has an empty key")
    try:
        return key.strip().split("."), yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"config override {item!r}: value is not valid YAML ({_yaml_problem(e)})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set each `a.b=value` into a nested dict (copying nothing else); validation happens later."""
    for item in overrides:
        path, value = parse_override(item)
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"config override {item!r}: {part} is not a section")
            node = child
        node[path[-1]] = value
    return data


Vet = Callable[[Config], None]


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, vet: Vet | None = None
) -> Config:
    """Read YAML (optional), apply overrides (TRL's `--flag value` ones too: config/trl_flags.py), validate.
    Raises ConfigError with one line. `vet`: see `validate_config`."""
    data, source, overrides = _read_config(path, overrides or [])
    if is_trl_config(data):
        data = from_trl(data, source)
    apply_overrides(data, overrides)
    return validate_config(data, source, vet)


def trl_resume(path: str | Path | None, overrides: list[str]) -> str | None:
    """The run a flat TRL config's `resume_from_checkpoint` names, which `trl grpo` passes to train():
    `"latest"` for `true` (output_dir's run), a path's run directory (a `checkpoint-N` folder's parent),
    None when it is unset or the config is leangrpo's."""
    data, _, _ = _read_config(path, overrides)
    value = data.get("resume_from_checkpoint") if is_trl_config(data) else None
    if value is True:
        return "latest"
    if not value:
        return None
    checkpoint = Path(str(value))
    return str(checkpoint.parent if checkpoint.name.startswith("checkpoint-") else checkpoint)


def _read_config(path: str | Path | None, overrides: list[str]) -> tuple[dict[str, Any], str, list[str]]:
    """The config's data with TRL's `--flag value` overrides merged in, where it comes from, and the
    `a.b=value` overrides left to apply."""
    data: dict[str, Any] = {}
    flags, overrides = split_flags(overrides)
    source = str(path) if path else "overrides"
    if path is not None:
        p = Path(path)
        if kind(p) in (None, "dir"):
            raise ConfigError(f"config file not found: {p}")
        try:
            data = read_yaml(p, what="config file ") or {}
        except RunDirError as e:
            raise ConfigError(str(e)) from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {p} must hold a mapping of sections, not {type(data)}")
    data = with_flags(data, flags, source)
    if flags:
        source = f"{path} and the command line" if path else "the command line"
    return data, source, overrides


def validate_config(
    data: dict[str, Any], source: str = "config", vet: Vet | None = None, environment_rewards: bool = False
) -> Config:
    """The whole config from nested data: the schema's checks, then the task's (`resolve`). `vet` sees
    the config between the two, before anything it names is imported (a task named by import path is
    imported by `resolve`): where the config comes from a run, `run.trust`'s check goes there.
    `environment_rewards`: the run's environments score it (`get_reward`), so no reward function is needed."""
    try:
        cfg = Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_problem_lines(e, source)) from None
    if vet is not None:
        vet(cfg)
    return resolve(cfg, source, environment_rewards)


def resolve(cfg: Config, source: str = "config", environment_rewards: bool = False) -> Config:
    """`cfg` with everything its task decides filled in (the task's option defaults, system prompt and
    rewards) and checked against the task (its data, its worked solutions for a cold start)."""

    def error(msg: str) -> ConfigError:
        return ConfigError(f"config error in {source}: {msg}")

    if "task" not in cfg.model_fields_set:
        cfg = cfg.model_copy(update={"task": TaskConfig(name=default_task(cfg.data))})  # in config.yaml
    try:
        task = task_class(cfg.task.name)
    except TaskError as e:
        raise error(f"task: {e}") from None
    options = _task_options(task, cfg.task, lambda msg: error(f"task: {msg}"))
    if cfg.data.path.startswith("reasoning_gym:") and not issubclass(task, ReasoningGym):
        raise error(
            f"data.path {cfg.data.path} needs task: reasoning_gym or calculator (got task: {task.name})"
        )
    try:
        task(options).check_data(cfg.data.path)
    except TaskError as e:
        raise error(str(e)) from None
    try:
        scored = cfg.rewards.functions or task.default_rewards or environment_rewards or _scored_by(cfg.tools)
    except UserError as e:
        raise error(f"tools.environment: {e}") from None
    if not scored:
        raise error(
            f"rewards.functions: required (task {task.name} has no default rewards, and no "
            "tools.environment defines get_reward)"
        )
    if cfg.sft.steps and not task.has_solutions:
        raise error(f"sft.steps needs worked solutions, which task {task.name} does not have")
    if cfg.sft.task is not None:
        sft_options = _task_options(task, cfg.sft_task, lambda msg: error(f"sft.task: {msg}"))
        try:
            task(sft_options).check_data(cfg.data.path)
        except TaskError as e:
            raise error(f"sft.task: {e}") from None
    data = cfg.data
    if "system_prompt" not in data.model_fields_set:
        data = data.model_copy(update={"system_prompt": task.system_prompt})
    rewards = cfg.rewards
    if not rewards.functions:
        rewards = rewards.model_copy(update={"functions": [RewardSpec(name=n) for n in task.default_rewards]})
    task_cfg = TaskConfig.model_validate({"name": cfg.task.name, **options.model_dump()})
    return cfg.model_copy(update={"task": task_cfg, "data": data, "rewards": rewards})


def _scored_by(tools: ToolsConfig) -> bool:
    """Whether a `tools.environment` class defines `get_reward`, which the trainer adds as a reward, as TRL
    does (engines/agents.py): then no reward function is needed, as for the Python API's environments."""
    env = tools.environment
    paths = [env] if isinstance(env, str) else list((env or {}).values())
    return any(callable(getattr(import_object(path, "environment"), "get_reward", None)) for path in paths)


def resolve_steps(cfg: Config, num_rows: int, num_processes: int) -> Config:
    """`cfg` with `optim.max_steps` worked out from `optim.num_train_epochs` (when it is set and
    max_steps is not): enough steps for every process together to draw each of `num_rows` rows that
    many times, rounded up to end on a whole optimizer step (one may span generations)."""
    optim = cfg.optim
    if not optim.num_train_epochs or "max_steps" in optim.model_fields_set:
        return cfg
    steps = math.ceil(optim.num_train_epochs * num_rows / (cfg.prompts_per_step * num_processes))
    steps = math.ceil(steps / cfg.whole_steps) * cfg.whole_steps  # the run ends on a whole optimizer step
    return cfg.model_copy(update={"optim": optim.model_copy(update={"max_steps": steps})})


def with_model_path(cfg: Config, path: str) -> Config:
    """`cfg` training the model at `path` (where the run directory keeps it: `rundir.start_run`)."""
    return cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": path})})


def _task_options(task: type[Task], cfg: TaskConfig, error: Callable[[str], ConfigError]) -> TaskOptions:
    """The task's own options from `cfg`, its defaults filled in; a bad one raises `error(message)`."""
    try:
        return task.Options.model_validate(cfg.options())
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        if first["type"] == "extra_forbidden":
            known = ", ".join(task.Options.model_fields) or "none"
            raise error(f"task {task.name} has no option {key!r} (its options: {known})") from None
        raise error(f"task option {key}: {first['msg'].removeprefix('Value error, ')}") from None


def save_config(cfg: Config, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as YAML, atomically (never a partial file)."""
    write_text_atomic(Path(path), yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
