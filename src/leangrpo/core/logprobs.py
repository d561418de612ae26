"""Token log-probs from hidden states and the lm_head, without a [batch, length, vocab] logits tensor.

A chunked log-softmax computes each row's log-prob (and, when asked, its entropy, both differentiable) a
chunk of rows at a time, forward and backward alike, with the architecture's logit scale and soft cap
applied as its model does. Tensors in, tensors out: the model-level code (Policy, micro-batches) is
train/policy.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Token rows per log-prob chunk: 256 × a 49k vocabulary is 50 MB of fp32 logits, and smaller chunks cost
# time (benchmarks/RESULTS.md, "Log-prob chunk size").
LOGPROB_CHUNK_SIZE = 256


@dataclass(frozen=True)
class LogitTransform:
    """What an architecture does to its lm_head's output: logits = cap · tanh(scale · (h @ W.T + b) / cap),
    without the tanh when `softcap` is None."""

    scale: float = 1.0
    softcap: float | None = None


# Architectures that scale their logits: model_type → (config field, power), logits × field ** power.
# MiniCPM3 divides the lm_head's input instead, which is the same for its bias-free lm_head.
_LOGIT_SCALES: dict[str, tuple[str, int]] = {
    **dict.fromkeys(["cohere", "cohere2", "cohere2_moe"], ("logit_scale", 1)),
    **dict.fromkeys(
        ["granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared"],
        ("logits_scaling", -1),
    ),
    "minicpm3": ("logits_scaling", -1),
    "hyperclovax": ("logits_scaling", 1),
    "falcon_h1": ("lm_head_multiplier", 1),
}
# Config fields of a final tanh soft cap: Gemma 2/3/4, VaultGemma, NanoChat; RecurrentGemma.
_SOFTCAP_FIELDS = ("final_logit_softcapping", "logits_soft_cap")


def logit_transform(config: Any) -> LogitTransform:
    """The logit scale and soft cap that the architecture of `config` applies after its lm_head."""
    field, power = _LOGIT_SCALES.get(config.model_type, (None, 1))
    scale = float(getattr(config, field)) ** power if field else 1.0
    softcap = next((getattr(config, f) for f in _SOFTCAP_FIELDS if getattr(config, f, None)), None)
    return LogitTransform(scale, float(softcap) if softcap else None)


def chunk_logits(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    head: LogitTransform,
    temperature: float,
    product: Callable[..., Tensor] = F.linear,
) -> Tensor:
    """fp32 logits of some rows, transformed as the architecture does and divided by the sampling
    temperature, in place (no second copy). `product`: F.linear, or `onednn.linear`."""
    logits = product(hidden, weight, bias).float()
    if head.scale != 1.0:
        logits.mul_(head.scale)
    if head.softcap is not None:
        logits.div_(head.softcap).tanh_().mul_(head.softcap)
    return logits.div_(temperature)


def _softmax_grad_(log_p: Tensor, g: Tensor, g_h: Tensor | None, entropy: Tensor) -> None:
    """In place on a chunk's log-probs [rows, V]: their gradient but for the target's one-hot term, -p · g
    for the log-probs' upstream gradient g, and -p · (g + g_h · (log p + H)) with the entropy's g_h too
    (dH/dx = -p · (log p + H)), which takes a second chunk-sized buffer (p)."""
    if g_h is None:
        log_p.exp_().mul_(-g)
        return
    p = log_p.exp()
    log_p.add_(entropy).mul_(g_h).add_(g).mul_(p).neg_()


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(f(h @ W.T + b) / T)[target] computed chunk by chunk, f the architecture's
    `LogitTransform`; backward recomputes each chunk.

    Only one chunk's logits ([chunk, vocab]) exists at any time, in the forward and in the backward,
    so memory does not grow with batch × length × vocab; every step on a chunk works in place.
    `with_entropy` also returns each row's entropy, at the cost of a second fp32 chunk buffer (in the
    backward too, only when a loss uses the entropy: the entropy bonus); otherwise the second output is
    empty. `product` computes the logits and the hidden states' gradient
    (F.linear or `onednn.linear`); the weight's gradient accumulates in place with addmm_.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head, temperature, chunk_size, with_entropy, product):  # noqa: D102
        logps = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        lses = torch.empty_like(logps)
        entropies = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = chunk_logits(hidden[rows], weight, bias, head, temperature, product)
            logps[rows] = logits.gather(-1, targets[rows, None]).squeeze(-1)
            top = logits.amax(dim=-1, keepdim=True)  # logsumexp, in place: log(sum(exp(x - max))) + max
            shifted = logits.sub_(top)
            if with_entropy:  # H = log Z - sum(e^s · s) / Z, with s = x - max and Z = sum(e^s)
                exp = shifted.exp()
                z = exp.sum(dim=-1)
                # e^s · s in place in e^s: a product of its own would be a third chunk-sized buffer
                entropies[rows] = z.log() - exp.mul_(shifted).sum(dim=-1) / z
                lses[rows] = z.log_().add_(top.squeeze(-1))
                del exp
            else:
                lses[rows] = shifted.exp_().sum(dim=-1).log_().add_(top.squeeze(-1))
            logps[rows] -= lses[rows]
            del logits, shifted  # before the next chunk's logits exist
        ctx.save_for_backward(hidden, weight, bias, targets, lses, entropies)
        ctx.head, ctx.temperature, ctx.chunk_size, ctx.product = head, temperature, chunk_size, product
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None
        if not with_entropy:
            ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, grad_entropies):  # noqa: D102
        hidden, weight, bias, targets, lses, entropies = ctx.saved_tensors
        head, temperature = ctx.head, ctx.temperature
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        # A soft cap's derivative needs a second [rows, vocab] buffer: half the rows keep the peak at a chunk.
        step = ctx.chunk_size if head.softcap is None else max(1, ctx.chunk_size // 2)
        grad_logps = lses.new_zeros(lses.shape) if grad_logps is None else grad_logps
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            g = grad_logps[rows, None].float()
            # d logp[target] / d logits = onehot(target) - softmax(logits), then the chain rule through
            # the temperature, the scale and the soft cap: d(cap · tanh(x / cap)) / dx = 1 - tanh².
            grad_logits = chunk_logits(hidden[rows], weight, bias, head, temperature, ctx.product)
            slope = None
            if head.softcap is not None:
                slope = (grad_logits * (temperature / head.softcap)).square_().neg_().add_(1)
            g_h = None if grad_entropies is None else grad_entropies[rows, None].float()
            _softmax_grad_(grad_logits.sub_(lses[rows, None]), g, g_h, entropies[rows, None])
            grad_logits.scatter_add_(-1, targets[rows, None], g).div_(temperature)
            if head.scale != 1.0:
                grad_logits.mul_(head.scale)
            if slope is not None:
                grad_logits.mul_(slope)
                del slope
            if want_hidden:
                grad_hidden[rows] = ctx.product(grad_logits.to(hidden.dtype), weight.t())  # grad @ W
            if want_weight:
                grad_weight.addmm_(grad_logits.T, hidden[rows].float())
            if want_bias:
                grad_bias += grad_logits.sum(dim=0)
            del grad_logits  # before the next chunk's logits exist
        if want_weight:
            grad_weight = grad_weight.to(weight.dtype)
        if want_bias:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = LOGPROB_CHUNK_SIZE,
    with_entropy: bool = False,
    bias: Tensor | None = None,
    head: LogitTransform = LogitTransform(),
    product: Callable[..., Tensor] = F.linear,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probs of `targets` [B, T] from hidden states [B, T, H] and the lm_head weight [V, H]
    (and bias [V]), with the architecture's logit transform `head`, the products computed by `product`
    (F.linear, or `onednn.linear`).

    Equal to `log_softmax(head(hidden @ weight.T + bias) / temperature).gather(targets)` without ever
    holding the [B, T, V] logits. Returned in float32; `with_entropy`: with the entropy of each
    position's distribution [B, T] (differentiable too), as `(logps, entropies)`.
    """
    flat, entropies = _ChunkedTokenLogprobs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        bias,
        targets.reshape(-1),
        head,
        temperature,
        chunk_size,
        with_entropy,
        product,
    )
    if with_entropy:
        return flat.view(targets.shape), entropies.view(targets.shape)
    return flat.view(targets.shape)


def head_product(lm_head: nn.Module) -> Callable[..., Tensor]:
    """The product (x, weight, bias) the LM head computes its logits with: its own `product()` where it
    has one (leangrpo.cpu's oneDNN Linear), else F.linear. The chunked path must round as the head does."""
    own = getattr(lm_head, "product", None)
    return own() if callable(own) else F.linear
