"""`from leangrpo import GRPOTrainer, GRPOConfig`: TRL 1.16's Python API over leangrpo's trainer, so that a
TRL script runs with only its import line changed.

`GRPOConfig` takes every TRL field name and is translated by the flat-YAML port (`config.trl.from_trl`),
so a script and a YAML with the same values give the same run. What cannot be config data (reward
callables, datasets in memory, a loaded model, callbacks) reaches the trainer as `RuntimeExtras`.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leangrpo.commands.report import write_report_after_training
from leangrpo.config.schema import Config, ConfigError
from leangrpo.config.trl import accepted_fields, from_trl, trainer_attributes, unknown_field_hint
from leangrpo.config.trl_fields import TRL_DEFAULTS, TRL_DICT_FIELDS, TRL_TYPES
from leangrpo.core.errors import UserError
from leangrpo.run.resolve import validate_config
from leangrpo.train.extras import RuntimeExtras

if TYPE_CHECKING:
    from leangrpo.engines.agents import AgentSpec
    from leangrpo.train.trainer import Trainer

logger = logging.getLogger("leangrpo.commands.trl_api")


class GRPOConfig:
    """TRL 1.16's `GRPOConfig`: a dataclass of its fields, with TRL's types and defaults, so that
    `TrlParser`/`HfArgumentParser` build it as TRL's (`trl/scripts/grpo.py` runs with its import changed);
    leangrpo's own field names (grpo/optim/... and `tool_timeout_s`, `reward_timeout_s`) are keywords too.
    A field reads what the run uses: one at TRL's default is trained as TRL would (`from_trl` fills in TRL's
    defaults where leangrpo's differ, as for a flat TRL YAML; docs/trl.md)."""

    def __init__(self, **fields: Any) -> None:
        unknown = sorted(fields.keys() - accepted_fields())
        if unknown:
            hints = "".join(f"\n{hint}" for name in unknown if (hint := unknown_field_hint(name)))
            raise TypeError(f"GRPOConfig got unexpected keyword arguments: {', '.join(unknown)}{hints}")
        object.__setattr__(self, "_extra", {})
        for name, default in TRL_DEFAULTS.items():
            object.__setattr__(self, name, copy.deepcopy(default))
        for name, value in fields.items():
            setattr(self, name, value)

    def __getattr__(self, name: str) -> Any:
        """A leangrpo field given by keyword (the TRL fields are plain attributes)."""
        extra = self.__dict__.get("_extra", {})
        if name in extra:
            return extra[name]
        raise AttributeError(f"GRPOConfig has no field {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in accepted_fields():
            raise AttributeError(f"GRPOConfig has no field {name!r}")
        if name not in TRL_DEFAULTS:
            self._extra[name] = value
        elif name in TRL_DICT_FIELDS and isinstance(value, str) and value.startswith("{"):
            object.__setattr__(self, name, json.loads(value))  # a command line's JSON, as TRL reads it
        elif name == "include_num_input_tokens_seen" and isinstance(value, bool):
            object.__setattr__(self, name, "all" if value else "no")  # transformers' reading of a bool
        else:
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """Every field, and the leangrpo fields given (transformers' `TrainingArguments.to_dict`)."""
        return {**{name: getattr(self, name) for name in TRL_DEFAULTS}, **self._extra}

    def trl_config(self) -> dict[str, Any]:
        """The flat TRL config the run is translated from: the fields away from TRL's default (one at its
        default asks for what an unset one does) and the leangrpo fields given."""
        return {name: v for name, v in self.to_dict().items() if TRL_DEFAULTS.get(name, _UNSET) != v}

    @classmethod
    def from_trl_args(cls, args: Any) -> GRPOConfig:
        """A `trl.GRPOConfig` field by field, with the values its `__post_init__` resolved (TRL's defaults
        included: they are what its user expects). Values TRL derives from others (its enums, the
        `activation_checkpointing` mirror of `gradient_checkpointing`, a default `accelerator_config`)
        are read as what they stand for."""
        values: dict[str, Any] = {}
        for name in TRL_DEFAULTS:
            value = getattr(args, name)
            if isinstance(value, Enum):
                value = value.value
            elif name == "accelerator_config" and value is not None:
                value = None if value == type(value)() else value.to_dict()
            values[name] = value
        if values["activation_checkpointing"] == values["gradient_checkpointing"]:
            values["activation_checkpointing"] = TRL_DEFAULTS["activation_checkpointing"]
        return cls(**values)

    def __repr__(self) -> str:
        return f"GRPOConfig({', '.join(f'{k}={v!r}' for k, v in self.trl_config().items())})"


def _grpo_config_dataclass() -> None:
    """Make `GRPOConfig` a dataclass of TRL's fields (types and defaults from config/trl_fields.py), keeping
    its own `__init__`, which takes leangrpo's field names too."""
    GRPOConfig.__annotations__ = dict(TRL_TYPES)
    for name, default in TRL_DEFAULTS.items():
        factory = partial(copy.deepcopy, default)
        setattr(
            GRPOConfig, name, field(default_factory=factory) if isinstance(default, list | dict) else default
        )
    dataclass(init=False, repr=False, eq=False)(GRPOConfig)


_UNSET = object()
_grpo_config_dataclass()


@dataclass
class TrainerState:
    """What TRL scripts read of `trainer.state`: optimizer steps done, the run's, and every logged row."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    total_flos: float = 0.0
    is_world_process_zero: bool = True

    def save_to_json(self, json_path: str | Path) -> None:
        """As transformers' `TrainerState.save_to_json`."""
        from leangrpo.run.rundir import write_text_atomic

        write_text_atomic(Path(json_path), json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")


@dataclass
class TrainerControl:
    """transformers' `TrainerControl`: what a callback asks of the loop. `should_training_stop` ends the
    run after the step (its checkpoint and final model saved, as a normal end); the rest are read as
    leangrpo's own schedules say."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


@dataclass(frozen=True)
class TrainOutput:
    """`trainer.train()`'s result, as transformers' `TrainOutput`."""

    global_step: int
    training_loss: float
    metrics: dict[str, Any]


def _grpo_config(args: Any) -> GRPOConfig:
    """`args` as leangrpo's GRPOConfig: TRL's defaults for None, a `trl.GRPOConfig` field by field."""
    if args is None:
        return GRPOConfig()
    if isinstance(args, GRPOConfig):
        return args
    if type(args).__name__ == "GRPOConfig" and type(args).__module__.startswith("trl."):
        return GRPOConfig.from_trl_args(args)
    raise UserError(f"GRPOTrainer: args must be leangrpo's or TRL's GRPOConfig, not {type(args).__name__}")


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
        args: Any = None,
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
        self.args = _grpo_config(args)
        problems: list[str] = []
        self._agent = _agent(tools, environment_factory, rollout_func, problems)
        if any(o is not None for o in optimizers):
            problems.append("optimizers: leangrpo builds its optimizer and schedule from args (optim, ...)")
        if reward_processing_classes is not None:
            problems.append("reward_processing_classes: a reward model is scored with its own tokenizer")
        flat = self.args.trl_config()
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
        owned = self._agent is not None and bool(self._agent.environment_rewards())
        specs, functions = _reward_specs(reward_funcs, problems, owned)
        flat["dataset_name"] = "train_dataset"
        if train_dataset is not None:
            extras["train_rows"] = _rows(train_dataset, "train_dataset", problems)
        else:
            _check_environment_owns_the_data(environment_factory, flat, problems)
        if eval_dataset is not None and flat.get("eval_strategy", "no") != "no":
            problems.append("eval_dataset: evaluation on an in-memory dataset is not supported yet")
        try:
            nested = from_trl(flat, "GRPOConfig", reward_specs=specs)
        except ConfigError as e:
            problems.append(str(e))
            nested = None
        if problems:
            raise UserError("GRPOTrainer: " + "\n".join(problems))
        self.cfg: Config = validate_config(nested or {}, "GRPOConfig", environment_rewards=owned)
        empty = [{"prompt": [{"role": "user", "content": ""}]} for _ in range(self.cfg.prompts_per_step)]
        extras.setdefault("train_rows", empty)  # TRL's rows without a train_dataset: the environment prompts
        _bound_tools(self._agent, self.cfg, bool(tools) or environment_factory is not None)
        self._extras = RuntimeExtras(
            reward_funcs=functions, step_hooks=(self._on_step,), rollout_trainer=self, **extras
        )
        vars(self).update(trainer_attributes(self.cfg))  # TRL's copies of args: what a rollout_func reads
        self._init_state(callbacks or [])

    def _init_state(self, callbacks: list[Any]) -> None:
        """The callbacks, state and control a transformers Trainer holds, and what train() keeps."""
        self.callbacks: list[Any] = []
        for callback in callbacks:
            self.add_callback(callback)
        self.state = TrainerState(max_steps=self.cfg.optim.max_steps * self.cfg.grpo.num_iterations)
        self.control = TrainerControl()
        self._final: Path | None = None
        self._run: Trainer | None = None  # the last train()'s trainer: its policy, tokenizer, accelerator
        self._accelerator: Any = None
        self._earlier: list[dict[str, Any]] | None = None  # a resumed run's rows, until its first step
        self._losses: list[float] = []  # each step's loss in this train(), for train_loss

    # ------------------------------------------------------------------ what TRL's GRPOTrainer exposes

    @property
    def model(self) -> Any:
        """The policy model: after train(), the trained one (a peft model with LoRA, as TRL's); before, the
        model given, or the base model loaded from its name on first access (then trained in place)."""
        if self._run is not None:
            return self._run.unwrapped.lm
        if self._extras.model is None:
            from leangrpo.models.load import load_base, resolve_model_path

            base = load_base(resolve_model_path(self.cfg.model.name_or_path), self.cfg.model)
            self._extras = replace(self._extras, model=base)
        return self._extras.model

    @property
    def processing_class(self) -> Any:
        """The tokenizer: the one given, or the model's own (loaded on first access, then used by the run)."""
        if self._run is not None:
            return self._run.tokenizer
        if self._extras.tokenizer is None:
            from leangrpo.models.load import load_tokenizer, resolve_model_path

            path = resolve_model_path(self.cfg.model.name_or_path)
            self._extras = replace(
                self._extras, tokenizer=load_tokenizer(path, self.cfg.model.trust_remote_code)
            )
        return self._extras.tokenizer

    @property
    def accelerator(self) -> Any:
        """The run's `accelerate.Accelerator` (before train(), one made as the run makes it)."""
        if self._run is not None:
            return self._run.acc
        if self._accelerator is None:
            import torch
            from accelerate import Accelerator

            self._accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
        return self._accelerator

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the (multi-machine) run."""
        from accelerate import PartialState

        return PartialState().is_main_process

    def is_local_process_zero(self) -> bool:
        from accelerate import PartialState

        return PartialState().is_local_main_process

    def end(self) -> None:
        """transformers' `Trainer.end` (`trl grpo` calls it last): train() already finished the trackers and
        left the process group; one still there (set up by the script) is destroyed."""
        import torch.distributed

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def add_callback(self, callback: Any) -> None:
        """Add a callback (a class is instantiated), called after those already there."""
        instance = callback() if isinstance(callback, type) else callback
        if type(instance) in [type(cb) for cb in self.callbacks]:
            logger.warning(f"a {type(instance).__name__} callback is already there; adding another")
        self.callbacks.append(instance)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return the first callback of a class, or the instance given (None when absent)."""
        for cb in self.callbacks:
            if isinstance(cb, callback) if isinstance(callback, type) else cb == callback:
                self.callbacks.remove(cb)
                return cb
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove the first callback of a class (none there: nothing), or the instance given (ValueError
        when absent), as transformers."""
        if isinstance(callback, type):
            self.pop_callback(callback)
        else:
            self.callbacks.remove(callback)

    # ------------------------------------------------------------------------------------ callbacks

    def _on_step(self, step: int, metrics: dict[str, Any], logged: bool) -> bool:
        """After each step: the state a TRL callback expects, then on_step_end and, when the step's row
        was logged (`logging_steps`), its log_history row and on_log, in transformers' order. A resumed
        run's first step puts the earlier steps' rows (its metrics.jsonl) first. Returns
        `control.should_training_stop`: True ends the run after this step."""
        iterations = self.cfg.grpo.num_iterations
        self.state.global_step = step * iterations
        self.state.epoch = self._epoch(self.state.global_step)
        if isinstance(loss := metrics.get("loss"), int | float):
            self._losses.append(float(loss))
        if self._earlier is not None:
            self.state.log_history = [r for r in self._earlier if r["step"] < self.state.global_step]
            self._earlier = None
        self.control.should_log = self.control.should_save = self.control.should_evaluate = False
        self._call("on_step_end")
        if logged:
            logs = {k: v for k, v in metrics.items() if k != "step"}
            self.state.log_history.append({**logs, "step": self.state.global_step})
            self._call("on_log", logs=logs)
        return self.control.should_training_stop

    def _call(self, event: str, **kwargs: Any) -> None:
        """`event` on every callback, in order; one returning a control replaces it (transformers)."""
        for callback in self.callbacks:
            if hasattr(callback, event):
                done = getattr(callback, event)(self.args, self.state, self.control, **kwargs)
                self.control = self.control if done is None else done

    def _epoch(self, global_step: int) -> float:
        """Epochs done after `global_step` optimizer steps: each prompt seen once by its num_generations
        completions and their num_iterations updates, as TRL's repeat sampler counts them."""
        rows = self._extras.train_rows
        per_epoch = len(rows) if isinstance(rows, list) else 0
        per_epoch *= self.cfg.grpo.num_generations * self.cfg.grpo.num_iterations
        return global_step * self._total_batch() / per_epoch if per_epoch else 0.0

    def _total_batch(self) -> int:
        """Completions per optimizer step over every process (transformers' total_train_batch_size)."""
        optim = self.cfg.optim
        return (
            optim.per_device_train_batch_size
            * optim.gradient_accumulation_steps
            * self.accelerator.num_processes
        )

    # ---------------------------------------------------------------------------------------- train

    def train(self, resume_from_checkpoint: str | bool | None = None, **_: Any) -> TrainOutput:
        """Train (or with `resume_from_checkpoint` True or a path, continue the run from its last complete
        checkpoint); an earlier run in output_dir is replaced, as TRL writes over it. `metrics` as
        transformers fills them (total_flos: 0, not counted)."""
        from leangrpo.train.trainer import Trainer, run

        cfg = self.cfg
        if isinstance(resume_from_checkpoint, str | Path):
            path = Path(resume_from_checkpoint)
            run_dir = path.parent if path.name.startswith("checkpoint-") else path
            cfg = cfg.model_copy(update={"output_dir": str(run_dir)})
        resume = bool(resume_from_checkpoint)
        if resume:
            self._earlier = _logged_rows(Path(cfg.output_dir), cfg.grpo.num_iterations)
        start, self._losses = time.time(), []
        trainer = Trainer(cfg, overwrite=not resume, resume=resume, agent=self._agent, extras=self._extras)
        self._run, self.control = trainer, TrainerControl()
        first = trainer.start_step * cfg.grpo.num_iterations
        self.state.is_world_process_zero = trainer.is_main
        self._call("on_train_begin")
        self._final = run(trainer)  # the CLI's run and teardown
        if trainer.is_main:  # a signal stops train() with Stopped
            write_report_after_training(Path(cfg.output_dir), print)
        self._call("on_train_end")
        steps = self.state.global_step - first
        train_loss = sum(self._losses) / max(len(self._losses), 1)
        metrics = _speed_metrics(start, steps * self._total_batch(), steps)
        metrics.update(total_flos=self.state.total_flos, train_loss=train_loss, epoch=self.state.epoch)
        return TrainOutput(self.state.global_step, train_loss, metrics)

    # ---------------------------------------------------------------------------------- saving

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model in `output_dir` (default: args.output_dir), in TRL's layout: the weights and
        tokenizer at the top level; for LoRA the adapter there (`PeftModel.from_pretrained(base, dir)`), and
        the merged model in `merged/` (at the top level, transformers would load the adapter's base)."""
        if self._final is None:
            raise UserError("save_model: nothing trained yet (call train() first)")
        out = Path(output_dir or self.cfg.output_dir)
        if out.resolve() == self._final.resolve():
            return
        adapter = self._final / "adapter"
        if not adapter.is_dir():
            shutil.copytree(self._final, out, dirs_exist_ok=True)
            return
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        ignore = shutil.ignore_patterns("adapter")
        shutil.copytree(self._final, out / "merged", ignore=ignore, dirs_exist_ok=True)

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print `metrics` as transformers does (main process only)."""
        if not self.is_world_process_zero():
            return
        from transformers.trainer_pt_utils import metrics_format

        shown = metrics_format(metrics)
        print(f"***** {split} metrics *****")
        width = max((len(key) for key in shown), default=0)
        value_width = max((len(str(v)) for v in shown.values()), default=0)
        for key in sorted(shown):
            print(f"  {key: <{width}} = {shown[key]:>{value_width}}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """`{split}_results.json` in args.output_dir and, with `combined`, `metrics` merged into its
        `all_results.json` (main process only), as transformers; the run's own files from then on."""
        if not self.is_world_process_zero():
            return
        out = Path(self.cfg.output_dir)
        self._write(out, f"{split}_results.json", metrics)
        if combined:
            try:
                everything = json.loads((out / "all_results.json").read_text())
            except (OSError, ValueError):
                everything = None
            earlier = everything if isinstance(everything, dict) else {}
            self._write(out, "all_results.json", {**earlier, **metrics})

    def save_state(self) -> None:
        """`trainer_state.json` (global_step, log_history, ...) in args.output_dir (main process only)."""
        if self.is_world_process_zero():
            self._write(Path(self.cfg.output_dir), "trainer_state.json", asdict(self.state), indent=2)

    @staticmethod
    def _write(out: Path, name: str, data: dict[str, Any], indent: int = 4) -> None:
        """One JSON file of the run's, written whole (never half) and claimed in its manifest, so that
        `--overwrite` moves it with the run."""
        from leangrpo.run.rundir import claim, write_text_atomic

        out.mkdir(parents=True, exist_ok=True)
        claim(out, name)
        write_text_atomic(out / name, json.dumps(data, indent=indent, sort_keys=True) + "\n")


def _speed_metrics(start: float, samples: int, steps: int) -> dict[str, Any]:
    """transformers' `speed_metrics("train", ...)`: the run's seconds, samples and steps per second."""
    runtime = time.time() - start
    out: dict[str, Any] = {"train_runtime": round(runtime, 4)}
    if runtime:
        out["train_samples_per_second"] = round(samples / runtime, 3)
        out["train_steps_per_second"] = round(steps / runtime, 3)
    return out


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


def _check_environment_owns_the_data(
    environment_factory: Any, flat: dict[str, Any], problems: list[str]
) -> None:
    """Without a train_dataset, as TRL 1.16: one environment_factory owns the data (its `reset` returns each
    prompt, appended to an empty user message) and max_steps sets the run's length."""
    if environment_factory is None:
        problems.append("train_dataset: required unless an environment_factory gives the prompts")
    elif isinstance(environment_factory, dict):
        problems.append("train_dataset: required with a dict environment_factory (its environment column)")
    elif int(flat.get("max_steps", TRL_DEFAULTS["max_steps"])) <= 0:
        problems.append("max_steps: must be set without a train_dataset (the environment gives the prompts)")


def _reward_specs(
    reward_funcs: Any, problems: list[str], environment_rewards: bool = False
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`rewards.functions` entries in TRL's order, and the callables among them by their spec name.
    A string is a reward (model id or path, built-in name, `module:function`) loaded by name. None are
    needed where the environments score the rollouts (`environment_rewards`: a `get_reward`)."""
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
    if not specs and not environment_rewards:
        problems.append(
            "reward_funcs: required (a callable, a reward model id, or a list of them), unless the "
            "environment_factory's environment defines get_reward"
        )
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
