"""Our speed-ups, each on and off, on vs_trl.py's model: generation with the lean decode loop
(decode.py) or generate() with the same packed weights; then, generate() only, with and without the
oneDNN-packed Linears, with and without the in-place KV cache + inverse-CDF sampling (off: transformers' own
DynamicCache and torch.multinomial), and with the prompt prefilled once per group or on every row; one
update forward + backward with and without the shared-prompt layout; and what the default log-prob chunk
(256 rows) costs in update time against 1024-row chunks.

    python benchmarks/phases.py [--completion-length 96] [--lora] [--repeats 2]

Runs alternate on/off so that drift in the machine's speed hits both alike; prints each run's seconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import build_model, default_data  # noqa: E402

from leangrpo.config.schema import CPUConfig, LoraConfig
from leangrpo.core.logprobs import LOGPROB_CHUNK_SIZE
from leangrpo.cpu import levers as levers_mod
from leangrpo.cpu.levers import CPULevers
from leangrpo.data.rows import PromptFormat
from leangrpo.data.sources import load_rows
from leangrpo.data.tasks import load_task
from leangrpo.engines import hf
from leangrpo.engines.hf import generate
from leangrpo.engines.types import RolloutBatch, Sampling
from leangrpo.models.load import apply_lora, cache_root, load_tokenizer
from leangrpo.run.resolve import validate_config
from leangrpo.train.policy import Policy, micro_batch_logprobs

G = 8


def multinomial(scores: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The draw generate() makes itself (torch.multinomial), in InverseCDFSampler's place."""
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)


@contextmanager
def transformers_cache_and_sampling():
    """generate() with transformers' own DynamicCache (torch.cat per token) and torch.multinomial."""
    with (
        mock.patch.object(hf, "kv_cache", lambda model, capacity: None),
        mock.patch.object(hf.InverseCDFSampler, "draw", staticmethod(multinomial)),
    ):
        yield


def no_lean_decoder(*args: object) -> None:
    """In lean_decoder's place: generate() then decodes, with its Linears packed by packed_linears."""


def no_prefill(*args: object) -> None:
    """In prefill_once_per_group's place: generate() then prefills the prompt on every row of a group."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--completion-length", type=int, default=96)
    p.add_argument("--lora", action="store_true", help="LoRA r=16 on all linears (else full fine-tuning)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--model", type=Path, help="a model directory (default: vs_trl.py's random SmolLM2)")
    a = p.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = a.model or build_model(cache_root() / "bench")
    tok = load_tokenizer(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if a.lora:
        model = apply_lora(model, LoraConfig(enabled=True, r=16, alpha=32, target_modules="all-linear"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = {"path": str(default_data()), "limit": 1}  # vs_trl.py's prompt: GSM8K's first question
    cfg = validate_config({"model": {"name_or_path": str(model_dir)}, "data": data,
                           "rewards": {"functions": [{"name": "correctness"}]}})  # fmt: skip
    row = load_rows(cfg.data, load_task(cfg.task)).rows[0]
    prompt = PromptFormat.from_config(cfg.data).render(tok, row["prompt"])
    times: dict[str, list[float]] = {}

    def timed(name: str, fn) -> object:
        start = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - start)
        print(f"{name}: {times[name][-1]:.2f} s", flush=True)
        return out

    def rollout_batch(packed: bool = True) -> RolloutBatch:
        C = a.completion_length
        sampling = Sampling(
            num_generations=G, max_prompt_length=512, max_completion_length=C, ignore_eos=True
        )
        levers = CPULevers(CPUConfig(packed_generation=packed))
        return generate(model, tok, [prompt], sampling, levers=levers)

    batch = None
    for _ in range(a.repeats):
        for on in (False, True):
            with nullcontext() if on else mock.patch.object(levers_mod, "lean_decoder", no_lean_decoder):
                batch = timed(f"generate, lean decode loop {'on' if on else 'off'}", rollout_batch)
        # generate()'s own speed-ups, the lean loop off on both sides
        with mock.patch.object(levers_mod, "lean_decoder", no_lean_decoder):
            for on in (False, True):
                name = f"generate, packed Linears {'on' if on else 'off'}"
                timed(name, lambda on=on: rollout_batch(on))
            for on in (False, True):
                with nullcontext() if on else transformers_cache_and_sampling():
                    timed(f"generate, in-place cache + ICDF {'on' if on else 'off'}", rollout_batch)
            for on in (False, True):
                with nullcontext() if on else mock.patch.object(hf, "prefill_once_per_group", no_prefill):
                    timed(f"generate, prompt prefilled once {'on' if on else 'off'}", rollout_batch)
    policy = Policy(model.train(), share_prompt=True)

    def update(group: int) -> None:
        logp, mask = micro_batch_logprobs(policy, batch, slice(None), group=group)
        (logp * mask).sum().backward()
        model.zero_grad(set_to_none=True)

    for _ in range(a.repeats):
        for group in (1, G):
            timed(f"update, shared prompt {'on' if group > 1 else 'off'}", lambda g=group: update(g))
    for _ in range(a.repeats):
        for chunk in (1024, LOGPROB_CHUNK_SIZE):
            policy.chunk_size = chunk
            timed(f"update, log-prob chunk {chunk}", lambda: update(G))
    method = "LoRA" if a.lora else "full"
    print(f"\nmodel {model_dir.name}, {method}, {batch.prompt_ids.shape[1]}-token prompt, "
          f"G={G} x {a.completion_length} tokens; median seconds:")  # fmt: skip
    for name, values in times.items():
        print(f"  {name:<36} {statistics.median(values):7.2f}")


if __name__ == "__main__":
    main()
