"""The GRPO training loop, and nothing else.

`Trainer.step()` is the table of contents: rollout → score → advantages → reference → update → record,
each phase one method below and each timed into the metrics as `time/<phase>`. What to learn (prompts,
answer format, rewards, correctness) comes from the task; how log-probs are computed from `logprobs.py`;
the loss from `grpo.py`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from leangrpo.config.schema import Config
from leangrpo.core import grpo
from leangrpo.core.errors import UserError, error_reason
from leangrpo.data.rewards import RewardContext, RewardScores, TrainerState, load_rewards, score_completions
from leangrpo.data.rows import has_chat_template, render_prompt
from leangrpo.data.sources import PromptSampler, load_rows
from leangrpo.data.tasks import load_task
from leangrpo.engines.rollout import (
    MAX_CHARS_PER_TOKEN,
    RolloutBatch,
    RolloutEngine,
    Sampling,
    as_reward_inputs,
)
from leangrpo.engines.vllm import VLLMError, check_vllm
from leangrpo.models.load import TensorStore, frozen_copy, is_peft, load_model_and_tokenizer
from leangrpo.run.checkpoint import (
    check_resumable,
    load_rank_state,
    load_trainable,
    read_state,
    remove_partial,
    resume_checkpoint,
    save_checkpoint,
    save_final_model,
    set_rng_state,
    truncate_log,
    what_holds,
)
from leangrpo.run.resolve import save_config
from leangrpo.run.rundir import RunDirError, RunLock, check_output_dir, drop_replaced, start_run
from leangrpo.run.signals import StopSignals
from leangrpo.run.tracking import MetricsLogger, check_trackers, eval_line, open_trackers, peak_memory_mb
from leangrpo.train import distributed, sft
from leangrpo.train.engine import cpu_levers, rollout_engine
from leangrpo.train.evaluation import TrainingEvaluator
from leangrpo.train.logprobs import Policy, batch_logprobs, micro_batch_logprobs, shared_prompt_group
from leangrpo.train.loss import loss_spec
from leangrpo.train.optim import (
    StepInBackward,
    activation_offload,
    build_optimizer,
    build_scheduler,
    check_device_options,
)

__all__ = ["RunDirError", "Trainer", "TrainingError", "train"]


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (too many non-finite steps in a row)."""


class PhaseTimer:
    """Seconds spent in each named phase of a step (on a GPU, each phase waits for its own kernels)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.seconds[phase] = time.perf_counter() - start


@dataclass
class Update:
    """What the update phase reports: the mean loss of its iterations, the last gradient norm and
    learning rate, and each micro-batch's token counts for the KL and clip metrics."""

    loss: float
    grad_norm: float
    learning_rate: float
    stats: list[grpo.LossStats]


class Trainer:
    """Holds what the loop needs across steps; `train()` runs it."""

    def __init__(self, cfg: Config, overwrite: bool = False, resume: bool = False):
        """`resume`: continue the run in `cfg.output_dir` from its last complete checkpoint."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.cfg = cfg
        # Without CUDA, cpu=True is what makes accelerate/torchrun processes form a gloo group.
        self.acc = Accelerator(cpu=not torch.cuda.is_available())
        self.dist = distributed.setup(self.acc)
        self.levers = cpu_levers(self.acc.device, cfg.cpu)
        if self.levers is not None:
            self.levers.before_loading()
        self.is_main = self.acc.is_main_process
        self.run_dir = Path(cfg.output_dir)
        self.resume_from = resume_checkpoint(self.run_dir) if resume else None
        if self.resume_from:
            check_resumable(self.resume_from, cfg, self.acc.num_processes)
        else:
            check_output_dir(self.run_dir, overwrite)
        set_seed(cfg.seed)  # identical initial weights (and LoRA init) on every rank

        # Everything that can fail on user input is checked before the model loads, and the run
        # directory is written only once the model has loaded (see `_take_run_dir`).
        check_device_options(cfg)
        distributed.check_options(self.dist, cfg)
        check_vllm(cfg, self.acc.num_processes)
        self.task = load_task(cfg.task)
        self.shuffle_generator = torch.Generator().manual_seed(cfg.seed)  # grpo.shuffle_rewards only
        self.reward_funcs = load_rewards(cfg.rewards.functions, self.task)
        loaded = load_rows(cfg.data, self.task)
        self.rows, self.skipped = loaded.rows, loaded.skipped
        self.sft_task, self.sft_rows = self.task, self.rows  # the cold start's problems
        if cfg.sft.steps and cfg.sft.task is not None and not self.resume_from:
            self.sft_task = load_task(cfg.sft_task)
            self.sft_rows = load_rows(cfg.data, self.sft_task).rows
        if cfg.optim.num_train_epochs and "max_steps" not in cfg.optim.model_fields_set:
            per_step = cfg.prompts_per_step * self.acc.num_processes
            cfg.optim.max_steps = math.ceil(cfg.optim.num_train_epochs * len(self.rows) / per_step)
        check_trackers(cfg.logging.report_to)
        self.evaluator = None
        if cfg.eval.enabled:
            self.evaluator = TrainingEvaluator(cfg, self.run_dir, self.reward_funcs, self.task)

        model, self.tokenizer = load_model_and_tokenizer(cfg.model)
        if self.levers is not None:
            self.levers.prepare(model)
        self.conversational = has_chat_template(self.tokenizer)
        if self.is_main:
            self._warn_long_prompts()
        g, micro = cfg.grpo, cfg.optim.per_device_train_batch_size
        self.group, why_not = (
            shared_prompt_group(model, micro, g.num_generations) if g.share_prompt else (1, None)
        )
        if why_not:
            self._write(
                f"grpo.share_prompt: off, {why_not}; each completion reads its own copy of the prompt"
            )
        shared = self.group > 1
        self.ref_policy, self.ref_pages = None, None
        if g.beta > 0 and not is_peft(model):
            dtype = None if g.reference_dtype == "auto" else getattr(torch, g.reference_dtype)
            self.ref_pages = self._reference_file() if cfg.cpu.reference_on_disk else None
            ref = Policy(
                frozen_copy(model, dtype, self.ref_pages), g.temperature, g.logprob_chunk_size, shared
            )
            self.ref_policy = self.dist.place_frozen(ref)
            if self.ref_pages is not None:
                self.ref_pages.drop_pages()  # written: out of memory until the first reference pass
        elif cfg.cpu.reference_on_disk:
            self._write("cpu.reference_on_disk: no effect, there is no reference copy (beta = 0, or LoRA)")
        if self.resume_from:  # into the whole model, before sharding (the reference keeps the start)
            self._check_steps_left(self.resume_from)
            load_trainable(model, self.resume_from)
        self.policy = self.dist.wrap(Policy(model, g.temperature, g.logprob_chunk_size, shared))
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, cfg.optim)
        self.in_backward = StepInBackward(self.optimizer, params) if cfg.optim.optimizer_in_backward else None
        if self.in_backward is not None and self.acc.num_processes > 1:
            raise TrainingError(
                "optim.optimizer_in_backward runs on one process only: the gradients of several are "
                "reduced after the backward, and it steps during it"
            )
        total = cfg.optim.max_steps * g.num_iterations
        self.scheduler = build_scheduler(
            self.optimizer, cfg.optim.lr_scheduler_type, cfg.optim.num_warmup_steps(total), total
        )
        set_seed(cfg.seed, device_specific=True)  # different samples on each rank
        self.sampler = PromptSampler(
            len(self.rows), cfg.prompts_per_step, cfg.seed, self.acc.process_index,
            self.acc.num_processes,
        )  # fmt: skip
        # Dynamic sampling's extra prompts: their own seeded order, so a step's prompts stay a pure
        # function of seed, step and round (an exact resume).
        self.resampler = PromptSampler(
            len(self.rows), cfg.prompts_per_step, cfg.seed + 2, self.acc.process_index,
            self.acc.num_processes,
        )  # fmt: skip
        self.start_step, self.skipped_steps, self.nonfinite_in_a_row = 0, 0, 0
        self._engine: RolloutEngine | None = None  # built at the first rollout, after any resume or SFT
        self.last_save = time.monotonic()
        self.lock = RunLock(self.run_dir) if self.is_main else None
        try:
            self._take_run_dir(overwrite)
        except OSError as e:  # a tracker's directory, a log... on a full or read-only disk
            self.release()
            raise RunDirError(f"cannot write in {self.run_dir}: {error_reason(e)}") from None
        except BaseException:
            self.release()
            raise

    def _reference_file(self) -> TensorStore:
        """cpu.reference_on_disk's file: on the run directory's disk (its nearest existing folder: the
        directory itself is made later, under the lock), one CPU process or DDP."""
        where = next(d for d in (self.run_dir, *self.run_dir.resolve().parents) if d.is_dir())
        if self.levers is None or isinstance(self.dist, distributed.Sharded):
            raise TrainingError(
                f"cpu.reference_on_disk is for CPU runs without FSDP (this run: {self.acc.device.type}, "
                f"{self.dist.describe()}): elsewhere the reference must live in device memory"
            )
        return self.levers.reference_store(where)

    def release_memory(self) -> None:
        """Hand back what a phase freed before the next one allocates (after the rollout and the update):
        CUDA's cached blocks, or on CPU glibc's heap pages."""
        if self.levers is not None:
            self.levers.release()
        elif torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _take_run_dir(self, overwrite: bool) -> None:
        """Under the lock: replace an earlier run (fresh start) or restore the checkpoint (resume), write
        the config, open the logs and trackers."""
        cfg = self.cfg
        if self.is_main and not self.resume_from:
            cfg.model.name_or_path = start_run(self.run_dir, overwrite, cfg.model.name_or_path)
            save_config(cfg, self.run_dir / "config.yaml")  # first: it marks the directory as a run
        self.acc.wait_for_everyone()
        trackers = []
        if self.is_main:
            name = cfg.logging.run_name or self.run_dir.name
            trackers = open_trackers(
                cfg.logging.report_to, self.run_dir, cfg.model_dump(mode="json"), cfg.logging.project, name
            )
        self.logger = MetricsLogger(self.run_dir, write=self._write, trackers=trackers)
        if self.resume_from:
            self._restore(self.resume_from)
            if self.is_main:
                save_config(cfg, self.run_dir / "config.yaml")  # with the resume's new max_steps...

    def release(self) -> None:
        """Let another process use the run directory."""
        if self.lock is not None:
            self.lock.release()

    # ------------------------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, Any]:
        """One GRPO step, phase by phase; each phase's seconds go into the metrics as time/<phase>.
        With vLLM, a first phase (sync) loads the policy's current weights into its engine (at step one
        of a run it also builds the engine)."""
        g, timer = self.cfg.grpo, PhaseTimer()
        if g.use_vllm:
            with timer("sync"):
                self.engine.sync_weights(self.unwrapped.lm)
        with timer("rollout"):
            rows, rollout = self.rollout(step)
        with timer("score"):
            scores = self.score(step, rows, rollout)
        sampling = None
        if g.dynamic_sampling:
            with timer("resample"):
                rows, rollout, scores, sampling = self.resample(step, rows, rollout, scores)
        with timer("advantages"):
            advantages, group_std = self.advantages(scores)
        with timer("reference"):
            ref_logp, old_logp = self.reference(rollout)
            sampler_weights, mismatch = self.sampler_correction(rollout, old_logp)
            if g.num_iterations == 1:  # the update's ratio is then 1 by construction, as on the HF path
                old_logp = None
        with timer("update"):
            update = self.update(rollout, advantages.to(self.acc.device), ref_logp, old_logp, sampler_weights)
        return self.record(step, rows, rollout, scores, group_std, update, timer.seconds, mismatch, sampling)

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (HF generate, or a colocated vLLM built once and fed the current weights)."""
        if self._engine is None:
            self._engine = rollout_engine(self.cfg, self.unwrapped.lm, self.tokenizer, self.levers)
        return self._engine

    def rollout(self, step: int, round_: int = 0) -> tuple[list[dict[str, Any]], RolloutBatch]:
        """The step's prompts (a pure function of seed, step and rank; `round_` > 0: dynamic sampling's
        extra draws) and G sampled completions of each."""
        cfg = self.cfg
        if round_:
            indices = self.resampler.indices((step - 1) * cfg.grpo.max_resample_rounds + round_ - 1)
        else:
            indices = self.sampler.indices(step - 1)
        rows = [self.rows[i] for i in indices]
        texts = [
            render_prompt(
                self.tokenizer, r["prompt"], cfg.data.assistant_prefix, cfg.data.chat_template_kwargs
            )
            for r in rows
        ]
        with self.dist.full_weights(self.policy):
            batch = self.engine.generate(texts, Sampling.from_config(cfg)).to(self.acc.device)
        self.release_memory()
        return rows, batch

    def score(self, step: int, rows: list[dict[str, Any]], rollout: RolloutBatch) -> RewardScores:
        """Every reward function on every completion, called as TRL calls it (prompts, completions,
        completion_ids, the row's columns, trainer_state, log_extra, log_metric)."""
        cfg, G = self.cfg, self.cfg.grpo.num_generations
        prompts, completions = as_reward_inputs(
            [r["prompt"] for r in rows], rollout.completion_texts, self.conversational
        )
        columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        ids = rollout.completion_ids.cpu()
        mask = rollout.completion_mask.bool().cpu()
        context = RewardContext(
            completion_ids=[row[keep].tolist() for row, keep in zip(ids, mask, strict=True)],
            trainer_state=TrainerState(
                global_step=(step - 1) * cfg.grpo.num_iterations,
                max_steps=cfg.optim.max_steps * cfg.grpo.num_iterations,
                epoch=(step - 1) * cfg.prompts_per_step * self.acc.num_processes / len(self.rows),
            ),
        )
        return score_completions(
            self.reward_funcs,
            prompts,
            completions,
            columns,
            cfg.rewards.on_error,
            context,
            cfg.rewards.timeout_s,
        )

    def resample(
        self, step: int, rows: list[dict[str, Any]], rollout: RolloutBatch, scores: RewardScores
    ) -> tuple[list[dict[str, Any]], RolloutBatch, RewardScores, dict[str, float]]:
        """DAPO's dynamic sampling: while this process (or any other: they generate together) has fewer
        informative groups than the batch holds, and at most `max_resample_rounds` times, draw and score
        another batch of prompts; then keep the first informative groups (`grpo.fill_groups`). Returns
        the batch to train on and its dynamic_sampling/* metrics, summed over processes."""
        g = self.cfg.grpo
        drawn = [(rows, rollout, scores)]
        informative = [self._informative(scores)]
        while len(drawn) <= g.max_resample_rounds and self._any_process(
            int(torch.cat(informative).sum()) < len(rows)
        ):
            more_rows, more = self.rollout(step, len(drawn))
            more_scores = self.score(step, more_rows, more)
            drawn.append((more_rows, more, more_scores))
            informative.append(self._informative(more_scores))
        flags = torch.cat(informative)
        groups = grpo.fill_groups(flags, len(rows))
        completions = (groups[:, None] * g.num_generations + torch.arange(g.num_generations)).flatten()
        every_row = [row for batch_rows, _, _ in drawn for row in batch_rows]
        rows = [every_row[i] for i in groups.tolist()]
        rollout = RolloutBatch.cat([batch for _, batch, _ in drawn]).select(
            completions.to(rollout.prompt_ids.device)
        )
        scores = RewardScores.cat([batch_scores for _, _, batch_scores in drawn]).select(completions)
        filled = int((~flags[groups]).sum())
        counts = torch.tensor([len(flags), int((~flags).sum()) - filled, filled], device=self.acc.device)
        prompts, dropped, filled = self.acc.reduce(counts, "sum").tolist()
        return (
            rows,
            rollout,
            scores,
            {
                "dynamic_sampling/rounds": len(drawn) - 1,
                "dynamic_sampling/prompts_drawn": prompts,
                "dynamic_sampling/groups_dropped": dropped,
                "dynamic_sampling/filled": filled,
            },
        )

    def _informative(self, scores: RewardScores) -> Tensor:
        """Which of this process's groups carry a signal, under `rewards.multi_objective_aggregation`."""
        return grpo.informative_groups(self._combine(scores.per_func, scores.total)[1])

    def _combine(self, per_func: Tensor, total: Tensor) -> tuple[Tensor, Tensor]:
        """Advantages and group stds, the rewards combined as `rewards.multi_objective_aggregation` says."""
        G = self.cfg.grpo.num_generations
        if self.cfg.rewards.multi_objective_aggregation == "normalize_then_sum":
            weights = torch.tensor([weight for _, _, weight in self.reward_funcs], device=per_func.device)
            return grpo.normalize_then_sum(per_func, weights, total.isnan(), G)
        return grpo.group_advantages(total, G, self.cfg.grpo.scale_rewards)

    def advantages(self, scores: RewardScores) -> tuple[Tensor, Tensor]:
        """This process's advantages and every process's group reward stds, as TRL computes them: on all
        processes' rewards (`scale_rewards: batch` and normalize_then_sum use the whole batch's std),
        combined as `rewards.multi_objective_aggregation` says."""
        acc = self.acc
        per_func, total = acc.gather(scores.per_func.to(acc.device)), acc.gather(scores.total.to(acc.device))
        if self.cfg.grpo.shuffle_rewards:
            G = self.cfg.grpo.num_generations
            rows = grpo.shuffle_within_groups(len(total), G, self.shuffle_generator).to(total.device)
            per_func, total = per_func[rows], total[rows]
        advantages, group_std = self._combine(per_func, total)
        n = len(scores.total)
        return advantages[acc.process_index * n : (acc.process_index + 1) * n], group_std

    def reference(self, rollout: RolloutBatch) -> tuple[Tensor | None, Tensor | None]:
        """Log-probs the update compares against, once per generation batch: the reference's (adapter
        disabled for LoRA, the frozen copy for full fine-tuning, none at beta = 0) and, with
        num_iterations > 1 or the vLLM correction on, the policy's own before the first update (else the
        update detaches its own)."""
        g, micro = self.cfg.grpo, self.cfg.optim.per_device_train_batch_size
        ref_logp = None
        if g.beta > 0 and self.ref_policy is not None:
            ref_logp = batch_logprobs(self.ref_policy, rollout, micro, self.group)
            if self.ref_pages is not None:
                self.ref_pages.drop_pages()
        elif g.beta > 0:
            lm = self.unwrapped.lm
            assert is_peft(lm), "without a reference copy the policy is LoRA (see __init__)"
            with lm.disable_adapter():
                ref_logp = batch_logprobs(self.unwrapped, rollout, micro, self.group)
        need_old = g.num_iterations > 1 or self._corrects_sampler(rollout)
        old_logp = batch_logprobs(self.policy, rollout, micro, self.group) if need_old else None
        return ref_logp, old_logp

    def _corrects_sampler(self, rollout: RolloutBatch) -> bool:
        return rollout.sampling_logprobs is not None and self.cfg.grpo.vllm_importance_sampling_correction

    def sampler_correction(
        self, rollout: RolloutBatch, old_logp: Tensor | None
    ) -> tuple[Tensor | None, grpo.SamplerMismatch | None]:
        """Importance weights for the gap between vLLM's sampling distribution and the trainer's (TRL's
        truncated/masked IS), and the numbers that make that gap visible; (None, None) on the HF path."""
        if old_logp is None or rollout.sampling_logprobs is None or not self._corrects_sampler(rollout):
            return None, None
        g = self.cfg.grpo
        return grpo.sampler_importance_weights(
            old_logp, rollout.sampling_logprobs, rollout.completion_mask, g.vllm_importance_sampling_mode,
            g.vllm_importance_sampling_clip_min, g.vllm_importance_sampling_clip_max,
        )  # fmt: skip

    def update(
        self,
        rollout: RolloutBatch,
        advantages: Tensor,
        ref_logp: Tensor | None,
        old_logp: Tensor | None,
        sampler_weights: Tensor | None = None,
    ) -> Update:
        """`num_iterations` optimizer steps on the rollout, each accumulated over micro-batches. A NaN/inf
        loss or gradient on any process skips that optimizer step on every process."""
        cfg, g = self.cfg, self.cfg.grpo
        micro = cfg.optim.per_device_train_batch_size
        mask = rollout.completion_mask.float()
        if g.mask_truncated_completions:
            mask = grpo.mask_truncated(mask, rollout.truncated)
        # dapo normalises by every process's tokens (DDP then averages the gradients)
        num_tokens = float(self.acc.reduce(mask.sum(), "sum")) / self.acc.num_processes
        spec = loss_spec(g)
        batch = grpo.BatchTotals(len(rollout), num_tokens, math.ceil(len(rollout) / micro))
        self.policy.train()
        loss_total, stats, skipped = 0.0, [], False
        grad_norm, lr = math.nan, float(self.scheduler.get_last_lr()[0])
        for _ in range(g.num_iterations):
            iteration_loss = 0.0
            for start in range(0, len(rollout), micro):
                rows = slice(start, start + micro)
                last = start + micro >= len(rollout)
                with (
                    self.dist.sync_gradients(self.policy, sync=last),
                    activation_offload(cfg.model.activation_offload),
                    nullcontext() if self.in_backward is None else self.in_backward.stepping(),
                ):
                    logp, _, entropy = micro_batch_logprobs(
                        self.policy, rollout, rows, group=self.group, with_entropy=True
                    )
                    width = logp.shape[1]
                    loss, mb_stats = grpo.grpo_loss(
                        logp,
                        logp.detach() if old_logp is None else old_logp[rows, :width],
                        None if ref_logp is None else ref_logp[rows, :width],
                        advantages[rows],
                        mask[rows, :width],
                        spec=spec,
                        batch=batch,
                        entropy=entropy,
                        sampler_weights=None if sampler_weights is None else sampler_weights[rows, :width],
                    )
                    self.acc.backward(loss)
                iteration_loss += loss.item()
                stats.append(mb_stats)
            loss_total += iteration_loss / g.num_iterations
            if self.in_backward is None:
                grad_norm = self.dist.clip_grad_norm(self.policy, cfg.optim.max_grad_norm or math.inf)
            else:  # each parameter took its step in the backward
                grad_norm = self.in_backward.grad_norm
            lr = float(self.scheduler.get_last_lr()[0])
            skipped = self._any_process(not (math.isfinite(iteration_loss) and math.isfinite(grad_norm)))
            if not skipped:
                if self.in_backward is None:
                    self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if skipped:  # the step's later iterations would build on the same bad batch
                break
        self.release_memory()
        self.skipped_steps += skipped
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        if skipped:
            self._write("non-finite loss or gradient; update skipped")
        return Update(loss_total, grad_norm, lr, stats)

    def record(
        self,
        step: int,
        rows: list[dict[str, Any]],
        rollout: RolloutBatch,
        scores: RewardScores,
        group_std: Tensor,
        update: Update,
        seconds: dict[str, float],
        mismatch: grpo.SamplerMismatch | None = None,
        sampling: dict[str, float] | None = None,
    ) -> dict[str, Any]:
        """The step's metrics, reduced over every process (`group_std` holds every process's groups);
        logged (and a sample completion with them) on the main process when due. `mismatch`: the vLLM
        sampler's gap to the trainer (vllm/*); `sampling`: dynamic sampling's dynamic_sampling/*."""
        cfg, gather, device = self.cfg, self.acc.gather, self.acc.device
        total, per_func = gather(scores.total.to(device)), gather(scores.per_func.to(device))
        lengths = gather(rollout.lengths().float())
        kl, clip_ratio, entropy = grpo.micro_batch_means(
            update.stats, lambda t: self.acc.reduce(t.to(device), "sum")
        )
        step_seconds = sum(seconds.values())
        metrics: dict[str, Any] = {
            "step": step,
            "reward": float(total.nanmean()),
            "reward_std": float(total[~total.isnan()].std()),  # TRL's: all rewards, not within groups
            "kl": kl if cfg.grpo.beta > 0 else None,
            "clip_ratio": clip_ratio,
            "entropy": entropy,
            "completion_length/mean": float(lengths.mean()),
            "completion_length/max": float(lengths.max()),
            "truncated_frac": float(gather(rollout.truncated.float()).mean()),
            "zero_std_frac": float(group_std.isclose(torch.zeros_like(group_std)).float().mean()),
            "reward_failures": int(gather(scores.failed.float()).sum()),
            "skipped_steps": self.skipped_steps,
            "tokens_per_s": float(lengths.sum()) / step_seconds,
            "step_seconds": step_seconds,
            "peak_memory_mb": peak_memory_mb(),
            **{
                f"rewards/{name}/mean": float(per_func[:, i].nanmean()) for i, name in enumerate(scores.names)
            },
            "loss": update.loss,
            "grad_norm": update.grad_norm,
            "learning_rate": update.learning_rate,
            **{f"time/{phase}": s for phase, s in seconds.items()},
            **scores.metrics,  # the rewards' log_metric values (this process's)
            **{f"vllm/{k}": v for k, v in (vars(mismatch) if mismatch else {}).items()},
            **(sampling or {}),
        }
        if self.is_main and _due(step, cfg.logging.log_completions_steps):
            sample = self.task.sample_view(rows[0], rollout.completion_texts[0])
            rewards = {n: float(scores.per_func[0, i]) for i, n in enumerate(scores.names)}
            extra = {column: values[0] for column, values in scores.extra.items() if values}
            self.logger.log_sample({"step": step, **sample, "rewards": rewards, **extra})
        if self.is_main and _due(step, cfg.logging.logging_steps):
            self.logger.log(metrics)
        return metrics

    # ----------------------------------------------------------------------------------- the run

    def train(self) -> Path | None:
        """Run every step and save the final model; returns its directory, or None when a signal stopped
        the run (after saving a checkpoint and printing how to resume)."""
        try:
            return self._run()
        except (OSError, RunDirError) as e:  # a full disk or I/O error in a log, an eval, a tracker...
            why = (
                str(e) if isinstance(e, RunDirError) else f"cannot write in {self.run_dir}: {error_reason(e)}"
            )
            raise TrainingError(f"{why}; {what_holds(self.run_dir)}") from None
        finally:
            if self.is_main:
                self.logger.close()
            self.release()

    def _run(self) -> Path | None:
        from tqdm import tqdm

        cfg = self.cfg
        self._write(f"training on {self.dist.describe()}, device {self.acc.device}")
        asked = distributed.launcher_processes()
        if asked and asked > self.acc.num_processes:
            self._write(
                f"warning: accelerate launch asked for {asked} processes but {self.acc.num_processes} formed "
                f"(--cpu starts one); on CPU use torchrun --nproc_per_node {asked} or accelerate launch "
                f"--multi_gpu --num_processes {asked} (docs/distributed.md)"
            )
        if self.is_main and self.skipped:
            self._write(f"data: skipped {len(self.skipped)} bad rows (first: {self.skipped[0]})")
        if cfg.grpo.use_vllm:  # before any work, so that a model vLLM cannot load stops the run at once
            self._engine = rollout_engine(cfg, self.unwrapped.lm, self.tokenizer, self.levers)
        if not self.resume_from:  # a resumed run went through these already
            self.maybe_evaluate(0)  # the starting model, before any training (SFT included)
        if cfg.sft.steps and not self.resume_from:
            self.cold_start()
            self.maybe_evaluate(0, name="cold-start")  # GRPO's own starting point, to tell its change apart
        bar = tqdm(
            total=cfg.optim.max_steps,
            initial=self.start_step,
            desc="GRPO",
            disable=not (self.is_main and cfg.logging.progress_bar),
            dynamic_ncols=True,
        )
        with StopSignals() as signals:
            for step in range(self.start_step + 1, cfg.optim.max_steps + 1):
                try:
                    metrics = self.step(step)
                except VLLMError as e:  # the engine fails before the step's update: keep the last one's
                    raise self._engine_failed(step, e) from e
                if self.is_main and step == self.start_step + 1:
                    drop_replaced(self.run_dir)  # the run this one replaced: it has now started
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
                self.maybe_evaluate(step)
                stop = self._any_process(signals.requested)
                diverged = self.nonfinite_in_a_row >= cfg.optim.max_nonfinite_steps
                if stop or diverged or self._checkpoint_due(step):
                    ckpt = self.save_checkpoint(step)
                if diverged:
                    raise TrainingError(
                        f"stopped at step {step}: {self.nonfinite_in_a_row} steps in a row had a non-finite "
                        f"loss or gradient (optim.max_nonfinite_steps={cfg.optim.max_nonfinite_steps}); "
                        f"{ckpt} holds the last good weights"
                    )
                if stop:
                    bar.close()
                    self._write(
                        f"stopped at step {step}; resume with: leangrpo train --resume {self.run_dir}"
                    )
                    return None
        bar.close()
        final = self.run_dir / "model"
        self.acc.wait_for_everyone()
        self._check_finite_weights("the final model")
        lm = self.dist.saveable(self.policy)
        if lm is not None:
            save_final_model(lm, self.tokenizer, final)
        return final

    def _engine_failed(self, step: int, error: VLLMError) -> TrainingError:
        """After vLLM failed during `step`: checkpoint the weights of the step before (unless one holds
        them already) and say, in one line, what failed and how to resume."""
        done = step - 1
        if done > 0 and not (self.run_dir / f"checkpoint-{done}").is_dir():
            self.save_checkpoint(done)
        return TrainingError(f"stopped at step {step}: {error}; {what_holds(self.run_dir)}")

    def cold_start(self) -> None:
        """`sft.steps` supervised steps on the task's worked solutions (of `sft.task`'s problems, if set),
        before the first GRPO step."""
        from tqdm import trange

        cfg, s = self.cfg, self.cfg.sft
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, cfg.optim, learning_rate=s.learning_rate)
        order = PromptSampler(
            len(self.sft_rows), s.batch_size, cfg.seed + 1, self.acc.process_index, self.acc.num_processes
        )
        self.policy.train()
        show = self.is_main and cfg.logging.progress_bar
        for step in trange(s.steps, desc="SFT cold start", disable=not show, dynamic_ncols=True):
            rows = [self.sft_rows[i] for i in order.indices(step)]
            batch = sft.sft_batch(
                self.tokenizer,
                [r["prompt"] for r in rows],
                [self.sft_task.solution(r) for r in rows],
                assistant_prefix=cfg.data.assistant_prefix,
                max_prompt_length=cfg.grpo.max_prompt_length,
                max_completion_length=cfg.grpo.max_completion_length,
            ).to(self.acc.device)
            logp, mask = micro_batch_logprobs(self.policy, batch, slice(None), temperature=1.0)
            loss = sft.nll_loss(logp, mask)
            self.acc.backward(loss)
            self.dist.clip_grad_norm(self.policy, cfg.optim.max_grad_norm or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % cfg.logging.logging_steps == 0 or step + 1 == s.steps:
                self._write(f"sft step {step + 1:>4} | loss={loss.item():.4g}")

    def maybe_evaluate(self, step: int, name: str | None = None) -> None:
        """Evaluate on the held-out subset when `eval` says so (step 0 = before training); main process.
        A `name`d evaluation (after the cold start) is saved as `eval/NAME.json(l)` and printed, but kept
        out of metrics.jsonl, whose evaluations are one per step."""
        if self.evaluator is None or not self.evaluator.due(step):
            return
        engine = self.engine  # the run's, given the weights of the step just trained (vLLM)
        engine.sync_weights(self.unwrapped.lm)
        with self.dist.full_weights(self.policy):
            if self.is_main:
                metrics = self.evaluator(self.unwrapped.lm, self.tokenizer, step, engine, name=name)
                if name is None:
                    self.logger.log(metrics)
                else:
                    self._write(eval_line(f"eval after the {name.replace('-', ' ')}", metrics))
            self.acc.wait_for_everyone()

    # ------------------------------------------------------------------------------ checkpoints

    def _checkpoint_due(self, step: int) -> bool:
        """Every `save_steps` steps, once `save_minutes` have passed since the last save (decided by any
        process, so all save together), and at the last step; never when both are 0."""
        log = self.cfg.logging
        if not (log.save_steps or log.save_minutes):
            return False
        if step == self.cfg.optim.max_steps or (log.save_steps and step % log.save_steps == 0):
            return True
        late = bool(log.save_minutes) and time.monotonic() - self.last_save >= 60 * log.save_minutes
        return self._any_process(late)

    def _check_finite_weights(self, what: str) -> None:
        """Refuse to save non-finite weights (NaN or inf in any trainable parameter, on any process)."""
        bad = any(not bool(torch.isfinite(p).all()) for p in self.policy.parameters() if p.requires_grad)
        if self._any_process(bad):
            holds = what_holds(self.run_dir)
            raise TrainingError(
                f"the trained weights are not finite (NaN or inf), so {what} is not saved; {holds}"
            )

    def save_checkpoint(self, step: int) -> Path:
        self._check_finite_weights(f"checkpoint-{step}")
        state = {
            "world_size": self.acc.num_processes,
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        ckpt = save_checkpoint(
            self.run_dir, step, model=self.dist.saveable(self.policy), tokenizer=self.tokenizer,
            optimizer_state=self.dist.optimizer_state(self.policy, self.optimizer), scheduler=self.scheduler,
            cfg=self.cfg, state=state, rank=self.acc.process_index, barrier=self.acc.wait_for_everyone,
        )  # fmt: skip
        self.last_save = time.monotonic()
        return ckpt

    def _check_steps_left(self, ckpt: Path) -> None:
        """A resume needs steps left to train, or (checkpoint at the last step, no final model: the run
        died while saving it) the final save still to do."""
        step, max_steps = read_state(ckpt)["step"], self.cfg.optim.max_steps
        if step == max_steps and not (self.run_dir / "model" / "config.json").is_file():
            self._write(f"{ckpt} is the last step, but the final model was never saved: saving it now")
        elif step >= max_steps:
            raise TrainingError(
                f"{ckpt} is at step {step} and optim.max_steps={max_steps}: "
                f"nothing left to train; raise optim.max_steps to continue"
            )

    def _restore(self, ckpt: Path) -> None:
        """Optimizer, scheduler, RNG and counters as they were right after the checkpoint's step (the
        weights were loaded before wrapping); log rows after that step are dropped, since those steps run
        again."""
        state = read_state(ckpt)
        rank_state = load_rank_state(ckpt, self.acc.process_index)
        self.dist.load_optimizer_state(self.policy, self.optimizer, rank_state["optimizer"])
        self.scheduler.load_state_dict(rank_state["scheduler"])
        self.start_step = state["step"]
        self.skipped_steps, self.nonfinite_in_a_row = state["skipped_steps"], state["nonfinite_in_a_row"]
        if self.is_main:
            remove_partial(self.run_dir)
            for log in (self.logger.metrics_path, self.logger.samples_path):
                truncate_log(log, self.start_step)
            self._write(f"resuming from {ckpt} at step {self.start_step}")
        set_rng_state(rank_state["rng"])  # last: nothing may draw random numbers after this

    # ---------------------------------------------------------------------------------- helpers

    def _warn_long_prompts(self) -> None:
        """Say once how many prompts are longer than max_prompt_length (rollouts keep only their end)."""
        limit, prefix = self.cfg.grpo.max_prompt_length, self.cfg.data.assistant_prefix
        texts = (render_prompt(self.tokenizer, r["prompt"], prefix) for r in self.rows)

        def too_long(text: str) -> bool:  # too many characters for `limit` tokens: no need to tokenize it
            return (
                len(text) > MAX_CHARS_PER_TOKEN * limit
                or len(self.tokenizer(text, add_special_tokens=False).input_ids) > limit
            )

        long = sum(map(too_long, texts))
        if long:
            self._write(
                f"warning: {long} of {len(self.rows)} prompts are longer than grpo.max_prompt_length={limit} "
                "tokens; their start is cut off in rollouts"
            )

    @property
    def unwrapped(self) -> Policy:
        return self.acc.unwrap_model(self.policy)

    def _write(self, text: str) -> None:
        from tqdm import tqdm

        if self.is_main:
            tqdm.write(text)

    def _any_process(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any (so that all stop at the same step)."""
        return bool(self.acc.reduce(torch.tensor(float(flag), device=self.acc.device), "sum") > 0)


def _due(step: int, every: int) -> bool:
    """A schedule of `every` steps (0: never) that also fires at step 1."""
    return bool(every) and (step % every == 0 or step == 1)


def train(cfg: Config, overwrite: bool = False, resume: bool = False) -> Path | None:
    """Train as configured (or resume the run in `cfg.output_dir`); returns the final model's directory,
    or None when a signal stopped the run after saving a checkpoint.

    Ends by tearing down the process group of a multi-process run (gloo's threads left running at
    interpreter exit can abort the process after the work is done; the CLI then also skips the
    interpreter's own teardown: `cli._leave_if_one_of_many`). Only the group accelerate formed: a
    colocated vLLM's own single-process group stays for the next engine in this process."""
    trainer = Trainer(cfg, overwrite, resume)
    try:
        return trainer.train()
    finally:
        if trainer.acc.num_processes > 1:
            torch.distributed.destroy_process_group()
