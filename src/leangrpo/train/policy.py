"""Completion-token log-probs of the policy: the one owner of the training forward.

The decoder runs over prompt + completion and only the completion positions' hidden states reach the
lm_head, through core/logprobs.py's chunked log-softmax that never holds [batch, length, vocab] logits.
Micro-batches are cropped to their real extent, the completions of one prompt can share a single
copy of it (`shared_prompt.py`'s layout), and a micro-batch can be packed into one sequence of its real
tokens, no padding at all (`shared_prompt.packed`, grpo.padding_free). The reference, old-policy and
update passes and the SFT cold start (padded) all come through here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
from torch import Tensor, nn

from leangrpo.core import shared_prompt
from leangrpo.core.errors import TrainingError, UserError
from leangrpo.core.logprobs import (
    LOGPROB_CHUNK_SIZE,
    LogitTransform,
    chunk_logits,
    head_product,
    logit_transform,
    token_logprobs,
)
from leangrpo.engines.vision import TOKEN_TYPE_FIELDS
from leangrpo.models import neftune
from leangrpo.models.load import is_peft, peft_base

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from leangrpo.config.schema import GRPOSection
    from leangrpo.engines.types import RolloutBatch


class LayoutError(UserError, RuntimeError):
    """The model cannot run the shared-prompt layout it was asked to."""


class HeadError(UserError, RuntimeError):
    """The model computes its logits in a way the chunked log-prob path does not reproduce."""


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
            ours = chunk_logits(hidden, lm_head.weight, bias, head, 1.0, head_product(lm_head))
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


BalancingLoss = Callable[[tuple[Tensor, ...], Tensor], Tensor]
"""A Mixture-of-Experts model's load-balancing loss of its router logits over the tokens of a mask."""


def _balancing_loss(model: PreTrainedModel) -> BalancingLoss | None:
    """The load-balancing loss TRL's fused forward computes for every MoE family (transformers' Mixtral
    function, the text config's expert counts); None where the config does not give them."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    config = model.config.get_text_config()
    experts, top_k = getattr(config, "num_experts", None), getattr(config, "num_experts_per_tok", None)
    if experts is None or top_k is None:
        return None

    def loss(router_logits: tuple[Tensor, ...], mask: Tensor) -> Tensor:
        return cast("Tensor", load_balancing_loss_func(router_logits, experts, top_k, mask))  # type: ignore[arg-type]

    return loss


def router_aux_loss_coef(model: nn.Module, asked: float | None) -> float:
    """TRL's weight of a Mixture-of-Experts model's load-balancing loss in the GRPO loss: `asked`, or
    (None) the architecture's own, its config's router_aux_loss_coef; 0 (off) for a model that returns no
    router logits, where a nonzero `asked` is refused in one line, as TRL refuses it."""
    base = _base(model)
    config = base.config.get_text_config()
    if not hasattr(config, "output_router_logits"):
        if asked:
            raise TrainingError(
                f"grpo.router_aux_loss_coef is {asked} but {type(base).__name__} is not a Mixture-of-Experts "
                "model that returns its router logits, so there is no auxiliary loss to weight"
            )
        return 0.0
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) if asked is None else asked)
    if coef and _balancing_loss(base) is None:
        raise TrainingError(
            f"{type(base).__name__}: leangrpo cannot compute its router's load-balancing loss (weighted "
            f"{coef}, grpo.router_aux_loss_coef); set grpo.router_aux_loss_coef: 0 to train without it"
        )
    return coef


class Policy(nn.Module):
    """Wraps a causal LM so that forward returns the log-probs of the completion tokens only.

    Wrapping (rather than calling the decoder from outside) keeps the forward inside accelerate/DDP, so
    gradients synchronise across processes. `share_prompt`: the model's attention is switched to the
    function that also runs the shared-prompt and packed layouts (`shared_prompt.use`), so forward takes
    group > 1 and `packing`.
    `placed`: the model is where it will run, so `prepare` runs now; False: the trainer's placement
    (`distributed`) moves or shards it first and then calls `prepare`, so that `check_head`'s forward runs
    there (the kernels training uses, an attention such as flash-attention that has no CPU version), not
    on the CPU the model was loaded on.
    `router_aux_coef` (`router_aux_loss_coef`), nonzero: each forward with gradients (padded layout) keeps
    the Mixture-of-Experts load-balancing loss of its tokens in `aux_loss`, for the update to add.
    """

    def __init__(
        self,
        lm: PreTrainedModel,
        temperature: float = 1.0,
        chunk_size: int = LOGPROB_CHUNK_SIZE,
        share_prompt: bool = False,
        placed: bool = True,
        router_aux_coef: float = 0.0,
    ):
        super().__init__()
        self.lm, self.temperature, self.chunk_size = lm, temperature, chunk_size
        self.share_prompt, self.router_aux_coef = share_prompt, router_aux_coef
        self.balancing_loss = _balancing_loss(self.base) if router_aux_coef else None
        self.aux_loss: Tensor | None = None
        self.head = logit_transform(self.base.config)
        if placed:
            self.prepare()

    def prepare(self) -> None:
        """Check the head where the model runs, then switch its attention for the shared-prompt layout."""
        check_head(self.base, self.head)
        if self.share_prompt:
            shared_prompt.use(self.base)

    @property
    def base(self) -> PreTrainedModel:
        return _base(self.lm)

    def forward(
        self,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        num_completion_tokens: int,
        temperature: float | None = None,
        group: int = 1,
        with_entropy: bool = False,
        packing: shared_prompt.Packing | None = None,
        vision: dict[str, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Log-probs of the completion tokens, each given everything before it, at the sampling
        temperature unless `temperature` is given (1.0 for supervised targets); `with_entropy`: and the
        entropy at each of those positions.

        group = 1: `input_ids` [B, P + C] are prompt + completion rows, `attention_mask` their mask;
        returns [B, C]. group > 1: the shared-prompt layout of `shared_prompt.pack` ([R, P + group·C])
        with the [R, P] prompt mask; returns [R·group, C]. `packing`: the packed layout
        (`shared_prompt.packed`), which holds the tokens (`input_ids` and `attention_mask` unused);
        returns [N, C], 0 where a completion has ended. `vision`: the rows' pixel inputs (image prompts,
        group = 1 only), for a vision-language model's whole forward.
        """
        if vision is not None:
            assert input_ids is not None and attention_mask is not None and group == 1 and packing is None
            hidden, targets = self._vision_states(input_ids, attention_mask, num_completion_tokens, vision)
        else:
            hidden, targets = self._completion_states(
                input_ids, attention_mask, num_completion_tokens, group, packing
            )
        lm_head = self.base.get_output_embeddings()
        temperature = self.temperature if temperature is None else temperature
        bias = getattr(lm_head, "bias", None)
        out = token_logprobs(
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
        if packing is None:
            return out
        if isinstance(out, tuple):
            return _on_grid(out[0], packing.real), _on_grid(out[1], packing.real)
        return _on_grid(out, packing.real)

    def _completion_states(
        self,
        input_ids: Tensor | None,
        attention_mask: Tensor | None,
        C: int,
        group: int,
        packing: shared_prompt.Packing | None,
    ) -> tuple[Tensor, Tensor]:
        """The hidden states that predict the completion tokens, and those tokens (forward's layouts)."""
        if packing is not None:
            length = packing.input_ids.shape[1]
            placeholder = torch.ones(1, 1, 1, length, dtype=torch.bool, device=packing.input_ids.device)
            hidden = self._laid_out(packing.input_ids, placeholder, packing.position_ids, packing)
            return hidden[0, packing.predictors], packing.targets
        assert input_ids is not None and attention_mask is not None
        if group == 1:
            # Positions count real tokens only, exactly as generate() numbers a left-padded prompt.
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            hidden = self._decoded(
                self.base.get_decoder(), input_ids, attention_mask, C, {"position_ids": position_ids}
            )
            return hidden, input_ids[:, -C:]
        position_ids, predictors = shared_prompt.positions(attention_mask, C, group)
        mask = attention_mask.bool()[:, None, None, :]
        hidden = self._laid_out(input_ids, mask, position_ids, shared_prompt.Layout(group))
        hidden = hidden.reshape(-1, hidden.shape[-1])[predictors]
        return hidden, input_ids[:, attention_mask.shape[1] :].reshape(-1, C)

    def _vision_states(
        self, input_ids: Tensor, attention_mask: Tensor, C: int, vision: dict[str, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """`_completion_states` of image prompts: the vision-language model's own inner model (vision tower,
        projector, the decoder given the image features) instead of its text decoder alone. Positions as
        generate() numbers them: counting real tokens, or the model's own (Qwen-VL's 3-D rope, from the ids,
        the mask and the image grid: no position_ids given)."""
        per_token = {k: v for k, v in vision.items() if k in TOKEN_TYPE_FIELDS}
        if not per_token:
            per_token["position_ids"] = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        inputs = {k: v for k, v in vision.items() if k not in TOKEN_TYPE_FIELDS}
        hidden = self._decoded(self.base.model, input_ids, attention_mask, C, per_token, **inputs)
        return hidden, input_ids[:, -C:]

    def _decoded(
        self,
        decoder: Callable[..., Any],
        input_ids: Tensor,
        attention_mask: Tensor,
        C: int,
        per_token: dict[str, Tensor],
        **inputs: Tensor,
    ) -> Tensor:
        """`decoder`'s hidden states that predict the last C tokens (`per_token`: [B, L] inputs cut as
        the ids are), from a pass over all but the last token. With the router's auxiliary loss on and
        gradients on (the update): over every token, the model's load-balancing loss of the real ones kept
        in `aux_loss`, as the model's own forward computes it and TRL adds it. With NEFTune: over every
        token too, as TRL's forward, whose width the noise scales with."""
        balancing_loss = self.balancing_loss if torch.is_grad_enabled() else None
        routed = balancing_loss is not None
        n = input_ids.shape[1] - (0 if routed or neftune.noised(self.base) else 1)
        out = decoder(
            input_ids=input_ids[:, :n],
            attention_mask=attention_mask[:, :n],
            use_cache=False,
            **{k: v[:, :n] for k, v in per_token.items()},
            **inputs,
            **({"output_router_logits": True} if routed else {}),
        )
        if balancing_loss is not None:
            self.aux_loss = balancing_loss(out.router_logits, attention_mask)
        end = input_ids.shape[1] - 1
        return cast("Tensor", out.last_hidden_state[:, end - C : end])

    def _laid_out(
        self,
        input_ids: Tensor,
        mask: Tensor,
        position_ids: Tensor,
        layout: shared_prompt.Layout | shared_prompt.Packing,
    ) -> Tensor:
        """The decoder's last hidden states under a `shared_prompt` layout, refused in one line when the
        model's attention never ran it."""
        hidden = self.base.get_decoder()(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=position_ids,
            use_cache=False,
            **{shared_prompt.KWARG: layout},
        ).last_hidden_state
        if not layout.used:
            option = "padding_free" if isinstance(layout, shared_prompt.Packing) else "share_prompt"
            raise LayoutError(
                f"{type(self.base).__name__} does not route attention through transformers' attention "
                f"interface, which grpo.{option} needs; set grpo.{option}: false"
            )
        return hidden


def _on_grid(values: Tensor, real: Tensor) -> Tensor:
    """A packed pass's per-token values back on the [N, C] completion grid, 0 where a completion ended."""
    return torch.zeros(real.shape, device=real.device).masked_scatter(real, values)


def _layouts_unsupported(model: nn.Module, g: GRPOSection) -> str | None:
    """Why the shared-prompt and packed layouts cannot run: the model's attention, the router's
    load-balancing loss, which routes each completion's own copy of its prompt (TRL's padded rows), or
    NEFTune, which draws each copy's noise apart."""
    if router_aux_loss_coef(model, g.router_aux_loss_coef):
        return "the MoE router's load-balancing loss (router_aux_loss_coef) counts each completion's prompt"
    if g.neftune_noise_alpha is not None:
        return (
            "neftune_noise_alpha noises each completion's own prompt copy, as TRL does (HF generation "
            "prefills each completion's prompt too)"
        )
    return shared_prompt.unsupported_reason(_base(model).config)


def shared_prompt_group(model: nn.Module, micro_batch: int, g: GRPOSection) -> tuple[int, str | None]:
    """Completions per decoder row that share one copy of their prompt: as many of a group's completions
    as every micro-batch holds together (1 = no sharing), and why not when the model cannot."""
    reason = _layouts_unsupported(model, g)
    return (1, reason) if reason else (math.gcd(micro_batch, g.num_generations), None)


class Extent(NamedTuple):
    """A micro-batch's real extent: its first prompt column holding a token, its longest completion (at
    least 1), and each row's prompt and completion token counts (what the packed layout is built from)."""

    first_prompt_col: int
    num_completion: int
    prompt_len: list[int]
    completion_len: list[int]


def micro_batch_extents(
    prompt_mask: Tensor, completion_mask: Tensor, micro_batch: int, trl_width: bool = False
) -> list[Extent]:
    """Each micro-batch's `Extent`, in one host sync for the whole rollout (one per micro-batch would
    stall the device as often). `trl_width`: each cropped to the whole rollout's extent instead, the
    width TRL's forwards see (its generation batch's longest prompt and completion), which NEFTune's
    noise scales with (`trl_width`)."""
    n = len(prompt_mask)
    chunks = math.ceil(n / micro_batch)
    pad = chunks * micro_batch - n
    prompt = nn.functional.pad(prompt_mask.bool(), (0, 0, 0, pad))
    first = prompt.reshape(chunks, micro_batch, -1).any(dim=1).int().argmax(dim=1)
    prompt_len, completion_len = prompt_mask.sum(dim=1), completion_mask.sum(dim=1)
    longest = (
        nn.functional.pad(completion_len, (0, pad)).reshape(chunks, micro_batch).amax(dim=1).clamp(min=1)
    )
    if trl_width:
        first, longest = first.min().expand(chunks), longest.max().expand(chunks)
    values = torch.cat([t.to(torch.long) for t in (first, longest, prompt_len, completion_len)]).tolist()
    firsts, longests, prompts, completions = (
        values[:chunks],
        values[chunks : 2 * chunks],
        values[2 * chunks :][:n],
        values[2 * chunks + n :],
    )
    return [
        Extent(
            firsts[i],
            longests[i],
            prompts[i * micro_batch :][:micro_batch],
            completions[i * micro_batch :][:micro_batch],
        )
        for i in range(chunks)
    ]


def trl_width(g: GRPOSection) -> bool:
    """Whether the passes run as wide as TRL's (`micro_batch_extents`): with NEFTune, whose noise is
    ±alpha/sqrt(L·d), L the forward's width."""
    return g.neftune_noise_alpha is not None


def padding_free(model: nn.Module, g: GRPOSection) -> tuple[bool, str | None]:
    """Whether the log-prob passes run packed (`grpo.padding_free` asked), and why not when the model
    cannot (the packed layout's attention is the shared-prompt function's)."""
    reason = _layouts_unsupported(model, g) if g.padding_free else None
    return g.padding_free and reason is None, reason


def micro_batch_logprobs(
    policy: nn.Module,
    rollout: RolloutBatch,
    rows: slice,
    temperature: float | None = None,
    group: int = 1,
    with_entropy: bool = False,
    extent: Extent | None = None,
    packed: bool = False,
) -> tuple[Tensor, ...]:
    """Log-probs of one micro-batch, cropped to its own real extent (no all-pad columns), and its mask;
    `with_entropy`: and the per-token entropy, as a third item. `extent`: that extent, from
    `micro_batch_extents` (else read here, which waits for the device).

    group > 1: every `group` consecutive rows share a prompt, which the decoder then reads once.
    `packed`: the decoder reads the real tokens only (`shared_prompt.packed`), no padding at all."""
    prompt_mask, completion_mask = rollout.prompt_mask[rows], rollout.completion_mask[rows]
    if extent is None:
        [extent] = micro_batch_extents(prompt_mask, completion_mask, len(prompt_mask))
    first_prompt_col, num_completion = extent.first_prompt_col, extent.num_completion
    prompt_ids, prompt_mask = rollout.prompt_ids[rows, first_prompt_col:], prompt_mask[:, first_prompt_col:]
    completion_ids = rollout.completion_ids[rows, :num_completion]
    completion_mask = completion_mask[:, :num_completion]
    input_ids: Tensor | None
    attention_mask: Tensor | None
    packing = None
    if packed:
        prompt_len = extent.prompt_len[::group]
        packing = shared_prompt.packed(prompt_ids, completion_ids, prompt_len, extent.completion_len, group)
        input_ids = attention_mask = None
    elif group > 1:
        input_ids = shared_prompt.pack(prompt_ids, completion_ids, group)
        attention_mask = prompt_mask[::group]
    else:
        input_ids = torch.cat([prompt_ids, completion_ids], 1)
        attention_mask = torch.cat([prompt_mask, completion_mask], 1)
    vision = None
    if rollout.vision is not None and input_ids is not None:
        vision = rollout.vision.collate(rows, input_ids, prompt_ids.shape[1])
    assert rollout.vision is None or (group == 1 and not packed), "image prompts run neither layout"
    out = policy(
        input_ids,
        attention_mask,
        num_completion,
        temperature,
        group,
        with_entropy,
        packing=packing,
        vision=vision,
    )
    if with_entropy:
        logp, entropy = out
        return logp, completion_mask, entropy
    return out, completion_mask


def batch_logprobs(
    policy: nn.Module,
    rollout: RolloutBatch,
    micro_batch: int,
    group: int = 1,
    packed: bool = False,
    trl_width: bool = False,
) -> Tensor:
    """Log-probs [N, C] for a whole rollout without gradients (reference / old policy), padded with 0;
    `trl_width`: as `micro_batch_extents`."""
    out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    extents = micro_batch_extents(rollout.prompt_mask, rollout.completion_mask, micro_batch, trl_width)
    with torch.inference_mode():
        for start, extent in zip(range(0, len(rollout), micro_batch), extents, strict=True):
            rows = slice(start, start + micro_batch)
            logp, _ = micro_batch_logprobs(policy, rollout, rows, group=group, extent=extent, packed=packed)
            out[rows, : logp.shape[1]] = logp
    return out
