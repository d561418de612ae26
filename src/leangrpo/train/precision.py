"""The precision the trained weights are stepped in: fp32 master copies of bf16 weights under full
fine-tuning (`optim.master_weights`), so that updates smaller than half a bf16 step accumulate instead of
rounding away (issue 53, item 4)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from leangrpo.train.distributed import MASTERS_KEY, Sharded
from leangrpo.train.optim import build_optimizer

if TYPE_CHECKING:
    from leangrpo.config.schema import Config
    from leangrpo.train.distributed import Replicated

STATE_KEY = MASTERS_KEY  # where the masters travel in the optimizer's state dict


class MasterWeights:
    """fp32 copies of low-precision trainable weights, which the optimizer steps in their place.

    bf16 keeps 8 significant bits: at lr 1e-6 an AdamW step (about lr per element) is below half a bf16
    step of any weight above ~1e-4 in size, so stepping bf16 weights directly leaves most of them where
    they were. Here the optimizer holds fp32 masters; its step hooks copy each weight's gradient to its
    master before the step and the stepped master, rounded, back into the weight after. The masters
    travel in the optimizer's state dict (`STATE_KEY`), so a resumed run continues them, not their
    rounded weights. Cost: 4 bytes per trainable parameter."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.weights = params
        self.masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
        self.master_of: dict[torch.Tensor, torch.nn.Parameter] = dict(zip(params, self.masters, strict=True))
        self.weight_of: dict[torch.Tensor, torch.nn.Parameter] = dict(zip(self.masters, params, strict=True))

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """`optimizer` (built on `masters`) with the hooks that connect it to the weights. A step moves
        the masters of the optimizer's param groups as they are at that step: all of them, or the one
        `StepInBackward` shows it, so an in-backward step costs one parameter's copies."""
        optimizer.register_step_pre_hook(lambda opt, *_: self._gradients_in(self._stepped(opt)))
        optimizer.register_step_post_hook(lambda opt, *_: self._weights_out(self._stepped(opt)))
        optimizer.register_state_dict_post_hook(self._save)
        optimizer.register_load_state_dict_pre_hook(self._load)
        return optimizer

    def _stepped(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        return [m for g in optimizer.param_groups for m in g["params"]]

    @torch.no_grad()
    def _gradients_in(self, masters: Sequence[torch.Tensor]) -> None:
        for master in masters:
            grad = self.weight_of[master].grad
            master.grad = None if grad is None else grad.float()

    @torch.no_grad()
    def _weights_out(self, masters: Sequence[torch.Tensor]) -> None:
        for master in masters:
            self.weight_of[master].copy_(master)
            master.grad = None

    def _save(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        return {**state, STATE_KEY: [m.detach().clone() for m in self.masters]}

    @torch.no_grad()
    def _load(self, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
        state = dict(state)
        saved = state.pop(STATE_KEY, None)  # none in a checkpoint saved without masters: keep the weights'
        for master, value in zip(self.masters, saved or [], strict=True):
            master.copy_(value)
        self._weights_out(self.masters)
        return state


def set_tf32(cfg: Config, device: torch.device, write: Callable[[str], None]) -> None:
    """TF32 for the run's fp32 matmuls on a GPU (`model.tf32`; null: on for fp32 weights): the product's
    inputs keep 10 bits of mantissa, its sum fp32, several times faster than fp32 on Ampere and later.
    TRL leaves torch's setting (off) as it is: a deliberate difference, said in one line."""
    if device.type != "cuda":
        return
    on = cfg.model.tf32 if cfg.model.tf32 is not None else cfg.model.dtype == "float32"
    torch.backends.cuda.matmul.allow_tf32 = on
    torch.backends.cudnn.allow_tf32 = on
    write(f"precision: fp32 matmuls in {'TF32' if on else 'full fp32'} on the GPU (model.tf32)")


def precise_optimizer(
    params: list[torch.nn.Parameter], cfg: Config, dist: Replicated, write: Callable[[str], None]
) -> tuple[torch.optim.Optimizer, dict[torch.Tensor, torch.nn.Parameter] | None]:
    """The run's precision on its device (`set_tf32`) and the optimizer of the trainable `params`: on
    fp32 masters (`MasterWeights`) where `optim.master_weights` says so (null: for bf16 full fine-tuning
    on a GPU), else on `params` themselves; says which in one line for bf16 weights. Returns the
    optimizer and, with masters, each weight's master (what `StepInBackward` steps).

    Under FSDP2 the masters are the fp32 shards themselves (`Sharded`, gathered in bf16 for compute): its
    optimizer state is gathered and restored by the model's parameter names, which separate masters
    would not be."""
    set_tf32(cfg, dist.acc.device, write)
    if isinstance(dist, Sharded) and dist.compute_dtype is not None:
        write(
            "precision: bfloat16 compute, fp32 sharded weights stepped by the optimizer (FSDP2 "
            "MixedPrecisionPolicy, gradients reduced in fp32; optim.master_weights)"
        )
        return build_optimizer(params, cfg.optim), None
    low = sorted({str(p.dtype).removeprefix("torch.") for p in params if p.dtype != torch.float32})
    if not low:
        return build_optimizer(params, cfg.optim), None
    asked = cfg.optim.master_weights
    use = asked if asked is not None else dist.acc.device.type == "cuda"
    if not use:
        why = "optim.master_weights: false" if asked is False else "the default on CPU"
        write(
            f"precision: the {'/'.join(low)} weights are stepped in {'/'.join(low)} ({why}); updates below "
            "half their rounding step are lost (optim.master_weights: true keeps fp32 copies)"
        )
        return build_optimizer(params, cfg.optim), None
    write(f"precision: {'/'.join(low)} weights stepped through fp32 master copies (optim.master_weights)")
    masters = MasterWeights(params)
    return masters.attach(build_optimizer(masters.masters, cfg.optim)), masters.master_of
