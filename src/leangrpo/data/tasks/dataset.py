"""Any dataset of prompts, trained with your own rewards: the prompt column becomes the user turn (after
the configured system prompt, if any) and every other column reaches the rewards. The answer column, when
there is one, is the gold answer that evaluation checks with math-verify."""

from __future__ import annotations

from leangrpo.data.tasks import Task


class Dataset(Task):
    name = "dataset"
    system_prompt = None


TASK = Dataset
