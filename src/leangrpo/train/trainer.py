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
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from leangrpo.config.schema import Config, step_interval
from leangrpo.core import grpo
from leangrpo.core.errors import DeviceOptionError, Stopped, UserError, error_reason
from leangrpo.data.rewards import (
    RewardContext,
    RewardsAbandoned,
    RewardScores,
    TrainerState,
    load_rewards,
    score_completions,
)
from leangrpo.data.rows import has_chat_template, render_prompt
from leangrpo.data.sources import PromptSampler, load_rows
from leangrpo.data.tasks import load_task
from leangrpo.engines.agents import AgentSpec
from leangrpo.engines.hf import SnapshotEngine
from leangrpo.engines.tools import prepare_tokenizer
from leangrpo.engines.types import (
    MAX_CHARS_PER_TOKEN,
    RolloutBatch,
    RolloutEngine,
    Sampling,
    as_reward_inputs,
    eos_token_ids,
    rollout_func_batch,
)
from leangrpo.engines.vllm import VLLMError, leave_vllm_groups
from leangrpo.models.load import TensorStore, frozen_copy, is_peft, load_model_and_tokenizer
from leangrpo.run.checkpoint import (
    load_rank_state,
    load_trainable,
    read_state,
    remove_partial,
    resume_checkpoint,
    rng_state,
    save_checkpoint,
    save_final_model,
    set_rng_state,
    truncate_log,
    what_holds,
)
from leangrpo.run.resolve import resolve_steps, save_config, with_model_path
from leangrpo.run.rundir import (
    RunDirError,
    RunLock,
    claim,
    drop_replaced,
    replaced_note,
    restore_replaced,
    start_run,
)
from leangrpo.run.signals import StopSignals
from leangrpo.run.tracking import MetricsLogger, eval_line, open_trackers, peak_memory_mb
from leangrpo.train import distributed, sft
from leangrpo.train.engine import agent_from_config, async_engine, cpu_levers, rollout_engine
from leangrpo.train.evaluation import RolloutFuncEngine, TrainingEvaluator
from leangrpo.train.extras import RuntimeExtras
from leangrpo.train.logprobs import Policy, batch_logprobs, micro_batch_logprobs, shared_prompt_group
from leangrpo.train.loss import loss_spec
from leangrpo.train.optim import StepInBackward, activation_offload, build_optimizer, build_scheduler
from leangrpo.train.preflight import World, check_async_agent, preflight
from leangrpo.train.rollouts import AsyncRollouts, Job, Rollout, rollout_seed

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import PreTrainedModel

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

    def __init__(
        self,
        cfg: Config,
        overwrite: bool = False,
        resume: bool = False,
        agent: AgentSpec | None = None,
        extras: RuntimeExtras | None = None,
    ):
        """`resume`: continue the run in `cfg.output_dir` from its last complete checkpoint. `agent`: the
        tools, environments or rollout_func of TRL's GRPOTrainer (default: the config's `tools:`).
        `extras`: the in-memory objects of a Python caller (rewards, rows, model, step hooks). Everything
        that can fail on user input is checked before the model loads (`preflight`, then the data), and
        the run directory is written only once the model has loaded (`_take_run_dir`)."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.extras = extras or RuntimeExtras()
        # Without CUDA, cpu=True is what makes accelerate/torchrun processes form a gloo group.
        # mixed_precision "no" whatever `accelerate launch` was configured with: the weights' dtype is
        # model.dtype, and accelerate's autocast or fp16 loss scaling would act on an optimizer it does
        # not own (never unscaled).
        self.acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
        self.dist = distributed.setup(self.acc)
        self.levers = cpu_levers(self.acc.device, cfg.cpu)
        if self.levers is not None:
            self.levers.before_loading()
        self.is_main = self.acc.is_main_process
        self.run_dir = Path(cfg.output_dir)
        self.resume_from = resume_checkpoint(self.run_dir) if resume else None
        sharded = isinstance(self.dist, distributed.Sharded)
        world = World(self.acc.num_processes, self.acc.device.type, sharded)
        preflight(cfg, world, overwrite=overwrite, resume_from=self.resume_from)
        set_seed(cfg.seed)  # identical initial weights (and LoRA init) on every rank
        self.agent = agent if agent is not None else agent_from_config(cfg.tools)
        check_async_agent(cfg, self.agent)
        self.cfg = self._load_data(cfg)
        self.evaluator = (
            TrainingEvaluator(self.cfg, self.run_dir, self.reward_funcs, self.task, self.agent)
            if cfg.eval.enabled
            else None
        )
        model = self._load_model()
        self.ref_policy, self.ref_pages = self._build_reference(model)
        if self.resume_from:  # into the whole model, before sharding (the reference keeps the start)
            self._check_steps_left(self.resume_from)
            load_trainable(model, self.resume_from)
        g = cfg.grpo
        self.policy = self.dist.wrap(Policy(model, g.temperature, g.logprob_chunk_size, self.group > 1))
        self.optimizer, self.in_backward, self.scheduler = self._build_optimizer()
        set_seed(cfg.seed, device_specific=True)  # different samples on each rank
        self.sampler, self.resampler = self._prompt_samplers()
        self.sampling = Sampling.from_config(g, cfg.data.assistant_prefix)
        self.loss_spec = loss_spec(g)  # the objective, its aggregation and constants, once
        self.start_step, self.skipped_steps, self.nonfinite_in_a_row = 0, 0, 0
        self._engine: RolloutEngine | None = None  # built at the first rollout, after any resume or SFT
        self._rollouts: AsyncRollouts | None = None  # grpo.async_rollouts: built with the engine
        self.async_metrics: dict[str, float] = {}  # async/*: of the batch the step trains on
        self.last_save = time.monotonic()
        self.signals = StopSignals()  # active while the steps run
        self._open_run_dir(overwrite)

    def _load_data(self, cfg: Config) -> Config:
        """The task, its reward functions and the training rows (and the cold start's); returns `cfg`
        with the step count an epoch-based run takes over these rows."""
        self.task = load_task(cfg.task)
        self.shuffle_generator = torch.Generator().manual_seed(cfg.seed)  # grpo.shuffle_rewards only
        self.reward_funcs = load_rewards(cfg.rewards.functions, self.task, self.extras.reward_funcs)
        if self.agent is not None:  # an environment's get_reward, as TRL adds it
            self.reward_funcs += self.agent.environment_rewards()
        loaded = load_rows(cfg.data, self.task, self.extras.train_rows)
        self.rows, self.skipped = loaded.rows, loaded.skipped
        self.sft_task, self.sft_rows = self.task, self.rows  # the cold start's problems
        if cfg.sft.steps and cfg.sft.task is not None and not self.resume_from:
            self.sft_task = load_task(cfg.sft_task)
            self.sft_rows = load_rows(cfg.data, self.sft_task).rows
        return resolve_steps(cfg, len(self.rows), self.acc.num_processes)

    def _load_model(self) -> PreTrainedModel:
        """The policy model and tokenizer (prepared by the device's levers), and how many completions
        read each prompt once (`grpo.share_prompt`)."""
        g, micro = self.cfg.grpo, self.cfg.optim.per_device_train_batch_size
        model, self.tokenizer = load_model_and_tokenizer(
            self.cfg.model, self.extras.model, self.extras.tokenizer
        )
        if self.levers is not None:
            with self.acc.main_process_first():  # one process measures for cpu.matmul: auto, the rest read it
                note = self.levers.prepare(model)
            if note:
                self._write(note)
        self.conversational = has_chat_template(self.tokenizer)
        if self.agent is not None and self.agent.uses_tools:
            prepare_tokenizer(self.tokenizer)
        if self.is_main:
            self._warn_long_prompts()
        self.group, why_not = (
            shared_prompt_group(model, micro, g.num_generations) if g.share_prompt else (1, None)
        )
        if why_not:
            self._write(
                f"grpo.share_prompt: off, {why_not}; each completion reads its own copy of the prompt"
            )
        return model

    def _build_reference(self, model: PreTrainedModel) -> tuple[torch.nn.Module | None, TensorStore | None]:
        """The frozen reference copy of full fine-tuning with beta > 0 (LoRA's reference is the model
        with its adapter off), and the file holding its weights with `cpu.reference_on_disk` (by default
        on CPU without FSDP, in memory where the disk has no room for it)."""
        g, asked = self.cfg.grpo, self.cfg.cpu.reference_on_disk
        if g.beta == 0 or is_peft(model):
            if asked:
                self._write(
                    "cpu.reference_on_disk: no effect, there is no reference copy (beta = 0, or LoRA)"
                )
            return None, None
        dtype = None if g.reference_dtype == "auto" else getattr(torch, g.reference_dtype)
        sharded = isinstance(self.dist, distributed.Sharded)
        on_disk = asked if asked is not None else self.levers is not None and not sharded
        try:
            pages = self._reference_file() if on_disk else None
            copy = frozen_copy(model, dtype, pages)
        except DeviceOptionError as e:
            if asked:
                raise
            self._write(f"{e}; the reference copy stays in memory")
            pages, copy = None, frozen_copy(model, dtype)
        ref_policy = self.dist.place_frozen(Policy(copy, g.temperature, g.logprob_chunk_size, self.group > 1))
        if pages is not None:
            pages.drop_pages()  # written: out of memory until the first reference pass
        return ref_policy, pages

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, StepInBackward | None, LambdaLR]:
        """The optimizer of the trainable parameters, its in-backward stepping
        (`optim.optimizer_in_backward`) and its learning-rate schedule over every update of the run."""
        optim = self.cfg.optim
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = build_optimizer(params, optim)
        in_backward = StepInBackward(optimizer, params) if optim.optimizer_in_backward else None
        scheduler = build_scheduler(optimizer, optim, optim.max_steps * self.cfg.grpo.num_iterations)
        return optimizer, in_backward, scheduler

    def _prompt_samplers(self) -> tuple[PromptSampler, PromptSampler]:
        """The order of each step's prompts, and of dynamic sampling's extra prompts: their own seeded
        order, so that a step's prompts stay a pure function of seed, step and round (an exact resume)."""
        cfg, acc = self.cfg, self.acc
        return (
            PromptSampler(
                len(self.rows), cfg.prompts_per_step, cfg.seed, acc.process_index, acc.num_processes
            ),
            PromptSampler(
                len(self.rows), cfg.prompts_per_step, cfg.seed + 2, acc.process_index, acc.num_processes
            ),
        )

    def _open_run_dir(self, overwrite: bool) -> None:
        """Take the run directory's lock (main process) and the directory (`_take_run_dir`); on any
        failure, let go of the lock."""
        self.lock = RunLock(self.run_dir) if self.is_main else None
        try:
            self._take_run_dir(overwrite)
        except BaseException as e:
            self._restore_replaced()
            self.release()
            if not isinstance(e, (OSError, RunDirError)):
                raise
            # a tracker's directory, a log... on a full or read-only disk
            why = e if isinstance(e, RunDirError) else f"cannot write in {self.run_dir}: {error_reason(e)}"
            raise RunDirError(f"{why}; {what_holds(self.run_dir)}" if self.resume_from else why) from None

    def _restore_replaced(self) -> None:
        """When the new run ends before finishing a step, however it ends, the run it replaced is moved
        back (or, if that fails, where it is and how to restore it is said)."""
        if not self.is_main:
            return
        try:
            if restore_replaced(self.run_dir):
                self._write("the run stopped before its first step; the run it replaced is back")
        except OSError as e:
            why = f"cannot restore the replaced run: {error_reason(e)}{replaced_note(self.run_dir)}"
            self._write(f"error: {why}")

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
        if self.is_main and not self.resume_from:
            self.cfg = with_model_path(
                self.cfg, start_run(self.run_dir, overwrite, self.cfg.model.name_or_path)
            )
            save_config(self.cfg, self.run_dir / "config.yaml")  # first: it marks the directory as a run
        self.acc.wait_for_everyone()
        cfg = self.cfg
        trackers = []
        if self.is_main:
            tracker_dirs = {"tensorboard", "wandb"} & set(cfg.logging.report_to)
            claim(self.run_dir, "metrics.jsonl", "completions.jsonl", *sorted(tracker_dirs))
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
        of a run it also builds the engine); with async rollouts, the sync follows the rollout and starts
        generating the next step's batch."""
        g, timer = self.cfg.grpo, PhaseTimer()
        if g.use_vllm and not g.async_rollouts:
            with timer("sync"):
                self.sync_engine()
        with timer("rollout"):  # async: waits for the batch generated in the background, if still running
            rows, rollout = self.rollout(step)
        if g.async_rollouts:
            with timer("sync"):  # the engine gets these weights, then generates the next batch meanwhile
                self.prefetch_next(step)
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

    def sync_engine(self) -> None:
        """Load the policy's current weights into the vLLM engine (HF generate reads the policy itself).
        Every process syncs its own engine; under FSDP2 they gather the weights together, a shard group at
        a time (`Sharded.engine_weights`)."""
        if self.cfg.grpo.use_vllm:
            self.engine.sync_weights(self.unwrapped.lm, self.dist.engine_weights(self.policy))

    def generating(self) -> AbstractContextManager[None]:
        """Around generation: under FSDP2 HF generate needs the whole weights gathered; a vLLM engine
        holds its own copy, so the shards stay as they are."""
        return nullcontext() if self.cfg.grpo.use_vllm else self.dist.full_weights(self.policy)

    @property
    def engine(self) -> RolloutEngine:
        """The rollout engine (HF generate, or a colocated vLLM built once and fed the current weights)."""
        if self._engine is None:
            self._engine = rollout_engine(self.cfg, self.unwrapped.lm, self.tokenizer, self.levers)
        return self._engine

    def rollout(self, step: int, round_: int = 0) -> Rollout:
        """The step's prompts (a pure function of seed, step and rank; `round_` > 0: dynamic sampling's
        extra draws) and G sampled completions of each; with async rollouts, the batch generated in the
        background (started now if it was not)."""
        if self.cfg.grpo.async_rollouts:
            return self._take(step)
        agent = self.agent
        if agent is not None and agent.rollout_func is not None:
            return self._rollout_func(self._rows(step, round_))
        job = self.rollout_job(step, round_)
        with self.generating():
            rows, batch = job(self.engine)
        self.release_memory()
        return rows, batch

    def _rows(self, step: int, round_: int) -> list[dict[str, Any]]:
        """The rows of `step`'s prompts (of dynamic sampling's round `round_`)."""
        if round_:
            indices = self.resampler.indices((step - 1) * self.cfg.grpo.max_resample_rounds + round_ - 1)
        else:
            indices = self.sampler.indices(step - 1)
        return [self.rows[i] for i in indices]

    def _rollout_func(self, rows: list[dict[str, Any]]) -> Rollout:
        """TRL's rollout_func: the user's function generates, with the trainer in hand."""
        cfg, G, agent = self.cfg, self.cfg.grpo.num_generations, self.agent
        assert agent is not None and agent.rollout_func is not None
        with self.dist.full_weights(self.policy):
            output = agent.rollout_func([r["prompt"] for r in rows for _ in range(G)], self)
        eos = eos_token_ids(self.tokenizer, self.unwrapped.lm)
        batch = rollout_func_batch(output, self.tokenizer, eos, self.acc.device, cfg.grpo.use_vllm)
        self.release_memory()
        return rows, batch

    def rollout_job(self, step: int, round_: int = 0) -> Job:
        """Generating `step`'s batch: here, what must run on this thread (the prompts, the environments'
        reset); returned, the rest as a function of the engine, which may run in another thread. The
        samples are drawn from the rollout's own seed (`rollout_seed`)."""
        cfg, G, agent = self.cfg, self.cfg.grpo.num_generations, self.agent
        rows = self._rows(step, round_)
        episodes = agent.start(rows, G) if agent is not None and agent.uses_tools else None
        if episodes is not None:  # the prompts after the environments' reset, each with its tools
            rows = [{**r, "prompt": p} for r, p in zip(rows, episodes.prompts, strict=True)]
        texts = [
            render_prompt(
                self.tokenizer, r["prompt"], cfg.data.assistant_prefix,
                cfg.data.chat_template_kwargs if episodes is None
                else {**(cfg.data.chat_template_kwargs or {}), "tools": episodes.toolboxes[i * G].schemas},
            )
            for i, r in enumerate(rows)
        ]  # fmt: skip
        sampling = replace(self.sampling, seed=rollout_seed(cfg.seed, step, round_, self.acc.process_index))
        device = self.acc.device

        def generate(engine: RolloutEngine) -> Rollout:
            batch = engine.generate(texts, sampling, None if episodes is None else episodes.toolboxes)
            batch = batch.to(device)
            if episodes is not None and episodes.environments is not None and batch.tool_use is not None:
                batch.tool_use.columns["environments"] = episodes.environments  # TRL gives them to rewards
            return rows, batch

        return generate

    @property
    def rollouts(self) -> AsyncRollouts:
        """Async rollouts' background thread and engine (built at the first rollout, like the engine)."""
        if self._rollouts is None:
            g, lm = self.cfg.grpo, self.unwrapped.lm
            engine = async_engine(self.engine, lm, self.tokenizer, self.levers)
            self._rollouts = AsyncRollouts(engine, g.max_staleness, g.num_iterations)
        return self._rollouts

    def prefetch(self, step: int, trained: int) -> None:
        """Async rollouts: give the engine the policy's weights, those after step `trained`, and start
        generating `step`'s batch in the background."""
        self.rollouts.sync(self.unwrapped.lm, trained * self.cfg.grpo.num_iterations)
        self.rollouts.submit(step, self.rollout_job(step))

    def prefetch_next(self, step: int) -> None:
        """While `step` trains, generate the next step's batch, if the staleness bound allows it."""
        if self.rollouts.ahead and step < self.cfg.optim.max_steps:
            self.prefetch(step + 1, trained=step - 1)

    def _take(self, step: int) -> Rollout:
        """`step`'s batch from the background thread (generated now if none was ahead: the first step, a
        resumed run's, or a staleness bound below num_iterations), and its async/* metrics."""
        if self.rollouts.in_flight is None:
            self.prefetch(step, trained=step - 1)
        taken = self.rollouts.take(step)
        staleness = float((step - 1) * self.cfg.grpo.num_iterations - taken.version)
        assert staleness <= self.cfg.grpo.max_staleness, f"a batch {staleness} optimizer steps stale"
        rows, batch = taken.rollout
        if staleness == 0 and isinstance(self.rollouts.engine, SnapshotEngine):
            batch.sampling_logprobs = None  # the policy's own weights: no gap to correct, as with HFEngine
        every = self.acc.gather(torch.tensor([staleness], device=self.acc.device))
        self.async_metrics = {
            "async/staleness_mean": float(every.mean()),
            "async/staleness_max": float(every.max()),
            "async/generate_seconds": taken.seconds,
        }
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
        if rollout.tool_use is not None:  # TRL's: the assistant's turns, tool calls and results as messages
            completions = rollout.tool_use.messages if self.conversational else completions
            columns.update(rollout.tool_use.columns)
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
            stop=lambda: self.signals.requested,
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
            old_logp, rollout.sampling_logprobs, rollout.loss_mask, g.vllm_importance_sampling_mode,
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
        g = self.cfg.grpo
        mask = rollout.loss_mask.float()  # the model's tokens: a tool's are no action of the policy
        if g.mask_truncated_completions:
            mask = grpo.mask_truncated(mask, rollout.truncated)
        # dapo normalises by every process's tokens (DDP then averages the gradients)
        num_tokens = float(self.acc.reduce(mask.sum(), "sum")) / self.acc.num_processes
        self.policy.train()
        loss_total, stats, skipped = 0.0, [], False
        grad_norm, lr = math.nan, float(self.scheduler.get_last_lr()[0])
        for _ in range(g.num_iterations):
            iteration_loss, iteration_stats = self._backward(
                rollout, advantages, ref_logp, old_logp, sampler_weights, mask, num_tokens
            )
            stats += iteration_stats
            loss_total += iteration_loss / g.num_iterations
            grad_norm, lr, skipped = self._optimizer_step(iteration_loss)
            if skipped:  # the step's later iterations would build on the same bad batch
                break
        self.release_memory()
        self.skipped_steps += skipped
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        if skipped:
            self._write("non-finite loss or gradient; update skipped")
        return Update(loss_total, grad_norm, lr, stats)

    def _backward(
        self,
        rollout: RolloutBatch,
        advantages: Tensor,
        ref_logp: Tensor | None,
        old_logp: Tensor | None,
        sampler_weights: Tensor | None,
        mask: Tensor,
        num_tokens: float,
    ) -> tuple[float, list[grpo.LossStats]]:
        """One iteration's loss and gradients, micro-batch by micro-batch (`mask`: the completion tokens
        that count, `num_tokens` of them on an average process); returns the summed loss and each
        micro-batch's token counts."""
        cfg = self.cfg
        micro = cfg.optim.per_device_train_batch_size
        batch = grpo.BatchTotals(len(rollout), num_tokens, math.ceil(len(rollout) / micro))
        iteration_loss, stats = 0.0, []
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
                    spec=self.loss_spec,
                    batch=batch,
                    entropy=entropy,
                    sampler_weights=None if sampler_weights is None else sampler_weights[rows, :width],
                )
                self.acc.backward(loss)
            iteration_loss += loss.item()
            stats.append(mb_stats)
        return iteration_loss, stats

    def _optimizer_step(self, iteration_loss: float) -> tuple[float, float, bool]:
        """Clip (or read the in-backward steps' norm), then step the optimizer and schedule unless the
        loss or gradient is non-finite on any process; returns the gradient norm, the learning rate
        the step used and whether it was skipped."""
        if self.in_backward is None:
            grad_norm = self.dist.clip_grad_norm(self.policy, self.cfg.optim.max_grad_norm or math.inf)
        else:  # each parameter took its step in the backward
            grad_norm = self.in_backward.grad_norm
        lr = float(self.scheduler.get_last_lr()[0])
        skipped = self._any_process(not (math.isfinite(iteration_loss) and math.isfinite(grad_norm)))
        if not skipped:
            if self.in_backward is None:
                self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, lr, skipped

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
        sampler's gap to the trainer (vllm/*); `sampling`: dynamic sampling's dynamic_sampling/*. With
        async rollouts, the batch's async/* (`_take`)."""
        cfg, gather, device = self.cfg, self.acc.gather, self.acc.device
        total, per_func = gather(scores.total.to(device)), gather(scores.per_func.to(device))
        lengths, truncated = gather(rollout.lengths().float()), gather(rollout.truncated)
        means = grpo.micro_batch_means(update.stats, lambda t: self.acc.reduce(t.to(device), "sum"))
        step_seconds = sum(seconds.values())
        metrics: dict[str, Any] = {
            "step": step,
            "reward": float(total.nanmean()),
            "reward_std": float(total[~total.isnan()].std()),  # TRL's: all rewards, not within groups
            **means,
            "kl": means["kl"] if cfg.grpo.beta > 0 else None,
            **_length_metrics(lengths, truncated),
            "frac_reward_zero_std": float(group_std.isclose(torch.zeros_like(group_std)).float().mean()),
            "reward_failures": int(gather(scores.failed.float().to(device)).sum()),
            "skipped_steps": self.skipped_steps,
            "tokens_per_s": float(lengths.sum()) / step_seconds,
            "step_seconds": step_seconds,
            "peak_memory_mb": peak_memory_mb(),
            **_reward_metrics(scores.names, per_func),
            "loss": update.loss,
            "grad_norm": update.grad_norm,
            "learning_rate": update.learning_rate,
            **{f"time/{phase}": s for phase, s in seconds.items()},
            **scores.metrics,  # the rewards' log_metric values (this process's)
            **self._mismatch_metrics(mismatch),
            **(sampling or {}),
            **self.async_metrics,
            **self._tool_metrics(rollout),
        }
        if self.is_main and _due(step, cfg.logging.log_completions_steps):
            sample = self.task.sample_view(rows[0], rollout.completion_texts[0])
            rewards = {n: float(scores.per_func[0, i]) for i, n in enumerate(scores.names)}
            extra = {column: values[0] for column, values in scores.extra.items() if values}
            self.logger.log_sample({"step": step, **sample, "rewards": rewards, **extra})
        if self.is_main and _due(step, step_interval(cfg.logging.logging_steps, cfg.optim.max_steps)):
            self.logger.log(metrics)
        if self.is_main:
            for hook in self.extras.step_hooks:
                hook(step, metrics)
        return metrics

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

    def _tool_metrics(self, rollout: RolloutBatch) -> dict[str, float]:
        """tools/*, this process's (the rollouts it generated), when rollouts call tools."""
        uses_tools = self.agent is not None and self.agent.uses_tools
        return rollout.tool_use.metrics() if uses_tools and rollout.tool_use is not None else {}

    # ----------------------------------------------------------------------------------- the run

    def train(self) -> Path:
        """Run every step and save the final model; returns its directory. A signal stops the run with
        Stopped (after saving a checkpoint), whose message says how to resume."""
        try:
            return self._run()
        except (OSError, RunDirError) as e:  # a full disk or I/O error in a log, an eval, a tracker...
            why = (
                str(e) if isinstance(e, RunDirError) else f"cannot write in {self.run_dir}: {error_reason(e)}"
            )
            raise TrainingError(f"{why}; {what_holds(self.run_dir)}") from None
        finally:
            if self._rollouts is not None:
                self._rollouts.close()
            if self.is_main:
                self.logger.close()
            self._restore_replaced()
            self.release()

    def _run(self) -> Path:
        from tqdm import tqdm

        cfg = self.cfg
        self._announce()
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
        with self.signals:
            for step in range(self.start_step + 1, cfg.optim.max_steps + 1):
                rng = rng_state()  # what a checkpoint of the step before holds, should this one be dropped
                try:
                    metrics = self.step(step)
                except VLLMError as e:  # the engine fails before the step's update: keep the last one's
                    raise self._engine_failed(step, e) from e
                except RewardsAbandoned:
                    bar.close()
                    raise self._abandoned(step, rng) from None
                if self.is_main and step == self.start_step + 1:
                    drop_replaced(self.run_dir)  # the run this one replaced: it has now started
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
                self.maybe_evaluate(step)
                stop = self._any_process(self.signals.requested)
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
                    raise self.signals.stopped(
                        f"stopped at step {step}; resume with: leangrpo train --resume {self.run_dir}"
                    )
        bar.close()
        final = self.run_dir / "model"
        self.acc.wait_for_everyone()
        self._check_finite_weights("the final model")
        lm = self.dist.saveable(self.policy)
        if lm is not None:
            save_final_model(lm, self.tokenizer, final, self.cfg.model.name_or_path)
        return final

    def _abandoned(self, step: int, rng: dict[str, Any]) -> Stopped:
        """A stop asked for while `step`'s rewards still ran: the step is dropped, and the one before it
        checkpointed with the RNG state it ended with (an exact resume), unless a checkpoint holds it."""
        done = step - 1
        if done == 0:
            return self.signals.stopped(
                "stopped during step 1, before any step had finished: nothing to resume"
            )
        if not (self.run_dir / f"checkpoint-{done}").is_dir():
            self.save_checkpoint(done, rng)
        return self.signals.stopped(
            f"stopped during step {step}, its rewards abandoned while still running; resume from step {done} "
            f"with: leangrpo train --resume {self.run_dir}"
        )

    def _announce(self) -> None:
        """Say where the run trains, warn of a launch that formed fewer processes than it asked for, and
        count the data's bad rows."""
        self._write(f"training on {self.dist.describe()}, device {self.acc.device}")
        if warning := distributed.launch_warning(self.acc.num_processes):
            self._write(warning)
        if self.is_main and self.skipped:
            self._write(f"data: skipped {len(self.skipped)} bad rows (first: {self.skipped[0]})")

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
            prompts, kwargs = [r["prompt"] for r in rows], None
            if self.agent is not None and self.agent.uses_tools:  # the prompts as rollouts show them
                episodes = self.agent.start(rows, 1)
                prompts, kwargs = episodes.prompts, [{"tools": box.schemas} for box in episodes.toolboxes]
            batch = sft.sft_batch(
                self.tokenizer,
                prompts,
                [self.sft_task.solution(r) for r in rows],
                assistant_prefix=cfg.data.assistant_prefix,
                max_prompt_length=cfg.grpo.max_prompt_length,
                max_completion_length=cfg.grpo.max_completion_length,
                chat_template_kwargs=kwargs,
            ).to(self.acc.device)
            logp, _ = micro_batch_logprobs(self.policy, batch, slice(None), temperature=1.0)
            loss = sft.nll_loss(logp, batch.loss_mask[:, : logp.shape[1]])  # a trace's tool results: out
            self.acc.backward(loss)
            self.dist.clip_grad_norm(self.policy, cfg.optim.max_grad_norm or math.inf)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % step_interval(cfg.logging.logging_steps, s.steps) == 0 or step + 1 == s.steps:
                self._write(f"sft step {step + 1:>4} | loss={loss.item():.4g}")

    def maybe_evaluate(self, step: int, name: str | None = None) -> None:
        """Evaluate on the held-out subset when `eval` says so (step 0 = before training); main process.
        A `name`d evaluation (after the cold start) is saved as `eval/NAME.json(l)` and printed, but kept
        out of metrics.jsonl, whose evaluations are one per step."""
        if self.evaluator is None or not self.evaluator.due(step):
            return
        engine: RolloutEngine = self.engine  # the run's, given the weights of the step just trained (vLLM)
        if self._rollouts is not None and self._rollouts.engine is engine:  # after its batch in flight
            self._rollouts.sync(self.unwrapped.lm, step * self.cfg.grpo.num_iterations)
        else:
            self.sync_engine()
        if self.agent is not None and self.agent.rollout_func is not None:  # as TRL: the run's generation
            eos, prompts = (
                eos_token_ids(self.tokenizer, self.unwrapped.lm),
                [r["prompt"] for r in self.evaluator.rows],
            )
            engine = RolloutFuncEngine(
                self.agent.rollout_func, self, self.tokenizer, eos, prompts, self.cfg.data.assistant_prefix
            )
        with self.generating():
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
        log, max_steps = self.cfg.logging, self.cfg.optim.max_steps
        if not (log.save_steps or log.save_minutes):
            return False
        every = step_interval(log.save_steps, max_steps)
        if step == max_steps or (every and step % every == 0):
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

    def save_checkpoint(self, step: int, rng: dict[str, Any] | None = None) -> Path:
        """`checkpoint-{step}` of the weights and states now (`rng`: the RNG state to record instead of
        the current one)."""
        self._check_finite_weights(f"checkpoint-{step}")
        state = {
            "world_size": self.acc.num_processes,
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        if self._rollouts is not None and self._rollouts.in_flight is not None:
            # dropped, never trained on: the resumed run generates it again from its step index
            state["async_discarded_step"] = self._rollouts.in_flight.step
        ckpt = save_checkpoint(
            self.run_dir, step, model=self.dist.saveable(self.policy), tokenizer=self.tokenizer,
            optimizer_state=self.dist.optimizer_state(self.policy, self.optimizer), scheduler=self.scheduler,
            cfg=self.cfg, state=state, rank=self.acc.process_index, barrier=self.acc.wait_for_everyone,
            rng=rng,
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


def _nanstd(values: Tensor) -> float:
    """The std of the scored values (TRL's per-reward `std`, which leaves unscored ones out)."""
    return float(values[~values.isnan()].std())


def _reward_metrics(names: list[str], per_func: Tensor) -> dict[str, float]:
    """Each reward function's `rewards/<name>/mean` and `/std` over the scored completions."""
    return {
        f"rewards/{name}/{stat}": value
        for i, name in enumerate(names)
        for stat, value in (("mean", float(per_func[:, i].nanmean())), ("std", _nanstd(per_func[:, i])))
    }


def _length_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, float]:
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


def _due(step: int, every: int) -> bool:
    """A schedule of `every` steps (0: never) that also fires at step 1."""
    return bool(every) and (step % every == 0 or step == 1)


def train(
    cfg: Config,
    overwrite: bool = False,
    resume: bool = False,
    agent: AgentSpec | None = None,
    extras: RuntimeExtras | None = None,
) -> Path:
    """Train as configured (or resume the run in `cfg.output_dir`); returns the final model's directory.
    A signal stops it with Stopped, after saving a checkpoint.

    Ends by tearing down the process group of a multi-process run (gloo's threads left running at
    interpreter exit can abort the process after the work is done; the CLI then also skips the
    interpreter's own teardown: `cli._leave_if_one_of_many`), the engines' groups over it first. Only a
    multi-process run's: a colocated vLLM's own single-process group stays for the next engine in this
    process."""
    trainer = Trainer(cfg, overwrite, resume, agent, extras)
    try:
        return trainer.train()
    finally:
        if trainer.acc.num_processes > 1:
            if cfg.grpo.use_vllm:  # the engines' groups first, while the job's group still exists
                leave_vllm_groups()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
