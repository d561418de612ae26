"""One run of the default demo's recipe with some of its settings changed, for tuning it; appends a line
to a JSONL file: the held-out correct count before, after the cold start and after GRPO.

    OMP_NUM_THREADS=1 python benchmarks/demo_tuning.py C2 --sft-digits 1 --sft-lr 2e-4 -G 8 --lr 1e-4 \\
        --temperature 1.2 [--seed 2] [--steps 30] [--sft-steps 4] [--eval-steps 10] \\
        [--sft-equation] [--control random-reward] [--out /tmp/tuning]

The shipped recipe is `leangrpo demo` (leangrpo.commands.demo.demo_config); benchmarks/RESULTS.md lists
the runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_seeds import correct  # noqa: E402

from leangrpo.commands.demo import CHAIN_SUM, demo_config
from leangrpo.data.tasks.reasoning_gym import ReasoningGym
from leangrpo.run.resolve import validate_config
from leangrpo.train.trainer import train


def equation_solution(self: ReasoningGym, row: dict[str, Any]) -> str:
    """A cold-start target whose reasoning is the problem's equation (`58 + 26 = 84`) instead of the
    shipped `The answer is 84.` (the arithmetic generators put the expression in the metadata)."""
    answer, expression = row["answer"], row["metadata"]["expression"]
    return f"<reasoning>\n{expression} = {answer}\n</reasoning>\n<answer>\n{answer}\n</answer>\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name", help="the run's name: OUT/NAME is its directory")
    p.add_argument("--out", type=Path, default=Path("/tmp/tuning"))
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--steps", type=int, default=20, help="GRPO steps")
    p.add_argument("--sft-steps", type=int, default=8, help="cold-start steps")
    p.add_argument("--sft-digits", type=int, default=1, help="digits of the cold start's sums")
    p.add_argument("--sft-lr", type=float, default=2e-4)
    p.add_argument("--lr", type=float, default=1e-4, help="GRPO learning rate")
    p.add_argument("-G", "--num-generations", type=int, default=8)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--temperature", type=float, default=1.2)
    p.add_argument("--control", choices=("none", "random-reward"), default="none")
    p.add_argument("--eval-steps", type=int, default=0, help="also evaluate every N GRPO steps")
    p.add_argument(
        "--sft-equation", action="store_true", help="the cold start's reasoning writes `a + b = c` out"
    )
    a = p.parse_args()

    run = a.out / a.name
    cfg = demo_config(
        "chain_sum", a.steps, False, str(run), sft_steps=a.sft_steps, seed=a.seed, control=a.control
    ).model_dump()
    sums = {**CHAIN_SUM, "min_digits": a.sft_digits, "max_digits": a.sft_digits}
    cfg["sft"].update(learning_rate=a.sft_lr, task={"config": {"chain_sum": sums}})
    cfg["grpo"].update(num_generations=a.num_generations, temperature=a.temperature)
    cfg["optim"].update(learning_rate=a.lr, per_device_train_batch_size=a.num_generations * a.prompts)
    cfg["eval"].update(eval_steps=a.eval_steps)
    if a.sft_equation:
        ReasoningGym.solution = equation_solution  # type: ignore[method-assign]
    start = time.perf_counter()
    train(validate_config(cfg, source="demo_tuning"), overwrite=True)

    steps = sorted(int(f.stem[5:]) for f in (run / "eval").glob("step-*.jsonl"))
    result = {
        **{k: str(v) for k, v in vars(a).items()},
        "seconds": round(time.perf_counter() - start),
        "before": sum(correct(run, "step-0")),
        "cold_start": sum(correct(run, "cold-start")),
        "after": sum(correct(run, "last")),
        "by_step": {s: sum(correct(run, f"step-{s}")) for s in steps[1:]},
    }
    print(json.dumps(result))
    with (a.out / "results.jsonl").open("a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
