"""The memory options of the training step: 8-bit AdamW and (CUDA only) activation offload;
handing back the memory generation used before the update starts; and having glibc return freed
activation memory to the OS.

Everything else that keeps the step lean (chunked log-probs, completion-only positions, micro-batches,
gradient checkpointing) lives where its quantity is computed: `grpo.py`, `models.Policy`, `trainer.py`.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from .errors import UserError

if TYPE_CHECKING:
    from .config import Config, OptimConfig


# glibc's mallopt() parameter number for the mmap threshold (malloc.h), and the value leangrpo sets.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 * 2**20


class DeviceOptionError(UserError, RuntimeError):
    """A memory option was asked for on a machine that cannot provide it."""


def check_device_options(cfg: Config) -> None:
    """Refuse, before any model loads, options this machine cannot provide: bitsandbytes' (8-bit AdamW,
    a 4-bit base: CPU or CUDA) without bitsandbytes, activation offload without CUDA."""
    from .models import require_bitsandbytes

    cuda = torch.cuda.is_available()
    if cfg.optim.optimizer == "adamw_8bit":
        require_bitsandbytes("optim.optimizer=adamw_8bit")
    if cfg.model.load_in_4bit:
        require_bitsandbytes("model.load_in_4bit")
    if cfg.model.activation_offload and not cuda:
        raise DeviceOptionError(
            "model.activation_offload needs a CUDA GPU (on CPU the activations already live in CPU memory); "
            "set model.activation_offload=false"
        )


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, learning_rate: float | None = None
) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit AdamW (optimizer state in 8 bits: ~2 bytes/param instead of 8), at
    `cfg.learning_rate` unless `learning_rate` is given (the cold start's).

    The AdamW is torch's fused kernel (as transformers' Trainer uses by default): one pass over each
    parameter, where the plain one allocates temporaries as large as the parameter."""
    kwargs: dict[str, Any] = {
        "lr": cfg.learning_rate if learning_rate is None else learning_rate,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "weight_decay": cfg.weight_decay,
    }
    if cfg.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs, fused=True)


def activation_offload(enabled: bool) -> AbstractContextManager:
    """Around a training forward + backward: tensors saved for the backward go to pinned CPU memory and
    come back asynchronously when the backward needs them.

    With (non-reentrant) gradient checkpointing on, each layer keeps only its input for the backward, so
    what moves to the CPU are those layer inputs and the hidden states of the log-prob head; the layer
    internals are recomputed on the GPU as before.
    """
    if not enabled:
        return nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


def release_generation_memory() -> None:
    """On CUDA, hand the blocks generation cached (KV cache, sampling buffers) back before the update
    allocates its activations. Generation's tensors are already freed when it returns (it leaves no
    reference cycles, see tests/test_memory.py), so on CPU there is nothing to do."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def return_freed_memory() -> int | None:
    """Fix glibc's mmap threshold at 4 MiB, so that every freed block of 4 MiB or more (activations,
    log-prob chunks, gradients) goes back to the OS at once instead of staying in the process.

    By default glibc raises the threshold to 32 MiB after the first large free; from then on the
    update's activations come from the heap, whose freed middle is never returned, and RSS keeps the
    high-water mark of every phase (benchmarks/RESULTS.md: 5.0 instead of 3.1 GB on row c). Smaller
    blocks, such as the KV cache growing token by token, stay on the heap: fresh mmaps there cost page
    faults (a 1 MiB threshold made row c's step 50% slower). Idempotent. A MALLOC_MMAP_THRESHOLD_ in
    the environment wins. Returns the threshold set, or None when the environment or a non-glibc
    system decides.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return None
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        return None
    return MMAP_THRESHOLD
