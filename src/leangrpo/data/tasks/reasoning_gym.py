"""Procedurally generated problems from reasoning-gym (`pip install 'leangrpo[reasoning-gym]'`), scored
by the generator's own verifier. `data.path: reasoning_gym:<dataset>` picks the generator (a comma list,
`reasoning_gym:chain_sum,leg_counting`, mixes several); the model answers inside `<answer>` tags and
reasoning-gym's `score_answer` on that answer is the correctness. The training split is generated from
`task.seed`, every other split (evaluation's `test`) from `task.eval_seed`, without the problems the
training split holds, so held-out means held out. No file and no network are needed.
"""

from __future__ import annotations

import difflib
import functools
from typing import TYPE_CHECKING, Any

from pydantic import Field, ValidationInfo, field_validator

from leangrpo.data.rewards.builtin import completion_text, extract_xml_answer
from leangrpo.data.tasks import Task, TaskError, TaskOptions

if TYPE_CHECKING:
    from reasoning_gym.dataset import ProceduralDataset

    from leangrpo.data.rewards import RewardFunc

PREFIX = "reasoning_gym:"


class ReasoningGymOptions(TaskOptions):
    size: int = Field(1000, ge=1, description="problems generated per split")
    seed: int = Field(0, description="generator seed of the training split")
    eval_seed: int = Field(
        1_000_000,
        description="generator seed of the held-out split; at least `size` away from seed (problem i is "
        "drawn from seed + i)",
    )
    config: dict[str, dict[str, Any]] = Field(
        default_factory=dict,
        description="generator settings per dataset, e.g. {chain_sum: {min_digits: 1, max_digits: 1}}",
    )
    weights: dict[str, float] = Field(
        default_factory=dict, description="share of each dataset in a mix (default 1 each)"
    )

    @field_validator("eval_seed")
    @classmethod
    def _apart(cls, eval_seed: int, info: ValidationInfo) -> int:
        seed, size = info.data.get("seed", 0), info.data.get("size", 1)
        if abs(eval_seed - seed) < size:
            raise ValueError(
                f"must be at least size={size} away from seed={seed}: reasoning-gym draws problem i from "
                "seed + i, so closer seeds regenerate training problems"
            )
        return eval_seed


def dataset_names(path: str) -> list[str]:
    """The generator names in `reasoning_gym:a,b`; [] when `path` is not a reasoning-gym source."""
    if not path.startswith(PREFIX):
        return []
    return [n.strip() for n in path.removeprefix(PREFIX).split(",") if n.strip()]


class ReasoningGym(Task):
    name = "reasoning_gym"
    Options = ReasoningGymOptions
    options: ReasoningGymOptions
    default_rewards = ("xmlcount", "soft_format", "strict_format", "correctness")
    has_solutions = True  # format-only: reasoning-gym has no worked solutions (see `solution`)

    def check_data(self, path: str) -> None:
        """One-line errors, before any model loads: not a reasoning-gym source, an unknown generator (with
        its close matches), settings for a generator not used, or settings the generator rejects."""
        names = dataset_names(path)
        if not names:
            raise TaskError(f"task reasoning_gym needs data.path: {PREFIX}<dataset> (got {path!r})")
        for key in (*self.options.config, *self.options.weights):
            if key not in names:
                raise TaskError(f"task.config/weights name {key!r}, which data.path does not use")
        self.dataset(tuple(names), self.options.seed)

    def generated_rows(self, path: str, split: str) -> list[dict[str, Any]] | None:
        names = tuple(dataset_names(path))
        if not names:
            return None
        train = self.dataset(names, self.options.seed)
        if split == "train":
            return [_row(e) for e in train]
        seen = {e["question"] for e in train}
        held_out = []
        for entry in self.dataset(names, self.options.eval_seed):
            if entry["question"] not in seen:
                seen.add(entry["question"])
                held_out.append(_row(entry))
        return held_out

    @functools.lru_cache(maxsize=4)  # noqa: B019 (a task lives as long as its run)
    def dataset(self, names: tuple[str, ...], seed: int) -> ProceduralDataset:
        """The generator (a weighted mix for several names) of `size` problems from `seed`."""
        try:
            import reasoning_gym
            from reasoning_gym.composite import DatasetSpec
            from reasoning_gym.factory import DATASETS
        except ImportError:
            raise TaskError(
                "task reasoning_gym needs the reasoning-gym package: pip install 'leangrpo[reasoning-gym]'"
            ) from None
        known = sorted(n for n in DATASETS if n != "composite")
        for name in names:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=5) or known[:10]
                raise TaskError(f"unknown reasoning-gym dataset {name!r}; close matches: {', '.join(close)}")
        size, config = self.options.size, self.options.config
        try:
            if len(names) == 1:
                settings = config.get(names[0], {})
                return reasoning_gym.create_dataset(names[0], size=size, seed=seed, **settings)
            specs = [DatasetSpec(n, self.options.weights.get(n, 1.0), config.get(n, {})) for n in names]
            return reasoning_gym.create_dataset("composite", size=size, seed=seed, datasets=specs)
        except Exception as e:  # generators reject settings with TypeError, AssertionError, ValueError
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            which = ", ".join(names)
            raise TaskError(f"bad reasoning-gym generator config for {which} ({config}): {detail}") from None

    def score(self, answer: str, row: dict[str, Any]) -> float:
        """reasoning-gym's score of `answer` for the row's problem, in [0, 1] (1: correct)."""
        entry = {"question": row["question"], "answer": row["answer"], "metadata": row["metadata"]}
        names = (row["metadata"]["source_dataset"],)
        return float(self.dataset(names, self.options.seed).score_answer(answer, entry))

    def rewards(self) -> dict[str, RewardFunc]:
        def correctness(
            prompts: list, completions: list, question: list, answer: list, metadata: list, **_: Any
        ) -> list[float]:
            """2.0 × reasoning-gym's score of the `<answer>` block."""
            answers = [extract_xml_answer(completion_text(c)) for c in completions]
            return [
                2.0 * self.score(ans, {"question": q, "answer": a, "metadata": m})
                for ans, q, a, m in zip(answers, question, answer, metadata, strict=True)
            ]

        return {"correctness": correctness}

    def solution(self, row: dict[str, Any]) -> str:
        """The cold start's target: the gold answer in the answer format, with no worked reasoning
        (generators give none): a cold start teaches the format, and the answers of the problems it sees."""
        answer = row["answer"]
        return f"<reasoning>\nThe answer is {answer}.\n</reasoning>\n<answer>\n{answer}\n</answer>\n"

    def is_correct(self, completion: str, row: dict[str, Any]) -> bool:
        return self.score(extract_xml_answer(completion), row) == 1.0


def _row(entry: dict[str, Any]) -> dict[str, Any]:
    return {"question": entry["question"], "answer": str(entry["answer"]), "metadata": entry["metadata"]}


TASK = ReasoningGym
