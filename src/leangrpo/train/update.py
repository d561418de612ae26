"""The policy update of a step: the log-probs it compares against (the reference's, the policy's own before
the first update, the sampler correction), then TRL's generation buffer: `num_iterations` passes over the
generation's `steps_per_generation` micro-batch slices, each `gradient_accumulation_steps` consecutive
micro-steps one optimizer step, which may take micro-steps of two generations: a step's trailing micro-steps
leave their gradient pending (`Carry`) for the next step's first optimizer step. A NaN/inf loss or gradient
on any process skips that optimizer step on every process."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from leangrpo.core import grpo
from leangrpo.core.errors import DeviceOptionError, TrainingError
from leangrpo.models import neftune
from leangrpo.models.load import TensorStore, frozen_copy, is_peft
from leangrpo.train.distributed import Sharded
from leangrpo.train.loss import EntropyControl, loss_spec
from leangrpo.train.optim import Optimization, activation_offload
from leangrpo.train.policy import (
    Extent,
    Policy,
    batch_logprobs,
    micro_batch_extents,
    micro_batch_logprobs,
    padding_free,
    router_aux_loss_coef,
    trl_width,
)

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel

    from leangrpo.config.schema import Config
    from leangrpo.engines.types import RolloutBatch
    from leangrpo.train.distributed import Replicated


@dataclass
class Reference:
    """What the update compares the policy against, computed once per generation batch: the reference's
    log-probs (None at beta = 0), the policy's own before the first update (None when the step makes one
    optimizer step: the ratio is then 1 by construction), the sampler's importance weights and the gap
    they correct (vllm/*), both None without the correction; `group`: the completions that read one
    prompt copy in this batch (`Updater.prompt_group`)."""

    ref_logp: Tensor | None
    old_logp: Tensor | None
    sampler_weights: Tensor | None
    mismatch: grpo.SamplerMismatch | None
    group: int = 1


@dataclass
class Carry:
    """An optimizer step left pending at a step's end: its micro-steps so far, their summed loss and their
    bonus-entropy window (token sums, for adaptive entropy control), and (in the parameters' `.grad`,
    synchronised across processes) their gradient. A checkpoint keeps it (`Updater.state`)."""

    micro_steps: int = 0
    loss: float = 0.0
    entropy: list[float] | None = None

    def add(self, micro_steps: int, loss: float, entropy: list[float] | None) -> Carry:
        """This window with `micro_steps` more micro-steps."""
        before = self.entropy or [0.0, 0.0]
        both = None if entropy is None else [a + b for a, b in zip(before, entropy, strict=True)]
        return Carry(self.micro_steps + micro_steps, self.loss + loss, both)


@dataclass
class Update:
    """What the update phase reports: its micro-steps' summed loss per optimizer step (a step's share of
    an optimizer step spanning two generations counts in its own step), the last gradient norm and
    learning rate (NaN and the current rate when the step completed no optimizer step), each
    micro-batch's token counts for the KL and clip metrics, the entropy bonus's `entropy_coef` after
    each optimizer step (TRL's metric: their mean; none without the bonus), and the MoE router's mean
    load-balancing loss over every process (TRL's `aux_loss`; None without it)."""

    loss: float
    grad_norm: float
    learning_rate: float
    stats: list[grpo.LossStats]
    entropy_coefs: list[float]
    aux_loss: float | None = None

    def metrics(self) -> dict[str, float]:
        """The update's own metrics beyond the loss's: `entropy_coef` with the entropy bonus, `aux_loss`
        with the router's load-balancing loss."""
        out = (
            {"entropy_coef": sum(self.entropy_coefs) / len(self.entropy_coefs)} if self.entropy_coefs else {}
        )
        return out | ({} if self.aux_loss is None else {"aux_loss": self.aux_loss})


def build_policy(cfg: Config, model: PreTrainedModel, dist: Replicated, group: int) -> torch.nn.Module:
    """The trained policy, wrapped for the job (`dist.wrap`): placed (or sharded) on this process's
    device before its head is checked (`Policy.prepare`); NEFTune noises its embeddings from then on."""
    g, (packed, _) = cfg.grpo, padding_free(model, cfg.grpo)
    aux = router_aux_loss_coef(model, g.router_aux_loss_coef)
    policy = dist.wrap(Policy(model, g.temperature, g.logprob_chunk_size, group > 1 or packed, False, aux))
    if g.neftune_noise_alpha is not None:  # after the frozen copies (build_reference) and the head check
        neftune.activate(model, g.neftune_noise_alpha)
    return policy


def build_reference(
    cfg: Config,
    model: PreTrainedModel,
    dist: Replicated,
    reference_store: Callable[[Path], TensorStore] | None,
    group: int,
    run_dir: Path,
    write: Callable[[str], None],
) -> tuple[torch.nn.Module | None, TensorStore | None]:
    """The frozen reference copy of full fine-tuning with beta > 0 (LoRA's reference is the model with its
    adapter off), and the file holding its weights with `cpu.reference_on_disk` (by default on CPU without
    FSDP, in memory where the disk has no room for it): `reference_store` (the CPU levers') makes it on the
    run directory's disk, in its nearest existing folder (the directory itself is made later, under the
    lock)."""
    g, asked = cfg.grpo, cfg.cpu.reference_on_disk
    if g.beta == 0 or is_peft(model):
        if asked:
            write("cpu.reference_on_disk: no effect, there is no reference copy (beta = 0, or LoRA)")
        return None, None
    dtype = None if g.reference_dtype == "auto" else getattr(torch, g.reference_dtype)
    sharded = isinstance(dist, Sharded)
    if asked and (reference_store is None or sharded):
        raise TrainingError(
            f"cpu.reference_on_disk is for CPU runs without FSDP (this run: {dist.acc.device.type}, "
            f"{dist.describe()}): elsewhere the reference must live in device memory"
        )
    on_disk = asked if asked is not None else reference_store is not None and not sharded
    try:
        where = next(d for d in (run_dir, *run_dir.resolve().parents) if d.is_dir())
        pages = reference_store(where) if on_disk and reference_store is not None else None
        copy = frozen_copy(model, dtype, pages)
    except DeviceOptionError as e:
        if asked:
            raise
        write(f"{e}; the reference copy stays in memory")
        pages, copy = None, frozen_copy(model, dtype)
    packed, _ = padding_free(copy, g)
    ref_policy = dist.place_frozen(
        Policy(copy, g.temperature, g.logprob_chunk_size, group > 1 or packed, placed=False)
    )
    if pages is not None:
        pages.drop_pages()  # written: out of memory until the first reference pass
    return ref_policy, pages


class Updater:
    """Computes a step's reference and trains the policy on it; counts the steps it skipped."""

    def __init__(
        self,
        cfg: Config,
        acc: Accelerator,
        dist: Replicated,
        opt: Optimization,
        ref_policy: torch.nn.Module | None,
        ref_pages: TensorStore | None,
        group: int,
        release_memory: Callable[[], None],
        write: Callable[[str], None],
        state: dict[str, Any] | None = None,
    ):
        """`state`: a resumed run's counters (`state()`)."""
        self.cfg, self.acc, self.dist, self.opt = cfg, acc, dist, opt
        self.ref_policy, self.ref_pages, self.group = ref_policy, ref_pages, group
        self.release_memory, self.write = release_memory, write
        self.loss_spec = loss_spec(cfg.grpo)  # the objective, its aggregation and constants, once
        self.packed, why_not = padding_free(self.unwrapped.lm, cfg.grpo)
        self.trl_width = trl_width(cfg.grpo)
        if why_not:
            write(f"grpo.padding_free: off, {why_not}; completions are padded to the longest")
        if cfg.steps_per_generation > cfg.optim.gradient_accumulation_steps:
            write(
                f"grpo.steps_per_generation: {cfg.steps_per_generation} slices of whole groups, in order "
                f"(TRL shuffles the completions before slicing), {cfg.optim.gradient_accumulation_steps} "
                "an optimizer step (docs/trl.md)"
            )
        if cfg.whole_steps > 1:
            write(
                f"optimizer steps span generations: {cfg.micro_steps_per_step} micro-steps a step, "
                f"{cfg.optim.gradient_accumulation_steps} an optimizer step, across steps and epoch ends "
                "alike (TRL ends one early at an epoch's end: docs/trl.md)"
            )
        state = state or {}
        self.skipped_steps = state.get("skipped_steps", 0)
        self.nonfinite_in_a_row = state.get("nonfinite_in_a_row", 0)
        self.entropy = EntropyControl.of(cfg.grpo, state)
        self.optimizer_steps = state.get("optimizer_steps", 0)  # TRL's global_step, for sync_ref_model
        self.aux_losses: list[Tensor] = []  # this step's load-balancing losses, one a micro-batch
        self.carry = Carry(**state.get("carry", {}))

    def state(self) -> dict[str, Any]:
        """The counters a checkpoint keeps: the skipped steps, the optimizer steps, the pending optimizer
        step's (its gradient: `Checkpoints`) and the entropy control's state."""
        out: dict[str, Any] = {
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
            "optimizer_steps": self.optimizer_steps,
            "carry": vars(self.carry),
        }
        if self.loss_spec.entropy_bonus:
            out["entropy_control"] = self.entropy.state()
        return out

    @property
    def unwrapped(self) -> Policy:
        return self.acc.unwrap_model(self.opt.policy)

    def reference(self, rollout: RolloutBatch) -> Reference:
        """The log-probs the update compares against: the reference's (adapter disabled for LoRA, the frozen
        copy for full fine-tuning, none at beta = 0) and, when the policy may move between the generation
        and a slice's use (TRL's gradient_accumulation_steps % (steps_per_generation × num_iterations) != 0:
        an optimizer step ends inside a generation's use) or with the vLLM correction on, the policy's own
        before the first update (else the update detaches its own)."""
        g, micro, group = (
            self.cfg.grpo,
            self.cfg.optim.per_device_train_batch_size,
            self.prompt_group(rollout),
        )
        ref_logp = self._reference_logprobs(rollout, group) if g.beta > 0 else None
        corrects = rollout.sampling_logprobs is not None and g.vllm_importance_sampling_correction
        moves = self.cfg.optim.gradient_accumulation_steps % self.cfg.micro_steps_per_step != 0
        old_logp = (
            batch_logprobs(self.opt.policy, rollout, micro, group, self.packed, self.trl_width)
            if moves or corrects
            else None
        )
        weights, mismatch = self._sampler_correction(rollout, old_logp) if corrects else (None, None)
        return Reference(ref_logp, old_logp if moves else None, weights, mismatch, group)

    def prompt_group(self, rollout: RolloutBatch) -> int:
        """The run's shared-prompt group, or 1 for a batch where the completions of some group have
        different prompts (an environment whose reset text differs per rollout): the shared layout reads
        one prompt per group. One host read a step, with the shared layout only."""
        group, ids, mask = self.group, rollout.prompt_ids, rollout.prompt_mask
        if group == 1:
            return 1
        same = (ids.view(-1, group, ids.shape[1]) == ids[::group, None]).all()
        same &= (mask.view(-1, group, mask.shape[1]) == mask[::group, None]).all()
        return group if bool(same) else 1

    def _reference_logprobs(self, rollout: RolloutBatch, group: int) -> Tensor:
        """The reference's log-probs of `rollout` (laid out in prompt groups of `group`): the frozen copy's
        for full fine-tuning (left sharded after under FSDP2: `release_frozen`), the policy's with its adapter
        off for LoRA."""
        micro = self.cfg.optim.per_device_train_batch_size
        if self.ref_policy is not None:
            ref_logp = batch_logprobs(self.ref_policy, rollout, micro, group, self.packed, self.trl_width)
            self.dist.release_frozen(self.ref_policy)
            if self.ref_pages is not None:
                self.ref_pages.drop_pages()
            return ref_logp
        lm = self.unwrapped.lm
        assert is_peft(lm), "without a reference copy the policy is LoRA (see build_reference)"
        with lm.disable_adapter():
            return batch_logprobs(self.unwrapped, rollout, micro, group, self.packed, self.trl_width)

    def reference_kl(self, rollout: RolloutBatch) -> float:
        """The mean k3 KL from the policy to the reference over `rollout`'s model tokens (beta > 0): TRL's
        evaluation `kl` of one eval batch (its ratio is 1 there, so bias correction changes nothing). Each
        completion reads its own prompt copy: an eval batch's groups need not be the run's."""
        rollout = rollout.to(self.acc.device)
        micro = self.cfg.optim.per_device_train_batch_size
        logp = batch_logprobs(self.opt.policy, rollout, micro, 1, self.packed, self.trl_width)
        keep = rollout.loss_mask.bool()
        kl = torch.where(keep, grpo.kl_k3(logp, self._reference_logprobs(rollout, 1)), 0.0)
        return float(kl.sum() / keep.sum().clamp(min=1))

    def _sampler_correction(
        self, rollout: RolloutBatch, old_logp: Tensor | None
    ) -> tuple[Tensor | None, grpo.SamplerMismatch | None]:
        """Importance weights for the gap between the sampler's distribution and the trainer's (TRL's
        truncated/masked IS), and the numbers that make that gap visible."""
        assert old_logp is not None and rollout.sampling_logprobs is not None
        g = self.cfg.grpo
        return grpo.sampler_importance_weights(
            old_logp, rollout.sampling_logprobs, rollout.loss_mask, g.vllm_importance_sampling_mode,
            g.vllm_importance_sampling_clip_min, g.vllm_importance_sampling_clip_max,
        )  # fmt: skip

    def update(self, rollout: RolloutBatch, advantages: Tensor, ref: Reference) -> Update:
        """The step's optimizer steps on the rollout (`MicroSteps`), each accumulated over its window of
        micro-batches: the first completes the optimizer step the step before left pending, the last may
        leave one pending (`Carry`)."""
        g = self.cfg.grpo
        mask = rollout.loss_mask.float()  # the model's tokens: a tool's are no action of the policy
        if g.mask_truncated_completions:
            mask = grpo.mask_truncated(mask, rollout.truncated)
        # dapo normalises by every process's tokens (DDP then averages the gradients)
        num_tokens = float(self.acc.reduce(mask.sum(), "sum")) / self.acc.num_processes
        micro_steps = MicroSteps.of(rollout, self.cfg, self.carry.micro_steps)
        self.opt.policy.train()
        loss_total, stats, skipped, coefs = 0.0, [], False, []
        grad_norm, lr = math.nan, float(self.opt.scheduler.get_last_lr()[0])
        for window in micro_steps.windows:
            batch = micro_steps.totals(window, num_tokens)
            loss_sum, window_stats = self._backward(rollout, advantages, ref, mask, window, batch)
            window_loss = float(loss_sum)  # the optimizer step's one host sync for its loss
            stats += window_stats
            loss_total += window_loss / self.cfg.updates_per_step
            self.carry = self.carry.add(len(window), window_loss, self._entropy_window(window_stats))
            if self.carry.micro_steps < self.cfg.optim.gradient_accumulation_steps:
                break  # the step's last micro-steps: their gradient waits for the next step's
            grad_norm, lr, skipped = self._optimizer_step(self.carry.loss)
            self._sync_reference()
            if self.loss_spec.entropy_bonus:
                coefs.append(self._control_entropy(self.carry.entropy))
            self.carry = Carry()
            if skipped:  # the step's later optimizer steps would build on the same bad batch
                break
        self.release_memory()
        self.skipped_steps += skipped
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        if skipped:
            self.write("non-finite loss or gradient; update skipped")
        aux = self.acc.reduce(torch.stack(self.aux_losses).mean(), "mean") if self.aux_losses else None
        self.aux_losses = []
        return Update(loss_total, grad_norm, lr, stats, coefs, None if aux is None else float(aux))

    def _sync_reference(self) -> None:
        """After an optimizer step: every `ref_model_sync_steps` of them, the reference moves toward the
        policy, ref = alpha·policy + (1 - alpha)·ref (TRL's SyncRefModelCallback, TR-DPO), in place
        (in its file with cpu.reference_on_disk; shard by shard under FSDP)."""
        g = self.cfg.grpo
        self.optimizer_steps += 1
        if not g.sync_ref_model or self.ref_policy is None or self.optimizer_steps % g.ref_model_sync_steps:
            return
        self.dist.mix_into(self.ref_policy, self.unwrapped, g.ref_model_mixup_alpha)
        if self.ref_pages is not None:
            self.ref_pages.drop_pages()

    def _entropy_window(self, stats: list[grpo.LossStats]) -> list[float] | None:
        """With adaptive entropy control: the window's bonus-entropy token sums over every process (TRL's
        window: each process's sums, summed)."""
        if not (self.loss_spec.entropy_bonus and self.cfg.grpo.use_adaptive_entropy):
            return None
        sums = torch.stack([s.bonus_entropy for s in stats if s.bonus_entropy is not None]).sum(0)
        return [float(x) for x in self.acc.reduce(sums, "sum").tolist()]  # one host sync

    def _control_entropy(self, window: list[float] | None) -> float:
        """After an optimizer step: adaptive entropy control reads its window's mean bonus entropy
        (`_entropy_window`); returns the coefficient then."""
        if window is not None:
            self.entropy.observe(window[0] / max(window[1], 1.0))
        return self.entropy.coef

    def _backward(
        self,
        rollout: RolloutBatch,
        advantages: Tensor,
        ref: Reference,
        mask: Tensor,
        window: list[MicroStep],
        batch: grpo.BatchTotals,
    ) -> tuple[Tensor, list[grpo.LossStats]]:
        """One optimizer step's loss and gradients, micro-batch by micro-batch of its `window` (`mask`: the
        completion tokens that count; `batch`: the window's totals its loss is normalised by); returns the
        summed loss and each micro-batch's token counts, on the device: the loop reads nothing back."""
        cfg, policy, in_backward = self.cfg, self.opt.policy, self.opt.in_backward
        iteration_loss, stats = torch.zeros((), dtype=torch.float64, device=mask.device), []
        coef = self.entropy.applied()
        for i, (rows, extent) in enumerate(window):
            last = i == len(window) - 1  # also a pending window's: its gradient is then every process's
            with (
                self.dist.sync_gradients(policy, sync=last),
                activation_offload(cfg.model.activation_offload, policy.parameters()),
                nullcontext() if in_backward is None else in_backward.stepping(),
            ):
                logp, _, entropy = micro_batch_logprobs(
                    policy,
                    rollout,
                    rows,
                    group=ref.group,
                    with_entropy=True,
                    extent=extent,
                    packed=self.packed,
                )
                width = logp.shape[1]
                old_logp = logp.detach() if ref.old_logp is None else ref.old_logp[rows, :width]
                loss, mb_stats = grpo.grpo_loss(
                    logp, old_logp, _cut(ref.ref_logp, rows, width), advantages[rows], mask[rows, :width],
                    spec=self.loss_spec, batch=batch, entropy=entropy,
                    sampler_weights=_cut(ref.sampler_weights, rows, width),
                    sampling_logp=_cut(rollout.sampling_logprobs, rows, width), entropy_coef=coef,
                )  # fmt: skip
                loss = self._with_router_aux(loss)
                self.acc.backward(loss)
            iteration_loss += loss.detach().double()  # as exact as summing floats
            stats.append(mb_stats)
        return iteration_loss, stats

    def _with_router_aux(self, loss: Tensor) -> Tensor:
        """A micro-batch's loss plus the MoE router's load-balancing loss of its forward, weighted by
        router_aux_loss_coef and scaled for gradient accumulation as TRL scales it (the policy term is)."""
        policy = self.unwrapped
        if policy.aux_loss is None:
            return loss
        aux, policy.aux_loss = policy.aux_loss, None
        self.aux_losses.append(aux.detach())
        return loss + policy.router_aux_coef * aux / self.cfg.optim.gradient_accumulation_steps

    def _optimizer_step(self, iteration_loss: float) -> tuple[float, float, bool]:
        """Clip (or read the in-backward steps' norm), then step the optimizer and schedule unless the
        loss or gradient is non-finite on any process; returns the gradient norm, the learning rate
        the step used and whether it was skipped."""
        opt = self.opt
        if opt.in_backward is None:
            grad_norm = self.dist.clip_grad_norm(opt.policy, self.cfg.optim.max_grad_norm or math.inf)
        else:  # each parameter took its step in the backward
            grad_norm = opt.in_backward.grad_norm
        lr = float(opt.scheduler.get_last_lr()[0])
        skipped = self.dist.any_process(not (math.isfinite(iteration_loss) and math.isfinite(grad_norm)))
        if not skipped:
            if opt.in_backward is None:
                opt.optimizer.step()
            opt.scheduler.step()
        opt.policy.zero_grad(set_to_none=True)  # the weights' (the optimizer's may be fp32 masters)
        return grad_norm, lr, skipped


MicroStep = tuple[slice, Extent]
"""A micro-batch's rows of the generation and the extent of its tokens."""


@dataclass
class MicroSteps:
    """TRL's generation buffer (`_prepare_inputs`, `_buffered_inputs`): the generation's slices of
    per_device_train_batch_size rows, used in order `num_iterations` times, cut into windows of
    gradient_accumulation_steps micro-steps, each window one optimizer step; the first window is shorter
    by the micro-steps an optimizer step left pending before, the last is left pending when short. (TRL
    shuffles the generation before slicing it; leangrpo keeps each group in one slice: docs/trl.md, `bnpo`
    micro-batches.)"""

    windows: list[list[MicroStep]]
    slices: int  # the generation's slices: steps_per_generation
    accumulation: int  # gradient_accumulation_steps

    @classmethod
    def of(cls, rollout: RolloutBatch, cfg: Config, carried: int = 0) -> MicroSteps:
        """The micro-steps of `rollout` as `cfg` schedules them, `carried` of the first optimizer step's
        micro-steps done by the step before."""
        micro, accumulation = cfg.optim.per_device_train_batch_size, cfg.optim.gradient_accumulation_steps
        extents = micro_batch_extents(
            rollout.prompt_mask, rollout.completion_mask, micro, trl_width(cfg.grpo)
        )
        slices = [
            (slice(start, start + micro), e)
            for start, e in zip(range(0, len(rollout), micro), extents, strict=True)
        ]
        steps = slices * cfg.grpo.num_iterations
        cuts = [0, *range(accumulation - carried, len(steps), accumulation), len(steps)]
        return cls([steps[a:b] for a, b in itertools.pairwise(cuts) if b > a], len(slices), accumulation)

    def totals(self, window: list[MicroStep], num_tokens: float) -> grpo.BatchTotals:
        """What `window`'s losses are normalised by, as TRL's `_compute_loss`: a whole optimizer step's
        completions and micro-batches (gradient_accumulation_steps of these, whichever generations they
        come from), and for dapo its share of this generation's tokens (`num_tokens`, per process), as TRL
        rescales num_items_in_batch by gradient_accumulation_steps / steps_per_generation."""
        rows = sum(r.stop - r.start for r, _ in window) * self.accumulation // len(window)
        return grpo.BatchTotals(rows, num_tokens * self.accumulation / self.slices, self.accumulation)


def _cut(values: Tensor | None, rows: slice, width: int) -> Tensor | None:
    """A micro-batch's rows of per-token values, as wide as its log-probs."""
    return None if values is None else values[rows, :width]
