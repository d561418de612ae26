"""Evaluation on held-out questions (during training, and for `leangrpo eval`): greedy accuracy, pass@k,
format rates, reward means, and one record per question.

Correctness is the task's (`Task.is_correct`; for GSM8K, math-verify on the `<answer>` block, exactly as
the `math_verify` reward decides, so `1,000` = `1000` and `$18` = `18`), and so is what a record shows.
Lenient correctness (`accuracy/lenient`) ignores the format: without closed answer tags the last number in
the completion is the answer, so a format gain cannot pass for a correctness gain.

A run with tools or environments (`agent`) is evaluated with the training rollout's tool loop: the rewards
get the same messages and columns, and `tools/*` say how often the model called a tool and how often a
call failed.
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
from leangrpo.data.rows import PromptFormat, prompt_images
from leangrpo.models import neftune
from leangrpo.run.rundir import atomic_file, claim, write_text_atomic
from leangrpo.train.scoring import RewardFuncs

# (text, token length, truncated, token ids) of each completion of each prompt
Completions = list[list[tuple[str, int, bool, list[int]]]]

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import Config, DataConfig, GRPOSection
    from leangrpo.data.tasks import Task
    from leangrpo.engines.agents import AgentSpec
    from leangrpo.engines.tools import Toolbox, ToolUse
    from leangrpo.engines.types import RolloutBatch, RolloutEngine, Sampling

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

    def save(self, path: str | Path, root: Path | None = None, **meta: Any) -> Path:
        """Write `path` (JSON: `meta`, the metrics, and the records file's name) and the records as JSON
        Lines beside it (same name, `.jsonl`). Returns the JSON path. `root`: the directory no link below
        is followed in (a run's, for its eval/), by default the file's own."""
        path = Path(path)
        records_path = path.with_suffix(".jsonl")
        if path.parent.name == "eval":  # a run's eval/: the run's own, from now on
            claim(path.parent.parent, f"eval/{path.name}", f"eval/{records_path.name}")
        with atomic_file(records_path, root, text=True) as f:
            f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in self.records)
        doc = {**meta, "metrics": self.metrics, "records_file": records_path.name}
        write_text_atomic(path, json.dumps(doc, indent=2, ensure_ascii=False) + "\n", root)
        return path


def evaluate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    reward_funcs: RewardFuncs,
    task: Task,
    sampling: Sampling,
    *,
    prompt_format: PromptFormat | None = None,
    batch_size: int = 16,
    num_samples: int = 0,
    seed: int = 0,
    on_error: Literal["raise", "missing"] = "missing",
    progress: bool = True,
    engine: RolloutEngine | None = None,
    agent: AgentSpec | None = None,
) -> EvalResult:
    """Greedy-decode one completion per row (rows as `data.load_rows` makes them), score it with
    `reward_funcs` and the task's correctness, and with `num_samples = k > 0` also sample k completions
    per row for pass@k, on a seeded RNG stream of its own (a training run's randomness stays untouched).
    `sampling`: the run's (`eval_sampling`): its lengths, tool rounds and knobs, the greedy pass with
    sampling off. `prompt_format`: the run's (default: the sampling's assistant prefix alone).
    `engine` generates (default: HF generate on `model`; a VLLMEngine holding its weights).
    `agent` (tools or environments, its tokenizer prepared): rollouts go through the tool loop."""
    import torch
    from tqdm import tqdm

    from leangrpo.engines.hf import HFEngine

    if not rows:
        raise EvalError("no rows to evaluate")
    agent = agent if agent is not None and agent.uses_tools else None
    fmt = prompt_format or PromptFormat(sampling.assistant_prefix)
    gen = partial(_generate_all, engine or HFEngine(model, tokenizer), tokenizer, rows, agent, fmt)
    greedy_sampling = replace(sampling, num_generations=1, do_sample=False, seed=None)
    # leave=False: in training, the bar goes once done and the console table goes on under the GRPO bar
    bar = tqdm(
        total=len(rows) * (1 + num_samples), desc="eval", unit="completion", disable=not progress,
        leave=False, dynamic_ncols=True,
    )  # fmt: skip
    with bar, _left_padded(tokenizer), torch.inference_mode():
        greedy, use = gen(greedy_sampling, batch_size, bar)
        # scored before sampling, which resets the environments the rewards read
        tools = use if agent is not None else None  # a rollout_func's own tool calls are not counted here
        records = _records(rows, greedy, use, tools, reward_funcs, task, tokenizer, on_error)
        if num_samples:
            k = replace(greedy_sampling, num_generations=num_samples, do_sample=True)
            sample = partial(gen, k, max(1, batch_size // num_samples), bar)
            _count_sampled_correct(records, rows, task, sample, seed, model.device)
    metrics = summarize(records, reward_funcs, num_samples)
    return EvalResult(metrics | (tools.metrics() if tools is not None else {}), records)


def sampled_rewards(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    reward_funcs: RewardFuncs,
    sampling: Sampling,
    *,
    prompt_format: PromptFormat,
    prompts_per_call: int,
    on_call: Callable[[], None] = lambda: None,
    kl: Callable[[RolloutBatch], float] | None = None,
    agent: AgentSpec | None = None,
) -> dict[str, float]:
    """TRL's GRPO evaluation: `sampling.num_generations` sampled completions of each row (HF generate on
    `model`), scored by the rewards and summarized as a training step's reward and length metrics (reward,
    reward_std, rewards/<name>/mean|std, completions/*, frac_reward_zero_std), and with `kl` (an eval
    batch's KL to the reference, at beta > 0) its mean over the batches, as TRL's `kl`. No loss, entropy
    or clip ratios (docs/trl.md). `on_call` after each generate call (TRL's `on_prediction_step` per eval
    batch). With tools or environments (`agent`, its tokenizer prepared) rollouts go through the tool loop,
    the rewards get their messages and environments as in training, and `tools/*` join the metrics."""
    import torch

    from leangrpo.data.rewards import RewardContext, reward_inputs, score_completions
    from leangrpo.data.rows import has_chat_template
    from leangrpo.engines.hf import HFEngine
    from leangrpo.engines.vision import image_processor, text_tokenizer
    from leangrpo.train.metrics import length_metrics, reward_metrics

    if not rows:
        raise EvalError("no rows to evaluate")
    processor, tokenizer = image_processor(tokenizer), text_tokenizer(tokenizer)  # TRL's processing_class
    k, engine = sampling.num_generations, HFEngine(model, tokenizer, processor=processor)
    calls, kls = _Calls(on_call), []
    agent = agent if agent is not None and agent.uses_tools else None
    with _left_padded(tokenizer), torch.inference_mode(), neftune.quiet(model):  # TRL: eval mode, no noise
        done, use = _generate_all(
            engine, tokenizer, rows, agent, prompt_format, sampling, prompts_per_call, calls,
            on_batch=None if kl is None else lambda batch: kls.append(kl(batch)),
        )  # fmt: skip
    flat = [c for group in done for c in group]
    texts, ids = [c[0] for c in flat], [c[3] for c in flat]
    use = use if agent is not None else None
    messages, extra = (None, None) if use is None else (use.messages, use.columns)
    prompts, comps, columns = reward_inputs(rows, texts, has_chat_template(tokenizer), messages, extra)
    scores = score_completions(reward_funcs, prompts, comps, columns, "missing", RewardContext(ids))
    total = scores.total
    group_std = total.view(-1, k).std(dim=1) if k > 1 else torch.zeros(len(rows))
    lengths = torch.tensor([float(c[1]) for c in flat])
    return {
        **length_metrics(lengths, torch.tensor([c[2] for c in flat])),
        **reward_metrics(scores.names, scores.per_func),
        "reward": float(total.nanmean()),
        "reward_std": float(total[~total.isnan()].std()),
        "frac_reward_zero_std": float(group_std.isclose(torch.zeros_like(group_std)).float().mean()),
        **({"kl": sum(kls) / len(kls)} if kls else {}),
        **(use.metrics() if use is not None else {}),
    }


class _Calls:
    """A progress bar's `update` that only tells `on_call` each generate call has returned."""

    def __init__(self, on_call: Callable[[], None]) -> None:
        self.on_call = on_call

    def update(self, _: int) -> None:
        self.on_call()


def eval_sampling(grpo: GRPOSection | None, data: DataConfig, max_new_tokens: int | None = None) -> Sampling:
    """How an evaluation samples: as the training run's rollouts (`grpo`; without one, its defaults), with
    `data`'s assistant prefix, up to `max_new_tokens` (default: grpo.max_completion_length, else 256) and
    never ignoring EOS. `evaluate` turns sampling off for its greedy pass."""
    from leangrpo.engines.types import Sampling

    if grpo is None:
        return Sampling(
            num_generations=1, max_prompt_length=None, max_completion_length=max_new_tokens or 256,
            assistant_prefix=data.assistant_prefix, chat_template_kwargs=data.chat_template_kwargs,
        )  # fmt: skip
    training = Sampling.from_config(grpo, data)
    length = max_new_tokens or grpo.max_completion_length
    return replace(training, max_completion_length=length, ignore_eos=False)


def _count_sampled_correct(
    records: list[dict[str, Any]],
    rows: list[dict[str, Any]],
    task: Task,
    sample: Callable[[], tuple[Completions, Any]],
    seed: int,
    device: Any,
) -> None:
    """pass@k: each record's count of correct completions among those `sample()` draws for its row, on a
    seeded RNG stream of their own (a training run's randomness stays untouched)."""
    import torch

    with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
        torch.manual_seed(seed)
        sampled, _ = sample()
    for record, row, samples in zip(records, rows, sampled, strict=True):
        record["samples_correct"] = sum(task.is_correct(text, row) for text, _, _, _ in samples)


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
    use: ToolUse | None,
    tools: ToolUse | None,
    reward_funcs: RewardFuncs,
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    on_error: Literal["raise", "missing"],
) -> list[dict[str, Any]]:
    """One scored record per row: the greedy completion's rewards (given `use`, as `score` says), length
    and truncation, and with the run's `tools` its tool calls, failed calls and model turns."""
    from leangrpo.data.rows import has_chat_template

    completions, chat = [g[0][0] for g in greedy], has_chat_template(tokenizer)
    records = score(rows, completions, reward_funcs, task, chat, on_error, [g[0][3] for g in greedy], use)
    for i, (record, [(_, length, truncated, _)]) in enumerate(zip(records, greedy, strict=True)):
        record.update(length=length, truncated=truncated)
        if tools is not None:
            calls, failures = sum(tools.calls[i].values()), sum(tools.failures[i].values())
            record.update(tool_calls=calls, tool_failures=failures, turns=tools.turns[i])
    return records


def _generate_all(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict[str, Any]],
    agent: AgentSpec | None,
    prompt_format: PromptFormat,
    sampling: Sampling,
    prompts_per_call: int,
    bar: Any,
    on_batch: Callable[[RolloutBatch], None] | None = None,
) -> tuple[Completions, ToolUse | None]:
    """(text, model tokens, truncated, token ids) of `sampling.num_generations` completions for each row,
    in `rows` order, and what they did with the tools (with `agent`) or what a rollout_func engine
    returned besides the tokens (None otherwise). Prompts go `prompts_per_call` at a time, similar
    lengths together (an environment whose reset text differs per rollout: each rollout with its own
    prompt); `on_batch` gets each generate call's batch."""
    from leangrpo.engines.tools import ToolUse

    per_prompt = sampling.num_generations
    # one environment per rollout, all reset now: a later batch's reset must not touch an earlier one's
    episodes = agent.start(rows, per_prompt) if agent is not None else None
    own = None if episodes is None else episodes.rollout_prompts
    prompts = own or ([r["prompt"] for r in rows] if episodes is None else episodes.prompts)
    per_text = 1 if own else per_prompt
    texts = [
        prompt_format.render(
            tokenizer, prompt, None if episodes is None else episodes.toolboxes[i * per_text].schemas
        )
        for i, prompt in enumerate(prompts)
    ]
    row_texts = [texts[i : i + per_prompt // per_text] for i in range(0, len(texts), per_prompt // per_text)]
    lengths = [len(ids) for ids in tokenizer([t[0] for t in row_texts], add_special_tokens=False).input_ids]
    images = [prompt_images(row["prompt"]) for row in rows]  # image prompts have no tools (refused)
    order = sorted(range(len(rows)), key=lambda i: lengths[i])
    out: Completions = [[] for _ in rows]
    uses: list[ToolUse | None] = [None] * len(rows)
    for start in range(0, len(order), prompts_per_call):
        idx = order[start : start + prompts_per_call]
        boxes: list[Toolbox] | None = None
        if episodes is not None:
            boxes = [episodes.toolboxes[i * per_prompt + k] for i in idx for k in range(per_prompt)]
        call = [text for i in idx for text in row_texts[i]]
        pictures = {"images": [images[i] for i in idx]} if any(images) else {}  # image prompts only
        batch = engine.generate(call, replace(sampling, num_generations=per_text), boxes, **pictures)
        if on_batch is not None:
            on_batch(batch)
        _collect(batch, idx, per_prompt, out, uses)
        bar.update(len(idx) * per_prompt)
    if any(u is None for u in uses):
        return out, None
    use = ToolUse.cat([u for u in uses if u is not None])
    if episodes is not None and episodes.environments is not None:  # TRL gives them to rewards
        use.columns["environments"] = episodes.environments
        if own:  # and each rollout's own prompt (`reward_inputs`)
            use.columns["prompt"] = own
    return out, use


def _collect(
    batch: RolloutBatch, idx: list[int], per_prompt: int, out: Completions, uses: list[ToolUse | None]
) -> None:
    """Into `out[i]` (and `uses[i]`) for each row `i` of `idx`: its `per_prompt` completions of `batch`."""
    lengths, ends = batch.lengths().tolist(), batch.completion_mask.sum(dim=1).tolist()
    truncated = batch.truncated.tolist()
    for j, i in enumerate(idx):
        group = range(j * per_prompt, (j + 1) * per_prompt)
        out[i] = [
            (
                batch.completion_texts[c],
                int(lengths[c]),
                bool(truncated[c]),
                batch.completion_ids[c, : ends[c]].tolist(),
            )
            for c in group
        ]
        if batch.tool_use is not None:
            uses[i] = batch.tool_use.select(list(group))


def score(
    rows: list[dict[str, Any]],
    completions: list[str],
    reward_funcs: RewardFuncs,
    task: Task,
    conversational: bool,
    on_error: Literal["raise", "missing"] = "missing",
    completion_ids: list[list[int]] | None = None,
    use: ToolUse | None = None,
) -> list[dict[str, Any]]:
    """One record per (row, completion): the task's view of it (question, completion, extracted answer,
    gold), whether it is correct, each reward (None where not applicable or failed) and their total.
    Rewards get `completion_ids` when given (no `trainer_state` outside training). With tools (`use`),
    rewards get what they get in training (the turns as messages, the environments, a rollout_func's
    extra keys)."""
    from leangrpo.data.rewards import RewardContext, reward_inputs, score_completions

    messages, extra = (None, None) if use is None else (use.messages, use.columns)
    prompts, comps, columns = reward_inputs(rows, completions, conversational, messages, extra)
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
    `eval/...` metrics for metrics.jsonl. With the run's `agent`, rollouts use its tools as in training."""

    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        reward_funcs: RewardFuncs,
        task: Task,
        agent: AgentSpec | None = None,
    ):
        ev = cfg.eval
        self.cfg, self.run_dir, self.reward_funcs, self.task = cfg, run_dir, reward_funcs, task
        self.agent = agent
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
        with neftune.quiet(model):  # TRL evaluates in eval mode: no noise
            result = evaluate(
                model, tokenizer, self.rows, self.reward_funcs, self.task,
                eval_sampling(cfg.grpo, cfg.data, ev.max_new_tokens),
                prompt_format=PromptFormat.from_config(cfg.data, cfg.grpo.max_prompt_length),
                batch_size=ev.batch_size, num_samples=ev.num_samples, seed=cfg.seed,
                progress=cfg.logging.progress_bar,  # called on the main process only
                engine=engine, agent=self.agent,
            )  # fmt: skip
        stem = name or f"step-{step}"
        path = self.run_dir / "eval" / f"{stem}.json"
        result.save(path, self.run_dir, step=step, data=self.source, split=ev.split)
        return {"step": step, **{f"eval/{k}": v for k, v in result.metrics.items()}}
