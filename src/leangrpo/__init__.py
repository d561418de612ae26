"""leangrpo: memory-lean GRPO for small language models.

`from leangrpo import GRPOTrainer, GRPOConfig` gives TRL's Python API (leangrpo.commands.trl_api); it is
imported on first use, so that `leangrpo --help` loads no torch."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["GRPOConfig", "GRPOTrainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from leangrpo.commands import trl_api

        return getattr(trl_api, name)
    raise AttributeError(f"module 'leangrpo' has no attribute {name!r}")
