"""Training data: load rows in any of TRL's GRPO dataset formats, render prompts, and order them.

Rows come from a local JSON Lines file (read here, line by line, so a bad line is named by its
number), a Parquet, CSV or JSON-array file, a ``save_to_disk`` directory or a directory of data
files (Parquet shards, ...), all read by the ``datasets`` library, or a Hugging Face hub dataset.
Every row becomes ``{"prompt": ..., **columns}``: every column under its own name with its value
intact (what TRL passes to reward functions as keyword arguments), and ``prompt`` as TRL shapes it:

- conversational: a ``prompt`` column holding chat messages is used as is (the configured system
  prompt, if any, goes first when the messages have none);
- standard: a ``prompt`` column holding text is the model's input verbatim (no chat template),
  and rewards then see prompts and completions as strings, as in TRL;
- question: any other prompt column (``question`` by default) becomes the user turn of a chat.

The gold answer (the ``answer`` column, else ``solution``, else none) is also ``row["answer"]``
as text; the task's ``prepare`` then parses it, or leaves the row out. Bad rows are never dropped
silently: they either stop the run (``on_bad_row="error"``) or are listed in
``LoadedData.skipped`` and logged.
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

from leangrpo.core.errors import UserError
from leangrpo.data.rows import BadRow, Message, column_images, with_images

if TYPE_CHECKING:
    import datasets

    from leangrpo.config.schema import DataConfig
    from leangrpo.data.tasks import Task

logger = logging.getLogger("leangrpo.data.sources")

_JSONL_SUFFIXES = (".jsonl", ".json")
_DATASETS_SUFFIXES = {".parquet": "parquet", ".csv": "csv", ".tsv": "csv", ".json": "json", ".arrow": "arrow"}
_AUTO_PROMPT_COLUMNS = ("prompt", "question")  # TRL's name, then leangrpo's
_AUTO_ANSWER_COLUMNS = ("answer", "solution")  # leangrpo's, then TRL's accuracy_reward's
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class DataError(UserError, ValueError):
    """A one-line, user-facing problem with the training data (names the file and line)."""


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


def load_rows(data: DataConfig, task: Task, records: Iterable[dict[str, Any]] | None = None) -> LoadedData:
    """Load the rows of ``data`` for ``task``, validating each row. ``records``: rows already in memory (a
    ``datasets.Dataset`` or a list of dicts from the Python API), read instead of ``data.path``, which
    then only names them in messages.

    Raises DataError for a missing source, a misnamed column, a bad row under
    ``on_bad_row="error"``, or when no usable row remains.
    """
    if records is None:
        source, raw_rows = _open_source(data, task)
    else:
        source, raw_rows = data.path, _table_rows(data.path, records)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    columns: tuple[str, str | None] | None = None
    left_out = 0
    for where, raw in raw_rows:
        if data.limit is not None and len(rows) >= data.limit:
            break
        try:
            record = _as_record(raw)
            if columns is None:
                columns = _pick_columns(record, data, task, where)
            row = task.prepare(_make_row(record, data, *columns))
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


def default_task(data: DataConfig) -> str:
    """The task of a config without `task:`, from its data's first row: gsm8k for GSM8K's own layout (a
    question column, not TRL's prompt, and an answer with '####'), dataset (TRL's: your rewards, the
    prompt as it is) for any other data. Data that cannot be read yet (a missing file, which loading
    reports later) keeps gsm8k, the default before TRL-formatted data was recognised."""
    from leangrpo.data.tasks import Task

    try:
        _, raw_rows = _open_source(data, Task())
        record = _as_record(next(iter(raw_rows))[1])
    except (DataError, BadRow, StopIteration):
        return "gsm8k"
    prompt = data.prompt_column or next((c for c in _AUTO_PROMPT_COLUMNS if c in record), None)
    answer = record.get(data.answer_column or "answer")
    gsm8k = prompt == "question" and isinstance(answer, str) and "####" in answer
    return "gsm8k" if gsm8k else "dataset"


def _open_source(data: DataConfig, task: Task) -> tuple[str, Iterator[tuple[str, bytes | dict[str, Any]]]]:
    """Pick the reader for ``data.path``; return a name for messages and ``(where, raw row)``s.

    Rows the task generates (reasoning-gym) come first. A JSON Lines file is read here; other local
    files and directories by ``datasets``; a missing path shaped like ``owner/name`` is a hub dataset
    id; any other missing path is a missing file.
    """
    path = data.path
    generated = task.generated_rows(path, data.split)
    if generated is not None:
        source = f"{path}[{data.split}]"
        return source, _table_rows(source, generated)
    local = Path(path).expanduser()
    if local.is_dir():
        return path, _table_rows(path, _load_local_directory(local, data))
    if local.is_file():
        suffix = local.suffix.lower()
        # only a .json file may be one JSON array; a .jsonl is lines, each a row (or a bad row, named)
        if suffix == ".jsonl" or (suffix in _JSONL_SUFFIXES and not _is_json_array(local)):
            return path, _jsonl_lines(local, path)
        if suffix not in _DATASETS_SUFFIXES:
            known = ", ".join(sorted({*_JSONL_SUFFIXES, *_DATASETS_SUFFIXES}))
            raise DataError(f"unsupported data file type {suffix!r}: {path} (use {known} or a directory)")
        return path, _table_rows(path, _load_with_datasets(path, _DATASETS_SUFFIXES[suffix], str(local)))
    looks_local = local.suffix.lower() in {*_JSONL_SUFFIXES, *_DATASETS_SUFFIXES} or path.startswith(
        (".", "/", "~")
    )
    if looks_local or not _HUB_ID.match(path):
        raise DataError(f"data file not found: {path}")
    source = f"{path}[{data.split}]"
    return source, _table_rows(source, _load_hub_dataset(data))


def _is_json_array(path: Path) -> bool:
    """Whether a .json file holds one JSON array (read by ``datasets``) rather than JSON Lines."""
    with path.open("rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def _load_with_datasets(path: str, builder: str, data_files: str) -> datasets.Dataset:
    """One local file through a ``datasets`` packaged builder; any failure is a one-line DataError."""
    import datasets  # here, not at the top: pyarrow and datasets are large in memory

    try:
        return datasets.load_dataset(builder, data_files=data_files, split="train")
    except Exception as exc:  # datasets raises many types (parse errors, schema mismatches)
        raise DataError(f"could not read {path} as {builder}: {_first_line(exc)}") from exc


def _load_local_directory(local: Path, data: DataConfig) -> datasets.Dataset:
    """A ``save_to_disk`` directory (a Dataset, or a DatasetDict's ``data.split``), or a directory of
    data files (Parquet shards, JSON Lines, CSV...) whose split is found by ``datasets``' file naming."""
    import datasets

    path = str(local)
    saved = any((local / name).is_file() for name in ("dataset_info.json", "dataset_dict.json"))
    try:
        loaded = datasets.load_from_disk(path) if saved else datasets.load_dataset(path, split=data.split)
    except Exception as exc:
        raise DataError(f"could not load the dataset directory {path}: {_first_line(exc)}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if data.split not in loaded:
            splits = ", ".join(loaded)
            raise DataError(f"{path} has no split {data.split!r} (data.split); its splits: {splits}")
        return loaded[data.split]
    return loaded


def _first_line(exc: Exception) -> str:
    return f"{type(exc).__name__}: {next(iter(str(exc).strip().splitlines()), '')}"


def _load_hub_dataset(data: DataConfig) -> datasets.Dataset:
    """Download a hub dataset split; any failure (offline, unknown id/split) is a DataError."""
    import datasets

    try:
        return datasets.load_dataset(data.path, data.hub_config, split=data.split)
    except Exception as exc:  # datasets raises many types (network, 404, bad split)
        raise DataError(
            f"could not load hub dataset {data.path!r} (config {data.hub_config!r}, "
            f"split {data.split!r}): {_first_line(exc)}; "
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


def _pick_columns(record: dict[str, Any], data: DataConfig, task: Task, where: str) -> tuple[str, str | None]:
    """The prompt and answer columns, checked on the first row: absent there means a config mistake."""
    found = ", ".join(record) or "none"
    prompt = data.prompt_column or next((c for c in _AUTO_PROMPT_COLUMNS if c in record), None)
    if prompt is None:
        problem = "no 'prompt' or 'question' column (set data.prompt_column)"
        raise DataError(f"{where}: {problem}; columns found: {found}")
    answer = data.answer_column or next((c for c in _AUTO_ANSWER_COLUMNS if c in record), None)
    for setting, column in (("prompt_column", prompt), ("answer_column", data.answer_column)):
        if column is not None and column not in record:
            raise DataError(f"{where}: column {column!r} (data.{setting}) not found; columns found: {found}")
    if answer is None and task.needs_answer:
        raise DataError(
            f"{where}: task {task.name} needs a gold answer, but there is no 'answer' or 'solution' "
            f"column (set data.answer_column); columns found: {found}"
        )
    return prompt, answer


def _make_row(
    record: dict[str, Any], data: DataConfig, prompt_column: str, answer_column: str | None
) -> dict[str, Any]:
    """Turn one record into a training row, or raise BadRow saying what is wrong."""
    row = {k: v for k, v in record.items() if k != "prompt"}
    row["prompt"] = _prompt(record, prompt_column, data.system_prompt)
    if answer_column is not None:
        gold = _required_text(record, answer_column)
        if answer_column == "answer" or "answer" not in record:
            row["answer"] = gold
    return row


def _prompt(record: dict[str, Any], column: str, system_prompt: str | None) -> str | list[Message]:
    """The row's prompt in TRL's shape: chat messages, or (a text ``prompt`` column) plain text."""
    value = record.get(column)
    images = column_images(record)
    if isinstance(value, list):
        if not value or not all(isinstance(m, dict) and {"role", "content"} <= m.keys() for m in value):
            raise BadRow(f"{column!r} is a list but not chat messages ({{'role': ..., 'content': ...}})")
        if system_prompt and value[0]["role"] != "system":
            value = [{"role": "system", "content": system_prompt}, *value]
        return with_images(value, images)
    text = _required_text(record, column)
    if column == "prompt" and images:
        raise BadRow(
            "an image row needs a conversational prompt (chat messages or a question column), as in TRL; "
            "this prompt is plain text"
        )
    return text if column == "prompt" else with_images(_messages(text, system_prompt), images)


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


@dataclass(frozen=True)
class PromptSampler:
    """Which rows each rank trains on at each global step: a pure function of (step, rank).

    Epoch ``e`` visits rows in the order ``torch.randperm(num_rows)`` seeded with ``seed + e`` (or,
    without ``shuffle``, in the dataset's order: TRL's ``shuffle_dataset=False``); the epochs' orders
    are concatenated into one endless stream. Step ``s`` takes the next ``prompts_per_step *
    world_size`` entries and rank ``r`` its ``r``-th contiguous slice, so ranks never share a row
    within an epoch, and resuming at step ``k`` yields exactly what an uninterrupted run would. A step
    may span an epoch boundary (always when there are fewer rows than one step needs).
    """

    num_rows: int
    prompts_per_step: int
    seed: int
    rank: int = 0
    world_size: int = 1
    shuffle: bool = True

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
        positions = range(start, start + self.prompts_per_step)
        if not self.shuffle:
            return [pos % self.num_rows for pos in positions]
        return [
            _epoch_order(self.num_rows, self.seed + pos // self.num_rows)[pos % self.num_rows]
            for pos in positions
        ]


@functools.lru_cache(maxsize=8)
def _epoch_order(num_rows: int, seed: int) -> tuple[int, ...]:
    """The row order of one epoch (cached: every step of an epoch reuses it)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(num_rows, generator=generator).tolist())
