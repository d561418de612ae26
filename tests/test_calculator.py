"""The built-in tool task: the calculator against hostile input, and the cold start's tool-use traces read
back by the chat template and the tool loop's own parser."""

from __future__ import annotations

from collections import Counter

import pytest

from leangrpo.config.schema import TaskConfig
from leangrpo.data.rewards.builtin import ANSWER_FORMAT_PROMPT
from leangrpo.data.tasks import load_task
from leangrpo.data.tasks.calculator import TOOLS, calculator, calculator_step, steps
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


@pytest.mark.parametrize(
    ("expression", "value"),
    [("1234 + 5678", "6912"), ("-3579 - 9376", "-12955"), ("7 / 2", "3.5"), ("42", "42")],
)
def test_calculator_step_takes_one_operation(expression, value):
    assert calculator_step(expression) == value


@pytest.mark.parametrize("expression", ["1 + 2 + 3", "(1 + 2) * 3", "-(1 - 2) - 3", "x + 1", "2 ** 3"])
def test_calculator_step_refuses_more_than_one_operation_or_anything_else(expression):
    with pytest.raises(ValueError, match="one operation per call|only numbers|not an arithmetic"):
        calculator_step(expression)


def test_steps_chain_left_to_right_on_each_result():
    assert steps("1663 - 5242 - 9376") == ["1663 - 5242", "-3579 - 9376"]
    assert steps("12 + 30 - 2 + 5") == ["12 + 30", "42 - 2", "40 + 5"]
    assert steps("7") == ["7"]
    with pytest.raises(ValueError, match="chain of numbers"):
        steps("2 * 3 + 1")


@pytest.fixture(scope="module", params=["calculator", "calculator_step"])
def rows(request):
    task = load_task(
        TaskConfig(
            name="calculator",
            tool=request.param,
            config={"chain_sum": {"min_terms": 3, "max_terms": 4, "min_digits": 3, "max_digits": 4}},
        )
    )
    return task, task.generated_rows("reasoning_gym:chain_sum", "train")[:5]  # fmt: skip


def test_traces_are_what_the_chat_template_renders_and_parse_back(real_tokenizer_dir, rows):
    """Each trace, after its prompt, is the conversation the ChatML tool template renders (tool calls with
    their results, then the answer); each call turn parses back, with the tool loop's parser, into the
    call that gives the next step, the last one's result being the gold answer; and the task finds the
    answer correct. `calculator` takes the whole expression in one call, `calculator_step` one call per
    operation, each on the previous result."""
    from transformers import AutoTokenizer

    from leangrpo.data.rows import PromptFormat

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    prepare_tokenizer(tok)
    task, problems = rows
    tool = task.options.tool
    box = Toolbox([TOOLS[tool]])
    for row in problems:
        prompt = [
            {"role": "system", "content": ANSWER_FORMAT_PROMPT},
            {"role": "user", "content": row["question"]},
        ]
        trace = task.solution(row)
        expression = row["metadata"]["expression"]
        calls = [
            {"type": "function", "function": {"name": tool, "arguments": {"expression": step}}}
            for step in ([expression] if tool == "calculator" else steps(expression))
        ]
        assert len(calls) == (1 if tool == "calculator" else row["metadata"]["num_terms"] - 1)
        results = [TOOLS[tool](c["function"]["arguments"]["expression"]) for c in calls]
        assert results[-1] == row["answer"]
        final = trace.rsplit("<|im_start|>assistant\n", 1)[1]
        conversation = [*prompt]
        for call, result in zip(calls, results, strict=True):
            conversation += [
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "name": tool, "content": result},
            ]
        conversation.append({"role": "assistant", "content": final})
        shown = PromptFormat().render(tok, prompt, box.schemas)
        assert tok.apply_chat_template(conversation, tools=box.schemas, tokenize=False) == (
            shown + trace + tok.eos_token + "\n"
        )
        turns = [
            t.split("<|im_start|>assistant\n")[-1] + "<|im_end|>" for t in trace.split("<|im_end|>")[::2]
        ]
        prefix = tok(shown, add_special_tokens=False).input_ids
        for turn, call, result in zip(turns, calls, results, strict=False):
            use = ToolUse([[]], [1], [Counter()], [Counter()])
            _, parsed = parse_turn(tok, tok(turn, add_special_tokens=False).input_ids, prefix, box, use, 0)
            assert parsed == [call] and not use.failures[0]
            assert run_tool_calls([(box, c) for c in parsed]) == [(tool, result, False)]
        assert task.is_correct(trace, row)
        assert abs(int(row["answer"])) >= 100  # 3–4 digit terms: not one-digit sums
