"""A task of the user's own, named by import path (`task: toy_task:TaggedTask`) in tests/test_user_task.py:
its rows get a column, its system prompt and its own reward reach the run."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from leangrpo.data.tasks import Task, TaskOptions

SYSTEM_PROMPT = "Answer the toy task's question."


def saw_tag(prompts, completions, tag, **kwargs):
    """1 for each completion whose row the task prepared (it carries the task's `tag` column) and whose
    prompt opens with the task's system prompt."""
    return [float(t == "toy" and p[0]["content"] == SYSTEM_PROMPT) for p, t in zip(prompts, tag, strict=True)]


class TaggedOptions(TaskOptions):
    tag: str = Field("toy", description="the value of the column `prepare` adds")


class TaggedTask(Task):
    """Any dataset; `prepare` adds a `tag` column, and the task's own reward checks it is there."""

    Options = TaggedOptions
    system_prompt = SYSTEM_PROMPT
    default_rewards = ("saw_tag",)

    def prepare(self, row: dict[str, Any]) -> dict[str, Any] | None:
        return {**row, "tag": self.options.tag}  # type: ignore[attr-defined]

    def rewards(self):
        return {"saw_tag": saw_tag}


class NotATask:
    """A class that is not a Task."""
