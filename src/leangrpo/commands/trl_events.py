"""transformers' callback events around leangrpo's steps, in the order a TRL 1.16 GRPO run fires them:
on_init_end; on_train_begin, on_epoch_begin; per step on_step_begin, (on_substep_end,)
on_pre_optimizer_step, on_optimizer_step, on_step_end, on_log, (on_prediction_step..., on_log,
on_evaluate,) (on_save,); on_epoch_end; the summary row's on_log and on_train_end. The step hooks of
`train/extras.py` call in here (main process).

Events after a step that need the run's next move (a checkpoint saved, an epoch ended) fire before the next
step begins, or at the end: on_save only once its checkpoint is on disk."""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from leangrpo.config.schema import Config, step_interval
from leangrpo.train.extras import StepAsk

logger = logging.getLogger("leangrpo.commands.trl_api")

AFTER_THE_UPDATE = ("on_substep_end", "on_pre_optimizer_step", "on_optimizer_step")
"""Events that fire, in TRL's order, once the step's update is done (leangrpo's update runs its
micro-batches and optimizer step inside; the gradients are gone by then)."""


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
    """transformers' `TrainerControl`: what a callback asks of the loop after a step. `should_training_stop`
    ends the run after the step (its checkpoint and final model saved, as a normal end); `should_save`
    checkpoints the step; `should_log` logs its row; `should_evaluate` evaluates on the eval_dataset."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


class Events:
    """The callbacks of a GRPOTrainer, the state and control they share, and the events of a run.
    `epoch_of(global_step)`: epochs done after that many optimizer steps; `evaluate()`: TRL's evaluation
    on the eval_dataset (None: no eval_dataset)."""

    def __init__(
        self,
        args: Any,
        cfg: Config,
        epoch_of: Callable[[int], float],
        evaluate: Callable[[], Any] | None,
    ) -> None:
        self.args, self.cfg, self.epoch_of, self.evaluate = args, cfg, epoch_of, evaluate
        self.callbacks: list[Any] = []
        self.state = TrainerState(max_steps=cfg.optimizer_steps(cfg.optim.max_steps))
        self.control = TrainerControl()
        self._after: int | None = None  # the step whose on_save/on_epoch_end are still to fire
        self._new_epoch = True  # the next step starts an epoch (on_epoch_begin)
        self._run_dir = Path(cfg.output_dir)
        self._earlier: list[dict[str, Any]] | None = None  # a resumed run's rows, until its first step
        self._losses: list[float] = []  # each step's loss in this train(), for train_loss

    def call(self, event: str, **kwargs: Any) -> None:
        """`event` on every callback, in order; one returning a control replaces it (transformers)."""
        for callback in self.callbacks:
            if hasattr(callback, event):
                done = getattr(callback, event)(self.args, self.state, self.control, **kwargs)
                self.control = self.control if done is None else done

    def log(self, logs: dict[str, Any]) -> dict[str, Any]:
        """A row of `state.log_history` with the epoch and step, then on_log, as transformers' `log()`;
        returns `logs` with the epoch. A metric without a value (`kl` at beta 0) is left out: TRL logs none
        there."""
        logs = {**{k: v for k, v in logs.items() if v is not None}, "epoch": self.state.epoch}
        self.state.log_history.append({**logs, "step": self.state.global_step})
        self.call("on_log", logs=logs)
        return logs

    def train_begin(self, global_step: int, earlier: list[dict[str, Any]] | None, run_dir: Path) -> None:
        """on_train_begin, for a run in `run_dir` starting after `global_step` optimizer steps (a resumed
        run's `earlier` rows first, once its first step is logged)."""
        self.control, self._losses, self._after, self._run_dir = TrainerControl(), [], None, run_dir
        self._earlier, self._new_epoch = earlier, True
        self.state.global_step, self.state.epoch = global_step, self.epoch_of(global_step)
        self.call("on_train_begin")
        if any(_overrides(callback, event) for callback in self.callbacks for event in AFTER_THE_UPDATE):
            logger.warning(
                "callbacks: on_substep_end, on_pre_optimizer_step and on_optimizer_step fire after the "
                "step's update (TRL: around its optimizer step)"
            )

    def step_begin(self, step: int) -> None:
        """Before `step`: the last step's pending events, on_epoch_begin at an epoch's start, then
        on_step_begin."""
        self._flush()
        self.state.global_step = self.cfg.optimizer_steps(step - 1)
        if not self._updates(step):
            return
        if self._new_epoch:
            self._new_epoch = False
            self.call("on_epoch_begin")
        self.call("on_step_begin")

    def step_end(self, step: int, metrics: dict[str, Any], logged: bool) -> StepAsk:
        """After `step`: the state a TRL callback expects, the events after the update, on_step_end, then
        as the control says its log row and on_log (`logging_steps`), its evaluation (`eval_strategy`,
        `eval_steps`) and its checkpoint; returns what the control asks of the run. A step that ends no
        optimizer step (its micro-steps wait for the next step's: `Config.optimizer_steps`) fires none, as
        TRL fires them per optimizer step."""
        if not self._updates(step):
            return StepAsk(0)
        for _ in range(self.cfg.optim.gradient_accumulation_steps - 1):
            self.call("on_substep_end")
        self.call("on_pre_optimizer_step")
        self.call("on_optimizer_step")
        self.state.global_step = self.cfg.optimizer_steps(step)
        self.state.epoch = self.epoch_of(self.state.global_step)
        if isinstance(loss := metrics.get("loss"), int | float):
            self._losses.append(float(loss))
        if self._earlier is not None:
            self.state.log_history = [r for r in self._earlier if r["step"] < self.state.global_step]
            self._earlier = None
        control = self.control
        control.should_log, control.should_save = logged, False
        control.should_evaluate = self._strategy() == "steps" and self._crossed(self._eval_every(), step)
        self.call("on_step_end")
        if self.control.should_log:
            self.log({k: v for k, v in metrics.items() if k != "step"})
        if self.control.should_evaluate and self.evaluate is not None:
            self.evaluate()
        self._after = step
        asks = StepAsk(0)
        if self.control.should_save:
            asks |= StepAsk.CHECKPOINT
        if self.control.should_training_stop:
            asks |= StepAsk.END
        return asks

    def train_end(self, summary: dict[str, Any]) -> None:
        """The last step's pending events, the summary row (transformers' `train_*` metrics) and
        on_train_end."""
        self._flush(last=True)
        self.log(summary)
        self.call("on_train_end")

    @property
    def train_loss(self) -> float:
        """The mean loss of the steps this train() ran."""
        return sum(self._losses) / max(len(self._losses), 1)

    def _flush(self, last: bool = False) -> None:
        """After the last step: on_save once its checkpoint is on disk, on_epoch_end when an epoch ended (or
        the run did), then an evaluation for `eval_strategy='epoch'`."""
        step, self._after = self._after, None
        if step is None:
            return
        if (self._run_dir / f"checkpoint-{step}").is_dir():
            self.call("on_save")
        now = self.state.global_step
        before = self.cfg.optimizer_steps(step - 1)
        ended = math.floor(self.epoch_of(now)) > math.floor(self.epoch_of(before))
        if ended or last:
            self._new_epoch = True
            self.call("on_epoch_end")
            if self._strategy() == "epoch" and self.evaluate is not None:
                self.evaluate()

    def _updates(self, step: int) -> bool:
        """Whether an optimizer step ends in `step`."""
        return self.cfg.optimizer_steps(step) > self.cfg.optimizer_steps(step - 1)

    def _strategy(self) -> str:
        """args.eval_strategy as a string (an IntervalStrategy's value)."""
        strategy = getattr(self.args, "eval_strategy", "no")
        return str(getattr(strategy, "value", strategy))

    def _eval_every(self) -> int:
        """Optimizer steps between evaluations: eval_steps (below 1, a ratio of the run), else
        logging_steps, as transformers."""
        every = getattr(self.args, "eval_steps", None) or getattr(self.args, "logging_steps", None) or 10
        return step_interval(float(every), self.state.max_steps)

    def _crossed(self, every: int, step: int) -> bool:
        """Whether `step`'s optimizer steps reached a multiple of `every`."""
        now, before = self.state.global_step, self.cfg.optimizer_steps(step - 1)
        return bool(every) and now // every > before // every


def _overrides(callback: Any, event: str) -> bool:
    """Whether `callback` does something on `event` (not transformers' TrainerCallback's no-op)."""
    from transformers import TrainerCallback

    own = getattr(callback, event, None)
    return own is not None and getattr(own, "__func__", own) is not getattr(TrainerCallback, event, None)
