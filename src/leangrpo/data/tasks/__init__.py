"""Tasks: what to learn. A task is one module, `leangrpo/data/tasks/<name>.py`, that defines `TASK`, a
`Task` subclass owning everything task-specific: how a dataset row becomes a training row (its gold
answer), the default system prompt and rewards, the worked solutions a cold start trains on, what a logged
sample shows, and when an answer is correct. `task: <name>` in the config picks it, and `task:
package.module:MyTask` a `Task` subclass of the user's, imported as a reward is (`run.trust` decides
whether a run's own config may name one); the core (rollout, update, record) knows none of this.
"""

from __future__ import annotations

import difflib
import importlib
import pkgutil
import re
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from leangrpo.core.errors import UserError
from leangrpo.data.rewards.builtin import (
    ANSWER_FORMAT_PROMPT,
    RewardError,
    answers_match,
    extract_xml_answer,
    predicted_answer,
)
from leangrpo.data.rewards.registry import import_object

if TYPE_CHECKING:
    from leangrpo.config.schema import TaskConfig
    from leangrpo.data.rewards import RewardFunc


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


class TaskError(UserError, ValueError):
    """An unknown task, or options a task does not take."""


class TaskOptions(BaseModel):
    """A task's own config keys (beside `name` in the config's `task` section)."""

    model_config = ConfigDict(extra="forbid")


class Task:
    """The default behaviour: prompts asking for the `<reasoning>`/`<answer>` format, correctness by
    math-verify on the answer. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    Options: ClassVar[type[TaskOptions]] = TaskOptions
    system_prompt: ClassVar[str | None] = ANSWER_FORMAT_PROMPT
    default_rewards: ClassVar[tuple[str, ...]] = ()
    has_solutions: ClassVar[bool] = False  # rows carry worked solutions (the SFT cold start needs them)
    needs_answer: ClassVar[bool] = False  # every row must have a gold answer (an answer column)

    def __init__(self, options: TaskOptions | None = None):
        self.options = options if options is not None else self.Options()

    def prepare(self, row: dict[str, Any]) -> dict[str, Any] | None:
        """A loaded row ready for training; None leaves it out (a task option), `data.BadRow` rejects it."""
        return row

    def left_out(self, count: int) -> str:
        """Why `count` rows were left out by `prepare` returning None."""
        return f"{count} rows left out by the task's options"

    def check_data(self, path: str) -> None:
        """Raise TaskError when this task cannot use `data.path` (called while the config is validated)."""

    def generated_rows(self, path: str, split: str) -> list[dict[str, Any]] | None:
        """Rows this task generates for `data.path` and a split (e.g. reasoning-gym's); None: read the
        path as a file or hub dataset."""
        return None

    def solution(self, row: dict[str, Any]) -> str:
        """The row's worked solution in the answer format (the cold start's target)."""
        raise NotImplementedError(f"task {self.name} has no worked solutions")

    def rewards(self) -> dict[str, RewardFunc]:
        """Rewards only this task offers, by name (beside the built-in ones)."""
        return {}

    def extract_answer(self, completion: str) -> str:
        """The answer a completion gives (what correctness compares and samples show)."""
        return extract_xml_answer(completion)

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        """The evaluation's correctness: math-verify finds the answer equal to the gold one."""
        return "answer" in row and answers_match(predicted_answer(completion), str(row["answer"]))

    def is_correct_lenient(self, completion: str, row: dict[str, Any]) -> bool:
        """Correctness whatever the format: the answer tags' content when they are closed, else the last
        number in the completion (lm-eval's "flexible extract"), judged by `is_correct`."""
        answer = extract_xml_answer(completion) or next(reversed(_NUMBER.findall(completion)), "")
        return self.is_correct(f"<answer>\n{answer}\n</answer>", row)

    def sample_view(self, row: dict[str, Any], completion: str) -> dict[str, Any]:
        """What a logged sample (completions.jsonl, eval records) shows of a row and its completion."""
        from leangrpo.data.rows import prompt_text

        return {
            "question": prompt_text(row["prompt"]),
            "completion": completion,
            "extracted": self.extract_answer(completion),
            "gold": row.get("answer"),
        }


def available() -> list[str]:
    """The task names: one module each in this package."""
    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def task_class(name: str) -> type[Task]:
    """The Task subclass of `leangrpo/data/tasks/<name>.py`, or the one an import path
    `package.module:MyTask` names; an unknown name lists the close matches."""
    if ":" in name:
        return imported_task(name)
    names = available()
    if name not in names:
        close = difflib.get_close_matches(name, names) or names
        raise TaskError(
            f"unknown task {name!r}; did you mean {', '.join(close)}? "
            "(or give your own Task subclass as 'package.module:MyTask')"
        )
    return importlib.import_module(f"{__name__}.{name}").TASK


def imported_task(path: str) -> type[Task]:
    """The Task subclass user code names as ``package.module:MyTask``, imported by the loader rewards and
    tools go through (`rewards.registry.import_object`); one without a `name` of its own is named by
    `path`. A module or object that is not there, or an object that is not a Task subclass, is a
    one-line TaskError."""
    try:
        cls = import_object(path, "task")
    except RewardError as e:
        raise TaskError(str(e)) from None
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        what = f"class {cls.__name__}" if isinstance(cls, type) else f"a {type(cls).__name__}"
        raise TaskError(f"task {path!r} is not a Task subclass (it is {what})")
    if not hasattr(cls, "name"):
        cls.name = path
    return cls


def load_task(cfg: TaskConfig) -> Task:
    """The configured task with its options."""
    cls = task_class(cfg.name)
    return cls(cls.Options.model_validate(cfg.options()))
