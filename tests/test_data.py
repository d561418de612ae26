"""Tests for leangrpo.data.sources: row loading and validation, prompt rendering, prompt sampling."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from leangrpo.config.schema import DataConfig, TaskConfig
from leangrpo.data.rows import PromptFormat, has_chat_template
from leangrpo.data.sources import DataError, LoadedData, PromptSampler, load_rows
from leangrpo.data.tasks import load_task
from leangrpo.data.tasks.gsm8k import parse_gold, solution_steps

GSM8K_DIR = Path(__file__).resolve().parent / "data" / "gsm8k"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def load(path: str | Path, task: str = "gsm8k", max_solution_steps: int | None = None, **data) -> LoadedData:
    """load_rows with a data config (system prompt "Think step by step." unless given) and a task."""
    options = {"max_solution_steps": max_solution_steps} if max_solution_steps else {}
    data_cfg = DataConfig(path=str(path), **{"system_prompt": "Think step by step.", **data})
    return load_rows(data_cfg, load_task(TaskConfig(name=task, **options)))


def write_jsonl(path: Path, lines: list[bytes | dict]) -> Path:
    """Write dicts as JSON lines and bytes verbatim (for malformed lines)."""
    encoded = [line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines]
    path.write_bytes(b"".join(line + b"\n" for line in encoded))
    return path


GOOD = {"question": "What is 2+3?", "answer": "2+3=5\n#### 5", "level": 1}


# --- loading -------------------------------------------------------------------------------


def test_real_gsm8k_file_with_limit():
    loaded = load(GSM8K_DIR / "test.jsonl", limit=5)
    assert len(loaded.rows) == 5
    assert loaded.skipped == []
    assert loaded.rows[0]["answer"] == "18"
    for row in loaded.rows:
        assert row["answer"].isdigit()
        system, user = row["prompt"]
        assert system == {"role": "system", "content": "Think step by step."}
        assert user == {"role": "user", "content": row["question"]}


def test_jsonl_loading_leaves_datasets_and_pyarrow_unimported(tmp_path):
    """They add ~80 MB to the RSS of every training process; only hub and Parquet data need them."""
    path = write_jsonl(tmp_path / "one.jsonl", [GOOD])
    code = (
        "import sys; from leangrpo.run.resolve import validate_config\n"
        "from leangrpo.data.sources import load_rows\n"
        f"cfg = validate_config({{'model': {{'name_or_path': 'm'}}, 'data': {{'path': {str(path)!r}}},"
        " 'rewards': {'functions': [{'name': 'int'}]}})\n"
        "from leangrpo.data.tasks import load_task\n"
        "assert len(load_rows(cfg.data, load_task(cfg.task)).rows) == 1\n"
        "print(sorted(m for m in ('datasets', 'pyarrow', 'pandas') if m in sys.modules))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_good_row_shape_carries_extra_columns(tmp_path):
    path = write_jsonl(tmp_path / "one.jsonl", [GOOD])
    (row,) = load(path, system_prompt=None).rows
    assert row == {
        "prompt": [{"role": "user", "content": "What is 2+3?"}],
        "question": "What is 2+3?",
        "answer": "5",
        "solution": "2+3=5\n#### 5",
        "level": 1,
    }


@pytest.fixture
def bad_jsonl(tmp_path) -> Path:
    return write_jsonl(
        tmp_path / "bad.jsonl",
        [
            GOOD,  # line 1
            {"question": "  ", "answer": "#### 1"},  # 2: empty question
            {"question": "No answer?"},  # 3: missing answer
            b'{"question": "unterminated',  # 4: invalid JSON
            b'{"question": "\xff\xfe", "answer": "#### 2"}',  # 5: not UTF-8
            {"question": "Q", "answer": "the answer is 3"},  # 6: no ####
            b"[1, 2]",  # 7: not an object
            b"   ",  # 8: blank, not a row
            {"question": "Last?", "answer": "#### 1,000"},  # 9
        ],
    )


def test_skip_reports_every_bad_row_with_its_line(bad_jsonl, caplog):
    with caplog.at_level(logging.WARNING, logger="leangrpo.data.sources"):
        loaded = load(bad_jsonl)
    assert [row["answer"] for row in loaded.rows] == ["5", "1000"]
    expected = [
        (2, "empty 'question'"),
        (3, "missing 'answer'"),
        (4, "invalid JSON"),
        (5, "not valid UTF-8"),
        (6, "no '####' in the answer"),
        (7, "not a JSON object"),
    ]
    for reason, (line, problem) in zip(loaded.skipped, expected, strict=True):
        assert reason.startswith(f"{bad_jsonl}:{line}: {problem}")
    assert loaded.skip_summary().startswith(f"skipped 6 bad row(s) (first: {bad_jsonl}:2:")
    assert "skipped 6 bad row(s)" in caplog.text


def test_error_mode_stops_at_first_bad_row(bad_jsonl):
    with pytest.raises(DataError, match=r"bad\.jsonl:2: empty 'question'"):
        load(bad_jsonl, on_bad_row="error")


def test_limit_counts_valid_rows(bad_jsonl):
    loaded = load(bad_jsonl, limit=1)
    assert len(loaded.rows) == 1
    assert loaded.skipped == []


def test_missing_local_file(tmp_path):
    for path in (tmp_path / "nope.jsonl", "./data/train", "owner/name.parquet"):
        with pytest.raises(DataError, match="data file not found"):
            load(path)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "data.txt"
    path.write_text("question,answer\n")
    with pytest.raises(DataError, match="unsupported data file type '.txt'"):
        load(path)


def test_column_typo_lists_columns_found(tmp_path):
    path = write_jsonl(tmp_path / "typo.jsonl", [GOOD])
    with pytest.raises(DataError) as info:
        load(path, prompt_column="questoin")
    message = str(info.value)
    assert f"{path}:1:" in message
    assert "'questoin' (data.prompt_column) not found" in message
    assert "question, answer, level" in message


def test_zero_usable_rows(tmp_path):
    path = write_jsonl(tmp_path / "allbad.jsonl", [{"question": "Q", "answer": "no marker"}])
    with pytest.raises(DataError, match=r"no usable rows in .*allbad\.jsonl; skipped 1 bad row"):
        load(path)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no usable rows"):
        load(empty)


def test_parquet_custom_columns_raw_answers(tmp_path):
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(
        [
            {"problem": "Six times seven?", "solution": 42, "source": "a"},
            {"problem": "Broken", "solution": None, "source": "b"},
            {"problem": "One plus one?", "solution": 2, "source": "c"},
        ]
    ).to_parquet(str(path))
    loaded = load(path, task="dataset", prompt_column="problem", answer_column="solution")
    assert [(r["prompt"][-1]["content"], r["answer"], r["solution"], r["source"]) for r in loaded.rows] == [
        ("Six times seven?", "42", 42, "a"),
        ("One plus one?", "2", 2, "c"),
    ]
    assert loaded.rows[0]["problem"] == "Six times seven?"  # every column keeps its own name
    assert loaded.skipped == [f"{path} row 1: empty 'solution'"]


def test_hub_load_failure_is_one_line_data_error(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub\n(more detail)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        load("openai/gsm8k", hub_config="main")
    message = str(info.value)
    assert "\n" not in message
    assert "'openai/gsm8k'" in message
    assert "ConnectionError" in message
    assert "local .jsonl" in message


def test_hub_load_success(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []

    def fake_load(path, name, split):
        calls.append((path, name, split))
        return datasets.Dataset.from_list([GOOD, {"question": "", "answer": "#### 1", "level": 2}])

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    loaded = load("openai/gsm8k", hub_config="main", split="test")
    assert calls == [("openai/gsm8k", "main", "test")]
    assert [r["answer"] for r in loaded.rows] == ["5"]
    assert loaded.skipped == ["openai/gsm8k[test] row 1: empty 'question'"]


def test_loaded_data_summary_empty_when_nothing_skipped():
    assert LoadedData(rows=[{}]).skip_summary() == ""


@pytest.mark.parametrize(
    ("answer", "gold"),
    [
        ("She pays 500 + 500 = 1,000.\n#### 1,000", "1000"),
        ("#### 72", "72"),
        ("a #### 1 then #### 2 ", "2"),
        ("no marker here", None),
    ],
)
def test_parse_gold(answer, gold):
    assert parse_gold(answer) == gold


# --- prompt rendering ------------------------------------------------------------------------


def tiny_tokenizer(chat_template: str | None) -> PreTrainedTokenizerFast:
    vocab = {"[UNK]": 0, "Question": 1, "Answer": 2}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = chat_template
    return tokenizer


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]


def test_prompt_format_with_chat_template():
    tokenizer = tiny_tokenizer(CHATML)
    assert has_chat_template(tokenizer)
    text = PromptFormat("<reasoning>\n").render(tokenizer, MESSAGES)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n2+3?<|im_end|>\n"
        "<|im_start|>assistant\n<reasoning>\n"
    )


def test_prompt_format_plain_fallback():
    tokenizer = tiny_tokenizer(None)
    assert not has_chat_template(tokenizer)
    assert PromptFormat().render(tokenizer, MESSAGES) == "Be brief.\n\nQuestion: 2+3?\nAnswer:"
    assert PromptFormat("<reasoning>\n").render(tokenizer, MESSAGES[1:]) == (
        "Question: 2+3?\nAnswer: <reasoning>\n"
    )
    few_shot = [
        {"role": "user", "content": "1+1?"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "2+3?"},
    ]
    expected = "Question: 1+1?\nAnswer: 2\n\nQuestion: 2+3?\nAnswer:"
    assert PromptFormat().render(tokenizer, few_shot) == expected


# --- sampling --------------------------------------------------------------------------------


def stream(num_rows: int, per_step: int, world: int, steps: int, seed: int = 0) -> list[int]:
    """Indices of all ranks over `steps` steps, in stream order."""
    samplers = [PromptSampler(num_rows, per_step, seed, rank, world) for rank in range(world)]
    return [i for step in range(steps) for s in samplers for i in s.indices(step)]


def test_sampler_follows_documented_epoch_permutations():
    expected = [
        *torch.randperm(10, generator=torch.Generator().manual_seed(7)).tolist(),
        *torch.randperm(10, generator=torch.Generator().manual_seed(8)).tolist(),
    ]
    assert stream(10, per_step=2, world=2, steps=5, seed=7) == expected


def test_sampler_without_shuffle_takes_the_dataset_order():
    """TRL's shuffle_dataset=False: every epoch in the dataset's order, ranks on contiguous slices."""
    assert stream(5, per_step=2, world=2, steps=3) != [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1]
    samplers = [PromptSampler(5, 2, 7, rank, 2, shuffle=False) for rank in range(2)]
    assert [i for step in range(3) for s in samplers for i in s.indices(step)] == [
        0,
        1,
        2,
        3,
        4,
        0,
        1,
        2,
        3,
        4,
        0,
        1,
    ]


def test_sampler_is_deterministic_and_seeded():
    a = PromptSampler(100, 8, seed=3)
    assert a.indices(4) == PromptSampler(100, 8, seed=3).indices(4)
    assert a.indices(4) != PromptSampler(100, 8, seed=4).indices(4)
    assert a.indices(4) != a.indices(5)


def test_sampler_ranks_disjoint_and_epoch_covers_every_row_once():
    per_step, world, num_rows = 3, 4, 36  # 3 steps per epoch
    for step in range(3):
        seen = [set(PromptSampler(num_rows, per_step, 0, r, world).indices(step)) for r in range(4)]
        assert sum(len(s) for s in seen) == per_step * world
        assert len(set().union(*seen)) == per_step * world
    assert sorted(stream(num_rows, per_step, world, steps=3)) == list(range(num_rows))


def test_sampler_wraps_across_epochs_when_rows_fewer_than_a_step():
    num_rows = 3
    indices = stream(num_rows, per_step=2, world=2, steps=3)  # 12 slots = 4 epochs
    epochs = [indices[i : i + num_rows] for i in range(0, len(indices), num_rows)]
    assert all(sorted(epoch) == [0, 1, 2] for epoch in epochs)
    assert PromptSampler(1, 4, seed=0).indices(2) == [0, 0, 0, 0]


def test_sampler_resume_matches_uninterrupted_run():
    uninterrupted = PromptSampler(50, 4, seed=1, rank=1, world_size=2)
    history = [uninterrupted.indices(step) for step in range(20)]
    resumed = PromptSampler(50, 4, seed=1, rank=1, world_size=2)
    assert resumed.indices(17) == history[17]


@pytest.mark.parametrize(
    "args",
    [(0, 4, 0), (10, 0, 0), (10, 4, 0, 2, 2), (10, 4, 0, -1, 2), (10, 4, 0, 0, 0)],
)
def test_sampler_rejects_bad_arguments(args):
    with pytest.raises(ValueError):
        PromptSampler(*args)


# --- easier problems first -----------------------------------------------------------------


def test_solution_steps_counts_reasoning_lines():
    assert solution_steps("a = 1\nb = 2\n\n#### 3") == 2
    assert solution_steps("#### 3") == 0


def test_max_solution_steps_keeps_short_solutions_and_limit_counts_kept_rows(tmp_path, caplog):
    long = {"question": "Long?", "answer": "1\n2\n3\n#### 3"}
    path = write_jsonl(tmp_path / "mix.jsonl", [long, GOOD, long, GOOD, GOOD])
    with caplog.at_level(logging.INFO, logger="leangrpo.data.sources"):
        rows = load(path, max_solution_steps=2, limit=2).rows
    assert [r["question"] for r in rows] == ["What is 2+3?"] * 2
    assert "2 left out by task.max_solution_steps=2" in caplog.text


def test_max_solution_steps_leaving_nothing_says_why(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", [{"question": "Q", "answer": "1\n2\n#### 3"}])
    with pytest.raises(DataError, match="1 left out by task.max_solution_steps=1"):
        load(path, max_solution_steps=1)


# --- TRL's dataset formats and the files `datasets` reads -----------------------------------

CHAT = [{"role": "user", "content": "What is 2+3?"}]
TRL_ROWS = [
    {"prompt": CHAT, "solution": "5", "meta": {"source": "x", "tags": ["a", "b"]}},
    {"prompt": [{"role": "user", "content": "1+1?"}], "solution": "2", "meta": {"source": "y", "tags": []}},
]


def test_trl_conversational_rows_keep_messages_and_columns(tmp_path):
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRL_ROWS))
    rows = load(tmp_path / "train.jsonl", task="dataset", system_prompt=None).rows
    assert rows[0] == {"prompt": CHAT, "solution": "5", "answer": "5", "meta": TRL_ROWS[0]["meta"]}
    with_system = load(tmp_path / "train.jsonl", task="dataset").rows[0]["prompt"]
    assert with_system == [{"role": "system", "content": "Think step by step."}, *CHAT]


def test_trl_standard_and_prompt_only_rows(tmp_path):
    path = write_jsonl(tmp_path / "std.jsonl", [{"prompt": "The sky is"}, {"prompt": "Once upon", "id": 7}])
    rows = load(path, task="dataset").rows
    assert rows == [{"prompt": "The sky is"}, {"prompt": "Once upon", "id": 7}]  # text, no chat, no answer
    assert PromptFormat("<r>").render(tiny_tokenizer(CHATML), rows[0]["prompt"]) == "The sky is<r>"


def test_gsm8k_task_needs_an_answer_column(tmp_path):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "Why?"}])
    with pytest.raises(DataError, match="task gsm8k needs a gold answer.*columns found: question"):
        load(path)


def test_bad_chat_messages_are_bad_rows(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": [{"text": "hi"}]}, {"prompt": CHAT}])
    loaded = load(path, task="dataset")
    assert len(loaded.rows) == 1
    (reason,) = loaded.skipped
    assert reason == f"{path}:1: 'prompt' is a list but not chat messages ({{'role': ..., 'content': ...}})"


@pytest.mark.parametrize("kind", ["save_to_disk", "dataset_dict", "parquet_shards", "json_array", "csv"])
def test_local_formats_load_through_datasets(tmp_path, kind):
    table = datasets.Dataset.from_list(TRL_ROWS)
    if kind == "save_to_disk":
        table.save_to_disk(path := tmp_path / "saved")
    elif kind == "dataset_dict":
        splits = datasets.DatasetDict({"train": table, "test": table.select([1])})
        splits.save_to_disk(path := tmp_path / "dd")
    elif kind == "parquet_shards":
        (path := tmp_path / "shards").mkdir()
        for i in range(2):
            table.select([i]).to_parquet(str(path / f"part-{i:05d}.parquet"))
    elif kind == "json_array":
        (path := tmp_path / "rows.json").write_text(json.dumps(TRL_ROWS, indent=1))
    else:
        path = tmp_path / "rows.csv"
        path.write_text("prompt,solution\nThe sky is,blue\nGrass is,green\n")
        assert [r["prompt"] for r in load(path, task="dataset").rows] == ["The sky is", "Grass is"]
        return
    rows = load(path, task="dataset", system_prompt=None).rows
    assert sorted(r["solution"] for r in rows) == ["2", "5"]
    assert {r["prompt"][0]["content"] for r in rows} == {"What is 2+3?", "1+1?"}
    assert sorted(r["meta"]["source"] for r in rows) == ["x", "y"]  # nested values intact
    if kind == "dataset_dict":
        assert len(load(path, task="dataset", split="test").rows) == 1
        with pytest.raises(DataError, match="has no split 'dev'.*its splits: train, test"):
            load(path, task="dataset", split="dev")


def test_eval_split_of_a_saved_dataset_dict(tmp_path):
    from leangrpo.train.evaluation import load_eval_rows

    table = datasets.Dataset.from_list(TRL_ROWS)
    datasets.DatasetDict({"train": table, "test": table.select([1])}).save_to_disk(tmp_path / "dd")
    data = DataConfig(path=str(tmp_path / "dd"), system_prompt=None)
    rows = load_eval_rows(data, load_task(TaskConfig(name="dataset")), str(tmp_path / "dd"), "test", None)
    assert [r["solution"] for r in rows] == ["2"]


@pytest.mark.parametrize(
    "first_row, task",
    [
        ({"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"}, "dataset"),
        ({"prompt": "What is 2+2?", "solution": "4"}, "dataset"),
        ({"question": "What is 2+2?", "answer": "4"}, "dataset"),
        ({"question": "What is 2+2?", "answer": "2+2=4\n#### 4"}, "gsm8k"),
    ],
)
def test_config_without_task_takes_it_from_the_data(tmp_path, first_row, task):
    """Without `task:`, TRL-formatted data (a prompt column) and other data train as task dataset, with
    the config's rewards and no system prompt added; only GSM8K's own layout (question, answer with
    '####') picks gsm8k. The rows then load under that task (before: 'no '####' in the answer')."""
    from leangrpo.run.resolve import validate_config

    path = write_jsonl(tmp_path / "d.jsonl", [first_row, first_row])
    cfg = validate_config(
        {
            "model": {"name_or_path": "m"},
            "data": {"path": str(path)},
            "rewards": {"functions": [{"name": "trl.rewards:accuracy_reward"}]},
        }
    )
    assert cfg.task.name == task
    assert (cfg.data.system_prompt is None) == (task == "dataset")
    assert len(load_rows(cfg.data, load_task(cfg.task)).rows) == 2


def test_config_without_task_keeps_gsm8k_for_the_gsm8k_sample_and_unread_data():
    """The shipped GSM8K sample still trains as gsm8k, and so does data not there yet (its loading
    reports it), so a config's default rewards stay the GSM8K recipe's."""
    from leangrpo.run.resolve import validate_config

    for path in (GSM8K_DIR / "train.jsonl", "not-there.jsonl"):
        cfg = validate_config({"model": {"name_or_path": "m"}, "data": {"path": str(path)}})
        assert cfg.task.name == "gsm8k" and cfg.rewards.functions
