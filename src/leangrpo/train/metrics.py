"""A step's record: its metrics under TRL's names, reduced over every process, written to metrics.jsonl
(and the trackers) when `logging.logging_steps` says so, with a sample completion when
`logging.log_completions_steps` does, and handed to the Python caller's step hooks."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from leangrpo.config.schema import step_interval
from leangrpo.core import grpo
from leangrpo.core.loss_types import LOSS_TYPES
from leangrpo.engines.tools import ToolUse
from leangrpo.run.tracking import peak_memory_mb
from leangrpo.train.extras import StepAsk

if TYPE_CHECKING:
    from accelerate import Accelerator

    from leangrpo.config.schema import Config
    from leangrpo.data.rewards import RewardScores
    from leangrpo.data.tasks import Task
    from leangrpo.run.tracking import MetricsLogger
    from leangrpo.train.extras import RuntimeExtras
    from leangrpo.train.rollouts import Rollout
    from leangrpo.train.update import Reference, Update


class PhaseTimer:
    """Seconds spent in each named phase of a step (on a GPU, each phase waits for its own kernels: those
    of the current stream only, not the whole device, where async rollouts generate meanwhile)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        self.seconds[phase] = time.perf_counter() - start


class StepRecorder:
    """Turns what a step measured into its metrics row, and logs it."""

    def __init__(
        self,
        cfg: Config,
        acc: Accelerator,
        logger: MetricsLogger,
        task: Task,
        uses_tools: bool,
        extras: RuntimeExtras,
        state: dict[str, Any],
    ):
        """`extras`: the Python caller's step hooks (before and after each step); `state`: a resumed run's
        counters (`state()`)."""
        self.cfg, self.acc, self.logger, self.task = cfg, acc, logger, task
        self.tokens_seen = int(state.get("num_input_tokens_seen", 0))  # TRL's state.num_input_tokens_seen
        self.uses_tools, self.hooks, self.begin_hooks = uses_tools, extras.step_hooks, extras.step_begin_hooks
        self.asks = StepAsk(0)  # what the step hooks asked of the run after their step (main process)

    def state(self) -> dict[str, Any]:
        """The counter a checkpoint keeps: the prompt and completion tokens of every step so far."""
        return {"num_input_tokens_seen": self.tokens_seen}

    @property
    def ends_run(self) -> bool:
        """A step hook asked to end the run after its step."""
        return StepAsk.END in self.asks

    @property
    def asked(self) -> tuple[bool, bool]:
        """Whether a step hook asked to end the run, and to checkpoint the step (main process)."""
        return self.ends_run, StepAsk.CHECKPOINT in self.asks

    def begin(self, step: int) -> None:
        """Before `step`: the step-begin hooks, on the main process."""
        if self.acc.is_main_process:
            for hook in self.begin_hooks:
                hook(step)

    def record(
        self,
        step: int,
        rollout: Rollout,
        scores: RewardScores,
        group_std: Tensor,
        ref: Reference,
        update: Update,
        seconds: dict[str, float],
        skipped_steps: int,
    ) -> dict[str, Any]:
        """The step's metrics (`group_std` holds every process's groups), logged on the main process
        when due. The rollout's own metrics (async/*, dynamic_sampling/*) and the sampler's gap to the
        trainer (vllm/*, from `ref`) go in with them."""
        cfg, gather, device, batch = self.cfg, self.acc.gather, self.acc.device, rollout.batch
        total, per_func = gather(scores.total.to(device)), gather(scores.per_func.to(device))
        lengths, truncated = gather(batch.lengths().float()), gather(batch.truncated)
        means = grpo.micro_batch_means(
            update.stats, lambda t: self.acc.reduce(t.to(device), "sum"), lambda t: gather(t.to(device))
        )
        if LOSS_TYPES[cfg.grpo.loss_type][0] != "clip":  # TRL logs clip_ratio/* for clipped objectives only
            means = {k: None if k.startswith("clip_ratio/") else v for k, v in means.items()}
        step_seconds = sum(seconds.values())
        self.tokens_seen += int(gather(batch.prompt_mask.sum(1).to(device)).sum() + lengths.sum())
        metrics: dict[str, Any] = {
            "step": step,
            "reward": float(total.nanmean()),
            "reward_std": float(total[~total.isnan()].std()),  # TRL's: all rewards, not within groups
            **means,
            "kl": means["kl"] if cfg.grpo.beta > 0 else None,
            **length_metrics(lengths, truncated),
            "frac_reward_zero_std": float(group_std.isclose(torch.zeros_like(group_std)).float().mean()),
            "reward_failures": int(gather(scores.failed.float().to(device)).sum()),
            "skipped_steps": skipped_steps,
            "tokens_per_s": float(lengths.sum()) / step_seconds,
            "step_seconds": step_seconds,
            "step_time": step_seconds / cfg.updates_per_step,  # TRL's: seconds per optimizer step
            "num_tokens": self.tokens_seen,  # TRL's: prompt and completion tokens so far, every process's
            "peak_memory_mb": peak_memory_mb(),
            **reward_metrics(scores.names, per_func),
            "loss": update.loss,
            "grad_norm": update.grad_norm,
            "learning_rate": update.learning_rate,
            **update.metrics(),
            **{f"time/{phase}": s for phase, s in seconds.items()},
            **scores.metrics,  # the rewards' log_metric values (this process's)
            **self._mismatch_metrics(ref.mismatch),
            **rollout.metrics,
            **self._tool_metrics(rollout),
        }
        self._log(step, rollout, scores, metrics)
        return metrics

    def _log(self, step: int, rollout: Rollout, scores: RewardScores, metrics: dict[str, Any]) -> None:
        """On the main process: a sample completion and the metrics row when due, then the step hooks
        (every one, in order; what any asks is `asks`: True ends the run after this step)."""
        if not self.acc.is_main_process:
            return
        cfg = self.cfg
        if due(step, cfg.logging.log_completions_steps):
            sample = self.task.sample_view(rollout.rows[0], rollout.batch.completion_texts[0])
            rewards = {n: float(scores.per_func[0, i]) for i, n in enumerate(scores.names)}
            extra = {column: values[0] for column, values in scores.extra.items() if values}
            self.logger.log_sample({"step": step, **sample, "rewards": rewards, **extra})
        logged = due(step, step_interval(cfg.logging.logging_steps, cfg.optim.max_steps))
        if logged:
            self.logger.log(metrics)
        self.asks = StepAsk(0)
        for hook in self.hooks:
            asked = hook(step, metrics, logged)
            self.asks |= StepAsk.END if asked is True else asked or StepAsk(0)

    def _mismatch_metrics(self, mismatch: grpo.SamplerMismatch | None) -> dict[str, float]:
        """vllm/*, over every process's engine (the largest gap, the mean of the rest): a process whose
        engine missed a sync shows in the logged maximum."""
        if mismatch is None:
            return {}
        names = list(vars(mismatch))
        rows = self.acc.gather(torch.tensor([list(vars(mismatch).values())], device=self.acc.device))
        return {
            f"vllm/{name}": float(rows[:, i].max() if name.endswith("_max") else rows[:, i].mean())
            for i, name in enumerate(names)
        }

    def _tool_metrics(self, rollout: Rollout) -> dict[str, float]:
        """tools/*, over every process's rollouts (TRL gathers its counts), when rollouts call tools."""
        use = rollout.batch.tool_use
        if not self.uses_tools or use is None:
            return {}
        counts = ToolUse([[] for _ in use.turns], use.turns, use.calls, use.failures)  # no messages
        return ToolUse.cat(gather_objects(self.acc, [counts])).metrics()


def gather_objects(acc: Accelerator, items: list[Any]) -> list[Any]:
    """Every process's `items`, in process order (picklable objects; on one process, `items`)."""
    if acc.num_processes == 1:
        return items
    from accelerate.utils import gather_object

    return list(gather_object(items))


def reward_metrics(names: list[str], per_func: Tensor) -> dict[str, float]:
    """Each reward function's `rewards/<name>/mean` and `/std` over the scored completions (the std leaves
    unscored ones out, as TRL's)."""
    out = {}
    for i, name in enumerate(names):
        values = per_func[:, i]
        out[f"rewards/{name}/mean"] = float(values.nanmean())
        out[f"rewards/{name}/std"] = float(values[~values.isnan()].std())
    return out


def length_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, float]:
    """TRL's `completions/*` metrics: lengths of all completions, and of those that ended (EOS) before
    max_completion_length (0 when none did, as TRL)."""
    ended = lengths[~truncated]
    out = {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(truncated.float().mean()),
    }
    for stat in ("mean", "min", "max"):
        out[f"completions/{stat}_terminated_length"] = float(getattr(ended, stat)()) if len(ended) else 0.0
    return out


def due(step: int, every: int) -> bool:
    """A schedule of `every` steps (0: never) that also fires at step 1."""
    return bool(every) and (step % every == 0 or step == 1)
