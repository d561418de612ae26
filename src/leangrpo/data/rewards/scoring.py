"""Score a batch of completions with several reward functions, isolating misbehaving ones.

Each function is called as TRL 1.16 calls it: ``prompts``, ``completions``, ``completion_ids``, every
column under its own name, ``trainer_state``, ``log_extra`` and ``log_metric``. Each call runs in a
worker thread (async functions awaited there), all of a batch's concurrently, so that a hung one can be
abandoned.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from leangrpo.data.rewards.builtin import MAIN_THREAD_REWARDS, RewardError, RewardFunc, completion_text

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

SNIPPET_CHARS = 200


def reward_inputs(
    rows: list[dict[str, Any]],
    completion_texts: list[str],
    conversational: bool,
    messages: list[Any] | None = None,
    extra_columns: dict[str, list[Any]] | None = None,
) -> tuple[list[Any], list[Any], dict[str, list[Any]]]:
    """A reward function's prompts, completions and dataset columns, in TRL's shapes, for completions that
    come `len(completion_texts) // len(rows)` to a row: chat messages when the prompts are chats rendered
    by a chat template, plain strings otherwise (TRL's standard format). A multi-turn rollout's
    `messages` (the assistant's turns, tool calls and results) replace a conversational run's
    completions, and `extra_columns` (the environments, a rollout_func's extra keys) join the row's; a
    `prompt` among them is each completion's own prompt (an environment's reset text per rollout).
    Training and evaluation both build their reward inputs here."""
    per_row = len(completion_texts) // len(rows)
    extra_columns = dict(extra_columns or {})
    prompts = extra_columns.pop("prompt", None) or [r["prompt"] for r in rows for _ in range(per_row)]
    completions: list[Any] = completion_texts
    if conversational and not isinstance(rows[0]["prompt"], str):
        completions = [[{"role": "assistant", "content": t}] for t in completion_texts]
    if messages is not None and conversational:
        completions = messages
    columns = {k: [r.get(k) for r in rows for _ in range(per_row)] for k in rows[0] if k != "prompt"}
    return prompts, completions, {**columns, **extra_columns}


@dataclass
class RewardScores:
    """Rewards for N completions from F functions."""

    per_func: torch.Tensor  # float32 [N, F]; NaN where a function returned None (not applicable)
    total: torch.Tensor  # float32 [N]; weighted nansum over functions; NaN where failed or unscorable
    failed: torch.Tensor  # bool [N]; some function raised or returned garbage (on_error="missing")
    names: list[str]
    metrics: dict[str, float] = field(default_factory=dict)  # log_metric values, each name's mean
    extra: dict[str, list] = field(default_factory=dict)  # log_extra columns, one value per completion

    def select(self, rows: torch.Tensor) -> RewardScores:
        """The scores of the completions at `rows` [K], in that order (the rewards' metrics unchanged)."""
        extra = {column: [values[i] for i in rows.tolist()] for column, values in self.extra.items()}
        return RewardScores(
            self.per_func[rows], self.total[rows], self.failed[rows], self.names, self.metrics, extra
        )

    @staticmethod
    def cat(scores: list[RewardScores]) -> RewardScores:
        """Scores of several batches one after another; each log_metric value is the mean over batches."""
        import torch

        names = {name for s in scores for name in s.metrics}
        columns = {column for s in scores for column in s.extra}
        return RewardScores(
            torch.cat([s.per_func for s in scores]),
            torch.cat([s.total for s in scores]),
            torch.cat([s.failed for s in scores]),
            scores[0].names,
            {
                n: sum(s.metrics[n] for s in scores if n in s.metrics) / sum(n in s.metrics for s in scores)
                for n in names
            },
            {c: [v for s in scores for v in s.extra.get(c, [None] * len(s.total))] for c in columns},
        )


@dataclass(frozen=True)
class TrainerState:
    """The part of transformers' ``TrainerState`` that TRL rewards read (e.g. for a schedule)."""

    global_step: int  # optimizer steps done so far
    max_steps: int  # optimizer steps in the whole run
    epoch: float  # passes over the training rows so far


@dataclass
class RewardContext:
    """What a reward receives beside prompts, completions and columns, and what it logs back."""

    completion_ids: list[list[int]] | None = None  # each completion's tokens, without padding
    trainer_state: TrainerState | None = None
    metrics: dict[str, list[float]] = field(default_factory=dict)
    extra: dict[str, list] = field(default_factory=dict)

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar logged with the step's metrics (the mean of its calls)."""
        self.metrics.setdefault(name, []).append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        """TRL's ``log_extra``: a column beside the logged completions (the batch call's values)."""
        self.extra.setdefault(column, list(values))

    def kwargs(self, indices: list[int]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "trainer_state": self.trainer_state,
            "log_extra": self.log_extra,
            "log_metric": self.log_metric,
        }
        if self.completion_ids is not None:
            out["completion_ids"] = [self.completion_ids[i] for i in indices]
        return out


@dataclass
class _Failure:
    """What went wrong in one call of a reward function."""

    problem: str
    index: int | None = None  # the offending completion, when the call's output tells
    cause: BaseException | None = None  # what the function raised, if it raised


def score_completions(
    funcs: list[tuple[str, RewardFunc, float]],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    on_error: Literal["raise", "missing"],
    context: RewardContext | None = None,
    timeout_s: float | None = None,
    stop: Callable[[], bool] | None = None,
) -> RewardScores:
    """Call each ``(name, func, weight)`` once on the batch, TRL-style, and combine the scores.

    None (not applicable) becomes NaN and is skipped by the weighted nansum, as in TRL; a completion
    every function declined is unscorable, total NaN (as in TRL: no baseline, advantage 0). A function
    that raises, or returns anything but one finite number or None per completion, is handled per
    ``on_error``: "raise" raises a one-line RewardError naming the function and, when it can be found, the
    completion; "missing" re-runs it on each completion alone, marks those that still fail as
    failed (total NaN) and keeps the individual scores of the rest.
    Every call runs in a worker thread, the batch's functions at once. A call that takes longer than
    ``timeout_s`` (None: no limit) is a failure of the whole batch (no per-completion retry: each would
    wait as long again). When ``stop()`` turns true while calls still run, RewardsAbandoned is raised.
    """
    import torch  # lazy: importing leangrpo.data.rewards must not pull in torch

    n = len(completions)
    context = context or RewardContext()
    if len(prompts) != n or any(len(values) != n for values in columns.values()):
        raise RewardError(f"prompts and every column must have one entry per completion ({n})")
    per_func = torch.full((n, len(funcs)), math.nan, dtype=torch.float32)
    failed = torch.zeros(n, dtype=torch.bool)
    batch = _Batch(prompts, completions, columns, context, timeout_s, stop)
    everyone = list(range(n))
    outputs = batch.run([batch.bind(func, everyone) for _, func, _ in funcs])
    for f, ((name, func, _), output) in enumerate(zip(funcs, outputs, strict=True)):
        values = _score_function(name, func, batch, _checked(output, everyone), on_error, failed)
        per_func[:, f] = torch.tensor(values, dtype=torch.float32)
    weights = torch.tensor([weight for _, _, weight in funcs], dtype=torch.float32)
    total = torch.nansum(per_func * weights, dim=1)
    total[failed | per_func.isnan().all(dim=1)] = math.nan
    metrics = {name: sum(values) / len(values) for name, values in context.metrics.items()}
    return RewardScores(per_func, total, failed, [name for name, _, _ in funcs], metrics, context.extra)


@dataclass
class _Batch:
    prompts: list
    completions: list
    columns: dict[str, list]
    context: RewardContext
    timeout_s: float | None = None
    stop: Callable[[], bool] | None = None

    def bind(self, func: RewardFunc, indices: list[int]) -> Callable[[], Any]:
        """``func`` called on the completions at ``indices``, ready to run."""
        return functools.partial(
            func,
            prompts=[self.prompts[i] for i in indices],
            completions=[self.completions[i] for i in indices],
            **{key: [column[i] for i in indices] for key, column in self.columns.items()},
            **self.context.kwargs(indices),
        )

    def run(self, calls: list[Callable[[], Any]]) -> list[Any]:
        """Each call in a daemon worker thread of its own, all at once (an awaitable it returns awaited
        there; MAIN_THREAD_REWARDS run on this thread meanwhile): what each returned or raised, or a
        _Timeout for one still running after ``timeout_s``. While waiting, ``stop()`` is asked five times a
        second; when it says so the calls are abandoned (left running: Python cannot stop a thread) and
        RewardsAbandoned is raised, so that a hung reward never keeps a run from stopping."""
        boxes: list[list[Any]] = [[] for _ in calls]
        own = [getattr(call, "func", None) in MAIN_THREAD_REWARDS for call in calls]
        workers = [
            threading.Thread(target=_fill, args=(call, box), daemon=True, name="leangrpo-reward")
            for call, box, here in zip(calls, boxes, own, strict=True)
            if not here
        ]
        for worker in workers:
            worker.start()
        for call, box, here in zip(calls, boxes, own, strict=True):
            if here:  # bounded by its own timeouts, which need the main thread
                _fill(call, box)
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        for worker in workers:
            while worker.is_alive():
                if self.stop is not None and self.stop():
                    raise RewardsAbandoned("a stop was asked for while the rewards were still running")
                wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
                if wait <= 0:
                    break
                worker.join(wait)
        timeout = f"did not return within rewards.timeout_s={self.timeout_s}s"  # a box is empty only then
        return [box[0] if box else _Timeout(timeout) for box in boxes]

    def call(self, func: RewardFunc, indices: list[int]) -> list[float] | _Failure:
        return _checked(self.run([self.bind(func, indices)])[0], indices)


_POLL_S = 0.2


class RewardsAbandoned(Exception):
    """The rewards of a step were abandoned, still running, because the run was asked to stop."""


class _Timeout(Exception):
    """A reward call that did not return within rewards.timeout_s."""


def _fill(call: Callable[[], Any], box: list[Any]) -> None:
    """Put what ``call()`` returns (awaited, if it is awaitable) or raises into ``box``."""
    try:
        out = call()
        box.append(asyncio.run(_awaited(out)) if inspect.isawaitable(out) else out)
    except (Exception, SystemExit) as exc:  # a reward calling sys.exit must not end the run unnamed
        box.append(exc)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _score_function(
    name: str,
    func: RewardFunc,
    batch: _Batch,
    first: list[float] | _Failure,
    on_error: Literal["raise", "missing"],
    failed: torch.Tensor,
) -> list[float]:
    """One column of ``per_func`` from the batch call's result ``first``; sets ``failed`` for the
    completions it could not score."""
    if not isinstance(first, _Failure):
        return first
    completions = batch.completions
    if on_error == "raise" and first.cause is None:  # bad output: the batch call says it all
        raise RewardError(_message(name, first.problem, completions, first.index))
    if isinstance(first.cause, _Timeout):  # a retry on each completion would wait as long again, each
        message = _message(name, first.problem, completions, None)
        if on_error == "raise":
            raise RewardError(message)
        logger.warning("%s; scoring the batch's completions as failed", message)
        failed[:] = True
        return [math.nan] * len(completions)
    # Call it on each completion alone to find the one(s) it fails on.
    values: list[float] = []
    for i in range(len(completions)):
        single = batch.call(func, [i])
        if isinstance(single, _Failure):
            message = _message(name, single.problem, completions, i)
            if on_error == "raise":
                raise RewardError(message) from single.cause
            logger.warning("%s; scoring that completion as failed", message)
            failed[i] = True
            single = [math.nan]
        values += single
    if on_error == "raise":  # it failed on the batch although it passed on each completion
        raise RewardError(_message(name, first.problem, completions, None)) from first.cause
    return values


def _checked(values: Any, indices: list[int]) -> list[float] | _Failure:
    """A call's output as scores (NaN for None), or why it is not one finite number or None each."""
    if isinstance(values, _Timeout):
        return _Failure(str(values), cause=values)
    if isinstance(values, BaseException):
        return _Failure(f"raised {type(values).__name__}: {values}".replace("\n", "\\n"), cause=values)
    if hasattr(values, "tolist"):  # a tensor or an array
        values = values.tolist()
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
        elif not math.isfinite(number := _as_float(value)):
            return _Failure(f"returned {value!s:.50}", index=i)
        else:
            checked.append(number)
    return checked


def _as_float(value: numbers.Real) -> float:
    try:
        return float(value)
    except OverflowError:  # an int like 10**400
        return math.inf


def _message(name: str, problem: str, completions: list, index: int | None) -> str:
    """One line naming the function, its problem and (if known) the completion, abridged."""
    message = f"reward function {name!r} {problem}"
    if index is None:
        return message
    snippet = completion_text(completions[index])[:SNIPPET_CHARS]
    return f"{message} on completion #{index}: {snippet!r}"
