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
