"""The differential suite's corpus (issue 49, item 7): TRL usage, each case a function run with `lib` either
`trl` or `leangrpo`, returning one JSON record of what a user can observe (effective settings, metric keys,
callback events, saved files, values fixed by the completions). `python corpus.py trl MODEL OUT CASE...`
runs cases under TRL in a process of their own (TRL leaves accelerate's shared state set) and writes
OUT/records.json."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

EVENTS = (
    "on_init_end", "on_train_begin", "on_epoch_begin", "on_step_begin", "on_substep_end",
    "on_pre_optimizer_step", "on_optimizer_step", "on_step_end", "on_log", "on_prediction_step",
    "on_evaluate", "on_save", "on_epoch_end", "on_train_end",
)  # fmt: skip
ROWS = [{"prompt": "Hi"}, {"prompt": "Yo"}]
"""Standard (string) prompts."""
CHATS = [
    {"prompt": [{"role": "user", "content": q}], "solution": a} for q, a in (("1+1?", "2"), ("2+2?", "4"))
]


def short(completions: list[Any], **kwargs: Any) -> list[float]:
    """Rewards shorter completions (strings or message lists)."""
    return [-float(len(c if isinstance(c, str) else c[-1]["content"])) for c in completions]


class Recorder:
    """A callback recording every event as (event, global_step)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []
        for event in EVENTS:
            setattr(self, event, self._recorder(event))

    def _recorder(self, event: str) -> Any:
        def record(args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seen.append((event, state.global_step))

        return record


def dataset(rows: list[dict[str, Any]]) -> Any:
    """A `datasets.Dataset`, which TRL requires."""
    from datasets import Dataset

    return Dataset.from_list(rows)


def config(lib: ModuleType, out: Path, **extra: Any) -> Any:
    """A 2-step GRPOConfig with tiny lengths (TRL needs `use_cpu` to run on a CPU)."""
    fields = dict(
        output_dir=str(out), max_steps=2, logging_steps=1, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, report_to="none", save_steps=100, per_device_eval_batch_size=4,
        learning_rate=1e-4,
    )  # fmt: skip
    if lib.__name__ == "trl":
        fields["use_cpu"] = True
    return lib.GRPOConfig(**{**fields, **extra})


def record(trainer: Any, recorder: Recorder, out: Path) -> dict[str, Any]:
    """What a user sees of a trained run: settings, train-row metric keys, events, save_model's files."""
    rows = trainer.state.log_history
    train_rows = [r for r in rows if "loss" in r and "train_runtime" not in r]
    peft = getattr(trainer.model, "peft_config", None)
    trainer.save_model(str(out / "saved"))
    return {
        "max_completion_length": trainer.args.max_completion_length,
        "loss_type": trainer.args.loss_type,
        "lora_targets": sorted(peft["default"].target_modules) if peft else None,
        "learning_rates": {r["step"]: r["learning_rate"] for r in train_rows},
        "steps": [r["step"] for r in rows],
        "metric_keys": sorted({k for r in train_rows for k in r}),
        "summary_keys": list(rows[-1]),
        "events": recorder.seen,
        "saved": sorted(str(p.relative_to(out / "saved")) for p in (out / "saved").rglob("*") if p.is_file()),
    }


def docstring(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """GRPOTrainer's class docstring: a model name, `accuracy_reward`, a conversational dataset."""
    from trl.rewards import accuracy_reward

    recorder = Recorder()
    trainer = lib.GRPOTrainer(
        model=model, reward_funcs=accuracy_reward, train_dataset=dataset(CHATS),
        args=config(lib, out), callbacks=[recorder],
    )  # fmt: skip
    trainer.train()
    return record(trainer, recorder, out)


def peft(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """A peft LoraConfig without target_modules (peft's default for the architecture), a cosine schedule."""
    from peft import LoraConfig

    recorder = Recorder()
    args = config(lib, out, max_steps=3, lr_scheduler_type="cosine", warmup_steps=1)
    trainer = lib.GRPOTrainer(
        model, short, args, dataset(ROWS), peft_config=LoraConfig(r=4, lora_alpha=8), callbacks=[recorder]
    )
    trainer.train()
    return record(trainer, recorder, out)


def evaluation(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """eval_dataset evaluated every step, then evaluate() after training: the eval rows' keys too."""
    recorder = Recorder()
    args = config(lib, out, eval_strategy="steps", eval_steps=1, loss_type="grpo", beta=0.04)
    data = dataset(ROWS)
    trainer = lib.GRPOTrainer(model, short, args, data, eval_dataset=data, callbacks=[recorder])
    trainer.train()
    result = record(trainer, recorder, out)
    result["eval_keys"] = sorted(trainer.evaluate())
    return result


def accumulation(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """Two micro-batches a step, two iterations per generation, `max_steps` in optimizer steps."""
    recorder = Recorder()
    args = config(
        lib, out, max_steps=4, gradient_accumulation_steps=2, per_device_train_batch_size=2, num_iterations=2
    )
    trainer = lib.GRPOTrainer(model, short, args, dataset(ROWS), callbacks=[recorder])
    trainer.train()
    return record(trainer, recorder, out)


def loss_type(name: str) -> Callable[[ModuleType, str, Path], dict[str, Any]]:
    """A case training with loss_type `name`: each logs its own metrics (TRL logs clip_ratio/* only for the
    clipped objectives, cispo_clip_ratio for cispo, vespo/phi_seq_mean for vespo)."""

    def case(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
        recorder = Recorder()
        args = config(lib, out, loss_type=name, max_steps=1)
        trainer = lib.GRPOTrainer(model, short, args, dataset(ROWS), callbacks=[recorder])
        trainer.train()
        return record(trainer, recorder, out)

    case.__name__ = name
    return case


def rollout_func(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """A rollout_func that returns fixed completions: the reward and length metrics must be equal."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        prompt_ids = [tok.encode(p) for p in prompts]
        completion_ids = [tok.encode(" a" * (i % 4 + 1)) + [tok.eos_token_id] for i in range(len(prompts))]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],
        }

    recorder = Recorder()
    trainer = lib.GRPOTrainer(
        model, short, config(lib, out, max_steps=1), dataset(ROWS), rollout_func=rollout, callbacks=[recorder]
    )
    trainer.train()
    result = record(trainer, recorder, out)
    row = trainer.state.log_history[0]
    result["values"] = {
        k: round(v, 5)
        for k, v in row.items()
        if k in ("reward", "reward_std", "num_tokens") or k.startswith(("rewards/", "completions/"))
    }
    return result


def tool_tokenizer(model: str) -> Any:
    """The model's tokenizer with TRL's ChatML tool template (qwen2_5), which TRL needs for tools."""
    import trl
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja").read_text()
    return tok


def lookup(key: int) -> str:
    """Looks a number up.

    Args:
        key: the number to look up
    """
    return str(key * 2)


def tools(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """A tool function, as in TRL's tools docs: the tools/* metrics join the rows."""
    recorder = Recorder()
    trainer = lib.GRPOTrainer(
        model, short, config(lib, out, max_completion_length=8), dataset(CHATS), callbacks=[recorder],
        tools=[lookup], processing_class=tool_tokenizer(model),
    )  # fmt: skip
    trainer.train()
    return record(trainer, recorder, out)


class Counter:
    """An environment as in TRL's environment_factory docs: `reset` gives the observation, its public methods
    are tools, `get_reward` the reward."""

    def reset(self, **kwargs: Any) -> str:
        self.count = 0
        return "Count up."

    def increment(self, step: int) -> str:
        """Adds to the counter.

        Args:
            step: how much to add
        """
        self.count += step
        return str(self.count)

    def get_reward(self) -> float:
        return float(self.count)


def environment(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """environment_factory with no dataset and no reward functions (the environment scores)."""
    recorder = Recorder()
    trainer = lib.GRPOTrainer(
        model, args=config(lib, out, max_completion_length=8), environment_factory=Counter,
        callbacks=[recorder], processing_class=tool_tokenizer(model),
    )  # fmt: skip
    trainer.train()
    return record(trainer, recorder, out)


SCRIPT_IMPORTS = (
    "    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n",
    "    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser\n",
)
"""trl/scripts/grpo.py's imports of GRPOTrainer and GRPOConfig, which the case takes from `lib` instead."""


def grpo_script(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """trl/scripts/grpo.py as TRL ships it, run with TRL's command line (`--use_peft` without target modules);
    its GRPOTrainer and GRPOConfig are `lib`'s, the trainer given the recording callback."""
    import trl

    source = (Path(trl.__file__).parent / "scripts" / "grpo.py").read_text()
    for line in SCRIPT_IMPORTS:
        assert source.count(line) == 1, line
        source = source.replace(line, line.replace(" GRPOTrainer,", "").replace(" GRPOConfig,", ""))
    data = out / "data"
    data.mkdir(parents=True)
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in CHATS * 2))
    recorder, made = Recorder(), []

    class Trainer(lib.GRPOTrainer):  # type: ignore[name-defined]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, callbacks=[recorder], **kwargs)
            made.append(self)

    argv = [
        "grpo.py", "--model_name_or_path", model, "--dataset_name", str(data), "--output_dir",
        str(out / "run"), "--reward_funcs", "think_format_reward", "--max_steps", "2",
        "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "4",
        "--bf16", "false", "--learning_rate", "1e-4", "--logging_steps", "1", "--report_to", "none",
        "--use_peft", "--lora_r", "4",
    ]  # fmt: skip
    old_argv, sys.argv = sys.argv, argv + (["--use_cpu", "true"] if lib.__name__ == "trl" else [])
    try:
        exec(
            compile(source, "grpo.py", "exec"),
            {"__name__": "__main__", "GRPOTrainer": Trainer, "GRPOConfig": lib.GRPOConfig},
        )
    finally:
        sys.argv = old_argv
    return record(made[0], recorder, out)


def tool_call(lib: ModuleType, model: str, out: Path) -> dict[str, Any]:
    """A rollout_func whose completions call the tool: the messages the rewards see, parsed from the same
    completions, must be equal. Its result is past `max_completion_length`, so neither runs it (at 200 tokens
    TRL 1.16's tool loop after a rollout_func raises a TypeError)."""
    tok, seen = tool_tokenizer(model), []
    call = '<tool_call>\n{"name": "lookup", "arguments": {"key": 3}}\n</tool_call><|im_end|>'

    def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        prompt_ids = [
            tok.apply_chat_template(
                p, tools=[lookup], add_generation_prompt=True, tokenize=True, return_dict=False
            )
            for p in prompts
        ]
        completion_ids = [tok.encode(call, add_special_tokens=False) for _ in prompts]
        return {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": [[0.0] * len(ids) for ids in completion_ids],
        }

    def tool_seen(completions: list[Any], **kwargs: Any) -> list[float]:
        seen.extend(completions)
        return [0.0] * len(completions)

    recorder = Recorder()
    trainer = lib.GRPOTrainer(
        model, tool_seen, config(lib, out, max_steps=1, max_completion_length=40), dataset(CHATS),
        callbacks=[recorder], tools=[lookup], processing_class=tok, rollout_func=rollout,
    )  # fmt: skip
    trainer.train()
    result = record(trainer, recorder, out)
    result["completion_messages"] = seen[0]
    return result


CASES = {
    f.__name__: f
    for f in (
        docstring,
        grpo_script,
        peft,
        evaluation,
        accumulation,
        rollout_func,
        tools,
        tool_call,
        environment,
        *(loss_type(name) for name in ("cispo", "sapo", "vespo")),
    )
}


def run(lib: ModuleType, model: str, out: Path, names: list[str]) -> dict[str, Any]:
    """Each named case's record; a case that raises records its error's type and first line."""
    records: dict[str, Any] = {}
    for name in names:
        try:
            records[name] = CASES[name](lib, model, out / name)
        except Exception as e:  # noqa: BLE001 - a refusal is part of the record
            records[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
    return json.loads(json.dumps(records))


if __name__ == "__main__":
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl

    out = Path(sys.argv[3])
    (out / "records.json").parent.mkdir(parents=True, exist_ok=True)
    (out / "records.json").write_text(json.dumps(run(trl, sys.argv[2], out, sys.argv[4:])))
