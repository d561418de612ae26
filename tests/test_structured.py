"""Structured outputs (`grpo.structured_outputs_regex`, TRL's `vllm_structured_outputs_regex`) on the HF
engine: llguidance's regex mask as a logits processor, in generate() and in the lean CPU decode loop, the
sampler's log-probs of the masked distribution, the config, and a training run from the Python API.
vLLM's side is tests/real_vllm/test_vllm_structured.py."""

from __future__ import annotations

import re
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from leangrpo.config.schema import ConfigError
from leangrpo.engines.hf import generate
from leangrpo.engines.types import Sampling
from leangrpo.models.load import load_tokenizer
from leangrpo.run.resolve import load_config, validate_config
from leangrpo.train.policy import Policy, batch_logprobs

REGEX = r"(yes|no) [0-9]{1,3}!"
PROMPTS = ["x y", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model, load_tokenizer(str(tiny_model_dir))


@pytest.mark.parametrize("do_sample", [True, False], ids=["sampled", "greedy"])
def test_every_completion_matches_the_regex(tiny, levers, do_sample, monkeypatch):
    """Both decode loops: generate()'s (no levers) and the lean one (the CPU's levers, which must run)."""
    import leangrpo.cpu.levers as cpu_levers

    model, tokenizer = tiny
    lean_runs = []
    decode_lean = cpu_levers.decode_lean
    monkeypatch.setattr(cpu_levers, "decode_lean", lambda *a: lean_runs.append(1) or decode_lean(*a))
    sampling = Sampling(
        num_generations=4, max_prompt_length=32, max_completion_length=12, do_sample=do_sample, regex=REGEX,
        seed=0,
    )  # fmt: skip
    batch = generate(model, tokenizer, PROMPTS, sampling, levers=levers)
    assert bool(lean_runs) == (levers is not None)
    assert all(re.fullmatch(REGEX, text) for text in batch.completion_texts), batch.completion_texts
    assert not batch.truncated.any()  # each ended at its EOS, right after the "!"
    free = generate(
        model, tokenizer, PROMPTS, Sampling(**{**sampling.__dict__, "regex": None}), levers=levers
    )
    assert not any(re.fullmatch(REGEX, text) for text in free.completion_texts)  # the mask did it


def test_sampler_logprobs_are_the_masked_distributions(tiny):
    """As vLLM's: the sampler draws from the masked distribution and reports its log-probs, which are never
    below the policy's (the trainer's, unmasked, as TRL's), and 0 where the regex forces the token (the
    EOS after "!")."""
    model, tokenizer = tiny
    sampling = Sampling(
        num_generations=4, max_prompt_length=32, max_completion_length=12, regex=REGEX, seed=1
    )
    batch = generate(model, tokenizer, PROMPTS, sampling, sampler_logprobs=True)
    assert batch.sampling_logprobs is not None
    policy = batch_logprobs(Policy(model, 1.0), batch, micro_batch=len(batch))
    mask = batch.completion_mask.bool()
    assert (batch.sampling_logprobs[mask] >= policy[mask] - 1e-4).all()
    eos = (batch.completion_ids == tokenizer.eos_token_id) & mask
    assert eos.any(dim=1).all()
    torch.testing.assert_close(batch.sampling_logprobs[eos], torch.zeros(int(eos.sum())))
    assert (policy[eos] < -1e-3).all()


def test_config_key_from_the_command_line_and_trl():
    from leangrpo.config.trl import from_trl

    cfg = load_config(
        None, ["model.name_or_path=m", "data.path=d.jsonl", f"grpo.structured_outputs_regex={REGEX}"]
    )
    assert cfg.grpo.structured_outputs_regex == REGEX
    assert Sampling.from_config(cfg.grpo, cfg.data).regex == REGEX
    nested = from_trl({"vllm_structured_outputs_regex": REGEX, "use_vllm": True}, "t.yaml")
    assert nested["grpo"]["structured_outputs_regex"] == REGEX
    flags = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl", "--reward_funcs", "accuracy_reward"]
    trl_cli = load_config(None, [*flags, "--vllm_structured_outputs_regex", REGEX])  # `leangrpo train --...`
    assert trl_cli.grpo.structured_outputs_regex == REGEX


@pytest.mark.parametrize("use_vllm", [False, True])
def test_a_regex_without_vllm_is_said_at_start_up(use_vllm, caplog):
    """A deliberate difference (docs/trl.md): TRL's transformers generation ignores the regex."""
    from leangrpo.config.trl import REGEX_WITHOUT_VLLM, from_trl

    from_trl({"vllm_structured_outputs_regex": REGEX, "use_vllm": use_vllm}, "t.yaml")
    assert (f"t.yaml: {REGEX_WITHOUT_VLLM}" in caplog.text) != use_vllm


@pytest.mark.parametrize(
    ("grpo", "message"),
    [
        (
            {"structured_outputs_regex": "(yes|no"},
            "structured_outputs_regex: .*not a regex: error: unclosed group",
        ),
        ({"structured_outputs_regex": "a+", "ignore_eos": True}, "structured_outputs_regex and ignore_eos"),
    ],
)
def test_bad_regex_is_one_line(grpo, message):
    data = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}, "grpo": grpo}  # rewards: the task's
    with pytest.raises(ConfigError, match=message) as e:
        validate_config(data)
    assert "\n" not in str(e.value)


def test_without_llguidance_the_config_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises ImportError
    data = {
        "model": {"name_or_path": "m"},
        "data": {"path": "d.jsonl"},
        "grpo": {"structured_outputs_regex": "a"},
    }
    with pytest.raises(ConfigError, match=r"needs llguidance: pip install 'leangrpo\[structured\]'"):
        validate_config(data)
    validate_config({**data, "grpo": {}})  # a config without a regex does not need it


def test_python_api_trains_on_constrained_completions(tmp_path, tiny_model_dir):
    from leangrpo import GRPOConfig, GRPOTrainer

    seen: list[str] = []

    def record(completions, **kwargs):
        seen.extend(completions)
        return [float(c.startswith("yes")) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=12, report_to="none", vllm_structured_outputs_regex=REGEX,
    )  # fmt: skip
    GRPOTrainer(str(tiny_model_dir), record, args, [{"prompt": "Hi"}, {"prompt": "Yo"}]).train()
    assert len(seen) == 4 and all(re.fullmatch(REGEX, text) for text in seen), seen
