"""Padding-free log-prob passes (`grpo.padding_free`) against padded ones, in one process: the reference
pass (no gradient) and one update forward + backward (gradient checkpointing on), over G completions of
vs_trl.py's prompt in one micro-batch, each prompt read once (`grpo.share_prompt`).

    python benchmarks/padding_free.py [--model DIR] [--lengths 25,96] [--pairs 3] [--lora]
    python benchmarks/padding_free.py --layouts packed --pairs 1   # one layout: its process's peak RSS

The completions' lengths spread evenly over --lengths (issue 52 measured 25 to 96 tokens with EOS on);
their tokens are random, which changes nothing in the work. Pairs alternate which layout runs first, so
that drift in the machine's speed hits both alike. Prints each run's wall-clock and CPU seconds (all
threads; steadier on a shared machine), the medians and the median of the per-pair ratios, the bytes
the update's forward saves for backward, the process's peak RSS, and the load average.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import build_model, default_data  # noqa: E402

from leangrpo.config.schema import LoraConfig
from leangrpo.data.rows import PromptFormat
from leangrpo.data.sources import load_rows
from leangrpo.data.tasks import load_task
from leangrpo.engines.types import RolloutBatch
from leangrpo.models.load import apply_lora, cache_root, load_tokenizer
from leangrpo.run.resolve import validate_config
from leangrpo.train.policy import Policy, batch_logprobs, micro_batch_logprobs

LAYOUTS = {"packed": True, "padded": False}


def rollout(model_dir: Path, group: int, shortest: int, longest: int) -> RolloutBatch:
    """vs_trl.py's GSM8K prompt, `group` times, with completions spread over [shortest, longest] tokens."""
    tok = load_tokenizer(str(model_dir))
    cfg = validate_config({"model": {"name_or_path": str(model_dir)},
                           "data": {"path": str(default_data()), "limit": 1},
                           "rewards": {"functions": [{"name": "correctness"}]}})  # fmt: skip
    row = load_rows(cfg.data, load_task(cfg.task)).rows[0]
    prompt = PromptFormat.from_config(cfg.data).render(tok, row["prompt"])
    prompt_ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids.repeat(group, 1)
    lengths = torch.linspace(shortest, longest, group).round().long()
    completion_ids = torch.randint(5, 1000, (group, longest), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(longest) < lengths[:, None]).long()
    return RolloutBatch(
        prompt_ids, torch.ones_like(prompt_ids), completion_ids, mask, torch.zeros(group, dtype=torch.bool),
        [""] * group,
    )  # fmt: skip


def saved_bytes(model: torch.nn.Module, fn) -> int:
    """Bytes of the distinct tensors autograd keeps for backward while `fn` runs, weights excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn()
    return sum(n for ptr, n in seen.items() if ptr not in params)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a model directory (default: vs_trl.py's random SmolLM2)")
    p.add_argument("--lengths", default="25,96", help="shortest,longest completion")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--lora", action="store_true", help="LoRA r=16 on all linears (else full fine-tuning)")
    p.add_argument("--layouts", default="packed,padded", help="packed,padded | packed | padded")
    a = p.parse_args()
    layouts = {name: LAYOUTS[name] for name in a.layouts.split(",")}
    from transformers import AutoModelForCausalLM

    model_dir = a.model or build_model(cache_root() / "bench")
    shortest, longest = (int(x) for x in a.lengths.split(","))
    G = a.num_generations
    batch = rollout(model_dir, G, shortest, longest)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if a.lora:
        model = apply_lora(model, LoraConfig(enabled=True, r=16, alpha=32, target_modules="all-linear"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = Policy(model.train(), share_prompt=True)

    def reference(packed: bool) -> None:
        batch_logprobs(policy, batch, G, G, packed)

    def update(packed: bool) -> None:
        logp, mask, _ = micro_batch_logprobs(
            policy, batch, slice(None), group=G, with_entropy=True, packed=packed
        )
        (logp * mask).sum().backward()
        model.zero_grad(set_to_none=True)

    load_before = os.getloadavg()[0]
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    for pair in range(a.pairs):
        for layout in layouts if pair % 2 == 0 else list(layouts)[::-1]:
            for phase, fn in (("reference", reference), ("update", update)):
                start, cpu_start = time.perf_counter(), time.process_time()
                fn(layouts[layout])
                times.setdefault((phase, layout), []).append(time.perf_counter() - start)
                cpu.setdefault((phase, layout), []).append(time.process_time() - cpu_start)
                print(f"pair {pair + 1} {phase} {layout}: {times[phase, layout][-1]:.2f} s, "
                      f"{cpu[phase, layout][-1]:.2f} CPU s", flush=True)  # fmt: skip
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    saved = {
        name: saved_bytes(model, lambda packed=packed: update(packed)) for name, packed in layouts.items()
    }
    load_after = os.getloadavg()[0]
    real = int(batch.completion_mask.sum())
    method, width = "LoRA r=16" if a.lora else "full", batch.prompt_ids.shape[1]
    print(f"\nmodel {model_dir.name}, {method}, {width}-token prompt, G={G} completions of "
          f"{shortest}-{longest} tokens ({real} real of {G * longest} padded), one micro-batch, "
          f"{a.pairs} pairs, load {load_before:.1f} before, {load_after:.1f} after; peak RSS "
          f"{peak_mib:.0f} MiB ({a.layouts})\n")  # fmt: skip
    names, both = list(layouts), len(layouts) == 2
    ratio_head = " packed/padded s | packed/padded CPU s |" if both else ""
    print(f"| pass | {' | '.join(f'{n} s | {n} CPU s' for n in names)} |{ratio_head}")
    print("|---" * (1 + 2 * len(names) + 2 * both) + "|")
    for phase in ("reference", "update"):
        cells = [f"{statistics.median(d[phase, n]):.2f}" for n in names for d in (times, cpu)]
        if both:
            cells += [_ratio(d[phase, "packed"], d[phase, "padded"]) for d in (times, cpu)]
        print(f"| {phase} | {' | '.join(cells)} |")
    mib = ", ".join(f"{n} {saved[n] / 2**20:.1f}" for n in names)
    print(f"\nupdate: saved for backward, MiB: {mib}")


def _ratio(packed: list[float], padded: list[float]) -> str:
    """The median of the per-pair ratios, with their range."""
    ratios = [x / y for x, y in zip(packed, padded, strict=True)]
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}–{max(ratios):.2f}]"


if __name__ == "__main__":
    main()
