"""The device's speed levers: leangrpo.cpu's, for a model on CPU only (the one way into leangrpo.cpu)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from leangrpo.config.schema import CPUConfig

if TYPE_CHECKING:
    from leangrpo.cpu.levers import CPULevers


def cpu_levers(device: torch.device, cfg: CPUConfig) -> CPULevers | None:
    """The CPU's levers for models on `device`, or None on any other device: leangrpo.cpu is imported
    here and nowhere else."""
    if device.type != "cpu":
        return None
    from leangrpo.cpu.levers import CPULevers

    return CPULevers(cfg)


def release_memory(levers: CPULevers | None) -> None:
    """Hand back what a phase freed before the next one allocates (after the rollout and the update):
    on CPU glibc's heap pages (the levers'), on CUDA the cached blocks."""
    if levers is not None:
        levers.release()
    elif torch.cuda.is_available():
        torch.cuda.empty_cache()
