"""How often the tool demo's cold-start model is right when sampled, by temperature: whether GRPO gets a
signal (a group of all-wrong rollouts has none). Chose the tool demo's temperature (benchmarks/RESULTS.md).

    python benchmarks/demo_temperature.py --temperatures 1.2,1.0,0.7 --questions 16 --samples 4

Runs the demo recipe's SFT cold start (`leangrpo demo --task tools`, the given seed), then evaluates the
first held-out questions greedily and with `--samples` sampled rollouts each (through the tool loop) at
each temperature: greedy accuracy, sampled pass@1 and pass@k, and each by the problem's number of terms.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from typing import Any

from leangrpo.commands.demo import demo_config
from leangrpo.train.evaluation import eval_sampling, evaluate
from leangrpo.train.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--temperatures", default="1.2,1.0,0.7")
    ap.add_argument("--questions", type=int, default=16)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        quiet = ["logging.progress_bar=false"]
        cfg = demo_config("tools", 1, False, out, eval_limit=a.questions, seed=a.seed, overrides=quiet)
        trainer = Trainer(cfg)
        start = time.perf_counter()
        trainer.cold_start()
        print(f"cold start: {time.perf_counter() - start:.0f} s", flush=True)
        g = cfg.grpo
        for temperature in (float(t) for t in a.temperatures.split(",")):
            start = time.perf_counter()
            sampling = replace(eval_sampling(g, cfg.data), temperature=temperature)
            result = evaluate(
                trainer.unwrapped.lm, trainer.tokenizer, trainer.evaluator.rows, trainer.reward_funcs,
                trainer.task, sampling, prompt_format=trainer.prompt_format, batch_size=a.questions,
                num_samples=a.samples, seed=a.seed, progress=False, agent=trainer.agent,
            )  # fmt: skip
            m = result.metrics
            print(
                f"T={temperature}: greedy correct {m['accuracy']:.2f} (lenient {m['accuracy/lenient']:.2f}), "
                f"sampled pass@1 {m['pass@1/sampled']:.3f}, pass@{a.samples} {m[f'pass@{a.samples}']:.2f} "
                f"({time.perf_counter() - start:.0f} s)",
                flush=True,
            )
            by_terms(result.records, trainer.evaluator.rows, a.samples)


def by_terms(records: list[dict[str, Any]], rows: list[dict[str, Any]], samples: int) -> None:
    """The same counts per number of terms (the tool demo's three-term sums need two calls in sequence):
    greedy strict and lenient, sampled right, and the questions with some but not all samples right
    (a GRPO group with reward variance)."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for record, row in zip(records, rows, strict=True):
        groups.setdefault(row["metadata"]["num_terms"], []).append(record)
    for terms, group in sorted(groups.items()):
        right = [r["samples_correct"] for r in group]
        varied = sum(0 < k < samples for k in right)
        print(
            f"  {terms} terms, {len(group)} questions: greedy strict {sum(r['correct'] for r in group)}, "
            f"lenient {sum(r['correct_lenient'] for r in group)}; sampled right {sum(right)} of "
            f"{samples * len(group)}; questions with some but not all right {varied}",
            flush=True,
        )


if __name__ == "__main__":
    main()
