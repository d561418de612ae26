"""float32 products on CPU through oneDNN instead of torch's BLAS, for the CPUs where that BLAS is slow.

torch's x86 wheels multiply float32 matrices with MKL, which on an AMD CPU does not use its AVX-512
instructions; oneDNN (also inside torch) does, and runs the training step's products faster there
(benchmarks/matmul_rates.py; benchmarks/RESULTS.md, "vs TRL on an AMD EPYC"). `use_onednn` turns a
model's Linears into `Linear`, whose forward and backward products both run in oneDNN; the chunked
log-probs use `linear` for the LM head. `preferred` decides what `model.cpu_matmul: auto` does.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def available() -> bool:
    """Whether this torch build has oneDNN's Linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def preferred(cpuinfo: str | None = None) -> bool:
    """`model.cpu_matmul: auto`: oneDNN on AMD CPUs with AVX-512, where it beats MKL (benchmarks/RESULTS.md),
    torch's own BLAS elsewhere, where the two were not compared (MKL is Intel's own, tuned for its CPUs)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", cpuinfo, re.MULTILINE)
    avx512 = re.search(r"^flags\s*:.*\bavx512f\b", cpuinfo, re.MULTILINE)
    return bool(vendor and vendor.group(1) == "AuthenticAMD" and avx512) and available()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight.T + bias in oneDNN, without autograd; `weight` plain (any strides) or packed by
    `torch.ops.mkldnn._reorder_linear_weight`."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _Linear(torch.autograd.Function):
    """F.linear with the forward and both backward products in oneDNN. It saves what F.linear's
    autograd saves (the input and the weight)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        return linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        want_x, want_weight, want_bias = ctx.needs_input_grad
        rows = grad.reshape(-1, grad.shape[-1])
        grad_x = linear(grad, weight.t()) if want_x else None  # grad @ W
        grad_weight = linear(rows.t(), x.reshape(-1, x.shape[-1]).t()) if want_weight else None  # grad.T @ x
        grad_bias = rows.sum(0) if want_bias else None
        return grad_x, grad_weight, grad_bias


def _plain_fp32_cpu(t: Tensor | None) -> bool:
    return t is None or (
        type(t) in (Tensor, nn.Parameter) and t.device.type == "cpu" and t.dtype == torch.float32
    )


class Linear(nn.Linear):
    """nn.Linear whose float32 CPU products run in oneDNN (`_Linear`); anything else (another dtype or
    device, a sharded or quantized tensor) takes nn.Linear's own path."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: D102
        if input.numel() and all(_plain_fp32_cpu(t) for t in (input, self.weight, self.bias)):
            return _Linear.apply(input, self.weight, self.bias)
        return super().forward(input)

    def product(self) -> Callable[..., Tensor]:
        """The product (x, weight, bias) this layer computes with: `linear` over a float32 CPU weight,
        else F.linear. The chunked log-prob head (core/logprobs.py) uses the same, to round alike."""
        return linear if _plain_fp32_cpu(self.weight) else F.linear


def use_onednn(model: nn.Module) -> int:
    """Make every plain nn.Linear of `model` (peft's adapter Linears included, not bitsandbytes' or
    other subclasses) a `Linear`, in place: same parameters, hooks and state dict. Returns how many."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for module in linears:
        module.__class__ = Linear
    return len(linears)
