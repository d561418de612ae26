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
import math
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from leangrpo.commands.report import write_report_after_training
from leangrpo.commands.trl_events import Events, TrainerControl
from leangrpo.config.schema import Config, ConfigError
from leangrpo.config.trl import (
    accepted_fields,
    dict_field,
    from_trl,
    trainer_attributes,
    unknown_field_hint,
)
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
        elif name in TRL_DICT_FIELDS:
            object.__setattr__(self, name, dict_field(name, value))  # a command line's JSON, as TRL reads it
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


ARGS_AS_JSON = (
    "save_model: the args go in training_args.json, not TRL's pickled training_args.bin (a pickle runs code "
    "when loaded; docs/trl.md)"
)


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
        self._eval_rows = _eval_rows(eval_dataset, flat, problems)
        if self._eval_rows is not None and self._agent is not None and self._agent.rollout_func is not None:
            problems.append("eval_dataset: evaluation with a rollout_func is not supported (docs/trl.md)")
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
        vars(self).update(trainer_attributes(self.cfg))  # TRL's copies of args: what a rollout_func reads
        self._init_state(callbacks or [], functions, extras)

    def _init_state(self, callbacks: list[Any], functions: dict[str, Any], extras: dict[str, Any]) -> None:
        """The callbacks, state and control a transformers Trainer holds (on_init_end once they are
        there), and what train() keeps."""
        evaluate = None if self._eval_rows is None else self.evaluate
        self._events = Events(self.args, self.cfg, self._epoch, evaluate)
        self.callbacks, self.state = self._events.callbacks, self._events.state
        self._extras = RuntimeExtras(
            reward_funcs=functions, step_hooks=(self._events.step_end,),
            step_begin_hooks=(self._events.step_begin,), rollout_trainer=self, **extras,
        )  # fmt: skip
        for callback in callbacks:
            self.add_callback(callback)
        self._final: Path | None = None
        self._run: Trainer | None = None  # the last train()'s trainer: its policy, tokenizer, accelerator
        self._accelerator: Any = None
        self._said_args = False  # save_model's training_args.json line, said once
        self._events.call("on_init_end")

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
        """The tokenizer: the one given, or the model's own (loaded on first access, then used by the run); a
        processor given (a VLM's) stays the processing class, as in TRL."""
        if self._run is not None and getattr(self._extras.tokenizer, "image_processor", None) is None:
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

    @property
    def vllm_generation(self) -> Any:
        """TRL's vLLM generation object (`generate`, `sync_weights`), which leangrpo has no counterpart of:
        an AttributeError in one line, so that `getattr(trainer, "vllm_generation", None)` still works."""
        raise AttributeError(
            "trainer.vllm_generation: leangrpo has no TRL VLLMGeneration; a rollout_func generates with "
            "trainer.model or its own vLLM client (docs/trl.md)"
        )

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

    @property
    def control(self) -> TrainerControl:
        """The `TrainerControl` the callbacks share (a callback returning one replaces it)."""
        return self._events.control

    def _epoch(self, global_step: int) -> float:
        """Epochs done after `global_step` optimizer steps: each prompt seen once by its num_generations
        completions and their num_iterations updates, as TRL's repeat sampler counts them: whole generation
        batches of prompts only (the rows left over from the last do not count)."""
        rows = self._extras.train_rows
        batch = self.cfg.prompts_per_step * self.accelerator.num_processes
        per_epoch = len(rows) // batch * batch if isinstance(rows, list) else 0
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
        earlier = _logged_rows(Path(cfg.output_dir), cfg.optimizer_steps) if resume else None
        start = time.time()
        trainer = Trainer(cfg, overwrite=not resume, resume=resume, agent=self._agent, extras=self._extras)
        self._run = trainer
        first = cfg.optimizer_steps(trainer.start_step)
        self.state.is_world_process_zero = trainer.is_main
        self._events.train_begin(first, earlier, Path(cfg.output_dir))
        self._final = run(trainer)  # the CLI's run and teardown
        if trainer.is_main:  # a signal stops train() with Stopped
            write_report_after_training(Path(cfg.output_dir), print)
        steps = self.state.global_step - first
        metrics = _speed_metrics(start, steps * self._total_batch(), steps)
        train_loss = self._events.train_loss
        metrics.update(total_flos=self.state.total_flos, train_loss=train_loss)
        self._events.train_end(metrics)  # the summary row of log_history, as transformers logs it
        return TrainOutput(self.state.global_step, train_loss, {**metrics, "epoch": self.state.epoch})

    # ----------------------------------------------------------------------------------- evaluation

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """TRL's GRPO evaluation with the policy as it is now: num_generations_eval (default
        num_generations) sampled completions of each eval_dataset prompt (or of `eval_dataset`, or of
        `self.eval_dataset[name]` for a name), scored by the rewards; the `{metric_key_prefix}_*` metrics
        are logged (on_log) and given to on_evaluate, as TRL's. A dict of eval datasets is evaluated set by
        set, each under `{metric_key_prefix}_{name}_*`."""
        if eval_dataset is None and isinstance(self._eval_rows, dict):
            out: dict[str, float] = {}
            for name in self._eval_rows:
                out.update(self.evaluate(name, ignore_keys, f"{metric_key_prefix}_{name}"))
            return out
        from leangrpo.data.rows import PromptFormat
        from leangrpo.engines.tools import prepare_tokenizer
        from leangrpo.train.evaluation import eval_sampling, sampled_rewards

        cfg, rows = self.cfg, self._eval_set(eval_dataset)
        k = getattr(self.args, "num_generations_eval", None) or cfg.grpo.num_generations
        batch = getattr(self.args, "per_device_eval_batch_size", 8)
        funcs, rows = self._eval_inputs(rows)
        tokenizer, agent = self.processing_class, self._agent
        if agent is not None and agent.uses_tools and self._run is None:  # train() prepares its own
            prepare_tokenizer(tokenizer)
        start = time.time()
        metrics = sampled_rewards(
            self.model, tokenizer, rows, funcs, replace(eval_sampling(cfg.grpo, cfg.data), num_generations=k),
            prompt_format=PromptFormat.from_config(cfg.data), prompts_per_call=max(1, batch // k),
            on_call=lambda: self._events.call("on_prediction_step"), kl=_eval_kl(self.cfg, self._run),
            agent=agent,
        )  # fmt: skip
        out = _speed_metrics(start, len(rows), math.ceil(len(rows) / batch), metric_key_prefix)
        out.update({f"{metric_key_prefix}_{key}": value for key, value in metrics.items()})
        logged = self._events.log(out)
        self._events.call("on_evaluate", metrics=logged)
        return logged

    def _eval_set(self, eval_dataset: Any) -> list[dict[str, Any]]:
        """The raw rows `evaluate(eval_dataset)` evaluates: the given dataset, a named one of the
        eval_dataset dict, or the eval_dataset."""
        if isinstance(eval_dataset, str):
            if not isinstance(self._eval_rows, dict) or eval_dataset not in self._eval_rows:
                raise UserError(f"evaluate: no eval dataset named {eval_dataset!r}")
            return self._eval_rows[eval_dataset]
        if eval_dataset is None:
            if not isinstance(self._eval_rows, list):
                raise UserError("evaluate: no eval_dataset (pass one to GRPOTrainer or to evaluate())")
            return self._eval_rows
        problems: list[str] = []
        rows = _rows(eval_dataset, "eval_dataset", problems)
        if problems:
            raise UserError("evaluate: " + "; ".join(problems))
        return rows

    def _eval_inputs(self, raw: list[dict[str, Any]]) -> tuple[Any, list[dict[str, Any]]]:
        """The run's reward functions (loaded before train(), with the environments') and `raw` rows read as
        training rows are."""
        from leangrpo.data.rewards import load_rewards
        from leangrpo.data.sources import load_rows
        from leangrpo.data.tasks import load_task

        if self._run is not None:
            funcs, task = self._run.reward_funcs, self._run.task
        else:
            task = load_task(self.cfg.task)
            funcs = load_rewards(self.cfg.rewards.functions, task, self._extras.reward_funcs)
            if self._agent is not None:  # an environment's get_reward, as train() adds it
                funcs += self._agent.environment_rewards()
        data = self.cfg.data.model_copy(update={"path": "eval_dataset", "limit": None})
        return funcs, load_rows(data, task, raw).rows

    # ---------------------------------------------------------------------------------- saving

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **_: Any,
    ) -> Any:
        """Upload the trained model, in save_model's layout, to the hub repo args.hub_model_id (default:
        output_dir's name), created if needed, from the main process (huggingface_hub's create_repo and
        upload_folder); returns the commit's URL, or with `blocking=False` (as transformers) at once a
        Future of the upload's CommitInfo. A hub that cannot be reached or refuses is a UserError in one
        line (in the background: the Future's exception, as transformers')."""
        if self._final is None:
            raise UserError("push_to_hub: nothing trained yet (call train() first)")
        if not self.is_world_process_zero():
            return None
        import tempfile

        from huggingface_hub import HfApi
        from huggingface_hub.errors import HfHubHTTPError

        from leangrpo.core.errors import error_reason

        repo = getattr(self.args, "hub_model_id", None) or Path(self.cfg.output_dir).name
        private = getattr(self.args, "hub_private_repo", None) if private is None else private
        api = HfApi(token=token or getattr(self.args, "hub_token", None))
        hub_errors: tuple[type[BaseException], ...] = (ValueError, *HfHubHTTPError.__bases__)  # HTTP, OS
        staging, background = Path(tempfile.mkdtemp(prefix="leangrpo-push-")), False
        try:
            repo_id = api.create_repo(repo, private=private, exist_ok=True).repo_id
            self.save_model(str(staging))
            upload = partial(
                api.upload_folder, repo_id=repo_id, folder_path=staging, commit_message=commit_message,
                revision=revision,
            )  # fmt: skip
            if not blocking:  # the staged copy goes once the background upload is done
                future = api.run_as_future(upload)
                future.add_done_callback(lambda _: shutil.rmtree(staging, ignore_errors=True))
                background = True
                return future
            return str(upload().commit_url)
        except hub_errors as e:
            raise UserError(f"push_to_hub: cannot push to {api.endpoint} ({repo}): {error_reason(e)}") from e
        finally:
            if not background:
                shutil.rmtree(staging, ignore_errors=True)

    def save_model(self, output_dir: str | None = None) -> None:
        """The trained model in `output_dir` (default: args.output_dir), in TRL's layout: the weights and
        tokenizer at the top level; for LoRA the adapter there (`PeftModel.from_pretrained(base, dir)`), and
        the merged model in `merged/` (at the top level, transformers would load the adapter's base). The
        args go in `training_args.json`, not TRL's pickled `training_args.bin`: nothing leangrpo writes
        runs code when it is read back (said once)."""
        if self._final is None:
            raise UserError("save_model: nothing trained yet (call train() first)")
        out = Path(output_dir or self.cfg.output_dir)
        if out.resolve() != self._final.resolve():
            adapter = self._final / "adapter"
            if adapter.is_dir():
                shutil.copytree(adapter, out, dirs_exist_ok=True)
                ignore = shutil.ignore_patterns("adapter")
                shutil.copytree(self._final, out / "merged", ignore=ignore, dirs_exist_ok=True)
            else:
                shutil.copytree(self._final, out, dirs_exist_ok=True)
        if self.is_world_process_zero():
            self._write(out, "training_args.json", json.loads(json.dumps(self.args.to_dict(), default=str)))
            if not self._said_args:
                logger.warning(ARGS_AS_JSON)
                self._said_args = True

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


def _eval_kl(cfg: Config, run: Trainer | None) -> Callable[[Any], float] | None:
    """An eval batch's KL to the reference, as TRL logs it at beta != 0 (None at beta 0). Before train()
    the reference is the policy itself (TRL's: a copy of it), so the KL is 0."""
    if not cfg.grpo.beta:
        return None
    return (lambda batch: 0.0) if run is None else run.updater.reference_kl


def _speed_metrics(start: float, samples: int, steps: int, split: str = "train") -> dict[str, Any]:
    """transformers' `speed_metrics(split, ...)`: the seconds, samples and steps per second since `start`."""
    runtime = time.time() - start
    out: dict[str, Any] = {f"{split}_runtime": round(runtime, 4)}
    if runtime:
        out[f"{split}_samples_per_second"] = round(samples / runtime, 3)
        out[f"{split}_steps_per_second"] = round(steps / runtime, 3)
    return out


def _eval_rows(
    eval_dataset: Any, flat: dict[str, Any], problems: list[str]
) -> list[dict[str, Any]] | dict[str, list[dict[str, Any]]] | None:
    """The eval_dataset's rows (a dict of datasets: each one's, by name). Its evaluation follows
    eval_strategy/eval_steps in the GRPOTrainer (taken out of `flat`: the `eval:` section's held-out split
    stays off); eval_strategy without an eval_dataset is refused, as TRL."""
    strategy = flat.pop("eval_strategy", "no")
    strategy = str(getattr(strategy, "value", strategy))
    flat.pop("eval_steps", None)
    if eval_dataset is None:
        if strategy != "no":
            problems.append(
                f"eval_strategy={strategy!r} needs an eval_dataset: pass eval_dataset= or set "
                "eval_strategy='no'"
            )
        return None
    logger.warning(
        "eval_dataset: evaluated with HF generate on the main process; logs TRL's reward and length "
        "metrics, all under metric_key_prefix, without eval_loss, eval_entropy, eval_clip_ratio/* or "
        "eval_num_tokens (docs/trl.md)"
    )
    if isinstance(eval_dataset, dict):
        return {
            str(name): _rows(data, f"eval_dataset[{name!r}]", problems) for name, data in eval_dataset.items()
        }
    return _rows(eval_dataset, "eval_dataset", problems)


def _logged_rows(run_dir: Path, global_step: Callable[[int], int]) -> list[dict[str, Any]]:
    """The training rows a run logged in its metrics.jsonl, as log_history rows (`global_step`: the
    optimizer steps after a step); a step that ended no optimizer step had none (`Events.step_end`)."""
    from leangrpo.run.rundir import read_jsonl, with_trl_names

    path = run_dir / "metrics.jsonl"
    rows = read_jsonl(path).rows if path.is_file() else []
    return [
        {**{k: v for k, v in with_trl_names(row).items() if v is not None}, "step": global_step(row["step"])}
        for row in rows
        if isinstance(row.get("step"), int)
        and not any(key.startswith("eval/") for key in row)
        and global_step(row["step"]) > global_step(row["step"] - 1)
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
