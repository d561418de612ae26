"""What a Python caller hands the Trainer beside its config: objects that are not config data (reward
callables, rows in memory, a loaded model, step callbacks). The config still describes the run (and is
saved as `config.yaml`); each extra replaces only how one of its parts is obtained."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Flag, auto
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.data.rewards import RewardFunc


class StepAsk(Flag):
    """What a step hook asks of the run after its step: END it, as a normal end (its checkpoint, then the
    final model: TRL's `control.should_training_stop`), or save a CHECKPOINT of it now (`should_save`)."""

    END = auto()
    CHECKPOINT = auto()


StepHook = Callable[[int, dict[str, Any], bool], "StepAsk | bool | None"]
"""Called on the main process after each step with the step number, its metrics and whether they were
logged (`logging.logging_steps`); returns what it asks of the run (True: `StepAsk.END`)."""

StepBeginHook = Callable[[int], None]
"""Called on the main process before each step with its number (TRL's `on_step_begin`)."""


@dataclass(frozen=True)
class RuntimeExtras:
    """In-memory parts of a run; every field left empty means "as the config says"."""

    train_rows: Iterable[dict[str, Any]] | None = None
    """The training rows, read instead of `data.path` (which then only names them)."""
    reward_funcs: Mapping[str, RewardFunc] = field(default_factory=dict)
    """Reward callables by the `rewards.functions` name that stands for them."""
    model: PreTrainedModel | None = None
    """The policy, used instead of loading `model.name_or_path`."""
    tokenizer: PreTrainedTokenizerBase | None = None
    """Its tokenizer, used instead of loading the model's own."""
    step_hooks: Sequence[StepHook] = ()
    step_begin_hooks: Sequence[StepBeginHook] = ()
    rollout_trainer: Any = None
    """What a rollout_func is given as its `trainer`: TRL passes its GRPOTrainer, and so does leangrpo's
    (commands/trl_api.py); by default, the Trainer itself."""
