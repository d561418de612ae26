"""The GRPO training loop: the Trainer builds what a run needs, `step()` runs one step as its timed
phases, and `train()` runs the steps with evaluation, checkpoints and stops.

`Trainer.step()` is the table of contents: rollout → score → advantages → reference → update → record,
each phase timed into the metrics as `time/<phase>`. Each role has its own module: where the batch comes
from (`rollout_source.py`), rewards and advantages (`scoring.py`), the update (`update.py`), the metrics
row (`metrics.py`), checkpoints (`checkpoints.py`), the cold start (`sft.py`), evaluation
(`evaluation.py`); the run directory's lock and logs are `run/session.py`'s.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from leangrpo.config.schema import Config
from leangrpo.core.errors import Stopped, TrainingError, error_reason
from leangrpo.data.rewards import RewardsAbandoned, load_rewards
from leangrpo.data.rows import PromptFormat, has_chat_template
from leangrpo.data.sources import load_rows
from leangrpo.data.tasks import load_task
from leangrpo.engines.agents import AgentSpec, agent_from_config
from leangrpo.engines.tools import prepare_tokenizer
from leangrpo.engines.types import EngineError
from leangrpo.models import neftune
from leangrpo.models.load import load_model_and_tokenizer, processing_class
from leangrpo.run.checkpoint import load_trainable, resume_checkpoint, rng_state, save_final_model, what_holds
from leangrpo.run.resolve import resolve_steps
from leangrpo.run.rundir import RunDirError, drop_replaced
from leangrpo.run.session import RunSession
from leangrpo.run.signals import StopSignals
from leangrpo.run.tracking import eval_line
from leangrpo.train import distributed, sft
from leangrpo.train.checkpoints import Checkpoints, check_steps_left
from leangrpo.train.evaluation import TrainingEvaluator
from leangrpo.train.extras import RuntimeExtras
from leangrpo.train.levers import cpu_levers, release_memory
from leangrpo.train.metrics import PhaseTimer, StepRecorder
from leangrpo.train.optim import Optimization, StepInBackward, build_scheduler
from leangrpo.train.policy import Policy, shared_prompt_group
from leangrpo.train.precision import precise_optimizer
from leangrpo.train.preflight import World, check_async_agent, preflight
from leangrpo.train.rollout_source import RolloutSource, long_prompts
from leangrpo.train.rollouts import Generation
from leangrpo.train.scoring import Scorer
from leangrpo.train.update import Updater, build_policy, build_reference

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from leangrpo.models.load import TensorStore

__all__ = ["RunDirError", "Trainer", "TrainingError", "train"]


class Trainer:
    """Builds a run's parts, in the order a run needs them; `train()` runs it."""

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
        the run directory is written only once the model has loaded (`_open_run_dir`)."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.extras = extras or RuntimeExtras()
        # Without CUDA, cpu=True is what makes accelerate/torchrun processes form a gloo group.
        # mixed_precision "no" whatever `accelerate launch` was configured with: the weights' dtype is
        # model.dtype, and accelerate's autocast or fp16 loss scaling would act on an optimizer it does
        # not own (never unscaled).
        self.acc = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="no")
        self.dist = distributed.setup(self.acc, cfg.optim.master_weights)
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
        self.prompt_format = PromptFormat.from_config(self.cfg.data, self.cfg.grpo.max_prompt_length)
        self.evaluator = (
            TrainingEvaluator(self.cfg, self.run_dir, self.reward_funcs, self.task, self.agent)
            if cfg.eval.enabled
            else None
        )
        model = self._load_model()
        store = None if self.levers is None else self.levers.reference_store
        self.ref_policy, ref_pages = build_reference(
            cfg, model, self.dist, store, self.group, self.run_dir, self._write
        )
        if self.resume_from:  # into the whole model, before sharding (the reference keeps the start)
            check_steps_left(self.resume_from, self.cfg.optim.max_steps, self.run_dir, self._write)
            load_trainable(model, self.resume_from)
        self.policy = build_policy(cfg, model, self.dist, self.group)
        opt = self._build_optimizer()
        self.optimizer, self.scheduler = opt.optimizer, opt.scheduler
        set_seed(cfg.seed, device_specific=True)  # different samples on each rank
        state = self._open_run_dir(overwrite, opt)
        self._build_roles(opt, ref_pages, state)
        self.signals = StopSignals()  # active while the steps run

    def _build_roles(self, opt: Optimization, ref_pages: TensorStore | None, state: dict[str, Any]) -> None:
        """Each role of a step, on the run's final config: where batches come from, the rewards and
        advantages, the update (its counters as a resumed run's `state` left them) and the record."""
        self.start_step = state.get("step", 0)
        free = partial(release_memory, self.levers)
        self.gen = Generation(self.policy, self.dist, self.tokenizer, self.levers, self.agent)
        self.source = RolloutSource(self.cfg, self.acc, self.gen, self.rows, self.prompt_format, self, free)
        self.scorer = Scorer(self.cfg, self.acc, self.reward_funcs, self.conversational, len(self.rows))
        self.updater = Updater(
            self.cfg, self.acc, self.dist, opt, self.ref_policy, ref_pages, self.group, free, self._write,
            state=state,
        )  # fmt: skip
        tools = self.agent is not None and self.agent.uses_tools
        self.recorder = StepRecorder(self.cfg, self.acc, self.logger, self.task, tools, self.extras, state)

    def _load_data(self, cfg: Config) -> Config:
        """The task, its reward functions and the training rows (and the cold start's); returns `cfg`
        with the step count an epoch-based run takes over these rows."""
        self.task = load_task(cfg.task)
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
        """The policy model, tokenizer (prepared by the device's levers) and processing class (saved with
        the weights), and how many completions read each prompt once (`grpo.share_prompt`)."""
        g, micro = self.cfg.grpo, self.cfg.optim.per_device_train_batch_size
        model, self.tokenizer = load_model_and_tokenizer(
            self.cfg.model, self.extras.model, self.extras.tokenizer, weights=self.dist.loads_weights
        )
        self.processing = processing_class(self.extras.tokenizer, self.tokenizer, model, self.cfg.model)
        if self.levers is not None:
            with self.acc.main_process_first():  # one process measures for cpu.matmul: auto, the rest read it
                note = self.levers.prepare(model)
            if note:
                self._write(note)
        self.conversational = has_chat_template(self.tokenizer)
        if self.agent is not None and self.agent.uses_tools:
            prepare_tokenizer(self.tokenizer)
        if (warning := long_prompts(self.tokenizer, self.rows, self.cfg, self.agent)) and self.is_main:
            self._write(warning)
        self.group, why_not = shared_prompt_group(model, micro, g) if g.share_prompt else (1, None)
        if why_not:
            self._write(f"grpo.share_prompt: off, {why_not}; each completion reads its own prompt copy")
        return model

    def _build_optimizer(self) -> Optimization:
        """The optimizer of the trainable parameters, its in-backward stepping
        (`optim.optimizer_in_backward`) and its learning-rate schedule over every update of the run."""
        optim = self.cfg.optim
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer, masters = precise_optimizer(params, self.cfg, self.dist, self._write)
        in_backward = StepInBackward(optimizer, params, masters) if optim.optimizer_in_backward else None
        scheduler = build_scheduler(optimizer, optim, self.cfg.optimizer_steps(optim.max_steps))
        return Optimization(self.policy, optimizer, in_backward, scheduler)

    def _open_run_dir(self, overwrite: bool, opt: Optimization) -> dict[str, Any]:
        """Take the run directory (`RunSession`): a fresh start replaces an earlier run and writes the
        config; a resume restores its checkpoint and writes the config with its new max_steps. Returns
        what the checkpoint's state says of the run (its step and counters; nothing for a fresh start)."""
        self.session = RunSession(self.run_dir, self.is_main, self._write)
        resuming = self.resume_from is not None
        with self.session.opening(resuming):
            self.cfg, self.logger = self.session.open(
                self.cfg, overwrite, resuming, self.acc.wait_for_everyone
            )
            self.checkpoints = Checkpoints(
                self.cfg, self.acc, self.dist, opt, self.processing, self._write, self.ref_policy
            )
            return {} if self.resume_from is None else self.checkpoints.restore(self.resume_from, self.logger)

    # ------------------------------------------------------------------------------------ one step

    def step(self, step: int) -> dict[str, Any]:
        """One GRPO step, phase by phase; each phase's seconds go into the metrics as time/<phase>. An
        engine holding weights of its own is given the policy's first (sync); with async rollouts, the
        sync follows the rollout and starts generating the next step's batch."""
        g, timer, source = self.cfg.grpo, PhaseTimer(), self.source
        stop = lambda: self.signals.requested  # noqa: E731 (abandons rewards still running)
        if source.syncs_each_step:
            with timer("sync"):
                source.sync()
        with timer("rollout"):  # async: waits for the batch generated in the background, if still running
            rollout = source.rollout(step)
        if g.async_rollouts:
            with timer("sync"):  # the engine gets these weights, then generates the next batch meanwhile
                source.prefetch_next(step)
        with timer("score"):
            scores = self.scorer.score(step, rollout, stop)
        if g.dynamic_sampling:
            with timer("resample"):
                rollout, scores = source.resample(step, rollout, scores, self.scorer, stop)
        with timer("advantages"):
            advantages, group_std = self.scorer.advantages(scores)
        with timer("reference"):
            ref = self.updater.reference(rollout.batch)
        with timer("update"):
            update = self.updater.update(rollout.batch, advantages.to(self.acc.device), ref)
        return self.recorder.record(
            step, rollout, scores, group_std, ref, update, timer.seconds, self.updater.skipped_steps
        )

    # ----------------------------------------------------------------------------------- the run

    def train(self) -> Path:
        """Run every step and save the final model; returns its directory. A signal stops the run with
        Stopped (after saving a checkpoint), whose message says how to resume."""
        try:
            return self._run()
        except (OSError, RunDirError) as e:  # a full disk or I/O error in a log, an eval, a tracker...
            why = e if isinstance(e, RunDirError) else f"cannot write in {self.run_dir}: {error_reason(e)}"
            raise TrainingError(f"{why}; {what_holds(self.run_dir)}") from None
        finally:
            neftune.deactivate(self.unwrapped.lm)  # as transformers' Trainer after training
            self.source.close()
            if self.is_main:
                self.logger.close()
            self.session.close()

    def _run(self) -> Path:
        cfg = self.cfg
        self._announce()
        self.source.start()
        if not self.resume_from:  # a resumed run went through these already
            self.maybe_evaluate(0)  # the starting model, before any training (SFT included)
        if cfg.sft.steps and not self.resume_from:
            self.cold_start()
            self.maybe_evaluate(0, name="cold-start")  # GRPO's own starting point, to tell its change apart
        self._steps()
        self.acc.wait_for_everyone()
        self.checkpoints.check_finite("the final model")
        final, lm = self.run_dir / "model", self.dist.saveable(self.policy)
        if lm is not None:
            save_final_model(lm, self.processing, final, self.cfg.model.name_or_path)
        return final

    def _steps(self) -> None:
        """Every step left, each followed by its evaluation and checkpoint when due; a stop asked for, or
        too many non-finite steps in a row, ends the run after a checkpoint (a step hook's end: normally)."""
        from tqdm import tqdm

        cfg, max_steps = self.cfg, self.cfg.optim.max_steps
        show = self.is_main and cfg.logging.progress_bar
        bar = tqdm(
            total=max_steps, initial=self.start_step, desc="GRPO", disable=not show, dynamic_ncols=True
        )
        with bar, self.signals:
            for step in range(self.start_step + 1, max_steps + 1):
                rng = rng_state()  # what a checkpoint of the step before holds, should this one be dropped
                self.recorder.begin(step)
                try:
                    metrics = self.step(step)
                except (EngineError, RewardsAbandoned) as e:  # before the step's update: keep the last one's
                    if self.signals.requested or isinstance(e, RewardsAbandoned):  # a stop ended a wait
                        raise self._abandoned(step, rng, e) from None
                    self._keep_step_before(step)
                    raise TrainingError(f"stopped at step {step}: {e}; {what_holds(self.run_dir)}") from e
                if self.is_main and step == self.start_step + 1:
                    drop_replaced(self.run_dir)  # the run this one replaced: it has now started
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
                self.maybe_evaluate(step)
                stop, ends, asked = map(self.dist.any_process, (self.signals.requested, *self.recorder.asked))
                in_a_row = self.updater.nonfinite_in_a_row
                diverged = in_a_row >= cfg.optim.max_nonfinite_steps
                if stop or ends or asked or diverged or self.checkpoints.due(step):
                    ckpt = self.save_checkpoint(step)
                if diverged:
                    raise TrainingError(
                        f"stopped at step {step}: {in_a_row} steps in a row had a non-finite loss or "
                        f"gradient (optim.max_nonfinite_steps={cfg.optim.max_nonfinite_steps}); {ckpt} "
                        "holds the last good weights"
                    )
                if stop:
                    raise self.signals.stopped(
                        f"stopped at step {step}; resume with: leangrpo train --resume {self.run_dir}"
                    )
                if ends:
                    break

    def save_checkpoint(self, step: int, rng: dict[str, Any] | None = None) -> Path:
        """`checkpoint-{step}` of the weights, states and counters now (`rng`: the RNG state to record
        instead of the current one). An async batch in flight is dropped, never trained on: the resumed
        run generates it again from its step index."""
        state: dict[str, Any] = {**self.updater.state(), **self.recorder.state()}
        if (in_flight := self.source.in_flight_step) is not None:
            state["async_discarded_step"] = in_flight
        return self.checkpoints.save(step, state, rng)

    def _abandoned(self, step: int, rng: dict[str, Any], cause: Exception) -> Stopped:
        """A stop while `step`'s rewards ran or its rollout waited: the step before is checkpointed."""
        if not (done := self._keep_step_before(step, rng)):
            return self.signals.stopped(
                "stopped during step 1, before any step had finished: nothing to resume"
            )
        what = "rewards" if isinstance(cause, RewardsAbandoned) else "rollout"
        return self.signals.stopped(
            f"stopped during step {step}, its {what} abandoned while still running; resume from step {done} "
            f"with: leangrpo train --resume {self.run_dir}"
        )

    def _keep_step_before(self, step: int, rng: dict[str, Any] | None = None) -> int:
        """When `step` fails or is dropped: checkpoint the weights of the step before, unless a checkpoint
        holds them already; returns that step (0: none)."""
        done = step - 1
        if done > 0 and not (self.run_dir / f"checkpoint-{done}").is_dir():
            self.save_checkpoint(done, rng)
        return done

    def _announce(self) -> None:
        """Where the run trains, a launch that formed fewer processes than it asked for, bad data rows."""
        self._write(f"training on {self.dist.describe()}, device {self.acc.device} ({self.cfg.model.dtype})")
        if warning := distributed.launch_warning(self.acc.num_processes):
            self._write(warning)
        if self.is_main and self.skipped:
            self._write(f"data: skipped {len(self.skipped)} bad rows (first: {self.skipped[0]})")

    def cold_start(self) -> None:
        """`sft.steps` supervised steps on the task's worked solutions (of `sft.task`'s problems, if set),
        before the first GRPO step."""
        sft.cold_start(self.cfg, self.acc, self.gen, self.sft_task, self.sft_rows, self._write)

    def maybe_evaluate(self, step: int, name: str | None = None) -> None:
        """Evaluate on the held-out subset when `eval` says so (step 0 = before training); main process.
        A `name`d evaluation (after the cold start) is saved as `eval/NAME.json(l)` and printed, but kept
        out of metrics.jsonl, whose evaluations are one per step."""
        if self.evaluator is None or not self.evaluator.due(step):
            return
        self.source.sync_for_eval(step)  # the run's engine, given the weights of the step just trained
        engine = self.source.eval_engine([r["prompt"] for r in self.evaluator.rows])
        with self.source.generating():
            if self.is_main:
                metrics = self.evaluator(self.unwrapped.lm, self.tokenizer, step, engine, name=name)
                if name is None:
                    self.logger.log(metrics)
                else:
                    self._write(eval_line(f"eval after the {name.replace('-', ' ')}", metrics))
            self.acc.wait_for_everyone()

    # ---------------------------------------------------------------------------------- helpers

    @property
    def unwrapped(self) -> Policy:
        return self.acc.unwrap_model(self.policy)

    def _write(self, text: str) -> None:
        from tqdm import tqdm

        if self.is_main:
            tqdm.write(text)


def run(trainer: Trainer) -> Path:
    """Train with `trainer`, then tear down the process group of a multi-process run (gloo's threads left
    running at interpreter exit can abort the process after the work is done; the CLI then also skips the
    interpreter's own teardown: `cli._leave_if_one_of_many`). The engines left their groups over it when
    the trainer closed them. The CLI and the Python API (`GRPOTrainer.train`) both end here."""
    try:
        return trainer.train()
    finally:
        if trainer.acc.num_processes > 1 and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def train(
    cfg: Config,
    overwrite: bool = False,
    resume: bool = False,
    agent: AgentSpec | None = None,
    extras: RuntimeExtras | None = None,
) -> Path:
    """Train as configured (or resume the run in `cfg.output_dir`); returns the final model's directory.
    A signal stops it with Stopped, after saving a checkpoint."""
    return run(Trainer(cfg, overwrite, resume, agent, extras))
