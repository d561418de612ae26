"""The demo on several seeds with its random-reward control, and the table of benchmarks/RESULTS.md.

    python benchmarks/demo_seeds.py --runs runs/seeds --seeds 1,2,3 --train   # 6 demo runs, then the table
    python benchmarks/demo_seeds.py --runs runs/seeds --seeds 1,2,3           # the table of finished runs
    python benchmarks/demo_seeds.py --runs runs/tools --seeds 1,2,3 --task tools --train   # the tool demo

Each run directory (RUNS/none-sN, RUNS/random-reward-sN) holds the demo's evaluations: before anything
(eval/step-0), after the cold start (eval/cold-start) and after GRPO (eval/step-M). Per seed and pooled
over the seeds: the whole recipe's change (before -> after) of the demo and of the control, GRPO's own
change (cold start -> after) and the control's, and the demo against the control after training, on
the same held-out questions (paired). A seed's control starts from the demo's cold start (the same seed
gives the same cold start), so the control's own change is taken from the demo's cold-start evaluation.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from leangrpo.commands.demo import paired_change
from leangrpo.run.rundir import read_jsonl

CONTROLS = ("none", "random-reward")


def correct(run: Path, name: str, key: str) -> list[bool]:
    """Per held-out question: correctness (`key`: correct_lenient or correct, the strict one read from the
    answer tags) in the run's evaluation `name`."""
    if name == "last":
        name = max((p.stem for p in (run / "eval").glob("step-*.jsonl")), key=lambda s: int(s[5:]))
    return [bool(r[key]) for r in read_jsonl(run / "eval" / f"{name}.jsonl").rows]


def change(before: list[bool], after: list[bool]) -> str:
    c = paired_change(before, after)
    return f"{100 * c.change:+.1f} [{100 * c.low:+.1f}, {100 * c.high:+.1f}], p={c.p_value:.2g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, type=Path)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--task", default="chain_sum", help="the demo's --task")
    ap.add_argument("--strict", action="store_true", help="strict correctness (answer tags), not lenient")
    ap.add_argument("--train", action="store_true", help="run the demos first (one after another)")
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    if a.train:
        for seed in seeds:
            for control in CONTROLS:
                out = a.runs / f"{control}-s{seed}"
                cmd = [
                    "leangrpo",
                    "demo",
                    "--task",
                    a.task,
                    "--seed",
                    str(seed),
                    "--control",
                    control,
                    "--output-dir",
                    str(out),
                ]
                subprocess.run([sys.executable, "-m", *cmd], check=True)
    key = "correct" if a.strict else "correct_lenient"
    pooled: dict[str, list[bool]] = {k: [] for k in ("before", "cold", "demo")}
    paired: dict[str, list[bool]] = {k: [] for k in ("before", "cold", "demo", "control")}  # with a control
    header = (
        "seed | before | cold start | demo after | whole recipe | GRPO's own | control after "
        "| control, whole recipe | control's own | demo - control"
    )
    print(f"| {header} |\n" + "|---" * 10 + "|")
    for seed in seeds:
        demo, control = (a.runs / f"{c}-s{seed}" for c in CONTROLS)
        runs = {"before": correct(demo, "step-0", key), "cold": correct(demo, "cold-start", key)}
        runs["demo"] = correct(demo, "last", key)
        for name, values in runs.items():
            pooled[name] += values
        cells = ["–"] * 4  # a seed whose control has not run
        if (control / "eval").is_dir():
            runs["control"] = ctrl = correct(control, "last", key)
            for name, values in runs.items():
                paired[name] += values
            cells = [str(sum(ctrl)), change(runs["before"], ctrl), change(runs["cold"], ctrl)]
            cells.append(change(ctrl, runs["demo"]))
        before, cold, after = runs["before"], runs["cold"], runs["demo"]
        print(f"| {seed} | {sum(before)} | {sum(cold)} | {sum(after)} | {change(before, after)} "
              f"| {change(cold, after)} | {' | '.join(cells)} |")  # fmt: skip
    before, cold, after = (pooled[k] for k in ("before", "cold", "demo"))
    print(f"\npooled over {len(seeds)} seeds ({len(cold)} question-runs; the same questions in every seed):")
    print(f"  whole recipe {change(before, after)}; GRPO's own change {change(cold, after)}")
    if paired["control"]:
        before, cold, after, ctrl = (paired[k] for k in ("before", "cold", "demo", "control"))
        print(
            f"  the seeds with a control ({len(ctrl)} question-runs): control's whole recipe "
            f"{change(before, ctrl)}; the control's own {change(cold, ctrl)}; after, demo - control "
            f"{change(ctrl, after)}"
        )
    print("  (points, 95% bootstrap interval, McNemar p)")


if __name__ == "__main__":
    main()
