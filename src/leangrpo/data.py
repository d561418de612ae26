"""Training data: load question/answer rows, render prompts, and order them across steps.

Rows come from a local JSON Lines or Parquet file or from a Hugging Face hub dataset. Every
row becomes ``{"prompt": messages, "question": str, "answer": str, **other_columns}``, the
shape TRL-style reward functions expect (extra columns arrive as keyword arguments), and then
goes through the task's ``prepare`` (which parses its gold answer, or leaves it out).
Bad rows are never dropped silently: they either stop the run (``on_bad_row="error"``) or
are listed in ``LoadedData.skipped`` and logged.
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UserError

if TYPE_CHECKING:
    import datasets

    from .config import DataConfig
    from .tasks import Task

logger = logging.getLogger("leangrpo.data")

_JSONL_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

Message = dict[str, str]  # one chat message: {"role": ..., "content": ...}


class DataError(UserError, ValueError):
    """A one-line, user-facing problem with the training data (names the file and line)."""


class BadRow(Exception):
    """One row is unusable; ``load_rows`` either skips it or turns it into a ``DataError``."""


@dataclass
class LoadedData:
    """Valid rows plus one-line reasons for every row that was skipped."""

    rows: list[dict[str, Any]]
    skipped: list[str] = field(default_factory=list)

    def skip_summary(self) -> str:
        """``"skipped N bad row(s) (first: ...)"``, or ``""`` when nothing was skipped."""
        if not self.skipped:
            return ""
        return f"skipped {len(self.skipped)} bad row(s) (first: {self.skipped[0]})"


def load_rows(data: DataConfig, task: Task) -> LoadedData:
    """Load the rows of ``data`` for ``task``, validating each row.

    The keys "prompt", "question" and "answer" take precedence over same-named data columns.
    Raises DataError for a missing source, a misnamed column, a bad row under
    ``on_bad_row="error"``, or when no usable row remains.
    """
    source, raw_rows = _open_source(data)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    columns_checked = False
    left_out = 0
    for where, raw in raw_rows:
        if data.limit is not None and len(rows) >= data.limit:
            break
        try:
            record = _as_record(raw)
            if not columns_checked:
                _check_columns(record, data, where)
                columns_checked = True
            row = task.prepare(_make_row(record, data))
            if row is None:
                left_out += 1
                continue
            rows.append(row)
        except BadRow as bad:
            reason = f"{where}: {bad}"
            if data.on_bad_row == "error":
                raise DataError(f"{reason} (set data.on_bad_row: skip to skip such rows)") from None
            skipped.append(reason)

    loaded = LoadedData(rows, skipped)
    if not rows:
        detail = f"; {loaded.skip_summary()}" if skipped else ""
        if left_out:
            detail += f"; {task.left_out(left_out)}"
        raise DataError(f"no usable rows in {source}{detail}")
    if skipped:
        logger.warning("%s: %s", source, loaded.skip_summary())
    if left_out:
        logger.info("%s: %s", source, task.left_out(left_out))
    return loaded


def _open_source(data: DataConfig) -> tuple[str, Iterator[tuple[str, bytes | dict[str, Any]]]]:
    """Pick the reader for ``data.path``; return a name for messages and ``(where, raw row)``s.

    An existing path is read by its extension; a missing path shaped like ``owner/name``
    is a hub dataset id; any other missing path is a missing file.
    """
    path = data.path
    local = Path(path).expanduser()
    if local.is_file():
        suffix = local.suffix.lower()
        if suffix in _JSONL_SUFFIXES:
            return path, _jsonl_lines(local, path)
        if suffix in _PARQUET_SUFFIXES:
            import pyarrow.parquet as pq  # here, not at the top: pyarrow and datasets cost ~80 MB RSS

            return path, _table_rows(path, pq.read_table(local).to_pylist())
        raise DataError(f"unsupported data file type {suffix!r}: {path} (use .jsonl or .parquet)")
    looks_local = local.suffix.lower() in _JSONL_SUFFIXES + _PARQUET_SUFFIXES or path.startswith(
        (".", "/", "~")
    )
    if looks_local or not _HUB_ID.match(path):
        raise DataError(f"data file not found: {path}")
    source = f"{path}[{data.split}]"
    return source, _table_rows(source, _load_hub_dataset(data))


def _load_hub_dataset(data: DataConfig) -> datasets.Dataset:
    """Download a hub dataset split; any failure (offline, unknown id/split) is a DataError."""
    import datasets

    try:
        return datasets.load_dataset(data.path, data.hub_config, split=data.split)
    except Exception as exc:  # datasets raises many types (network, 404, bad split)
        first_line = next(iter(str(exc).strip().splitlines()), "")
        raise DataError(
            f"could not load hub dataset {data.path!r} (config {data.hub_config!r}, "
            f"split {data.split!r}): {type(exc).__name__}: {first_line}; "
            "without network access, set data.path to a local .jsonl file"
        ) from exc


def _jsonl_lines(path: Path, name: str) -> Iterator[tuple[str, bytes]]:
    """Yield ``("name:LINE", raw bytes)`` for each non-blank line; decoding is left to the caller
    so a bad line is reported with its number instead of failing the whole file."""
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield f"{name}:{lineno}", line


def _table_rows(name: str, rows: Iterable[dict[str, Any]]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("name row N", row)`` with N the 0-based row index (as in ``dataset[N]``)."""
    for index, row in enumerate(rows):
        yield f"{name} row {index}", row


def _as_record(raw: bytes | dict[str, Any]) -> dict[str, Any]:
    """Decode one JSONL line into a JSON object; table rows are already dicts."""
    if isinstance(raw, dict):
        return raw
    try:
        text = raw.decode("utf-8-sig")  # -sig: tolerate a byte-order mark on line 1
    except UnicodeDecodeError:
        raise BadRow("not valid UTF-8") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadRow(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise BadRow(f"not a JSON object (got {type(record).__name__})")
    return record


def _check_columns(record: dict[str, Any], data: DataConfig, where: str) -> None:
    """Fail fast on a misnamed column: absent from the first row means a config mistake."""
    for setting in ("prompt_column", "answer_column"):
        column = getattr(data, setting)
        if column not in record:
            found = ", ".join(record) or "none"
            problem = f"column {column!r} (data.{setting}) not found; columns found: {found}"
            raise DataError(f"{where}: {problem}")


def _make_row(record: dict[str, Any], data: DataConfig) -> dict[str, Any]:
    """Turn one record into a training row, or raise BadRow saying what is wrong."""
    question = _required_text(record, data.prompt_column)
    answer = _required_text(record, data.answer_column)
    extra = {k: v for k, v in record.items() if k not in (data.prompt_column, data.answer_column)}
    return {
        **extra,
        "prompt": _messages(question, data.system_prompt),
        "question": question,
        "answer": answer,
    }


def _required_text(record: dict[str, Any], column: str) -> str:
    """The column's value as stripped text; missing, null, blank or non-scalar is a bad row."""
    if column not in record:
        raise BadRow(f"missing {column!r}")
    value = record[column]
    if value is None:
        raise BadRow(f"empty {column!r}")
    if not isinstance(value, (str, int, float)):
        raise BadRow(f"{column!r} is a {type(value).__name__}, not text")
    text = str(value).strip()
    if not text:
        raise BadRow(f"empty {column!r}")
    return text


def _messages(question: str, system_prompt: str | None) -> list[Message]:
    """Chat messages for one question, with a system message only when one is configured."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": question}]


def has_chat_template(tokenizer: Any) -> bool:
    """True when the tokenizer defines a chat template (instruct models); base models do not."""
    return bool(getattr(tokenizer, "chat_template", None))


def render_prompt(tokenizer: Any, messages: list[Message], assistant_prefix: str = "") -> str:
    """Prompt text for generation, ending where the assistant's answer begins.

    With a chat template: the template with the generation prompt. Without one (base models):
    ``"{system}\\n\\n"`` (if any), then ``"Question: {user}\\nAnswer:"`` per user turn, with
    earlier assistant turns as ``" {answer}\\n\\n"``, so few-shot messages read naturally.
    ``assistant_prefix`` (e.g. ``"<reasoning>\\n"``) prefills the assistant turn; in the
    plain-text form it is separated from ``"Answer:"`` by one space.
    """
    if has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text + assistant_prefix
    text = "".join(_plain_turn(m) for m in messages)
    return f"{text} {assistant_prefix}" if assistant_prefix else text


def _plain_turn(message: Message) -> str:
    """One message in the plain-text prompt format of ``render_prompt``."""
    role, content = message["role"], message["content"]
    if role == "system":
        return f"{content}\n\n"
    if role == "user":
        return f"Question: {content}\nAnswer:"
    return f" {content}\n\n"


@dataclass(frozen=True)
class PromptSampler:
    """Which rows each rank trains on at each global step: a pure function of (step, rank).

    Epoch ``e`` visits rows in the order ``torch.randperm(num_rows)`` seeded with ``seed + e``;
    the epochs' orders are concatenated into one endless stream. Step ``s`` takes the next
    ``prompts_per_step * world_size`` entries and rank ``r`` its ``r``-th contiguous slice, so
    ranks never share a row within an epoch, and resuming at step ``k`` yields exactly what an
    uninterrupted run would. A step may span an epoch boundary (always when there are fewer
    rows than one step needs).
    """

    num_rows: int
    prompts_per_step: int
    seed: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.num_rows < 1 or self.prompts_per_step < 1 or self.world_size < 1:
            raise ValueError(f"num_rows, prompts_per_step and world_size must be >= 1: {self}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size): {self}")

    def indices(self, step: int) -> list[int]:
        """This rank's row indices for global step ``step`` (0-based)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        start = (step * self.world_size + self.rank) * self.prompts_per_step
        return [
            _epoch_order(self.num_rows, self.seed + pos // self.num_rows)[pos % self.num_rows]
            for pos in range(start, start + self.prompts_per_step)
        ]


@functools.lru_cache(maxsize=8)
def _epoch_order(num_rows: int, seed: int) -> tuple[int, ...]:
    """The row order of one epoch (cached: every step of an epoch reuses it)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(num_rows, generator=generator).tolist())
