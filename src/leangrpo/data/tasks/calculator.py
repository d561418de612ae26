"""reasoning-gym arithmetic with a `calculator` tool: sums and products of 3–4 digit numbers, which a 135M
model cannot do in its head but can hand to the tool. Problems and correctness are reasoning_gym's
(`data.path: reasoning_gym:chain_sum`); the run offers the tool with
`tools: {functions: [leangrpo.data.tasks.calculator:calculator]}`. The cold start's worked solutions are
tool-use traces in the ChatML tool format (engines/tools.py gives it to SmolLM2): one calculator call on
the problem's expression, the tool's result, then the answer in the `<reasoning>`/`<answer>` format.
"""

from __future__ import annotations

import ast
import json
import math
import operator
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from leangrpo.data.tasks.reasoning_gym import ReasoningGym

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
    if not isinstance(expression, str):
        raise ValueError("expression must be text")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"not an arithmetic expression: {expression!r:.60}") from None
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


def tool_trace(expression: str, answer: str) -> str:
    """The assistant's side of a solved problem, as the model writes it after the prompt: a calculator call
    (ended by `<|im_end|>`), the tool's result as the chat template shows it, and the answer turn (its end
    token left to the cold start, which adds the tokenizer's)."""
    call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
    return (
        f"<tool_call>\n{call}\n</tool_call><|im_end|>\n"
        f"<|im_start|>user\n<tool_response>\n{calculator(expression)}\n</tool_response><|im_end|>\n"
        f"<|im_start|>assistant\n<reasoning>\nThe calculator gives {answer}.\n</reasoning>\n"
        f"<answer>\n{answer}\n</answer>\n"
    )


class Calculator(ReasoningGym):
    name = "calculator"

    def solution(self, row: dict[str, Any]) -> str:
        """A tool-use trace: the calculator on the generator's own expression, then the gold answer."""
        return tool_trace(str(row["metadata"]["expression"]), str(row["answer"]))


TASK = Calculator
