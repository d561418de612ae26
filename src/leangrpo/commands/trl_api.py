"""`from leangrpo import GRPOTrainer, GRPOConfig`: TRL 1.16's Python API over leangrpo's trainer, so that a
TRL script runs with only its import line changed.

`GRPOConfig` takes every TRL field name and is translated by the flat-YAML port (`config.trl.from_trl`),
so a script and a YAML with the same values give the same run. What cannot be config data (reward
callables, datasets in memory, a loaded model, callbacks) reaches the trainer as `RuntimeExtras`.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

from leangrpo.commands.report import write_report_after_training
from leangrpo.config.schema import Config, ConfigError
from leangrpo.config.trl import accepted_fields, from_trl, unknown_field_hint
from leangrpo.config.trl_fields import TRL_DEFAULTS
from leangrpo.core.errors import UserError
from leangrpo.run.resolve import validate_config
from leangrpo.train.extras import RuntimeExtras

if TYPE_CHECKING:
    from leangrpo.engines.agents import AgentSpec

logger = logging.getLogger("leangrpo.commands.trl_api")


class GRPOConfig:
    """TRL 1.16's `GRPOConfig` by name: any of its fields (and leangrpo's own grpo/optim/... field names)
    as keyword arguments; an unset field reads as TRL's default, and the run uses it (`from_trl` fills in
    TRL's defaults where leangrpo's differ, as for a flat TRL YAML; docs/trl.md)."""

    def __init__(self, **fields: Any) -> None:
        unknown = sorted(fields.keys() - accepted_fields())
        if unknown:
            hints = "".join(f"\n{hint}" for name in unknown if (hint := unknown_field_hint(name)))
            raise TypeError(f"GRPOConfig got unexpected keyword arguments: {', '.join(unknown)}{hints}")
        object.__setattr__(self, "_given", dict(fields))

    def __getattr__(self, name: str) -> Any:
        given = self.__dict__["_given"]
        if name in given:
            return given[name]
        if name in TRL_DEFAULTS:
            return TRL_DEFAULTS[name]
        raise AttributeError(f"GRPOConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in accepted_fields():
            raise AttributeError(f"GRPOConfig has no field {name!r}")
        self._given[name] = value

    def to_dict(self) -> dict[str, Any]:
        """The fields that were set, as a flat TRL config."""
        return dict(self._given)

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self._given.items())})"


@dataclass
class TrainerState:
    """What TRL scripts read of `trainer.state`: optimizer steps done, the run's, and every logged row."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class TrainOutput:
    """`trainer.train()`'s result, as transformers' `TrainOutput`."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


def _agent(
    tools: list[Callable[..., Any]] | None, environment_factory: Any, rollout_func: Any, problems: list[str]
) -> AgentSpec | None:
    """The tools, environments or rollout_func as the Trainer takes them (engines/agents.py); None without
    any. A problem with them joins `problems`."""
    if not tools and rollout_func is None and environment_factory is None:
        return None
    from leangrpo.engines.agents import AgentSpec

    try:
        return AgentSpec(tools or (), environment_factory, rollout_func)
    except UserError as e:
        problems.append(str(e))
        return None


class GRPOTrainer:
    """TRL 1.16's `GRPOTrainer` signature; `train()` runs leangrpo's trainer. Arguments leangrpo cannot
    honour are refused together, one line each, in a `UserError`."""

    def __init__(
        self,
        model: Any,
        reward_funcs: Any = None,
        args: GRPOConfig | None = None,
        train_dataset: Any = None,
        eval_dataset: Any = None,
        processing_class: Any = None,
        reward_processing_classes: Any = None,
        callbacks: list[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        quantization_config: Any = None,
        peft_config: Any = None,
        tools: list[Callable[..., Any]] | None = None,
        rollout_func: Callable[..., Any] | None = None,
        environment_factory: Any = None,
    ) -> None:
        self.args = args or GRPOConfig()
        problems: list[str] = []
        self._agent = _agent(tools, environment_factory, rollout_func, problems)
        if any(o is not None for o in optimizers):
            problems.append("optimizers: leangrpo builds its optimizer and schedule from args (optim, ...)")
        if reward_processing_classes is not None:
            problems.append("reward_processing_classes: a reward model is scored with its own tokenizer")
        flat = self.args.to_dict()
        flat.setdefault("output_dir", "trainer_output")  # TRL's default
        extras: dict[str, Any] = {"tokenizer": processing_class}
        if isinstance(model, str | Path):
            flat["model_name_or_path"] = str(model)
        else:
            extras["model"] = model
            flat["model_name_or_path"] = _model_name(model)
            flat.setdefault("dtype", str(getattr(model, "dtype", "float32")).removeprefix("torch."))
        flat.update(_peft_fields(peft_config, problems))
        flat.update(_quantization_fields(quantization_config, problems))
        specs, functions = _reward_specs(reward_funcs, problems)
        if train_dataset is None:
            problems.append("train_dataset: required")
        else:
            extras["train_rows"] = _rows(train_dataset, "train_dataset", problems)
            flat["dataset_name"] = "train_dataset"
        if eval_dataset is not None and flat.get("eval_strategy", "no") != "no":
            problems.append("eval_dataset: evaluation on an in-memory dataset is not supported yet")
        try:
            nested = from_trl(flat, "GRPOConfig", reward_specs=specs)
        except ConfigError as e:
            problems.append(str(e))
            nested = None
        if problems:
            raise UserError("GRPOTrainer: " + "\n".join(problems))
        self.cfg: Config = validate_config(nested or {}, "GRPOConfig")
        _bound_tools(self._agent, self.cfg, bool(tools) or environment_factory is not None)
        self.callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks or []]
        self.state = TrainerState(max_steps=self.cfg.optim.max_steps * self.cfg.grpo.num_iterations)
        self._final: Path | None = None
        self._earlier: list[dict[str, Any]] | None = None  # a resumed run's rows, until its first step
        self._extras = RuntimeExtras(reward_funcs=functions, step_hooks=(self._on_step,), **extras)

    def _on_step(self, step: int, metrics: dict[str, Any], logged: bool) -> None:
        """After each step: the state a TRL callback expects, then, when the step's row was logged
        (`logging_steps`), its log_history row and on_log; then on_step_end. A resumed run's first step
        puts the earlier steps' rows (its metrics.jsonl) first."""
        iterations = self.cfg.grpo.num_iterations
        self.state.global_step = step * iterations
        if self._earlier is not None:
            self.state.log_history = [r for r in self._earlier if r["step"] < self.state.global_step]
            self._earlier = None
        if logged:
            logs = {k: v for k, v in metrics.items() if k != "step"}
            self.state.log_history.append({**logs, "step": self.state.global_step})
            self._call("on_log", logs=logs)
        self._call("on_step_end")

    def _call(self, event: str, **kwargs: Any) -> None:
        control = SimpleNamespace(should_training_stop=False, should_log=False, should_save=False)
        for callback in self.callbacks:
            if hasattr(callback, event):
                getattr(callback, event)(self.args, self.state, control, **kwargs)

    def train(self, resume_from_checkpoint: str | bool | None = None, **_: Any) -> TrainOutput:
        """Train (or with `resume_from_checkpoint` True or a path, continue the run from its last complete
        checkpoint); an earlier run in output_dir is replaced, as TRL writes over it."""
        from leangrpo.train.trainer import Trainer, run

        cfg = self.cfg
        if isinstance(resume_from_checkpoint, str | Path):
            path = Path(resume_from_checkpoint)
            run_dir = path.parent if path.name.startswith("checkpoint-") else path
            cfg = cfg.model_copy(update={"output_dir": str(run_dir)})
        resume = bool(resume_from_checkpoint)
        if resume:
            self._earlier = _logged_rows(Path(cfg.output_dir), cfg.grpo.num_iterations)
        trainer = Trainer(cfg, overwrite=not resume, resume=resume, agent=self._agent, extras=self._extras)
        self._call("on_train_begin")
        self._final = run(trainer)  # the CLI's run and teardown
        if trainer.is_main:  # a signal stops train() with Stopped
            write_report_after_training(Path(cfg.output_dir), print)
        self._call("on_train_end")
        losses = [row["loss"] for row in self.state.log_history if "loss" in row]
        return TrainOutput(self.state.global_step, sum(losses) / max(len(losses), 1), {})

    def save_model(self, output_dir: str | None = None) -> None:
        """Copy the trained model (the run's `model/`: merged weights, and `adapter/` for LoRA) to
        `output_dir` (default: args.output_dir)."""
        if self._final is None:
            raise UserError("save_model: nothing trained yet (call train() first)")
        out = Path(output_dir or self.cfg.output_dir)
        if out.resolve() != self._final.resolve():
            shutil.copytree(self._final, out, dirs_exist_ok=True)


def _logged_rows(run_dir: Path, iterations: int) -> list[dict[str, Any]]:
    """The training rows a run logged in its metrics.jsonl, as log_history rows (optimizer steps)."""
    from leangrpo.run.rundir import read_jsonl, with_trl_names

    path = run_dir / "metrics.jsonl"
    rows = read_jsonl(path).rows if path.is_file() else []
    return [
        {**with_trl_names(row), "step": row["step"] * iterations}
        for row in rows
        if isinstance(row.get("step"), int) and not any(key.startswith("eval/") for key in row)
    ]


def _bound_tools(agent: AgentSpec | None, cfg: Config, calls_tools: bool) -> None:
    """The agent's tool calls bounded by `tools.timeout_s` (`tool_timeout_s`), said in one line: TRL has no
    limit."""
    if agent is None:
        return
    agent.timeout_s = cfg.tools.timeout_s
    if calls_tools:
        limit = cfg.tools.timeout_s
        logger.warning(f"tools: a call past tool_timeout_s={limit}s gets an error result (TRL: no limit)")


def _model_name(model: Any) -> str:
    """A loaded model's hub id or path, for the run's config."""
    name = getattr(model, "name_or_path", None) or getattr(
        getattr(model, "config", None), "_name_or_path", ""
    )
    return str(name) or type(model).__name__


def _rows(dataset: Any, what: str, problems: list[str]) -> list[dict[str, Any]]:
    """A `datasets.Dataset`/`IterableDataset` or a list of dicts as a list of rows."""
    if isinstance(dataset, dict) or not isinstance(dataset, Iterable):
        problems.append(f"{what}: expected a datasets.Dataset, IterableDataset or list of dicts")
        return []
    rows = list(dataset)
    if not all(isinstance(row, dict) for row in rows):
        problems.append(f"{what}: every row must be a dict of columns")
    return rows


def _reward_specs(reward_funcs: Any, problems: list[str]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`rewards.functions` entries in TRL's order, and the callables among them by their spec name.
    A string is a reward (model id or path, built-in name, `module:function`) loaded by name."""
    items = reward_funcs if isinstance(reward_funcs, list | tuple) else [reward_funcs]
    specs: list[dict[str, Any]] = []
    functions: dict[str, Any] = {}
    for index, item in enumerate(i for i in items if i is not None):
        if isinstance(item, str | Path):
            specs.append({"name": str(item)})
        elif callable(item) and not hasattr(item, "parameters"):
            name = str(getattr(item, "__name__", f"reward_{index}"))
            key = name if name not in functions else f"{name}#{index}"
            functions[key] = item
            specs.append({"name": key})
        else:
            problems.append(f"reward_funcs[{index}]: a loaded reward model; pass its path or hub id instead")
    if not specs:
        problems.append("reward_funcs: required (a callable, a reward model id, or a list of them)")
    return specs, functions


_LORA_DEFAULTS = {
    "fan_in_fan_out": False, "bias": "none", "use_rslora": False, "modules_to_save": None,
    "layers_to_transform": None, "rank_pattern": {}, "alpha_pattern": {}, "use_dora": False,
}  # fmt: skip
"""peft LoraConfig fields leangrpo's adapter has at these values only."""


def _peft_fields(peft_config: Any, problems: list[str]) -> dict[str, Any]:
    """A peft `LoraConfig` as the flat TRL script keys (`use_peft`, `lora_r`, ...); without target_modules,
    peft's default for the architecture, as in TRL."""
    if peft_config is None:
        return {}
    if type(peft_config).__name__ != "LoraConfig":
        problems.append(f"peft_config: {type(peft_config).__name__} is not supported (LoraConfig is)")
        return {}
    for name, default in _LORA_DEFAULTS.items():
        value = getattr(peft_config, name, default)
        if value != default:
            problems.append(f"peft_config.{name}={value!r}: not supported (leangrpo's LoRA has {default!r})")
    return {
        "use_peft": True,
        "lora_r": peft_config.r,
        "lora_alpha": peft_config.lora_alpha,
        "lora_dropout": peft_config.lora_dropout,
        "lora_target_modules": peft_config.target_modules,
    }


def _quantization_fields(config: Any, problems: list[str]) -> dict[str, Any]:
    """A bitsandbytes 4-bit `BitsAndBytesConfig` as the flat keys of `trl grpo`'s model arguments."""
    if config is None:
        return {}
    if not getattr(config, "load_in_4bit", False):
        problems.append("quantization_config: only a 4-bit BitsAndBytesConfig is supported (QLoRA)")
        return {}
    return {
        "load_in_4bit": True,
        "bnb_4bit_quant_type": config.bnb_4bit_quant_type,
        "use_bnb_nested_quant": config.bnb_4bit_use_double_quant,
    }
