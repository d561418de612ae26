"""Completion-token log-probs of the policy: the one owner of the training forward.

The decoder runs over prompt + completion and only the completion positions' hidden states reach the
lm_head, through a chunked log-softmax that never holds [batch, length, vocab] logits. Micro-batches are
cropped to their real extent, and the completions of one prompt can share a single copy of it
(`shared_prompt.py`'s layout). The reference, old-policy and update passes and the SFT cold start all
come through here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from leangrpo.core import shared_prompt
from leangrpo.core.errors import UserError
from leangrpo.models.load import is_peft, peft_base

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from leangrpo.engines.rollout import RolloutBatch

# Token rows per log-prob chunk: 256 × a 49k vocabulary is 50 MB of fp32 logits, and smaller chunks cost
# time (benchmarks/RESULTS.md, "Log-prob chunk size").
LOGPROB_CHUNK_SIZE = 256


class LayoutError(UserError, RuntimeError):
    """The model cannot run the shared-prompt layout it was asked to."""


class HeadError(UserError, RuntimeError):
    """The model computes its logits in a way the chunked log-prob path does not reproduce."""


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


def _chunk_logits(
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


class _ChunkedTokenLogprobs(torch.autograd.Function):
    """log_softmax(f(h @ W.T + b) / T)[target] computed chunk by chunk, f the architecture's
    `LogitTransform`; backward recomputes each chunk.

    Only one chunk's logits ([chunk, vocab]) exists at any time, in the forward and in the backward,
    so memory does not grow with batch × length × vocab; every step on a chunk works in place.
    `with_entropy` also returns each row's entropy (no gradient), at the cost of a second fp32 chunk buffer;
    otherwise the second output is empty. `product` computes the logits and the hidden states' gradient
    (F.linear or `onednn.linear`); the weight's gradient accumulates in place with addmm_.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head, temperature, chunk_size, with_entropy, product):  # noqa: D102
        logps = torch.empty(hidden.shape[0], device=hidden.device, dtype=torch.float32)
        lses = torch.empty_like(logps)
        entropies = torch.empty_like(logps) if with_entropy else logps.new_empty(0)
        for start in range(0, hidden.shape[0], chunk_size):
            rows = slice(start, start + chunk_size)
            logits = _chunk_logits(hidden[rows], weight, bias, head, temperature, product)
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
        ctx.save_for_backward(hidden, weight, bias, targets, lses)
        ctx.head, ctx.temperature, ctx.chunk_size, ctx.product = head, temperature, chunk_size, product
        ctx.mark_non_differentiable(entropies)
        return logps, entropies

    @staticmethod
    def backward(ctx, grad_logps, _grad_entropies):  # noqa: D102
        hidden, weight, bias, targets, lses = ctx.saved_tensors
        head, temperature = ctx.head, ctx.temperature
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        # A soft cap's derivative needs a second [rows, vocab] buffer: half the rows keep the peak at a chunk.
        step = ctx.chunk_size if head.softcap is None else max(1, ctx.chunk_size // 2)
        for start in range(0, hidden.shape[0], step):
            rows = slice(start, start + step)
            g = grad_logps[rows, None].float()
            # d logp[target] / d logits = onehot(target) - softmax(logits), then the chain rule through
            # the temperature, the scale and the soft cap: d(cap · tanh(x / cap)) / dx = 1 - tanh².
            grad_logits = _chunk_logits(hidden[rows], weight, bias, head, temperature, ctx.product)
            slope = None
            if head.softcap is not None:
                slope = (grad_logits * (temperature / head.softcap)).square_().neg_().add_(1)
            grad_logits.sub_(lses[rows, None]).exp_().mul_(-g)
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
    position's distribution [B, T] (no gradient), as `(logps, entropies)`.
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


def check_head(model: PreTrainedModel, head: LogitTransform) -> None:
    """Refuse, in one line, a model whose own logits are not the lm_head's output under `head`: the
    log-probs trained on would then belong to another distribution than the one generate() samples.

    Compares the model's logits on a few tokens with the chunked path's, to within rounding of the
    model's dtype (the transform runs in float32 here, in the model's dtype there), both products from
    the same library (another one rounds differently: beyond that bound on SmolLM2's logits)."""
    ids = torch.arange(1, 9, device=model.device)[None] % model.config.get_text_config().vocab_size
    lm_head = model.get_output_embeddings()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            theirs = model(input_ids=ids).logits[0].float()
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state[0]
            bias = getattr(lm_head, "bias", None)
            ours = _chunk_logits(hidden, lm_head.weight, bias, head, 1.0, head_product(lm_head))
    finally:
        model.train(was_training)
    tolerance = 8 * torch.finfo(lm_head.weight.dtype).eps * float(theirs.abs().max())
    if ours.shape != theirs.shape or float((ours - theirs).abs().max()) > tolerance:
        raise HeadError(
            f"{type(model).__name__} transforms its logits in a way leangrpo's log-probs do not reproduce, "
            "so it cannot be trained (supported: a linear lm_head with optional bias, then the logit "
            "scale of Cohere, Granite, MiniCPM3, HyperCLOVAX, Falcon-H1 or the soft cap of Gemma 2-4 and "
            "RecurrentGemma)"
        )


def _base(lm: nn.Module) -> PreTrainedModel:
    """The transformers model under a peft wrapper (or the model itself)."""
    return peft_base(lm) if is_peft(lm) else cast("PreTrainedModel", lm)


class Policy(nn.Module):
    """Wraps a causal LM so that forward returns the log-probs of the completion tokens only.

    Wrapping (rather than calling the decoder from outside) keeps the forward inside accelerate/DDP, so
    gradients synchronise across processes. `share_prompt`: the model's attention is switched to the
    function that also runs the shared-prompt layout (`shared_prompt.use`), so forward takes group > 1.
    """

    def __init__(
        self,
        lm: PreTrainedModel,
        temperature: float = 1.0,
        chunk_size: int = LOGPROB_CHUNK_SIZE,
        share_prompt: bool = False,
    ):
        super().__init__()
        self.lm, self.temperature, self.chunk_size = lm, temperature, chunk_size
        self.head = logit_transform(self.base.config)
        check_head(self.base, self.head)
        if share_prompt:
            shared_prompt.use(_base(lm))

    @property
    def base(self) -> PreTrainedModel:
        return _base(self.lm)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        num_completion_tokens: int,
        temperature: float | None = None,
        group: int = 1,
        with_entropy: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Log-probs of the completion tokens, each given everything before it, at the sampling
        temperature unless `temperature` is given (1.0 for supervised targets); `with_entropy`: and the
        entropy at each of those positions.

        group = 1: `input_ids` [B, P + C] are prompt + completion rows, `attention_mask` their mask;
        returns [B, C]. group > 1: the shared-prompt layout of `shared_prompt.pack` ([R, P + group·C])
        with the [R, P] prompt mask; returns [R·group, C].
        """
        C, decoder = num_completion_tokens, self.base.get_decoder()
        if group == 1:
            # Positions count real tokens only, exactly as generate() numbers a left-padded prompt.
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            hidden = decoder(
                input_ids=input_ids[:, :-1],
                attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, :-1],
                use_cache=False,
            ).last_hidden_state[:, -C:]
            targets = input_ids[:, -C:]
        else:
            position_ids, predictors = shared_prompt.positions(attention_mask, C, group)
            layout = shared_prompt.Layout(group)
            hidden = decoder(
                input_ids=input_ids,
                attention_mask=attention_mask.bool()[:, None, None, :],
                position_ids=position_ids,
                use_cache=False,
                **{shared_prompt.KWARG: layout},
            ).last_hidden_state
            if not layout.used:
                raise LayoutError(
                    f"{type(self.base).__name__} does not route attention through transformers' attention "
                    "interface, which grpo.share_prompt needs; set grpo.share_prompt: false"
                )
            hidden = hidden.reshape(-1, hidden.shape[-1])[predictors]
            width = attention_mask.shape[1]
            targets = input_ids[:, width:].reshape(-1, C)
        lm_head = self.base.get_output_embeddings()
        temperature = self.temperature if temperature is None else temperature
        bias = getattr(lm_head, "bias", None)
        return token_logprobs(
            hidden,
            lm_head.weight,
            targets,
            temperature,
            self.chunk_size,
            with_entropy,
            bias,
            self.head,
            head_product(lm_head),
        )


def shared_prompt_group(model: nn.Module, micro_batch: int, num_generations: int) -> tuple[int, str | None]:
    """Completions per decoder row that share one copy of their prompt: as many of a group's completions
    as every micro-batch holds together (1 = no sharing), and why not when the model cannot."""
    reason = shared_prompt.unsupported_reason(_base(model).config)
    return (1, reason) if reason else (math.gcd(micro_batch, num_generations), None)


def micro_batch_logprobs(
    policy: nn.Module,
    rollout: RolloutBatch,
    rows: slice,
    temperature: float | None = None,
    group: int = 1,
    with_entropy: bool = False,
) -> tuple[Tensor, ...]:
    """Log-probs of one micro-batch, cropped to its own real extent (no all-pad columns), and its mask;
    `with_entropy`: and the per-token entropy, as a third item.

    group > 1: every `group` consecutive rows share a prompt, which the decoder then reads once."""
    prompt_mask, completion_mask = rollout.prompt_mask[rows], rollout.completion_mask[rows]
    first_prompt_col = int(prompt_mask.any(dim=0).int().argmax())
    num_completion = int(completion_mask.sum(dim=1).max().clamp(min=1))
    prompt_ids, prompt_mask = rollout.prompt_ids[rows, first_prompt_col:], prompt_mask[:, first_prompt_col:]
    completion_ids = rollout.completion_ids[rows, :num_completion]
    completion_mask = completion_mask[:, :num_completion]
    if group > 1:
        input_ids = shared_prompt.pack(prompt_ids, completion_ids, group)
        attention_mask = prompt_mask[::group]
    else:
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    if with_entropy:
        logp, entropy = policy(
            input_ids, attention_mask, num_completion, temperature, group, with_entropy=True
        )
        return logp, completion_mask, entropy
    return policy(input_ids, attention_mask, num_completion, temperature, group), completion_mask


def batch_logprobs(policy: nn.Module, rollout: RolloutBatch, micro_batch: int, group: int = 1) -> Tensor:
    """Log-probs [N, C] for a whole rollout without gradients (reference / old policy), padded with 0."""
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    with torch.inference_mode():
        for start in range(0, len(rollout), micro_batch):
            rows = slice(start, start + micro_batch)
            logp, _ = micro_batch_logprobs(policy, rollout, rows, group=group)
            out[rows, : logp.shape[1]] = logp
    return out
