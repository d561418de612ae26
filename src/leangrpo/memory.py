"""The memory options of the training step that need a GPU: 8-bit AdamW and activation offload; and
handing back the memory generation used before the update starts.

Everything else that keeps the step lean (chunked log-probs, completion-only positions, micro-batches,
gradient checkpointing) lives where its quantity is computed: `grpo.py`, `models.Policy`, `trainer.py`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch

from .errors import UserError

if TYPE_CHECKING:
    from .config import Config, OptimConfig


class DeviceOptionError(UserError, RuntimeError):
    """A memory option was asked for on a machine that cannot provide it."""


def check_device_options(cfg: Config) -> None:
    """Refuse GPU-only options on a machine without CUDA (or without bitsandbytes), before any model loads."""
    cuda = torch.cuda.is_available()
    if cfg.optim.optimizer == "adamw_8bit":
        if not cuda:
            raise DeviceOptionError(
                "optim.optimizer=adamw_8bit needs a CUDA GPU (bitsandbytes); on CPU use optim.optimizer=adamw"
            )
        if importlib.util.find_spec("bitsandbytes") is None:
            raise DeviceOptionError(
                "optim.optimizer=adamw_8bit needs bitsandbytes: pip install 'leangrpo[gpu]' "
                "(or pip install bitsandbytes)"
            )
    if cfg.model.activation_offload and not cuda:
        raise DeviceOptionError(
            "model.activation_offload needs a CUDA GPU (on CPU the activations already live in CPU memory); "
            "set model.activation_offload=false"
        )


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit AdamW (optimizer state in 8 bits: ~2 bytes/param instead of 8).

    The AdamW is torch's fused kernel (as transformers' Trainer uses by default): one pass over each
    parameter, where the plain one allocates temporaries as large as the parameter."""
    kwargs = {
        "lr": cfg.learning_rate,
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
