"""Built-in reward functions (TRL signature: ``f(prompts, completions, **columns)``).

The first five reproduce the GSM8K R1 recipe (willccbb's ``grpo_demo.py``) for the format::

    <reasoning>
    ...
    </reasoning>
    <answer>
    ...
    </answer>

with one deliberate fix: the recipe's format regexes lacked ``re.DOTALL``, so multi-line
reasoning or answers never matched. Ours accept them, and are implemented as linear-time
string scans (equivalent to the regexes quoted in their docstrings) so that huge or adversarial
completions cannot trigger quadratic regex backtracking.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

from leangrpo.core.errors import UserError

RewardFunc = Callable[..., list[Any]]
"""TRL reward signature: ``f(prompts, completions, completion_ids, trainer_state, log_extra, log_metric,
**columns) -> list[float | None]`` (or a coroutine of it)."""


class RewardError(UserError, ValueError):
    """A reward could not be loaded, or a reward function misbehaved while scoring."""


ANSWER_FORMAT_PROMPT = (
    "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"
)
"""The system prompt that asks for the format these rewards check."""
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"

# math-verify guards parsing and comparison with signal.alarm; these bound the worst case
# (e.g. a model writing 9^9^9^9) per parse/comparison. Only the tail of an over-long prediction
# is parsed: the final answer sits at the end, and math-verify is slow on long inputs.
MATH_VERIFY_TIMEOUT_S = 2
MAX_PREDICTION_CHARS = 1000

_REASONING_TO_ANSWER = re.compile(r"</reasoning>\s*<answer>")
_STRICT_HEAD = "<reasoning>\n"
_STRICT_MIDDLE = "\n</reasoning>\n<answer>\n"
_STRICT_TAIL = "\n</answer>"


def completion_text(completion: str | list[dict[str, Any]]) -> str:
    """Text of a completion given as a string or as chat messages (content of the last one)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        content = completion[-1].get("content")
        if isinstance(content, str):
            return content
    raise TypeError(
        f"completion must be a string or a list of chat messages with string content, got {completion!r:.100}"
    )


def extract_xml_answer(text: str) -> str:
    """Stripped text between the last ``<answer>`` and the ``</answer>`` after it.

    Returns "" when there is no answer tag or it is never closed (a completion cut off mid-answer
    must not be credited with the digits it had written so far). The single answer parser shared
    by rewards and evaluation.
    """
    start = text.rfind(ANSWER_OPEN)
    if start < 0:
        return ""
    start += len(ANSWER_OPEN)
    end = text.find(ANSWER_CLOSE, start)
    return "" if end < 0 else text[start:end].strip()


def has_strict_format(text: str) -> bool:
    r"""Linear-time ``re.fullmatch(r"<reasoning>\n.*?\n</reasoning>\n<answer>\n.*?\n</answer>\n?",
    text, re.DOTALL)``."""
    body_end = len(text) - 1 if text.endswith(_STRICT_TAIL + "\n") else len(text)
    if not (text.startswith(_STRICT_HEAD) and text.endswith(_STRICT_TAIL, 0, body_end)):
        return False
    return text.find(_STRICT_MIDDLE, len(_STRICT_HEAD), body_end - len(_STRICT_TAIL)) >= 0


def has_soft_format(text: str) -> bool:
    r"""Linear-time ``re.search(r"<reasoning>.*?</reasoning>\s*<answer>.*?</answer>", text,
    re.DOTALL)``.

    Taking the first ``<reasoning>`` and the first ``</reasoning>\s*<answer>`` after it leaves the
    most room for the rest, so a match exists iff these greedy choices find one.
    """
    start = text.find("<reasoning>")
    if start < 0:
        return False
    middle = _REASONING_TO_ANSWER.search(text, start + len("<reasoning>"))
    return middle is not None and text.find(ANSWER_CLOSE, middle.end()) >= 0


def xmlcount(text: str) -> float:
    """The recipe's tag-count score: 0.125 per tag present exactly once, minus 0.001 per
    trailing character after the answer.

    Reproduced faithfully, quirks included: with no ``\\n</answer>\\n`` in the text the first
    penalty counts the whole text, and a bare ``\\n</answer>`` at the very end earns +0.001.
    """
    score = 0.0
    if text.count("<reasoning>\n") == 1:
        score += 0.125
    if text.count("\n</reasoning>\n") == 1:
        score += 0.125
    if text.count("\n<answer>\n") == 1:
        score += 0.125
        score -= len(text.rpartition("\n</answer>\n")[2]) * 0.001
    if text.count("\n</answer>") == 1:
        score += 0.125
        score -= (len(text.rpartition("\n</answer>")[2]) - 1) * 0.001
    return score


def answers_match(predicted: str, gold: str) -> bool:
    """Whether ``predicted`` is mathematically equal to ``gold`` according to math-verify.

    Accepts e.g. "1,000" for "1000", "0.5" for "1/2", "$18" for "18". math-verify's timeouts use
    signal.alarm, which only works in the main thread; elsewhere they are disabled and only the
    length cap bounds the work.
    """
    from math_verify import parse, verify  # lazy: pulls in sympy, slow to import

    timeout = MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else 0
    gold_parsed = parse(gold, parsing_timeout=timeout)
    predicted_parsed = parse(predicted[-MAX_PREDICTION_CHARS:], parsing_timeout=timeout)
    if not gold_parsed or not predicted_parsed:
        return False
    return verify(gold_parsed, predicted_parsed, timeout_seconds=timeout)


def _texts(completions: list) -> list[str]:
    return [completion_text(c) for c in completions]


def xmlcount_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """Partial credit per well-placed tag, so the format is learned gradually."""
    return [xmlcount(text) for text in _texts(completions)]


def soft_format_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """0.5 when reasoning and answer blocks appear in order, whitespace between them free."""
    return [0.5 if has_soft_format(text) else 0.0 for text in _texts(completions)]


def strict_format_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """0.5 when the whole completion is exactly the target format (one newline may trail)."""
    return [0.5 if has_strict_format(text) else 0.0 for text in _texts(completions)]


def int_reward(prompts: list, completions: list, **kwargs: Any) -> list[float]:
    """0.5 when the extracted answer is all digits (GSM8K answers are integers)."""
    return [0.5 if extract_xml_answer(text).isdigit() else 0.0 for text in _texts(completions)]


def correctness_reward(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """2.0 when the extracted answer equals the gold ``answer`` column as a string."""
    return [
        2.0 if extract_xml_answer(text) == str(gold).strip() else 0.0
        for text, gold in zip(_texts(completions), answer, strict=True)
    ]


def math_verify_reward(prompts: list, completions: list, answer: list[str], **kwargs: Any) -> list[float]:
    """2.0 when the answer is mathematically equal to the gold ``answer`` column.

    Uses the ``<answer>`` block when the completion has an answer tag (an unclosed one yields
    no answer), otherwise the whole completion, so it also works without the XML format.
    """
    return [
        2.0 if answers_match(predicted_answer(text), str(gold)) else 0.0
        for text, gold in zip(_texts(completions), answer, strict=True)
    ]


MAIN_THREAD_REWARDS: frozenset[RewardFunc] = frozenset({math_verify_reward})
"""Built-ins bounded by math-verify's own timeouts, which use signal alarms and so act on the main thread
only: scoring calls these there, not in an abandonable worker (where nothing would bound them)."""


def soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> Callable[..., list[float]]:
    """DAPO's overlong shaping, a reward factory configured by ``kwargs`` (TRL's
    ``get_soft_overlong_punishment``, the same values): 0 up to ``max_completion_len - soft_punish_cache``
    completion tokens, then linearly down to -1 at ``max_completion_len``, and -1 beyond."""
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError("needs 0 < soft_punish_cache <= max_completion_len")
    free = max_completion_len - soft_punish_cache

    def soft_overlong_punishment_reward(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
        return [
            0.0
            if len(ids) <= free
            else -1.0
            if len(ids) > max_completion_len
            else (free - len(ids)) / soft_punish_cache
            for ids in completion_ids
        ]

    return soft_overlong_punishment_reward


def predicted_answer(text: str) -> str:
    """What ``math_verify`` compares with the gold answer (and what evaluation reports): the
    ``<answer>`` block when there is an answer tag, else the whole completion."""
    return extract_xml_answer(text) if ANSWER_OPEN in text else text
