"""The Trainer split by role (issue 48): the five places where copies had drifted apart, each shown on the
tiny model, and the one path every prompt and every reward input takes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from leangrpo.run.resolve import validate_config

pytestmark = pytest.mark.slow

# A chat template that refuses to render without `data.chat_template_kwargs` (as Qwen3's enable_thinking
# would silently render another prompt), and shows the kwarg it got.
STRICT_TEMPLATE = (
    "{% if mode is not defined %}{{ raise_exception('rendered without chat_template_kwargs') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant [{{ mode }}]\n{% endif %}"
)


def strict_model(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """The tiny model with STRICT_TEMPLATE as its chat template."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "strict-model")
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = STRICT_TEMPLATE
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    return model


def config(tmp_path: Path, model: Path, gsm8k_dir: Path, **sections: dict) -> dict:
    cfg = {
        "model": {"name_or_path": str(model), "gradient_checkpointing": False},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        "rewards": {"functions": [{"name": "toy_rewards:vowel_share"}]},
        "grpo": {"num_generations": 2, "max_completion_length": 4, "max_prompt_length": 160},
        "optim": {"per_device_train_batch_size": 4, "max_steps": 1},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(tmp_path / "run"),
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def test_chat_template_kwargs_reach_rollouts_evaluation_the_cold_start_and_the_prompt_check(
    tmp_path, tiny_model_dir, gsm8k_dir
):
    """Drift 1: `data.chat_template_kwargs` reached only the training rollouts. With a template that
    refuses to render without them, a run with the long-prompt check, a cold start, evaluation before
    and after, and a GRPO step renders every prompt with them."""
    from leangrpo.train.trainer import Trainer

    model = strict_model(tmp_path, tiny_model_dir)
    cfg = config(
        tmp_path, model, gsm8k_dir,
        data={"chat_template_kwargs": {"mode": "quiet"}},
        sft={"steps": 1, "batch_size": 2},
        eval={"enabled": True, "path": str(gsm8k_dir), "limit": 2, "batch_size": 2},
    )  # fmt: skip
    trainer = Trainer(validate_config(cfg))
    trainer.train()
    records = (tmp_path / "run" / "eval" / "step-1.jsonl").read_text().splitlines()
    assert len(records) == 2
    assert "[quiet]" in trainer.prompt_format.render(trainer.tokenizer, trainer.rows[0]["prompt"])


def test_a_rollout_func_engine_renders_prompts_with_the_run_format(tmp_path, tiny_model_dir):
    """Drift 1 for rollout_func's evaluation engine: it maps rendered texts back to prompts, rendered as
    the evaluation renders them."""
    from transformers import AutoTokenizer

    from leangrpo.data.rows import PromptFormat
    from leangrpo.train.rollout_source import RolloutFuncEngine

    tok = AutoTokenizer.from_pretrained(strict_model(tmp_path, tiny_model_dir))
    fmt = PromptFormat("", {"mode": "quiet"})
    prompt = [{"role": "user", "content": "2+2?"}]
    engine = RolloutFuncEngine(lambda p, t: {}, None, tok, [0], [prompt], fmt, torch.device("cpu"))
    assert engine.prompts == {fmt.render(tok, prompt): prompt}


def test_pass_at_k_samples_with_the_runs_top_k_and_min_p(tmp_path, tiny_model_dir, gsm8k_dir):
    """Drift 2: evaluation rebuilt its sampling from a few settings, and pass@k dropped top_k and min_p."""
    from leangrpo.data.tasks import load_task
    from leangrpo.engines.hf import HFEngine
    from leangrpo.train.evaluation import TrainingEvaluator

    cfg = validate_config(
        config(
            tmp_path,
            tiny_model_dir,
            gsm8k_dir,
            grpo={"top_k": 5, "min_p": 0.1, "temperature": 0.7, "repetition_penalty": 1.1},
            eval={"enabled": True, "path": str(gsm8k_dir), "limit": 2, "num_samples": 2},
        )  # fmt: skip
    )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen = []

    class Recording(HFEngine):
        def generate(self, texts, sampling, toolboxes=None):
            seen.append(sampling)
            return super().generate(texts, sampling, toolboxes)

    task = load_task(cfg.task)
    TrainingEvaluator(cfg, tmp_path / "run", [], task)(model, tok, 0, Recording(model, tok))
    greedy, sampled = seen[0], seen[-1]
    assert not greedy.do_sample and greedy.num_generations == 1
    assert sampled.do_sample and sampled.num_generations == 2
    assert (sampled.top_k, sampled.min_p, sampled.temperature, sampled.repetition_penalty) == (
        5,
        0.1,
        0.7,
        1.1,
    )


def test_training_and_evaluation_build_reward_inputs_in_one_place(
    tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch
):
    """Drift 3: reward inputs were built twice (the trainer's and the evaluation's). Both now go through
    `data.rewards.reward_inputs`, and a reward gets the same arguments from both."""
    import leangrpo.data.rewards as rewards
    import leangrpo.train.scoring as scoring
    from leangrpo.train.trainer import Trainer

    built, seen = [], []
    real = rewards.reward_inputs

    def counted(*args, **kwargs):
        built.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(rewards, "reward_inputs", counted)
    monkeypatch.setattr(scoring, "reward_inputs", counted)
    monkeypatch.setattr(
        "toy_rewards.vowel_share", lambda completions, **kw: seen.append(kw) or [0.0] * len(completions)
    )
    cfg = config(
        tmp_path, tiny_model_dir, gsm8k_dir, eval={"enabled": True, "path": str(gsm8k_dir), "limit": 2}
    )
    trainer = Trainer(validate_config(cfg))
    trainer.maybe_evaluate(0)
    trainer.step(1)
    assert len(built) == 2 and len(seen) == 2
    evaluation, training = seen
    assert set(training) == set(evaluation) and {"question", "answer", "completion_ids"} <= set(training)
    assert type(training["prompts"][0]) is type(evaluation["prompts"][0])


def test_the_python_api_closes_the_engine_as_the_cli_does(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    """Drift 4: GRPOTrainer.train() repeated the CLI's teardown without the engines' part (vLLM's groups
    in a multi-process job). Both now end in `trainer.run`, which closes the engine."""
    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.engines.hf import HFEngine

    closed = []
    monkeypatch.setattr(HFEngine, "close", lambda self: closed.append(self))

    def reward(completions, **_):
        return [float(len(c)) for c in completions]

    args = GRPOConfig(
        output_dir=str(tmp_path / "api"), num_generations=2, max_completion_length=4, max_steps=1,
        per_device_train_batch_size=2, report_to="none",
    )  # fmt: skip
    GRPOTrainer(str(tiny_model_dir), reward, args, [{"prompt": "Hi"}, {"prompt": "Yo"}]).train()
    assert len(closed) == 1


def test_an_async_batch_carries_its_own_metrics(tmp_path, tiny_model_dir, gsm8k_dir):
    """Drift 5: async/* travelled from the rollout to the record as an attribute set on the side. They now
    travel with the batch, and the Trainer holds no step's values."""
    from leangrpo.train.trainer import Trainer

    cfg = config(tmp_path, tiny_model_dir, gsm8k_dir, grpo={"async_rollouts": True})
    trainer = Trainer(validate_config(cfg))
    rollout = trainer.source.rollout(1)
    assert rollout.metrics["async/staleness_max"] == 0.0 and rollout.metrics["async/generate_seconds"] > 0
    assert not hasattr(trainer, "async_metrics")
    metrics = trainer.step(1)
    assert metrics["async/staleness_max"] == 0.0
    trainer.source.close()


def test_engines_tell_the_trainer_what_it_needs(tmp_path, tiny_model_dir):
    """The registry maps TRL's names to engines; the trainer asks the engine, not the config."""
    from leangrpo.engines.hf import HFEngine
    from leangrpo.engines.registry import ENGINES, engine_name

    g = SimpleNamespace
    assert engine_name(g(use_vllm=False, vllm_mode="colocate")) == "hf"
    assert engine_name(g(use_vllm=True, vllm_mode="colocate")) == "vllm"
    assert engine_name(g(use_vllm=True, vllm_mode="server")) == "vllm_server"
    assert ENGINES["vllm"].copy_in_process and not ENGINES["vllm_server"].copy_in_process
    engine = HFEngine(torch.nn.Linear(1, 1), None)
    assert not engine.holds_weights and not engine.sampler_logprobs
