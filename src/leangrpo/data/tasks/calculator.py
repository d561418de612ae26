"""reasoning-gym arithmetic with a `calculator` tool: sums and products of 3–4 digit numbers, which a 135M
model cannot do in its head but can hand to the tool. Problems and correctness are reasoning_gym's
(`data.path: reasoning_gym:chain_sum`); the run offers the tool with
`tools: {functions: [leangrpo.data.tasks.calculator:calculator]}`. The cold start's worked solutions are
tool-use traces in the ChatML tool format (engines/tools.py gives it to SmolLM2): one calculator call on
the problem's expression, the tool's result, then the answer in the `<reasoning>`/`<answer>` format.
With `task.tool: calculator_step` (the tool that takes one operation a call) a trace chains one call per
operation, each on the previous result: a problem of n terms needs n - 1 calls in sequence.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any, Literal

from pydantic import Field

from leangrpo.data.tasks.reasoning_gym import ReasoningGym, ReasoningGymOptions

MAX_EXPRESSION_CHARS = 200
"""Longer expressions are refused: the tool's work stays bounded whatever the model writes."""
_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}
_UNARY: dict[type[ast.unaryop], Callable[[Fraction], Fraction]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly.

    Args:
        expression: numbers with + - * / and parentheses, e.g. "(1234 + 5678) * 3"
    """
    return _value(_parse(expression))


def calculator_step(expression: str) -> str:
    """Evaluate one arithmetic operation exactly: two numbers and one of + - * /.

    Args:
        expression: two numbers and one operator, e.g. "1234 + 5678"
    """
    tree = _parse(expression)
    operations = sum(isinstance(node, ast.BinOp) for node in ast.walk(tree))
    if operations > 1:
        raise ValueError(f"one operation per call, not {operations}: call again with the result")
    return _value(tree)


def _parse(expression: str) -> ast.Expression:
    """The parsed expression; text too long or not Python syntax is refused."""
    if not isinstance(expression, str):
        raise ValueError("expression must be text")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r:.60}") from None
    return tree


def _value(tree: ast.Expression) -> str:
    """The exact value of a parsed expression as text: an integer, or the float nearest a fraction."""
    try:
        value = _evaluate(tree.body)
        return str(value.numerator) if value.denominator == 1 else repr(float(value))
    except OverflowError:  # a fraction past float's range
        raise ValueError("a number out of range") from None


def _evaluate(node: ast.expr) -> Fraction:
    """The exact value of a parsed expression of numbers, + - * / and parentheses; anything else (names,
    calls, attributes, powers, strings, booleans, complex numbers) is refused."""
    number = node.value if isinstance(node, ast.Constant) else None
    if isinstance(number, (int, float)) and not isinstance(number, bool):  # not complex either
        if isinstance(number, float) and not math.isfinite(number):
            raise ValueError("a number out of range")
        return Fraction(repr(number))  # as written: 0.1 is 1/10, not the float nearest it
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div) and right == 0:
            raise ValueError("division by zero")
        return _BINARY[type(node.op)](left, right)
    raise ValueError(f"only numbers, + - * / and parentheses are allowed, not {ast.unparse(node)!r:.40}")


TOOLS: dict[str, Callable[[str], str]] = {"calculator": calculator, "calculator_step": calculator_step}


def steps(expression: str) -> list[str]:
    """calculator_step's calls for a chain of + and - (`a + b - c`), left to right, each on the previous
    result: `a + b`, then `<a + b> - c`."""
    first, *rest = expression.split()
    if len(rest) % 2 or any(op not in "+-" for op in rest[::2]):
        raise ValueError(f"not a chain of numbers joined by + and -: {expression!r:.60}")
    calls, value = [], first
    for op, term in zip(rest[::2], rest[1::2], strict=True):
        calls.append(f"{value} {op} {term}")
        value = calculator_step(calls[-1])
    return calls or [first]


def tool_trace(expression: str, answer: str, tool: str = "calculator") -> str:
    """The assistant's side of a solved problem, as the model writes it after the prompt: each call of
    `tool` (one turn, ended by `<|im_end|>`) with the tool's result as the chat template shows it, then
    the answer turn (its end token left to the cold start, which adds the tokenizer's). `calculator`
    takes the whole expression in one call; `calculator_step` one operation a call (`steps`)."""
    turns = []
    for step in [expression] if tool == "calculator" else steps(expression):
        call = json.dumps({"name": tool, "arguments": {"expression": step}})
        turns.append(
            f"<tool_call>\n{call}\n</tool_call><|im_end|>\n"
            f"<|im_start|>user\n<tool_response>\n{TOOLS[tool](step)}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"
        )
    return (
        "".join(turns) + f"<reasoning>\nThe calculator gives {answer}.\n</reasoning>\n"
        f"<answer>\n{answer}\n</answer>\n"
    )


class CalculatorOptions(ReasoningGymOptions):
    tool: Literal["calculator", "calculator_step"] = Field(
        "calculator",
        description="the tool the cold start's traces call: calculator takes the whole expression, "
        "calculator_step one operation a call (a chain of n terms takes n - 1 calls); offer the same one "
        "in tools.functions",
    )


class Calculator(ReasoningGym):
    name = "calculator"
    Options = CalculatorOptions
    options: CalculatorOptions

    def solution(self, row: dict[str, Any]) -> str:
        """A tool-use trace: the tool on the generator's own expression, then the gold answer."""
        return tool_trace(str(row["metadata"]["expression"]), str(row["answer"]), self.options.tool)


TASK = Calculator
