"""float32 products on CPU through oneDNN instead of torch's BLAS, for the CPUs where that BLAS is slow.

torch's x86 wheels multiply float32 matrices with MKL, which on some AMD CPUs leaves their AVX-512 units
idle; oneDNN (also inside torch) does not, and runs the training step's products about twice as fast on
a Zen 5 EPYC, though no faster on a Zen 4 (benchmarks/matmul_rates.py; benchmarks/RESULTS.md).
`use_onednn` turns a model's Linears into `Linear`, whose forward and backward products both run in
oneDNN; the chunked log-probs use `linear` for the LM head. `preferred` decides what `cpu.matmul: auto`
does, by a one-time measurement.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leangrpo.models.load import cache_root


def available() -> bool:
    """Whether this torch build has oneDNN's Linear product."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


FASTER = 1.5
"""`auto` takes oneDNN only when it multiplies at least this much faster than torch's BLAS: where the two
are close the step takes as long either way (benchmarks/RESULTS.md, "vs TRL on a Zen 4 EPYC"),
and the margin keeps noise from flipping the choice."""


def preferred() -> bool:
    """`cpu.matmul: auto`: oneDNN where it measured clearly faster than torch's BLAS on this CPU."""
    return available() and measured_speedup() >= FASTER


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name, with its family and model numbers where Linux gives them (/proc/cpuinfo):
    virtual machines often name a whole line alike ("AMD EPYC" for Zen 4 and Zen 5), and which products
    are fast differs."""
    try:
        info = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return platform.processor() or "CPU unknown"
    fields: dict[str, str] = {}
    for line in info.splitlines():  # the first processor's fields
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name", "CPU unknown")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']}, model {fields['model']})"
    return name


def measured_speedup() -> float:
    """oneDNN's rate over torch's BLAS on the training step's products, measured once per CPU model,
    torch version and thread count (about 0.2 s) and kept in $LEANGRPO_CACHE/cpu_matmul.json; delete
    that file to measure again. A cache that cannot be read or written is measured past, not fatal."""
    path = cache_root() / "cpu_matmul.json"
    key = f"{cpu_name()} | torch {torch.__version__} | {torch.get_num_threads()} threads"
    known = _read_cache(path)
    if isinstance(known.get(key), float | int):
        return float(known[key])
    speedup = round(_measure(), 3)  # as the cache keeps it: the first run says what later ones read
    written = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        written.write_text(json.dumps({**known, key: speedup}, indent=1))
        os.replace(written, path)  # whole, even with two runs starting at once
    except OSError:  # a cache that cannot be written is measured again next time
        with suppress(OSError):
            written.unlink(missing_ok=True)
    return speedup


def _read_cache(path: Path) -> dict[str, Any]:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _measure(rows: int = 256, repeats: int = 5) -> float:
    """Best-of-`repeats` time of the forward and both backward products of a 576 → 1536 Linear over
    `rows` positions (SmolLM2-135M's MLP), torch's BLAS against oneDNN, the two interleaved."""
    generator = torch.Generator().manual_seed(0)
    x, w, g = (torch.randn(*shape, generator=generator) for shape in ((rows, 576), (1536, 576), (rows, 1536)))

    def blas() -> tuple[Tensor, ...]:
        return x @ w.T, g @ w, g.T @ x

    def ours() -> tuple[Tensor, ...]:
        return linear(x, w), linear(g, w.t()), linear(g.t(), x.t())

    best = {blas: float("inf"), ours: float("inf")}
    for _ in range(repeats + 1):  # the first round warms both up
        for fn in best:
            start = time.perf_counter()
            fn()
            best[fn] = min(best[fn], time.perf_counter() - start)
    return best[blas] / best[ours]


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
