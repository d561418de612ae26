"""The shared-prompt layout: the completions of one prompt read a single copy of its tokens.

A micro-batch row becomes `[prompt | completion 1 | ... | completion g]`. An attention function lets
each completion see the prompt and its own earlier tokens only, so every log-prob equals the one from
running prompt + completion as a row of its own, but the prompt goes through the decoder once per row
instead of g times (forward, checkpoint recompute and backward alike). With GRPO's G completions per
prompt, that is most of the update's work when prompts are long against completions.

The attention function is registered under its own name (`ATTENTION`) and a model is switched to it
with `use`; calls without the layout keyword (generation, evaluation) go to transformers' own sdpa
function unchanged, so nothing changes for any other model in the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

ATTENTION = "leangrpo_shared_prompt"
KWARG = "shared_prompt_layout"


@dataclass
class Layout:
    """The layout keyword of one decoder call: completions per row, and whether attention ran it (a model
    whose layers bypass transformers' attention interface would silently ignore the keyword)."""

    group: int
    used: bool = False


def unsupported_reason(config: Any) -> str | None:
    """Why a model cannot use the shared-prompt layout, or None when it can."""
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", ATTENTION):
        return f"attn_implementation={impl!r} (needs 'sdpa')"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "the model uses sliding-window attention"
    if getattr(config, "attn_logit_softcapping", None):
        return "the model soft-caps attention logits"
    return None


def use(model: Any) -> None:
    """Switch a transformers model's attention to the shared-prompt function (registered once)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # ordinary calls get sdpa's masks
    model.set_attn_implementation(ATTENTION)


def pack(prompt_ids: Tensor, completion_ids: Tensor, group: int) -> Tensor:
    """[B, P] prompts (each repeated `group` times in a row) + [B, C] completions → [B/group, P + group·C]."""
    rows = prompt_ids.shape[0] // group
    return torch.cat([prompt_ids[::group], completion_ids.reshape(rows, -1)], dim=1)


def positions(prompt_mask: Tensor, num_completion: int, group: int) -> tuple[Tensor, Tensor]:
    """Position ids [R, P + group·C] of packed rows (each completion counts on from its prompt's real
    length, as generate() numbers it) and, for each of the R·group completions, the flat index into
    [R · (P + group·C)] of the hidden state that predicts each of its C tokens."""
    rows, width = prompt_mask.shape
    device = prompt_mask.device
    length = width + group * num_completion
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    steps = torch.arange(num_completion, device=device)
    completion_pos = prompt_mask.sum(-1, keepdim=True) + steps.repeat(group)
    position_ids = torch.cat([prompt_pos, completion_pos], dim=1)
    # Token j of completion i is predicted by token j-1 of the same completion; token 0 by the prompt's last.
    completion = torch.arange(rows * group, device=device)
    starts = (completion // group) * length + width + (completion % group) * num_completion
    predictors = (starts[:, None] + steps - 1).where(
        steps > 0, (completion // group)[:, None] * length + width - 1
    )
    return position_ids, predictors


def _attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' sdpa attention; with the layout keyword, the shared-prompt layout's (the mask is
    then the [R, 1, 1, P] bool of the prompt's real, not left-pad, tokens)."""
    layout: Layout | None = kwargs.pop(KWARG, None)
    if layout is None:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    layout.used = True
    out_prompt = _prompt_attention(module, query, key, value, attention_mask, **kwargs)
    out_completion = _completion_attention(module, query, key, value, attention_mask, layout.group, **kwargs)
    return torch.cat([out_prompt, out_completion], dim=1), None


def _prompt_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, prompt_ok: Tensor, **kwargs
) -> Tensor:
    """The prompt's part: causal over its own real tokens (a pad query sees itself, so that no row is
    empty)."""
    width, device = prompt_ok.shape[-1], query.device
    causal = torch.ones(width, width, dtype=torch.bool, device=device).tril()
    mask = (causal & prompt_ok) | torch.eye(width, dtype=torch.bool, device=device)
    prompt = slice(None, width)
    out, _ = _sdpa(
        module, query[:, :, prompt], key[:, :, prompt], value[:, :, prompt], mask, is_causal=False, **kwargs
    )
    return out


def _completion_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    prompt_ok: Tensor,
    group: int,
    **kwargs,
) -> Tensor:
    """The completions' part, one batch row each: keys and values are the prompt's followed by its own."""
    rows, _, length, _ = query.shape
    width = prompt_ok.shape[-1]
    size = (length - width) // group
    own = torch.ones(size, size, dtype=torch.bool, device=query.device).tril()
    sees_prompt = prompt_ok.repeat_interleave(group, dim=0).expand(-1, -1, size, -1)
    mask = torch.cat([sees_prompt, own.expand(rows * group, 1, size, size)], dim=-1)
    out, _ = _sdpa(
        module,
        _per_completion(query, width, group),
        _with_prompt(key, width, group),
        _with_prompt(value, width, group),
        mask,
        is_causal=False,
        **kwargs,
    )  # [R·g, C, heads, d]
    return out.reshape(rows, group * size, *out.shape[2:])


def _per_completion(t: Tensor, width: int, group: int) -> Tensor:
    """The completions of packed rows, one per row: [R, h, P + g·C, d] → [R·g, h, C, d]."""
    rows, h, length, d = t.shape
    size = (length - width) // group
    return t[:, :, width:].reshape(rows, h, group, size, d).transpose(1, 2).reshape(rows * group, h, size, d)


def _with_prompt(t: Tensor, width: int, group: int) -> Tensor:
    """Each completion's keys or values after its prompt's: [R, h, P + g·C, d] → [R·g, h, P + C, d]."""
    prompt = t[:, None, :, :width].expand(-1, group, -1, -1, -1).flatten(0, 1)
    return torch.cat([prompt, _per_completion(t, width, group)], dim=2)


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)
