"""GSM8K grade-school math word problems with the R1 recipe (willccbb's grpo_demo.py): the model reasons
inside `<reasoning>` tags and answers inside `<answer>` tags; five rewards score the format and the answer.

Rows come from GSM8K's `question`/`answer` columns, whose answer is a worked solution ending in
`#### <gold>`: the gold number is parsed out and the solution is kept for the cold start.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field

from leangrpo.data.tasks import Task, TaskOptions

_CALCULATOR_NOTE = re.compile(r"<<[^>]*>>")  # GSM8K's "48/2 = <<48/2=24>>24" annotations


def parse_gold(answer: str) -> str | None:
    """Gold answer of a worked solution: text after the last '####', without commas or padding; None
    when there is no '####' marker."""
    _, marker, tail = answer.rpartition("####")
    return tail.replace(",", "").strip() if marker else None


def solution_steps(solution: str) -> int:
    """Number of reasoning lines in a worked solution (the lines before '####')."""
    return len([line for line in solution.rpartition("####")[0].splitlines() if line.strip()])


def tagged_solution(solution: str, answer: str) -> str:
    """A worked solution in the recipe's format, without its calculator annotations."""
    steps = _CALCULATOR_NOTE.sub("", solution.rpartition("####")[0]).strip()
    return f"<reasoning>\n{steps}\n</reasoning>\n<answer>\n{answer}\n</answer>\n"


class GSM8KOptions(TaskOptions):
    max_solution_steps: int | None = Field(
        None, ge=1, description="keep only problems whose worked solution has at most this many lines"
    )


class GSM8K(Task):
    name = "gsm8k"
    Options = GSM8KOptions
    options: GSM8KOptions
    default_rewards = ("xmlcount", "soft_format", "strict_format", "int", "correctness")
    has_solutions = True
    needs_answer = True

    def prepare(self, row: dict[str, Any]) -> dict[str, Any] | None:
        from leangrpo.data.rows import BadRow

        gold = parse_gold(str(row["answer"]))
        if gold is None:
            raise BadRow("no '####' in the answer")
        if not gold:
            raise BadRow("nothing after '####' in the answer")
        limit = self.options.max_solution_steps
        if limit and solution_steps(row["answer"]) > limit:
            return None
        return {**row, "solution": row["answer"], "answer": gold}

    def left_out(self, count: int) -> str:
        return f"{count} left out by task.max_solution_steps={self.options.max_solution_steps}"

    def solution(self, row: dict[str, Any]) -> str:
        return tagged_solution(row["solution"], row["answer"])


TASK = GSM8K
