"""The GRPO training loop, and nothing else: rollout → score → advantages → reference → update → record."""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import grpo, sft, shared_prompt
from .checkpoint import (
    RunDirError,
    check_resumable,
    load_rank_state,
    load_trainable,
    prepare_run_dir,
    read_state,
    remove_partial,
    resume_checkpoint,
    save_checkpoint,
    save_final_model,
    set_rng_state,
    truncate_log,
)
from .config import Config, save_config
from .data import PromptSampler, has_chat_template, load_rows, render_prompt
from .errors import UserError
from .memory import (
    activation_offload,
    build_optimizer,
    check_device_options,
    release_generation_memory,
    return_freed_memory,
)
from .models import Policy, frozen_copy, is_peft, load_model_and_tokenizer
from .rewards import extract_xml_answer, load_reward, score_completions
from .rollout import RolloutBatch, as_reward_inputs, generate
from .signals import StopSignals
from .tracking import MetricsLogger, check_trackers, open_trackers, peak_memory_mb

__all__ = ["RunDirError", "Trainer", "TrainingError", "train"]


class TrainingError(UserError, RuntimeError):
    """The run cannot go on (too many non-finite steps in a row)."""


def _micro_batch_logprobs(
    policy: torch.nn.Module,
    rollout: RolloutBatch,
    rows: slice,
    temperature: float | None = None,
    group: int = 1,
) -> tuple[Tensor, Tensor]:
    """Log-probs of one micro-batch, cropped to its own real extent (no all-pad columns), and its mask.

    group > 1: every `group` consecutive rows share a prompt, which the decoder then reads once
    (shared_prompt.py)."""
    prompt_mask, completion_mask = rollout.prompt_mask[rows], rollout.completion_mask[rows]
    first_prompt_col = int(prompt_mask.any(dim=0).int().argmax())
    num_completion = int(completion_mask.sum(dim=1).max().clamp(min=1))
    prompt_ids, prompt_mask = rollout.prompt_ids[rows, first_prompt_col:], prompt_mask[:, first_prompt_col:]
    completion_ids, completion_mask = (
        rollout.completion_ids[rows, :num_completion],
        completion_mask[:, :num_completion],
    )
    if group > 1:
        input_ids, attention_mask = (
            shared_prompt.pack(prompt_ids, completion_ids, group),
            prompt_mask[::group],
        )
    else:
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    logp = policy(input_ids, attention_mask, num_completion, temperature, group)
    return logp, completion_mask


def batch_logprobs(
    policy: torch.nn.Module, rollout: RolloutBatch, micro_batch: int, group: int = 1
) -> Tensor:
    """Log-probs [N, C] for a whole rollout without gradients (reference / old policy), padded with 0."""
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    with torch.inference_mode():
        for start in range(0, len(rollout), micro_batch):
            rows = slice(start, start + micro_batch)
            logp, _ = _micro_batch_logprobs(policy, rollout, rows, group=group)
            out[rows, : logp.shape[1]] = logp
    return out


class Trainer:
    """Holds what the loop needs across steps; `train()` runs it."""

    def __init__(self, cfg: Config, overwrite: bool = False, resume: bool = False):
        """`resume`: continue the run in `cfg.output_dir` from its last complete checkpoint."""
        from accelerate import Accelerator
        from accelerate.utils import set_seed

        self.cfg = cfg
        return_freed_memory()  # before anything large is allocated
        # Without CUDA, cpu=True is what makes accelerate/torchrun processes form a gloo group.
        self.acc = Accelerator(cpu=not torch.cuda.is_available())
        self.is_main = self.acc.is_main_process
        self.run_dir = Path(cfg.output_dir)
        self.resume_from = resume_checkpoint(self.run_dir) if resume else None
        if self.resume_from:
            check_resumable(self.resume_from, cfg, self.acc.num_processes)
        elif self.is_main:
            prepare_run_dir(self.run_dir, overwrite)
        self.acc.wait_for_everyone()
        set_seed(cfg.seed)  # identical initial weights (and LoRA init) on every rank

        # Everything that can fail on user input is checked before the model loads.
        check_device_options(cfg)
        self.reward_funcs = [(s.name, load_reward(s.name), s.weight) for s in cfg.rewards.functions]
        loaded = load_rows(cfg)
        self.rows, self.skipped = loaded.rows, loaded.skipped
        check_trackers(cfg.logging.report_to)
        self.evaluator = None
        if cfg.eval.enabled:
            from .evaluate import TrainingEvaluator

            self.evaluator = TrainingEvaluator(cfg, self.run_dir, self.reward_funcs)

        model, self.tokenizer = load_model_and_tokenizer(cfg.model)
        self.conversational = has_chat_template(self.tokenizer)
        self.ref_policy = None
        if cfg.grpo.beta > 0 and not is_peft(model):
            ref = Policy(frozen_copy(model), cfg.grpo.temperature, cfg.grpo.logprob_chunk_size)
            self.ref_policy = ref.to(self.acc.device)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, cfg.optim)
        from transformers import get_scheduler

        total = cfg.optim.max_steps * cfg.grpo.num_iterations
        self.scheduler = get_scheduler(
            cfg.optim.lr_scheduler_type,
            self.optimizer,
            num_warmup_steps=math.ceil(cfg.optim.warmup_ratio * total),
            num_training_steps=total,
        )
        self.group = self._shared_prompt_group(model)
        policy = Policy(model, cfg.grpo.temperature, cfg.grpo.logprob_chunk_size)
        self.policy = self.acc.prepare_model(policy)
        set_seed(cfg.seed, device_specific=True)  # different samples on each rank
        self.sampler = PromptSampler(
            len(self.rows), cfg.prompts_per_step, cfg.seed, self.acc.process_index,
            self.acc.num_processes,
        )  # fmt: skip
        trackers = []
        if self.is_main:
            name = cfg.logging.run_name or self.run_dir.name
            trackers = open_trackers(
                cfg.logging.report_to, self.run_dir, cfg.model_dump(mode="json"), cfg.logging.project, name
            )
        self.logger = MetricsLogger(self.run_dir, write=self._write, trackers=trackers)
        self.start_step, self.skipped_steps, self.nonfinite_in_a_row = 0, 0, 0
        if self.resume_from:
            self._restore(self.resume_from)

    def _shared_prompt_group(self, model: torch.nn.Module) -> int:
        """Completions per decoder row that share one copy of their prompt (1 = no sharing): as many
        of a group's completions as every micro-batch holds together."""
        if not self.cfg.grpo.share_prompt:
            return 1
        reason = shared_prompt.unsupported_reason(model.config)
        if reason:
            self._write(f"grpo.share_prompt: off, {reason}; each completion reads its own copy of the prompt")
            return 1
        return math.gcd(self.cfg.optim.per_device_train_batch_size, self.cfg.grpo.num_generations)

    def _restore(self, ckpt: Path) -> None:
        """Weights, optimizer, scheduler, RNG and counters as they were right after the checkpoint's step;
        log rows after that step are dropped, since those steps run again."""
        state = read_state(ckpt)
        if state["step"] >= self.cfg.optim.max_steps:
            raise TrainingError(
                f"{ckpt} is at step {state['step']} and optim.max_steps={self.cfg.optim.max_steps}: "
                f"nothing left to train; raise optim.max_steps to continue"
            )
        load_trainable(self.unwrapped.lm, ckpt)
        rank_state = load_rank_state(ckpt, self.acc.process_index)
        self.optimizer.load_state_dict(rank_state["optimizer"])
        self.scheduler.load_state_dict(rank_state["scheduler"])
        self.start_step = state["step"]
        self.skipped_steps, self.nonfinite_in_a_row = state["skipped_steps"], state["nonfinite_in_a_row"]
        if self.is_main:
            remove_partial(self.run_dir)
            for log in (self.logger.metrics_path, self.logger.samples_path):
                truncate_log(log, self.start_step)
            self._write(f"resuming from {ckpt} at step {self.start_step}")
        set_rng_state(rank_state["rng"])  # last: nothing may draw random numbers after this

    @property
    def unwrapped(self) -> Policy:
        return self.acc.unwrap_model(self.policy)

    def _write(self, text: str) -> None:
        from tqdm import tqdm

        if self.is_main:
            tqdm.write(text)

    def train(self) -> Path | None:
        """Run every step and save the final model; returns its directory, or None when a signal stopped
        the run (after saving a checkpoint and printing how to resume)."""
        from tqdm import tqdm

        cfg = self.cfg
        if self.is_main:
            save_config(cfg, self.run_dir / "config.yaml")
            if self.skipped:
                self._write(f"data: skipped {len(self.skipped)} bad rows (first: {self.skipped[0]})")
        if not self.resume_from:  # a resumed run went through these already
            self.maybe_evaluate(0)  # the starting model, before any training (SFT included)
        if cfg.sft.steps and not self.resume_from:
            self.cold_start()
        bar = tqdm(
            total=cfg.optim.max_steps,
            initial=self.start_step,
            desc="GRPO",
            disable=not (self.is_main and cfg.logging.progress_bar),
            dynamic_ncols=True,
        )
        with StopSignals() as signals:
            for step in range(self.start_step + 1, cfg.optim.max_steps + 1):
                metrics = self.step(step)
                bar.update(1)
                bar.set_postfix(reward=f"{metrics['reward']:.3f}", loss=f"{metrics['loss']:.4f}")
                if self.is_main and (step % cfg.logging.logging_steps == 0 or step == 1):
                    self.logger.log(metrics)
                self.maybe_evaluate(step)
                stop = self._any_process(signals.requested)
                diverged = self.nonfinite_in_a_row >= cfg.optim.max_nonfinite_steps
                if stop or diverged or self._checkpoint_due(step):
                    ckpt = self.save_checkpoint(step)
                if diverged:
                    if self.is_main:
                        self.logger.close()
                    raise TrainingError(
                        f"stopped at step {step}: {self.nonfinite_in_a_row} steps in a row had a non-finite "
                        f"loss or gradient (optim.max_nonfinite_steps={cfg.optim.max_nonfinite_steps}); "
                        f"{ckpt} holds the last good weights"
                    )
                if stop:
                    bar.close()
                    if self.is_main:
                        self.logger.close()
                    self._write(
                        f"stopped at step {step}; resume with: leangrpo train --resume {self.run_dir}"
                    )
                    return None
        bar.close()
        final = self.run_dir / "model"
        self.acc.wait_for_everyone()
        if self.is_main:
            save_final_model(self.unwrapped.lm, self.tokenizer, final)
            self.logger.close()
            from .report import write_report_after_training

            write_report_after_training(self.run_dir, self._write)
        return final

    def cold_start(self) -> None:
        """`sft.steps` supervised steps on tagged worked solutions, before the first GRPO step."""
        from tqdm import trange

        cfg, s = self.cfg, self.cfg.sft
        params = [p for p in self.policy.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(
            params, lr=s.learning_rate, weight_decay=cfg.optim.weight_decay, fused=True
        )
        order = PromptSampler(
            len(self.rows), s.batch_size, cfg.seed + 1, self.acc.process_index, self.acc.num_processes
        )
        self.policy.train()
        show = self.is_main and cfg.logging.progress_bar
        for step in trange(s.steps, desc="SFT cold start", disable=not show, dynamic_ncols=True):
            batch = sft.sft_batch(
                self.tokenizer,
                [self.rows[i] for i in order.indices(step)],
                assistant_prefix=cfg.data.assistant_prefix,
                max_prompt_length=cfg.grpo.max_prompt_length,
                max_completion_length=cfg.grpo.max_completion_length,
            ).to(self.acc.device)
            logp, mask = _micro_batch_logprobs(self.policy, batch, slice(None), temperature=1.0)
            loss = sft.nll_loss(logp, mask)
            self.acc.backward(loss)
            torch.nn.utils.clip_grad_norm_(params, cfg.optim.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if (step + 1) % cfg.logging.logging_steps == 0 or step + 1 == s.steps:
                self._write(f"sft step {step + 1:>4} | loss={loss.item():.4g}")

    def maybe_evaluate(self, step: int) -> None:
        """Evaluate on the held-out subset when `eval` says so (step 0 = before training); main process."""
        if self.evaluator is None or not self.evaluator.due(step):
            return
        if self.is_main:
            self.logger.log(self.evaluator(self.unwrapped.lm, self.tokenizer, step))
        self.acc.wait_for_everyone()

    def _any_process(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any (so that all stop at the same step)."""
        return bool(self.acc.reduce(torch.tensor(float(flag), device=self.acc.device), "sum") > 0)

    def _checkpoint_due(self, step: int) -> bool:
        every = self.cfg.logging.save_steps
        return bool(every) and (step % every == 0 or step == self.cfg.optim.max_steps)

    def save_checkpoint(self, step: int) -> Path:
        state = {
            "world_size": self.acc.num_processes,
            "skipped_steps": self.skipped_steps,
            "nonfinite_in_a_row": self.nonfinite_in_a_row,
        }
        return save_checkpoint(
            self.run_dir, step, model=self.unwrapped.lm, tokenizer=self.tokenizer, optimizer=self.optimizer,
            scheduler=self.scheduler, cfg=self.cfg, state=state, rank=self.acc.process_index,
            barrier=self.acc.wait_for_everyone,
        )  # fmt: skip

    def rollout(self, step: int) -> tuple[list[dict[str, Any]], RolloutBatch]:
        cfg = self.cfg
        rows = [self.rows[i] for i in self.sampler.indices(step - 1)]
        texts = [render_prompt(self.tokenizer, r["prompt"], cfg.data.assistant_prefix) for r in rows]
        batch = generate(
            self.unwrapped.lm,
            self.tokenizer,
            texts,
            num_generations=cfg.grpo.num_generations,
            max_prompt_length=cfg.grpo.max_prompt_length,
            max_completion_length=cfg.grpo.max_completion_length,
            temperature=cfg.grpo.temperature,
            top_p=cfg.grpo.top_p,
            assistant_prefix=cfg.data.assistant_prefix,
            ignore_eos=cfg.grpo.ignore_eos,
            packed=cfg.grpo.packed_generation,
        )
        return rows, batch

    def reference_logprobs(self, rollout: RolloutBatch) -> Tensor | None:
        """Once per generation batch: adapter disabled (LoRA), frozen copy (full), none at beta=0."""
        micro = self.cfg.optim.per_device_train_batch_size
        if self.cfg.grpo.beta == 0:
            return None
        if self.ref_policy is not None:
            return batch_logprobs(self.ref_policy, rollout, micro, self.group)
        with self.unwrapped.lm.disable_adapter():
            return batch_logprobs(self.unwrapped, rollout, micro, self.group)

    def step(self, step: int) -> dict[str, Any]:
        cfg, g = self.cfg, self.cfg.grpo
        start = time.perf_counter()
        rows, rollout = self.rollout(step)
        release_generation_memory()

        G = g.num_generations
        prompts, completions = as_reward_inputs(
            [r["prompt"] for r in rows], rollout.completion_texts, self.conversational
        )
        columns = {k: [r[k] for r in rows for _ in range(G)] for k in rows[0] if k != "prompt"}
        scores = score_completions(self.reward_funcs, prompts, completions, columns, cfg.rewards.on_error)
        advantages, group_std = grpo.group_advantages(scores.total, G, g.scale_rewards)
        advantages = advantages.to(self.acc.device)
        ref_logp = self.reference_logprobs(rollout)
        micro = cfg.optim.per_device_train_batch_size
        old_logp = batch_logprobs(self.policy, rollout, micro, self.group) if g.num_iterations > 1 else None

        mask = rollout.completion_mask.float()
        num_tokens = float(mask.sum())
        if g.loss_type == "dapo":  # normalise by every process's tokens (DDP then averages grads)
            num_tokens = float(self.acc.reduce(mask.sum(), "sum")) / self.acc.num_processes

        self.policy.train()
        loss_total, totals, skipped = 0.0, grpo.LossStats(), False
        for _ in range(g.num_iterations):
            iteration_loss = 0.0
            for mb_start in range(0, len(rollout), micro):
                rows_mb = slice(mb_start, mb_start + micro)
                last = mb_start + micro >= len(rollout)
                with (
                    nullcontext() if last else self.acc.no_sync(self.policy),
                    activation_offload(cfg.model.activation_offload),
                ):
                    logp, mb_mask = _micro_batch_logprobs(self.policy, rollout, rows_mb, group=self.group)
                    width = logp.shape[1]
                    loss, st = grpo.grpo_loss(
                        logp,
                        logp.detach() if old_logp is None else old_logp[rows_mb, :width],
                        None if ref_logp is None else ref_logp[rows_mb, :width],
                        advantages[rows_mb],
                        mb_mask,
                        loss_type=g.loss_type,
                        epsilon=g.epsilon,
                        epsilon_high=g.epsilon_high or g.epsilon,
                        beta=g.beta,
                        num_sequences=len(rollout),
                        num_tokens=num_tokens,
                        max_completion_length=g.max_completion_length,
                    )
                    self.acc.backward(loss)
                iteration_loss += loss.item()
                totals += st
            loss_total += iteration_loss / g.num_iterations
            grad_norm = float(
                torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.optim.max_grad_norm)
            )
            lr = self.scheduler.get_last_lr()[0]
            # A NaN/inf loss or gradient on any process skips the update on every process.
            skipped = self._any_process(not (math.isfinite(iteration_loss) and math.isfinite(grad_norm)))
            if not skipped:
                self.optimizer.step()
                self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            if skipped:  # the step's later iterations would build on the same bad batch
                break
        self.skipped_steps += skipped
        self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if skipped else 0
        if skipped:
            self._write(f"step {step}: non-finite loss or gradient; update skipped")

        seconds = time.perf_counter() - start
        metrics = self._metrics(step, scores, group_std, rollout, totals, seconds)
        metrics.update(loss=loss_total, grad_norm=grad_norm, learning_rate=lr)
        if (
            self.is_main
            and cfg.logging.log_completions_steps
            and (step % cfg.logging.log_completions_steps == 0 or step == 1)
        ):
            self._log_sample(step, rows[0], rollout.completion_texts[0], scores)
        return metrics

    def _metrics(self, step, scores, group_std, rollout, totals, seconds) -> dict[str, Any]:
        """Metrics of one step, reduced over every process."""
        gather = self.acc.gather
        total = gather(scores.total.to(self.acc.device))
        per_func = gather(scores.per_func.to(self.acc.device))
        lengths = gather(rollout.lengths().float())
        stds = gather(group_std.to(self.acc.device))
        sums = self.acc.reduce(
            torch.tensor([totals.kl_sum, totals.clipped_tokens, totals.tokens], device=self.acc.device),
            "sum",
        )
        truncated = gather(rollout.truncated.float())
        failures = gather(scores.failed.float())
        metrics: dict[str, Any] = {
            "step": step,
            "reward": float(total.nanmean()),
            "reward_std": float(stds.mean()),
            "kl": float(sums[0] / sums[2]) if self.cfg.grpo.beta > 0 else None,
            "clip_ratio": float(sums[1] / sums[2]),
            "completion_length/mean": float(lengths.mean()),
            "completion_length/max": float(lengths.max()),
            "truncated_frac": float(truncated.mean()),
            "zero_std_frac": float((stds < 1e-6).float().mean()),
            "reward_failures": int(failures.sum()),
            "skipped_steps": self.skipped_steps,
            "tokens_per_s": float(lengths.sum()) / seconds,
            "step_seconds": seconds,
            "peak_memory_mb": peak_memory_mb(),
        }
        for i, name in enumerate(scores.names):
            metrics[f"rewards/{name}/mean"] = float(per_func[:, i].nanmean())
        return metrics

    def _log_sample(self, step: int, row: dict[str, Any], completion: str, scores) -> None:
        self.logger.log_sample(
            {
                "step": step,
                "question": row["question"],
                "completion": completion,
                "extracted": extract_xml_answer(completion),
                "gold": row["answer"],
                "rewards": {n: float(scores.per_func[0, i]) for i, n in enumerate(scores.names)},
            }
        )


def train(cfg: Config, overwrite: bool = False, resume: bool = False) -> Path | None:
    """Train as configured (or resume the run in `cfg.output_dir`); returns the final model's directory,
    or None when a signal stopped the run after saving a checkpoint."""
    return Trainer(cfg, overwrite, resume).train()
