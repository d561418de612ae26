"""NEFTune (`grpo.neftune_noise_alpha`, TRL's `neftune_noise_alpha`): uniform noise of ±alpha/sqrt(L·d)
added to the input embeddings of every forward, L the forward's sequence length and d the hidden size,
by transformers' own hook (`neftune_post_forward_hook`), on the embedding module transformers' Trainer
hooks (the base model's under peft).

TRL noises every forward made while its model is in train mode: the rollout's generation (each
completion's prompt prefill, each new token), the old-policy, LoRA-reference and training passes, not
evaluation (eval mode) and not the frozen reference copy (another module). leangrpo's engines generate in
eval mode (KV cache, no dropout), so the noise here follows whether NEFTune is on, not the module's mode:
on from `activate` (after the frozen copies are made) to `deactivate`, off within `quiet` (evaluation)."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from torch import nn

from leangrpo.models.load import is_peft, peft_base

if TYPE_CHECKING:
    from torch import Tensor
    from torch.utils.hooks import RemovableHandle

ALPHA = "neftune_noise_alpha"
"""The embedding module's attribute transformers' hook reads alpha from; present only while noising."""

_HANDLES: weakref.WeakKeyDictionary[nn.Module, RemovableHandle] = weakref.WeakKeyDictionary()


def embeddings(model: nn.Module) -> nn.Module:
    """The input embeddings transformers' Trainer hooks: the base model's under a peft wrapper."""
    base = peft_base(model) if is_peft(model) else model
    return base.get_input_embeddings()  # type: ignore[operator]


def _noise(module: nn.Module, args: Any, output: Tensor) -> Tensor:
    """transformers' hook as if the module were in train mode (it noises train-mode forwards only),
    while NEFTune is on (`ALPHA` set)."""
    if not hasattr(module, ALPHA):
        return output
    # here, not at the top: transformers.integrations imports bitsandbytes, whose CPU backend logs a
    # warning at import, which would join every one-line error of a run without NEFTune
    from transformers.integrations.neftune import neftune_post_forward_hook

    training, module.training = module.training, True
    try:
        return neftune_post_forward_hook(module, args, output)
    finally:
        module.training = training


def activate(model: nn.Module, alpha: float) -> None:
    """Noise `model`'s input embeddings in every forward from now on (its copies made later too)."""
    module = embeddings(model)
    setattr(module, ALPHA, alpha)
    if module not in _HANDLES:
        _HANDLES[module] = module.register_forward_hook(_noise)


def deactivate(model: nn.Module) -> None:
    """Stop noising `model` (a model NEFTune never hooked: nothing to do), as transformers does after
    training."""
    module = embeddings(model)
    handle = _HANDLES.pop(module, None)
    if handle is not None:
        handle.remove()
    if hasattr(module, ALPHA):
        delattr(module, ALPHA)


def noised(model: nn.Module) -> bool:
    """Whether `model`'s forwards are noised now: generation then gives each completion its own draw."""
    return hasattr(embeddings(model), ALPHA)


@contextmanager
def quiet(model: nn.Module) -> Iterator[None]:
    """No noise within (TRL evaluates in eval mode, where transformers' hook adds none)."""
    module = embeddings(model)
    alpha = getattr(module, ALPHA, None)
    if alpha is not None:
        delattr(module, ALPHA)
    try:
        yield
    finally:
        if alpha is not None:
            setattr(module, ALPHA, alpha)
