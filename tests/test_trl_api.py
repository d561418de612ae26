"""`from leangrpo import GRPOTrainer, GRPOConfig`: TRL 1.16's quickstart trains with only its import line
changed, and the constructor maps TRL's arguments or refuses them, all at once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent

# TRL's GRPO quickstart (docs/source/quickstart.md, grpo_trainer.md), adapted to a local tiny model, a
# local in-memory dataset and two short steps; only the import line is leangrpo's.
QUICKSTART = """
from datasets import Dataset
from leangrpo import GRPOConfig, GRPOTrainer

dataset = Dataset.from_list([{{"prompt": f"The sky is {{i}}"}} for i in range(8)])

# Define the reward function, which rewards completions that are close to 20 characters
def reward_len(completions, **kwargs):
    return [-abs(20 - len(completion)) for completion in completions]

training_args = GRPOConfig(
    output_dir={out!r}, max_steps=2, per_device_train_batch_size=4, num_generations=4, max_completion_length=8
)
trainer = GRPOTrainer(
    model={model!r},
    reward_funcs=reward_len,
    args=training_args,
    train_dataset=dataset,
)
trainer.train()
print("LOG", __import__("json").dumps(trainer.state.log_history))
"""


def test_trl_quickstart_trains_with_only_the_import_changed(tmp_path, tiny_model_dir):
    out = tmp_path / "Qwen2-0.5B-GRPO"
    script = tmp_path / "quickstart.py"
    script.write_text(QUICKSTART.format(out=str(out), model=str(tiny_model_dir)))
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent / "src")}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    log = json.loads(done.stdout.split("LOG ", 1)[1])
    assert [row["step"] for row in log] == [1, 2]  # logging_steps 10 (TRL's): step 1, then the summary
    assert {"rewards/reward_len/mean", "rewards/reward_len/std", "completions/mean_length"} <= log[0].keys()
    assert (out / "model" / "config.json").is_file()


class Recorder:
    """A TRL callback: records the events it sees."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log" if "reward" in logs else "summary", state.global_step))

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("step_end", state.global_step))


def test_callbacks_state_and_save_model(tmp_path, tiny_model_dir, caplog):
    from leangrpo import GRPOConfig, GRPOTrainer

    def short(completions, **kwargs):
        return [-float(len(c)) for c in completions]

    recorder = Recorder()
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, num_iterations=2, per_device_train_batch_size=4,
        num_generations=4, max_completion_length=4, report_to="none",
    )  # fmt: skip
    trainer = GRPOTrainer(
        str(tiny_model_dir), [short, "strict_format"], args, [{"prompt": "Hi"}, {"prompt": "Yo"}],
        callbacks=[recorder],
    )  # fmt: skip
    output = trainer.train()
    assert recorder.events == [("step_end", 2), ("log", 2), ("summary", 2)]  # one generation, 2 updates
    assert output.global_step == trainer.state.global_step == 2
    assert trainer.state.log_history[0]["rewards/short/mean"] <= 0
    assert "rewards/strict_format_reward/mean" in trainer.state.log_history[0]
    with caplog.at_level("WARNING"):
        trainer.save_model(str(tmp_path / "saved"))
    assert (tmp_path / "saved" / "config.json").is_file()
    # the args as JSON, never a pickle (TRL's training_args.bin): a deliberate difference, said once
    saved_args = json.loads((tmp_path / "saved" / "training_args.json").read_text())
    assert saved_args["output_dir"] == str(tmp_path / "run") and saved_args["num_iterations"] == 2
    assert not (tmp_path / "saved" / "training_args.bin").exists()
    assert "not TRL's pickled training_args.bin" in caplog.text


def test_constructor_maps_peft_and_refuses_everything_at_once(tmp_path):
    from peft import LoraConfig

    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.core.errors import UserError

    args = GRPOConfig(output_dir=str(tmp_path), optim="sgd", optim_args="beta1")
    with pytest.raises(UserError) as e:
        GRPOTrainer(
            "some/model", lambda completions, **_: [0.0] * len(completions), args, [{"prompt": "x"}],
            peft_config=LoraConfig(use_dora=True), tools=["not callable"],
        )  # fmt: skip
    lines = str(e.value).splitlines()
    assert "is not callable" in lines[0]  # the agentic arguments reach AgentSpec
    assert any("peft_config.use_dora" in line for line in lines)
    assert any("optim='sgd'" in line for line in lines)
    assert any("optim_args='beta1'" in line for line in lines)
    with pytest.raises(TypeError, match="not_a_field"):
        GRPOConfig(not_a_field=1)
    assert GRPOConfig().learning_rate == 1e-6 and GRPOConfig(beta=0.1).beta == 0.1  # TRL's defaults


def test_peft_config_becomes_the_lora_section(tmp_path, tiny_model_dir):
    from peft import LoraConfig

    from leangrpo import GRPOConfig, GRPOTrainer

    trainer = GRPOTrainer(
        str(tiny_model_dir), "strict_format", GRPOConfig(output_dir=str(tmp_path)), [{"prompt": "x"}],
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]),
    )  # fmt: skip
    lora = trainer.cfg.model.lora
    assert (lora.enabled, lora.r, lora.alpha, lora.target_modules) == (True, 4, 8, ["q_proj"])


def test_leangrpo_help_imports_no_torch():
    code = "import sys, leangrpo.cli; assert 'torch' not in sys.modules; import leangrpo; leangrpo.GRPOConfig"
    env = {**os.environ, "PYTHONPATH": str(TESTS.parent / "src")}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0


def test_image_prompts_without_a_processor_are_refused_in_one_line(tmp_path, tiny_model_dir):
    """Image prompts train (tests/test_vlm.py) with a processor; a text model's tokenizer cannot take them."""
    from PIL import Image

    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.core.errors import UserError

    parts = [{"type": "image"}, {"type": "text", "text": "What?"}]
    row = {"prompt": [{"role": "user", "content": parts}], "image": Image.new("RGB", (8, 8))}
    trainer = GRPOTrainer(str(tiny_model_dir), "strict_format", GRPOConfig(output_dir=str(tmp_path)), [row])
    with pytest.raises(UserError, match="^the rows have images, but no processor .* processing_class$"):
        trainer.train()


def _field(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


# TRL fields whose GRPOConfig value is read another way: output_dir (GRPOTrainer's "trainer_output"),
# max_steps (-1: num_train_epochs), report_to ("none" is no tracker) and the older name of a clip.
_READ_OTHERWISE = {"output_dir", "max_steps", "report_to", "vllm_importance_sampling_cap"}


def test_grpo_config_reads_what_the_run_uses(tmp_path, tiny_model_dir):
    """`GRPOConfig()` says TRL's defaults (max_completion_length 512, ...): the run uses exactly those."""
    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.config.trl import _mapped
    from leangrpo.config.trl_fields import TRL_DEFAULTS

    args = GRPOConfig()
    trainer = GRPOTrainer(str(tiny_model_dir), "strict_format", args, [{"prompt": "x"}])
    assert trainer.cfg.grpo.max_completion_length == args.max_completion_length == 512
    for name in TRL_DEFAULTS.keys() - _READ_OTHERWISE:
        if (target := _mapped(name)) is not None:
            assert _field(trainer.cfg, target) == getattr(args, name), name
    assert trainer.cfg.output_dir == "trainer_output"
    args = GRPOConfig(max_completion_length=8)
    given = GRPOTrainer(str(tiny_model_dir), "strict_format", args, [{"prompt": "x"}])
    assert given.cfg.grpo.max_completion_length == 8


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_lora_config_without_targets_gets_peft_defaults(tmp_path, tiny_model_dir):
    """TRL hands the LoraConfig to peft, which adapts its per-architecture default (q_proj and v_proj for
    Llama), not every Linear."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.config.trl import from_trl
    from leangrpo.models.load import apply_lora

    trainer = GRPOTrainer(
        str(tiny_model_dir), "strict_format", GRPOConfig(output_dir=str(tmp_path)), [{"prompt": "x"}],
        peft_config=LoraConfig(r=8, lora_alpha=16, task_type="CAUSAL_LM"),
    )  # fmt: skip
    lora = trainer.cfg.model.lora
    assert lora.target_modules is None
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora)
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"q_proj", "v_proj"}
    flat = {"model_name_or_path": "m", "dataset_name": "d", "use_peft": True}  # `trl grpo`'s default too
    assert from_trl(flat, "t")["model"]["lora"]["target_modules"] is None


def test_tool_timeout_has_its_own_field(tmp_path, tiny_model_dir, caplog):
    """TRL 1.16 has no `timeout_s`: leangrpo's two limits are named, and the tool one reaches the tools."""
    from leangrpo import GRPOConfig, GRPOTrainer

    def lookup(x: int) -> str:
        """Looks up x.

        Args:
            x: the key
        """
        return str(x)

    with pytest.raises(TypeError, match="tool_timeout_s"):
        GRPOConfig(timeout_s=60)
    args = GRPOConfig(output_dir=str(tmp_path), tool_timeout_s=60, reward_timeout_s=9)
    with caplog.at_level("WARNING"):
        trainer = GRPOTrainer(str(tiny_model_dir), "strict_format", args, [{"prompt": "x"}], tools=[lookup])
    assert (trainer.cfg.tools.timeout_s, trainer.cfg.rewards.timeout_s) == (60, 9)
    assert trainer._agent.timeout_s == 60
    assert "tool_timeout_s=60" in caplog.text


def test_logging_steps_governs_log_history_and_it_survives_a_resume(tmp_path, tiny_model_dir):
    """on_log and log_history follow logging_steps (leangrpo logs step 1 too, TRL's logging_first_step);
    a resumed run's log_history starts with the earlier steps, read back from its metrics.jsonl."""
    from leangrpo import GRPOConfig, GRPOTrainer

    def short(completions, **kwargs):
        return [-float(len(c)) for c in completions]

    common = dict(
        output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, report_to="none", save_steps=1,
    )  # fmt: skip
    recorder = Recorder()
    rows = [{"prompt": "Hi"}, {"prompt": "Yo"}]
    args = GRPOConfig(max_steps=3, logging_steps=2, **common)
    trainer = GRPOTrainer(str(tiny_model_dir), short, args, rows, callbacks=[recorder])
    trainer.train()
    assert [row["step"] for row in trainer.state.log_history] == [1, 2, 3]  # 3: the summary row
    assert [e for e in recorder.events if e[0] == "log"] == [("log", 1), ("log", 2)]
    assert [e for e in recorder.events if e[0] == "step_end"] == [
        ("step_end", 1),
        ("step_end", 2),
        ("step_end", 3),
    ]

    resumed = GRPOTrainer(
        str(tiny_model_dir), short, GRPOConfig(max_steps=4, logging_steps=1, **common), rows
    )
    resumed.train(resume_from_checkpoint=True)
    assert [row["step"] for row in resumed.state.log_history] == [1, 2, 4, 4]
    assert "rewards/short/mean" in resumed.state.log_history[0]
    assert "kl" not in resumed.state.log_history[0]  # beta 0: TRL logs no kl (tests/trl_parity)


class Order:
    """A TRL callback that writes the events it sees, with its name, into a shared list."""

    def __init__(self, name: str, seen: list) -> None:
        self.name, self.seen = name, seen

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append((self.name, "step_end", state.global_step))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append((self.name, "log", state.global_step))


class StopAtTwo:
    """Asks the run to stop, as a TRL callback does (early stopping)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= 2:
            control.should_training_stop = True


def test_trainer_attributes_and_callback_list(tmp_path, tiny_model_dir):
    """args, processing_class, model (loaded on first access, then the one trained), accelerator,
    is_world_process_zero; add/pop/remove_callback with a class or an instance, as transformers."""
    from transformers import AutoTokenizer, PrinterCallback, ProgressCallback

    from leangrpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path / "run"), report_to="none")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    seen: list = []
    first = Order("a", seen)
    trainer = GRPOTrainer(
        str(tiny_model_dir), "strict_format", args, [{"prompt": "x"}], processing_class=tokenizer,
        callbacks=[first, Recorder],
    )  # fmt: skip
    assert trainer.args is args and trainer.processing_class is tokenizer
    assert trainer.is_world_process_zero() and trainer.accelerator.is_main_process
    model = trainer.model
    assert model is trainer.model and model is trainer._extras.model  # the object train() will train
    assert model.config.num_hidden_layers >= 1
    assert trainer.callbacks[0] is first and isinstance(trainer.callbacks[1], Recorder)
    trainer.add_callback(PrinterCallback)
    assert isinstance(trainer.callbacks[-1], PrinterCallback)
    assert isinstance(trainer.pop_callback(PrinterCallback), PrinterCallback)
    assert trainer.pop_callback(PrinterCallback) is None
    trainer.remove_callback(Order)
    trainer.remove_callback(ProgressCallback)  # a class not there: nothing
    assert [type(cb) for cb in trainer.callbacks] == [Recorder]
    with pytest.raises(ValueError):
        trainer.remove_callback(first)
    assert trainer.pop_callback(trainer.callbacks[0]) is not None and trainer.callbacks == []


def short(completions, **kwargs):
    return [-float(len(c)) for c in completions]


def _two_step_trainer(run: Path, tiny_model_dir: Path, **kwargs):
    from leangrpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(run), max_steps=kwargs.pop("max_steps", 2), logging_steps=1,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=4, report_to="none",
        save_steps=100,
    )  # fmt: skip
    return GRPOTrainer(str(tiny_model_dir), short, args, [{"prompt": "Hi"}, {"prompt": "Yo"}], **kwargs)


def test_callbacks_in_order_and_should_training_stop(tmp_path, tiny_model_dir):
    """Callbacks in the order given, on_step_end before on_log (transformers); should_training_stop ends
    the run after its step as a normal end: its checkpoint and the final model."""
    run, seen = tmp_path / "run", []
    callbacks = [Order("a", seen), StopAtTwo, Order("b", seen)]
    trainer = _two_step_trainer(run, tiny_model_dir, max_steps=4, callbacks=callbacks)
    output = trainer.train()
    assert output.global_step == trainer.state.global_step == 2
    steps = [(name, event, step) for step in (1, 2) for event in ("step_end", "log") for name in ("a", "b")]
    assert seen == steps + [("a", "log", 2), ("b", "log", 2)]  # then the summary row's on_log
    assert (run / "checkpoint-2").is_dir() and (run / "model" / "config.json").is_file()
    assert not (run / "checkpoint-3").exists()


def test_train_output_metrics_log_save_metrics_and_state(tmp_path, tiny_model_dir, capsys):
    """TrainOutput.metrics as transformers fills them; log_metrics, save_metrics and save_state write
    what transformers writes."""
    run = tmp_path / "run"
    trainer = _two_step_trainer(run, tiny_model_dir)
    output = trainer.train()
    metrics = output.metrics
    assert set(metrics) == {
        "train_runtime", "train_samples_per_second", "train_steps_per_second", "total_flos", "train_loss",
        "epoch",
    }  # fmt: skip
    assert metrics["train_loss"] == output.training_loss and metrics["epoch"] == pytest.approx(1.0)
    assert metrics["train_steps_per_second"] > 0 and metrics["total_flos"] == 0
    trainer.log_metrics("train", metrics)
    assert "***** train metrics *****" in capsys.readouterr().out
    trainer.save_metrics("train", metrics)
    trainer.save_metrics("eval", {"eval_reward": 1.0})
    assert json.loads((run / "train_results.json").read_text()) == metrics
    assert json.loads((run / "all_results.json").read_text()) == {**metrics, "eval_reward": 1.0}
    trainer.save_state()
    state = json.loads((run / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and [row["step"] for row in state["log_history"]] == [1, 2, 2]


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")
def test_save_model_puts_a_lora_adapter_at_the_top_level(tmp_path, tiny_model_dir):
    """As TRL: `PeftModel.from_pretrained(base, out)` loads what save_model(out) wrote; the merged model
    is in out/merged/; trainer.model is the trained peft model."""
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
    trainer = _two_step_trainer(tmp_path / "run", tiny_model_dir, peft_config=lora)
    trainer.train()
    assert isinstance(trainer.model, PeftModel)
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    assert (out / "merged" / "config.json").is_file() and not (out / "config.json").exists()


def test_save_state_leaves_the_run_readable_as_a_run(tmp_path, tiny_model_dir):
    """`save_state()` writes trainer_state.json at the run's top, where a checkpoint keeps its own: the run
    is still a run (eval, chat and export find its final model), and the file is the run's (claimed)."""
    from leangrpo.run.rundir import MANIFEST
    from leangrpo.run.trained import locate

    run = tmp_path / "run"
    trainer = _two_step_trainer(run, tiny_model_dir)
    trainer.train()
    trainer.save_state()
    trainer.save_metrics("train", {"train_loss": 1.0})
    found = locate(run)
    assert found is not None and found.full == run / "model" and found.run_dir == run
    assert {"trainer_state.json", "train_results.json"} <= set((run / MANIFEST).read_text().splitlines())
