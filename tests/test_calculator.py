"""The built-in tool task: the calculator against hostile input, and the cold start's tool-use traces read
back by the chat template and the tool loop's own parser."""

from __future__ import annotations

from collections import Counter

import pytest

from leangrpo.config.schema import TaskConfig
from leangrpo.data.rewards.builtin import ANSWER_FORMAT_PROMPT
from leangrpo.data.tasks import load_task
from leangrpo.data.tasks.calculator import calculator
from leangrpo.engines.tools import Toolbox, ToolUse, parse_turn, prepare_tokenizer, run_tool_calls


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1234 + 5678", "6912"), ("(2 + 3) * 4", "20"), ("559 - -32", "591"), ("7 / 2", "3.5"),
     ("1 / 3", repr(1 / 3)), ("0.1 + 0.2", "0.3"), (" 4821 * 9377 ", str(4821 * 9377))],
)  # fmt: skip
def test_the_calculator_is_exact(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo hi')", "().__class__.__bases__", "open('/etc/passwd')", "x + 1",
        "2 ** 10", "9 ** 9 ** 9", "1 if 1 else 2", "'a' * 3", "True + 1", "1j * 2", "[1, 2]", "lambda: 1",
        "1; 2", "1 // 2", "5 % 3", "1 << 40", "", "1 +", "1 / 0", "1e999 - 1", "1e308 * 1e308 / 3",
        "9" * 201, "(" * 99 + "1" + ")" * 99 + " + " + "1" * 100,
    ],
)  # fmt: skip
def test_the_calculator_refuses_anything_else(expression):
    with pytest.raises(ValueError):
        calculator(expression)


def test_a_hostile_call_is_a_failed_tool_call():
    """Through the tool loop's Toolbox: the model gets the error, the call counts as failed."""
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "exit()"}}}
    [(name, content, failed)] = run_tool_calls([(Toolbox([calculator]), call)])
    assert name == "calculator" and failed and "error" in content


@pytest.fixture(scope="module")
def rows():
    task = load_task(
        TaskConfig(
            name="calculator",
            config={"chain_sum": {"min_terms": 3, "max_terms": 4, "min_digits": 3, "max_digits": 4}},
        )
    )
    return task, task.generated_rows("reasoning_gym:chain_sum", "train")[:5]  # fmt: skip


def test_traces_are_what_the_chat_template_renders_and_parse_back(real_tokenizer_dir, rows):
    """Each trace, after its prompt, is the conversation the ChatML tool template renders (tool call,
    result, answer); its first turn parses back, with the tool loop's parser, into the calculator call
    whose result is the gold answer; and the task finds the answer correct."""
    from transformers import AutoTokenizer

    from leangrpo.data.rows import PromptFormat

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    prepare_tokenizer(tok)
    box = Toolbox([calculator])
    task, problems = rows
    for row in problems:
        prompt = [
            {"role": "system", "content": ANSWER_FORMAT_PROMPT},
            {"role": "user", "content": row["question"]},
        ]
        trace = task.solution(row)
        call = {
            "type": "function",
            "function": {"name": "calculator", "arguments": {"expression": row["metadata"]["expression"]}},
        }
        final = trace.rsplit("<|im_start|>assistant\n", 1)[1]
        conversation = [
            *prompt, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "calculator", "content": row["answer"]},
            {"role": "assistant", "content": final},
        ]  # fmt: skip
        shown = PromptFormat().render(tok, prompt, box.schemas)
        assert tok.apply_chat_template(conversation, tools=box.schemas, tokenize=False) == (
            shown + trace + tok.eos_token + "\n"
        )
        first_turn = trace.split("<|im_end|>")[0] + "<|im_end|>"
        use = ToolUse([[]], [1], [Counter()], [Counter()])
        prefix = tok(shown, add_special_tokens=False).input_ids
        _, calls = parse_turn(tok, tok(first_turn, add_special_tokens=False).input_ids, prefix, box, use, 0)
        assert calls == [call] and not use.failures[0]
        assert run_tool_calls([(box, c) for c in calls]) == [("calculator", row["answer"], False)]
        assert task.is_correct(trace, row)
        assert abs(int(row["answer"])) >= 100  # 3–4 digit terms: not one-digit sums
