"""The optimizer and its schedule, with the update's memory options: 8-bit AdamW, optimizer steps inside
the backward, and (CUDA only) activation offload. The CPU-only ones live in leangrpo.cpu."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR

    from leangrpo.config.schema import OptimConfig


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
        "eps": cfg.adam_epsilon,
    }
    if cfg.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs, fused=True)


class StepInBackward:
    """`optim.optimizer_in_backward`: each parameter takes its optimizer step as soon as its gradient is
    complete, and that gradient is freed at once, so the full set of gradients (one more copy of the
    trainable weights) is never alive together (torchtune's `optimizer_in_bwd`).

    The hooks act only inside `stepping()`, so the cold start's own optimizer is left alone. With no
    gradients held, there is no global norm to clip by before stepping: the config requires
    `max_grad_norm: null` and one micro-batch per optimizer step. The norm is still summed for the
    metrics. A non-finite gradient stops the stepping for the rest of that backward; parameters stepped
    before it keep their step (a non-finite loss makes the first gradient non-finite, so nothing steps).

    Each step is the optimizer's own `step()` shown one parameter group holding only that parameter, so
    a step costs one parameter's work, not a scan of them all. The non-finite check stays on the device
    for torch's fused AdamW (its `found_inf` skips the step in the kernel); 8-bit AdamW has no such
    input, so there it reads each gradient's norm on the host (on CUDA one synchronisation a parameter).

    `stepped` maps a hooked parameter to the tensor the optimizer holds in its place (its fp32 master,
    `optim.master_weights`); the optimizer's step hooks move that one parameter's gradient in and its
    weight out."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Iterable[torch.nn.Parameter],
        stepped: Mapping[torch.Tensor, torch.nn.Parameter] | None = None,
    ):
        self.optimizer, self.active, self.stepped = optimizer, False, stepped or {}
        self.group = {p: g for g in optimizer.param_groups for p in g["params"]}
        self.checks_on_device = isinstance(optimizer, torch.optim.AdamW) and bool(
            optimizer.defaults.get("fused")
        )
        device = next(iter(self.group)).device
        self.found_inf = torch.zeros((), device=device)  # 1 once a gradient of this backward was not finite
        self.squared_norm = torch.zeros((), device=device)
        for p in params:
            p.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: torch.Tensor) -> None:
        if not self.active:
            return
        assert param.grad is not None  # the hook runs right after the gradient was accumulated
        norm = torch.linalg.vector_norm(param.grad, dtype=torch.float32)
        self.found_inf.copy_(torch.maximum(self.found_inf, (~norm.isfinite()).float()))
        self.squared_norm += torch.where(self.found_inf > 0, 0.0, norm.square())
        if self.checks_on_device or not self.found_inf.item():
            groups = self.optimizer.param_groups
            held = self.stepped.get(param, param)
            self.optimizer.param_groups = [{**self.group[held], "params": [held]}]
            try:
                self.optimizer.step()
            finally:
                self.optimizer.param_groups = groups
        param.grad = None

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Around one optimizer step's backward."""
        self.active = True
        self.squared_norm.zero_()
        self.found_inf.zero_()
        if self.checks_on_device:
            self.optimizer.found_inf = self.found_inf  # type: ignore[attr-defined]  # read by AdamW.step
        try:
            yield
        finally:
            self.active = False
            if self.checks_on_device:
                del self.optimizer.found_inf  # type: ignore[attr-defined]

    @property
    def grad_norm(self) -> float:
        """The global gradient norm of the last `stepping()` (NaN if a gradient was not finite): one host
        read for the whole backward."""
        found_inf, squared = torch.stack([self.found_inf, self.squared_norm]).tolist()
        return math.nan if found_inf else math.sqrt(squared)


OWN_SCHEDULES = ("linear", "cosine", "constant", "cosine_with_min_lr")


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, num_training_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """The config's schedule, as transformers' `get_scheduler` builds it. The four usual ones
    (`OWN_SCHEDULES`: linear, cosine, constant, cosine_with_min_lr) are its formulas, written here (checked
    step by step against it in tests/test_memory.py): transformers.optimization imports peft and
    bitsandbytes (through `trainer_pt_utils`), about 150 MiB of peak RSS and 2 s of start-up that a run
    using neither would pay for nothing (docs/memory.md). Every other schedule is transformers' own."""
    kind, kwargs = cfg.lr_scheduler_type, cfg.lr_scheduler_kwargs or {}
    num_warmup_steps = cfg.num_warmup_steps(num_training_steps)
    if kind not in OWN_SCHEDULES:
        from transformers.optimization import get_scheduler

        return get_scheduler(kind, optimizer, num_warmup_steps, num_training_steps, dict(kwargs))
    floor = float(kwargs.get("min_lr_rate", float(kwargs.get("min_lr", 0.0)) / cfg.learning_rate))
    cycles = float(kwargs.get("num_cycles", 0.5))

    def factor(step: int) -> float:
        if kind == "constant":
            return 1.0
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        cosine = 0.5 * (1.0 + math.cos(math.pi * 2.0 * cycles * progress))
        if kind == "cosine_with_min_lr":
            return floor + (1 - floor) * cosine
        return max(0.0, cosine)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


@dataclass
class Optimization:
    """The policy and what steps it: the optimizer, its in-backward stepping (`optim.optimizer_in_backward`)
    and the learning-rate schedule."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    in_backward: StepInBackward | None
    scheduler: LambdaLR


def activation_offload(enabled: bool, params: Iterable[torch.Tensor] = ()) -> AbstractContextManager:
    """Around a training forward + backward: tensors saved for the backward go to pinned CPU memory and
    come back asynchronously when the backward needs them, except the weights among `params` (and views
    of them), which stay where they are: the LM head's weight, saved by the chunked log-probs, would
    otherwise be copied to the host, [V, H] per micro-batch, for nothing.

    With (non-reentrant) gradient checkpointing on, each layer keeps only its input for the backward, so
    what moves to the CPU are those layer inputs and the hidden states of the log-prob head; the layer
    internals are recomputed on the GPU as before.
    """
    if not enabled:
        return nullcontext()
    return torch.autograd.graph.saved_tensors_hooks(*offload_hooks(params))


def _storage(t: torch.Tensor) -> int:
    return getattr(t, "_local_tensor", t).untyped_storage().data_ptr()  # an FSDP2 DTensor: its shard


def offload_hooks(
    params: Iterable[torch.Tensor],
) -> tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]:
    """`activation_offload`'s pack and unpack hooks: a saved tensor sharing storage with one of `params`
    is kept as it is (no copy); any other is copied to (pinned, where CUDA is) CPU memory."""
    keep = {_storage(p) for p in params}
    pinnable = torch.cuda.is_available()

    def pack(t: torch.Tensor) -> tuple[torch.device | None, torch.Tensor]:
        if isinstance(t, torch.nn.Parameter) or _storage(t) in keep:
            return None, t
        pin = pinnable and not t.is_sparse
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=pin)
        host.copy_(t, non_blocking=pin)
        return t.device, host

    def unpack(packed: tuple[torch.device | None, torch.Tensor]) -> torch.Tensor:
        device, t = packed
        return t if device is None else t.to(device, non_blocking=pinnable)

    return pack, unpack
