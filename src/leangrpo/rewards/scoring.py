"""Score a batch of completions with several reward functions, isolating misbehaving ones."""

from __future__ import annotations

import logging
import math
import numbers
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from leangrpo.rewards.builtin import completion_text
from leangrpo.rewards.registry import RewardError, RewardFunc

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SNIPPET_CHARS = 200


@dataclass
class RewardScores:
    """Rewards for N completions from F functions."""

    per_func: torch.Tensor  # float32 [N, F]; NaN where a function returned None (not applicable)
    total: torch.Tensor  # float32 [N]; weighted nansum over functions; NaN where failed or unscorable
    failed: torch.Tensor  # bool [N]; some function raised or returned garbage (on_error="missing")
    names: list[str]


@dataclass
class _Failure:
    """What went wrong in one call of a reward function."""

    problem: str
    index: int | None = None  # the offending completion, when the call's output tells
    cause: Exception | None = None  # what the function raised, if it raised


def score_completions(
    funcs: list[tuple[str, RewardFunc, float]],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    on_error: Literal["raise", "missing"],
) -> RewardScores:
    """Call each ``(name, func, weight)`` once on the batch, TRL-style, and combine the scores.

    None (not applicable) becomes NaN and is skipped by the weighted nansum, as in TRL; a completion
    every function declined is unscorable, total NaN (as in TRL: no baseline, advantage 0). A function
    that raises, or returns anything but one finite number or None per completion, is handled per
    ``on_error``: "raise" raises a one-line RewardError naming the function and, when it can be found, the
    completion; "missing" re-runs it on each completion alone, marks those that still fail as
    failed (total NaN) and keeps the individual scores of the rest.
    """
    import torch  # lazy: importing leangrpo.rewards must not pull in torch

    n = len(completions)
    if len(prompts) != n or any(len(values) != n for values in columns.values()):
        raise RewardError(f"prompts and every column must have one entry per completion ({n})")
    per_func = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    failed = torch.zeros(n, dtype=torch.bool)
    for f, (name, func, _) in enumerate(funcs):
        values = _score_function(name, func, prompts, completions, columns, on_error, failed)
        per_func[:, f] = torch.tensor(values, dtype=torch.float32)
    weights = torch.tensor([weight for _, _, weight in funcs], dtype=torch.float32)
    total = torch.nansum(per_func * weights, dim=1)
    total[failed | per_func.isnan().all(dim=1)] = math.nan
    return RewardScores(per_func, total, failed, [name for name, _, _ in funcs])


def _score_function(
    name: str,
    func: RewardFunc,
    prompts: list,
    completions: list,
    columns: dict[str, list],
    on_error: Literal["raise", "missing"],
    failed: torch.Tensor,
) -> list[float]:
    """One column of ``per_func``; sets ``failed`` for the completions it could not score."""
    batch = _call(func, prompts, completions, columns, list(range(len(completions))))
    if not isinstance(batch, _Failure):
        return batch
    if on_error == "raise" and batch.cause is None:  # bad output: the batch call says it all
        raise RewardError(_message(name, batch.problem, completions, batch.index))
    # Call it on each completion alone to find the one(s) it fails on.
    values: list[float] = []
    for i in range(len(completions)):
        single = _call(func, prompts, completions, columns, [i])
        if isinstance(single, _Failure):
            message = _message(name, single.problem, completions, i)
            if on_error == "raise":
                raise RewardError(message) from single.cause
            logger.warning("%s; scoring that completion as failed", message)
            failed[i] = True
            single = [math.nan]
        values += single
    if on_error == "raise":  # it failed on the batch although it passed on each completion
        raise RewardError(_message(name, batch.problem, completions, None)) from batch.cause
    return values


def _call(
    func: RewardFunc, prompts: list, completions: list, columns: dict[str, list], indices: list[int]
) -> list[float] | _Failure:
    """Call ``func`` on the completions at ``indices``: their scores (NaN for None), or why not."""
    try:
        values = func(
            prompts=[prompts[i] for i in indices],
            completions=[completions[i] for i in indices],
            **{key: [column[i] for i in indices] for key, column in columns.items()},
        )
    except Exception as exc:
        return _Failure(f"raised {type(exc).__name__}: {exc}".replace("\n", "\\n"), cause=exc)
    try:
        values = list(values)
    except TypeError:
        return _Failure(f"returned a {type(values).__name__}, not a list")
    if len(values) != len(indices):
        return _Failure(f"returned {len(values)} values for {len(indices)} completions")
    checked = []
    for i, value in zip(indices, values, strict=True):
        if value is None:
            checked.append(math.nan)
        elif not isinstance(value, numbers.Real):
            return _Failure(f"returned a non-number {value!r:.50}", index=i)
        elif not math.isfinite(value):
            return _Failure(f"returned {value}", index=i)
        else:
            checked.append(float(value))
    return checked


def _message(name: str, problem: str, completions: list, index: int | None) -> str:
    """One line naming the function, its problem and (if known) the completion, abridged."""
    message = f"reward function {name!r} {problem}"
    if index is None:
        return message
    snippet = completion_text(completions[index])[:SNIPPET_CHARS]
    return f"{message} on completion #{index}: {snippet!r}"
