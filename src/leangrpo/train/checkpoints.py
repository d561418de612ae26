"""When a run checkpoints, and what a checkpoint holds beyond the files `run.checkpoint` writes: the
trainable weights (refused when not finite), the optimizer's state as the distribution keeps it, the
schedule, the RNG and the counters; and a resume's restore of them."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from leangrpo.config.schema import step_interval
from leangrpo.core.errors import TrainingError
from leangrpo.run.checkpoint import (
    load_extra,
    load_rank_state,
    read_state,
    remove_partial,
    save_checkpoint,
    set_rng_state,
    truncate_log,
    what_holds,
)
from leangrpo.run.resolve import save_config

if TYPE_CHECKING:
    from accelerate import Accelerator

    from leangrpo.config.schema import Config
    from leangrpo.run.tracking import MetricsLogger
    from leangrpo.train.distributed import Replicated
    from leangrpo.train.optim import Optimization


def check_steps_left(ckpt: Path, max_steps: int, run_dir: Path, write: Callable[[str], None]) -> None:
    """A resume needs steps left to train, or (checkpoint at the last step, no final model: the run died
    while saving it) the final save still to do."""
    step = read_state(ckpt)["step"]
    if step == max_steps and not (run_dir / "model" / "config.json").is_file():
        write(f"{ckpt} is the last step, but the final model was never saved: saving it now")
    elif step >= max_steps:
        raise TrainingError(
            f"{ckpt} is at step {step} and optim.max_steps={max_steps}: "
            f"nothing left to train; raise optim.max_steps to continue"
        )


REFERENCE_FILE = "reference.pt"
PENDING_GRADIENT_FILE = "pending_gradient.pt"


class Checkpoints:
    """Saves and restores a run's checkpoints; every process calls each method together."""

    def __init__(
        self,
        cfg: Config,
        acc: Accelerator,
        dist: Replicated,
        opt: Optimization,
        processing: Any,
        write: Callable[[str], None],
        reference: torch.nn.Module | None = None,
    ):
        """`processing`: the run's processing class (a tokenizer, or a vision-language model's processor),
        saved beside the weights. `reference`: the reference copy when it moves (grpo.sync_ref_model):
        checkpoints keep it."""
        self.cfg, self.acc, self.dist, self.opt, self.processing = cfg, acc, dist, opt, processing
        self.run_dir, self.write = Path(cfg.output_dir), write
        self.reference = reference if cfg.grpo.sync_ref_model else None
        self.last_save = time.monotonic()

    def due(self, step: int) -> bool:
        """Every `save_steps` steps, once `save_minutes` have passed since the last save (decided by any
        process, so all save together), and at the last step; never when both are 0."""
        log, max_steps = self.cfg.logging, self.cfg.optim.max_steps
        if not (log.save_steps or log.save_minutes):
            return False
        every = step_interval(log.save_steps, max_steps)
        if step == max_steps or (every and step % every == 0):
            return True
        late = bool(log.save_minutes) and time.monotonic() - self.last_save >= 60 * log.save_minutes
        return self.dist.any_process(late)

    def check_finite(self, what: str) -> None:
        """Refuse to save non-finite weights (NaN or inf in any trainable parameter, on any process)."""
        params = (p for p in self.opt.policy.parameters() if p.requires_grad)
        if self.dist.any_process(any(not bool(torch.isfinite(p).all()) for p in params)):
            raise TrainingError(
                f"the trained weights are not finite (NaN or inf), so {what} is not saved; "
                f"{what_holds(self.run_dir)}"
            )

    def save(self, step: int, state: dict[str, Any], rng: dict[str, Any] | None = None) -> Path:
        """`checkpoint-{step}` of the weights and states now, with the trainer's `state` (its counters);
        `rng`: the RNG state to record instead of the current one."""
        self.check_finite(f"checkpoint-{step}")
        opt, dist = self.opt, self.dist
        ckpt = save_checkpoint(
            self.run_dir, step, model=dist.saveable(opt.policy), tokenizer=self.processing,
            optimizer_state=dist.optimizer_state(opt.policy, opt.optimizer), scheduler=opt.scheduler,
            cfg=self.cfg, state={"world_size": self.acc.num_processes, **state}, rank=self.acc.process_index,
            barrier=self.acc.wait_for_everyone, rng=rng,
            extra={**self._reference_file(), **self._pending_gradient(state)},
        )  # fmt: skip
        self.last_save = time.monotonic()
        return ckpt

    def restore(self, ckpt: Path, logger: MetricsLogger) -> dict[str, Any]:
        """The optimizer, schedule and RNG as they were right after the checkpoint's step (the weights were
        loaded before wrapping); log rows after that step are dropped, since those steps run again, and
        the run's config is written again (with the resume's new max_steps...). Returns the checkpoint's
        state (its step and the trainer's counters)."""
        state = read_state(ckpt)
        rank_state = load_rank_state(ckpt, self.acc.process_index)
        self.dist.load_optimizer_state(self.opt.policy, self.opt.optimizer, rank_state["optimizer"])
        self.opt.scheduler.load_state_dict(rank_state["scheduler"])
        if self.acc.is_main_process:
            remove_partial(self.run_dir)
            for log in (logger.metrics_path, logger.samples_path):
                truncate_log(log, state["step"])
            self.write(f"resuming from {ckpt} at step {state['step']}")
            save_config(self.cfg, self.run_dir / "config.yaml")
        if self.reference is not None:
            self.dist.load_frozen_state(self.reference, load_extra(ckpt, REFERENCE_FILE))
        if state.get("carry", {}).get("micro_steps"):
            grads = load_extra(ckpt, PENDING_GRADIENT_FILE)
            for name, p in self.acc.unwrap_model(self.opt.policy).named_parameters():
                if name in grads:
                    p.grad = grads[name].to(p.device, p.dtype)
        set_rng_state(rank_state["rng"])  # last: nothing may draw random numbers after this
        return state

    def _pending_gradient(self, state: dict[str, Any]) -> dict[str, Any]:
        """The gradient of an optimizer step a step left pending (`update.Carry`), so that a resume completes
        it exactly: the same on every process (its micro-steps synchronised), on CPU. Replicated runs
        only (`preflight` refuses a pending gradient under FSDP)."""
        if not state.get("carry", {}).get("micro_steps"):
            return {}
        params = self.acc.unwrap_model(self.opt.policy).named_parameters()
        grads = {name: p.grad.detach().cpu() for name, p in params if p.grad is not None}
        return {PENDING_GRADIENT_FILE: grads}

    def _reference_file(self) -> dict[str, Any]:
        """The moving reference's weights, whole (gathered under FSDP), for the checkpoint."""
        if self.reference is None:
            return {}
        return {REFERENCE_FILE: self.dist.frozen_state(self.reference)}
