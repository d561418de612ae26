"""Evaluation on held-out questions (during training, and for `leangrpo eval`): greedy accuracy, pass@k,
format rates, reward means, and one record per question.

Correctness is the task's (`Task.is_correct`; for GSM8K, math-verify on the `<answer>` block, exactly as
the `math_verify` reward decides, so `1,000` = `1000` and `$18` = `18`), and so is what a record shows.
Lenient correctness (`accuracy/lenient`) ignores the format: without closed answer tags the last number in
the completion is the answer, so a format gain cannot pass for a correctness gain.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from leangrpo.config.schema import step_interval
from leangrpo.core.errors import UserError
from leangrpo.data.rewards import soft_format_reward, strict_format_reward
from leangrpo.run.rundir import atomic_path, write_text_atomic

# (text, token length, truncated, token ids) of each completion of each prompt
Completions = list[list[tuple[str, int, bool, list[int]]]]

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import Config, DataConfig
    from leangrpo.data.tasks import Task
    from leangrpo.engines.rollout import RolloutEngine, Sampling

RewardFuncs = list[tuple[str, Callable[..., list[Any]], float]]
FORMAT_REWARDS = (strict_format_reward, soft_format_reward)
"""Rewards that check the output format: their rate of non-zero scores is reported as `format/<name>`."""
DATA_SUFFIXES = (".jsonl", ".parquet", ".json")


class EvalError(UserError, ValueError):
    """Evaluation cannot run as asked (model, adapter or data)."""


@dataclass
class EvalResult:
    """Aggregate metrics and one record per question (in the order of the rows given)."""

    metrics: dict[str, Any]
    records: list[dict[str, Any]]

    def save(self, path: str | Path, **meta: Any) -> Path:
        """Write `path` (JSON: `meta`, the metrics, and the records file's name) and the records as JSON
        Lines beside it (same name, `.jsonl`). Returns the JSON path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        records_path = path.with_suffix(".jsonl")
        with atomic_path(records_path) as tmp, tmp.open("w") as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records)
        doc = {**meta, "metrics": self.metrics, "records_file": records_path.name}
        write_text_atomic(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
        return path


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    reward_funcs: RewardFuncs,
    task: Task,
    *,
    assistant_prefix: str = "",
    max_new_tokens: int = 256,
    max_prompt_length: int = 512,
    batch_size: int = 16,
    num_samples: int = 0,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    on_error: Literal["raise", "missing"] = "missing",
    progress: bool = True,
    engine: RolloutEngine | None = None,
) -> EvalResult:
    """Greedy-decode one completion per row (rows as `data.load_rows` makes them), score it with
    `reward_funcs` and the task's correctness, and with `num_samples = k > 0` also sample k completions
    per row for pass@k. Batched (`batch_size` prompts per call, left-padded, shortest padding first) under
    `inference_mode`; sampling uses its own seeded RNG stream, so a training run's randomness is
    untouched. `engine` generates (default: HF generate on `model`; a VLLMEngine holding its weights)."""
    import torch
    from tqdm import tqdm

    from leangrpo.data.rows import has_chat_template, render_prompt
    from leangrpo.engines.rollout import HFEngine, Sampling

    if not rows:
        raise EvalError("no rows to evaluate")
    texts = [render_prompt(tokenizer, r["prompt"], assistant_prefix) for r in rows]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]
    order = sorted(range(len(rows)), key=lambda i: lengths[i])  # similar lengths share a batch
    gen = partial(_generate_all, engine or HFEngine(model, tokenizer), texts, order)
    greedy_sampling = Sampling(
        num_generations=1, max_prompt_length=max_prompt_length, max_completion_length=max_new_tokens,
        do_sample=False, assistant_prefix=assistant_prefix,
    )  # fmt: skip
    bar = tqdm(total=len(rows) * (1 + num_samples), desc="eval", unit="completion", disable=not progress)
    with bar, _left_padded(tokenizer), torch.inference_mode():
        greedy = gen(greedy_sampling, batch_size, bar)
        sampled = None
        if num_samples:
            with torch.random.fork_rng(devices=[] if model.device.type == "cpu" else [model.device]):
                torch.manual_seed(seed)
                sampling = replace(
                    greedy_sampling, num_generations=num_samples, do_sample=True, temperature=temperature,
                    top_p=top_p,
                )  # fmt: skip
                sampled = gen(sampling, max(1, batch_size // num_samples), bar)
    records = _records(rows, greedy, sampled, reward_funcs, task, has_chat_template(tokenizer), on_error)
    return EvalResult(summarize(records, reward_funcs, num_samples), records)


@contextmanager
def _left_padded(tokenizer: PreTrainedTokenizerBase) -> Iterator[None]:
    """The tokenizer padding and truncating on the left (a prompt ends where its completion starts), its
    own sides restored after."""
    sides = (tokenizer.padding_side, tokenizer.truncation_side)
    tokenizer.padding_side = tokenizer.truncation_side = "left"
    try:
        yield
    finally:
        tokenizer.padding_side, tokenizer.truncation_side = sides


def _records(
    rows: list[dict[str, Any]],
    greedy: Completions,
    sampled: Completions | None,
    reward_funcs: RewardFuncs,
    task: Task,
    conversational: bool,
    on_error: Literal["raise", "missing"],
) -> list[dict[str, Any]]:
    """One scored record per row: the greedy completion's rewards, length and truncation, and how many
    of its samples are correct."""
    completions = [g[0][0] for g in greedy]
    records = score(
        rows, completions, reward_funcs, task, conversational, on_error, [g[0][3] for g in greedy]
    )
    for record, [(_, length, truncated, _)] in zip(records, greedy, strict=True):
        record.update(length=length, truncated=truncated)
    if sampled is not None:
        for record, row, samples in zip(records, rows, sampled, strict=True):
            record["samples_correct"] = sum(task.is_correct(text, row) for text, _, _, _ in samples)
    return records


def _generate_all(
    engine: RolloutEngine,
    texts: list[str],
    order: list[int],
    sampling: Sampling,
    prompts_per_call: int,
    bar: Any,
) -> Completions:
    """(text, token length, truncated, token ids) of `sampling.num_generations` completions for each
    prompt, in `texts` order; prompts go `prompts_per_call` at a time, in `order`."""
    per_prompt = sampling.num_generations
    out: Completions = [[] for _ in texts]
    for start in range(0, len(order), prompts_per_call):
        idx = order[start : start + prompts_per_call]
        batch = engine.generate([texts[i] for i in idx], sampling)
        lengths, truncated = batch.lengths().tolist(), batch.truncated.tolist()
        for j, i in enumerate(idx):
            group = range(j * per_prompt, (j + 1) * per_prompt)
            out[i] = [
                (
                    batch.completion_texts[c],
                    int(lengths[c]),
                    bool(truncated[c]),
                    batch.completion_ids[c, : lengths[c]].tolist(),
                )
                for c in group
            ]
        bar.update(len(idx) * per_prompt)
    return out


def score(
    rows: list[dict[str, Any]],
    completions: list[str],
    reward_funcs: RewardFuncs,
    task: Task,
    conversational: bool,
    on_error: Literal["raise", "missing"] = "missing",
    completion_ids: list[list[int]] | None = None,
) -> list[dict[str, Any]]:
    """One record per (row, completion): the task's view of it (question, completion, extracted answer,
    gold), whether it is correct, each reward (None where not applicable or failed) and their total.
    Rewards get `completion_ids` when given (no `trainer_state` outside training)."""
    from leangrpo.data.rewards import RewardContext, score_completions
    from leangrpo.engines.rollout import as_reward_inputs

    prompts, comps = as_reward_inputs([r["prompt"] for r in rows], completions, conversational)
    columns = {k: [r.get(k) for r in rows] for k in rows[0] if k != "prompt"}
    scores = score_completions(reward_funcs, prompts, comps, columns, on_error, RewardContext(completion_ids))
    records = []
    for i, (row, text) in enumerate(zip(rows, completions, strict=True)):
        rewards = {name: _finite(scores.per_func[i, f]) for f, name in enumerate(scores.names)}
        records.append(
            {
                **task.sample_view(row, text),
                "correct": task.is_correct(text, row),
                "correct_lenient": task.is_correct_lenient(text, row),
                "reward": _finite(scores.total[i]),
                "rewards": rewards,
            }
        )
    return records


def _finite(x: Any) -> float | None:
    value = float(x)
    return value if math.isfinite(value) else None


def _mean(values: list[Any]) -> float | None:
    kept = [float(v) for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def summarize(records: list[dict[str, Any]], reward_funcs: RewardFuncs, num_samples: int) -> dict[str, Any]:
    """Aggregate metrics over records (see README: Evaluation)."""
    metrics: dict[str, Any] = {
        "n": len(records),
        "accuracy": _mean([r["correct"] for r in records]),
        "accuracy/lenient": _mean([r["correct_lenient"] for r in records]),
        "completions/mean_length": _mean([r.get("length") for r in records]),
        "completions/clipped_ratio": _mean([r.get("truncated") for r in records]),
        "reward": _mean([r["reward"] for r in records]),
    }
    for name, func, _ in reward_funcs:
        values = [r["rewards"][name] for r in records]
        metrics[f"rewards/{name}/mean"] = _mean(values)
        if func in FORMAT_REWARDS:
            metrics[f"format/{name}"] = _mean([None if v is None else v > 0 for v in values])
    if num_samples:
        metrics[f"pass@{num_samples}"] = _mean([r["samples_correct"] > 0 for r in records])
        metrics["pass@1/sampled"] = _mean([r["samples_correct"] / num_samples for r in records])
    return metrics


# ---- data and model for evaluation -------------------------------------------------------------


def resolve_data_path(path: str, split: str) -> str:
    """A directory holding `{split}.jsonl` (or .parquet/.json) resolves to that file; a file, hub id or
    `save_to_disk` directory (whose split `data.load_rows` picks) passes through."""
    p = Path(path).expanduser()
    if not p.is_dir() or (p / "dataset_dict.json").is_file():
        return path
    for suffix in DATA_SUFFIXES:
        if (p / f"{split}{suffix}").is_file():
            return str(p / f"{split}{suffix}")
    raise EvalError(
        f"data directory {path} has no {split!r} split (expected {split}.jsonl or {split}.parquet)"
    )


def load_eval_rows(
    data: DataConfig, task: Task, path: str, split: str, limit: int | None
) -> list[dict[str, Any]]:
    """The first `limit` rows of a split, read with the training data's columns and prompt settings."""
    from leangrpo.data.sources import load_rows

    resolved = resolve_data_path(path, split)
    eval_data = data.model_copy(update={"path": resolved, "split": split, "limit": limit})
    return load_rows(eval_data, task).rows


class TrainingEvaluator:
    """Evaluates the policy on a fixed held-out subset before step 1 (and after the SFT cold start, if
    any), every `eval.eval_steps`, and at the end; writes `RUN/eval/step-N.json(l)` and returns the
    `eval/...` metrics for metrics.jsonl."""

    def __init__(self, cfg: Config, run_dir: Path, reward_funcs: RewardFuncs, task: Task):
        ev = cfg.eval
        self.cfg, self.run_dir, self.reward_funcs, self.task = cfg, run_dir, reward_funcs, task
        self.source = resolve_data_path(ev.path or cfg.data.path, ev.split)
        self.rows = load_eval_rows(cfg.data, task, self.source, ev.split, ev.limit)

    def due(self, step: int) -> bool:
        """Before training (step 0), every eval_steps, and at the last step."""
        every = step_interval(self.cfg.eval.eval_steps, self.cfg.optim.max_steps)
        return step in (0, self.cfg.optim.max_steps) or bool(every and step % every == 0)

    def __call__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        step: int,
        engine: RolloutEngine | None = None,
        name: str | None = None,
    ) -> dict[str, Any]:
        """`engine`: the training run's (vLLM's, holding `model`'s weights); default HF generate.
        `name`: the files' stem (default `step-N`)."""
        cfg, ev = self.cfg, self.cfg.eval
        result = evaluate(
            model,
            tokenizer,
            self.rows,
            self.reward_funcs,
            self.task,
            assistant_prefix=cfg.data.assistant_prefix,
            max_new_tokens=ev.max_new_tokens or cfg.grpo.max_completion_length,
            max_prompt_length=cfg.grpo.max_prompt_length,
            batch_size=ev.batch_size,
            num_samples=ev.num_samples,
            temperature=cfg.grpo.temperature,
            top_p=cfg.grpo.top_p,
            seed=cfg.seed,
            progress=False,
            engine=engine,
        )
        stem = name or f"step-{step}"
        result.save(self.run_dir / "eval" / f"{stem}.json", step=step, data=self.source, split=ev.split)
        return {"step": step, **{f"eval/{k}": v for k, v in result.metrics.items()}}
