"""The shared-prompt layout: the completions of one prompt read a single copy of its tokens.

A micro-batch row becomes `[prompt | completion 1 | ... | completion g]`. An attention function lets
each completion see the prompt and its own earlier tokens only, so every log-prob equals the one from
running prompt + completion as a row of its own, but the prompt goes through the decoder once per row
instead of g times (forward, checkpoint recompute and backward alike). With GRPO's G completions per
prompt, that is most of the update's work when prompts are long against completions.

Packed (`Packing`, `grpo.padding_free`): the micro-batch becomes one sequence without padding,
`[prompt | its completions | next prompt | ...]`, each completion only as long as its real tokens, with
position ids counting on from its own prompt. The decoder's projections and MLPs then run over the real
tokens only; attention gathers each prompt with its first completion, and each other completion after
its prompt's keys, into blocks run as one sdpa batch each, so every token still sees its own prompt and
its own earlier tokens only.

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


@dataclass
class Blocks:
    """Attention blocks run as one sdpa batch: each block's queries are the last of its keys, and a query
    sees the keys up to itself. Indices are flat positions in the packed sequence (pad slots point at 0)."""

    query: Tensor  # [n, Q]
    key: Tensor  # [n, K]
    mask: Tensor  # [n, 1, Q, K] bool
    real: Tensor  # [n, Q] bool: the query slots that are tokens
    real_index: Tensor  # their flat indices in [n·Q] (an index, not a mask: no device wait to apply)

    def to(self, device: torch.device) -> Blocks:
        """The same block set on `device`."""
        return Blocks(*(t.to(device) for t in (self.query, self.key, self.mask, self.real, self.real_index)))


@dataclass
class Packing:
    """A micro-batch packed without padding (`packed`): the layout keyword of its decoder call, and what
    turns the packed hidden states back into the [N, C] completion grid."""

    input_ids: Tensor  # [1, T]
    position_ids: Tensor  # [1, T]
    blocks: tuple[Blocks, Blocks]  # each prompt with its first completion; the others after their prompt
    order: Tensor  # [T]: where each position's output lies among the blocks' real queries, in turn
    predictors: Tensor  # [M]: the position whose hidden state predicts each completion token
    targets: Tensor  # [M]: the completion tokens, row by row
    real: Tensor  # [N, C] bool: the grid's slots that hold them
    used: bool = False


def unsupported_reason(config: Any) -> str | None:
    """Why a model cannot use the shared-prompt layout, or None when it can."""
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model (its layouts run the text decoder alone, which sees no image)"
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


def packed(
    prompt_ids: Tensor, completion_ids: Tensor, prompt_len: list[int], completion_len: list[int], group: int
) -> Packing:
    """The packed layout of N = R·group rows of left-padded prompts (each repeated `group` times in a
    row) and right-padded completions: `[prompt r | completion r·g | ... | completion r·g + g - 1]` for
    each r, the real tokens only (group = 1: each completion after its own prompt copy).

    `prompt_len` [R] and `completion_len` [N] are the real token counts, read from the device once a
    rollout (`train/policy.micro_batch_extents`): the layout is built on the host from them and moved
    over, so building it never waits for the device."""
    device, width, C = prompt_ids.device, prompt_ids.shape[1], completion_ids.shape[1]
    p_len, c_len = torch.tensor(prompt_len), torch.tensor(completion_len)
    rows, total = len(prompt_len), sum(prompt_len) + sum(completion_len)
    prompt_start, completion_start = _segment_starts(p_len, c_len, group)
    p_of, p_off = _ranges(p_len, sum(prompt_len))
    c_of, c_off = _ranges(c_len, sum(completion_len))
    p_dest, c_dest = prompt_start[p_of] + p_off, completion_start[c_of] + c_off
    # Where each packed token comes from in [prompt rows | completion rows], flattened.
    source, position_ids = torch.empty(total, dtype=torch.long), torch.empty(total, dtype=torch.long)
    c_source = c_of * C + c_off
    source[p_dest], source[c_dest] = p_of * width + width - p_len[p_of] + p_off, rows * width + c_source
    position_ids[p_dest], position_ids[c_dest] = p_off, p_len[c_of // group] + c_off
    # Token j of a completion is predicted by its token j-1; token 0 by its prompt's last.
    own_prompt = torch.arange(rows * group) // group
    prompt_last = prompt_start[own_prompt] + p_len[own_prompt] - 1
    predictors = (c_dest - 1).where(c_off > 0, prompt_last[c_of])
    blocks = _packed_blocks(prompt_start, prompt_len, completion_start, completion_len, group)
    order = torch.cat([b.query[b.real] for b in blocks]).argsort()
    tokens = torch.cat([prompt_ids[::group].reshape(-1), completion_ids.reshape(-1)])
    real = torch.arange(C) < c_len[:, None]
    return Packing(
        tokens[source.to(device)][None], position_ids.to(device)[None],
        (blocks[0].to(device), blocks[1].to(device)), order.to(device), predictors.to(device),
        completion_ids.reshape(-1)[c_source.to(device)], real.to(device),
    )  # fmt: skip


def _segment_starts(prompt_len: Tensor, completion_len: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """Where each prompt and each completion starts in the packed sequence: each group's prompt, then its
    completions, in order."""
    rows = prompt_len.shape[0]
    prompt_seg = torch.arange(rows) * (group + 1)
    completion = torch.arange(rows * group)
    completion_seg = (completion // group) * (group + 1) + 1 + completion % group
    lengths = torch.zeros(rows * (group + 1), dtype=torch.long)
    lengths[prompt_seg], lengths[completion_seg] = prompt_len, completion_len
    starts = lengths.cumsum(0) - lengths
    return starts[prompt_seg], starts[completion_seg]


def _packed_blocks(
    prompt_start: Tensor,
    prompt_len: list[int],
    completion_start: Tensor,
    completion_len: list[int],
    group: int,
) -> tuple[Blocks, Blocks]:
    """Each prompt with its first completion (adjacent: one causal block), then every other completion
    after its prompt's keys (host tensors; the blocks' widths come from the token counts)."""
    p_len, c_len = torch.tensor(prompt_len), torch.tensor(completion_len)
    completion = torch.arange(len(completion_len))
    first, other, own_prompt = completion % group == 0, completion % group > 0, completion // group
    zero = torch.zeros_like(p_len)
    joined = [p + c for p, c in zip(prompt_len, completion_len[::group], strict=True)]
    others = [(prompt_len[i // group], c) for i, c in enumerate(completion_len) if i % group]
    return (
        _blocks(zero, zero, prompt_start, p_len + c_len[first], (max(joined, default=0),) * 2),
        _blocks(
            prompt_start[own_prompt[other]], p_len[own_prompt[other]],
            completion_start[other], c_len[other],
            (max((c for _, c in others), default=0), max((p + c for p, c in others), default=0)),
        ),
    )  # fmt: skip


def _ranges(lengths: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """For segments of `lengths` (summing to `total`), each element's segment and its offset in it."""
    of = torch.repeat_interleave(torch.arange(lengths.shape[0]), lengths, output_size=total)
    offsets = torch.arange(total) - (lengths.cumsum(0) - lengths)[of]
    return of, offsets


def _blocks(
    prefix_start: Tensor, prefix_len: Tensor, own_start: Tensor, own_len: Tensor, widths: tuple[int, int]
) -> Blocks:
    """One block per non-empty own range: its queries are that range, its keys the prefix range then it;
    `widths`: the longest own range and the longest prefix + own range."""
    keep = own_len > 0
    prefix_start, prefix_len, own_start, own_len = (
        t[keep, None] for t in (prefix_start, prefix_len, own_start, own_len)
    )
    seen = prefix_len + own_len
    j, k = torch.arange(widths[0]), torch.arange(widths[1])
    real, key_real = j < own_len, k < seen
    key = (prefix_start + k).where(k < prefix_len, own_start + k - prefix_len).where(key_real, 0)
    mask = key_real[:, None, :] & (k <= prefix_len[:, :, None] + j[None, :, None])
    query = (own_start + j).where(real, 0)
    return Blocks(query, key, mask[:, None], real, real.flatten().nonzero().squeeze(1))


def _attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask, **kwargs):
    """transformers' sdpa attention; with the layout keyword, the shared-prompt layout's (the mask is
    then the [R, 1, 1, P] bool of the prompt's real, not left-pad, tokens) or the packed one's."""
    layout: Layout | Packing | None = kwargs.pop(KWARG, None)
    if layout is None:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    layout.used = True
    if isinstance(layout, Packing):
        return _packed_attention(module, query, key, value, layout, **kwargs), None
    out_prompt = _prompt_attention(module, query, key, value, attention_mask, **kwargs)
    out_completion = _completion_attention(module, query, key, value, attention_mask, layout.group, **kwargs)
    return torch.cat([out_prompt, out_completion], dim=1), None


def _packed_attention(
    module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, packing: Packing, **kwargs
) -> Tensor:
    """The packed layout's attention: each block set gathered from [1, h, T, d] into one sdpa batch, the
    real queries' outputs put back in sequence order → [1, T, h, d]."""
    outs = []
    for b in packing.blocks:
        if b.query.numel():
            out, _ = _sdpa(
                module, _gather(query, b.query), _gather(key, b.key), _gather(value, b.key), b.mask,
                is_causal=False, **kwargs,
            )  # fmt: skip
            outs.append(out.flatten(0, 1)[b.real_index])
    return torch.cat(outs)[packing.order][None]


def _gather(t: Tensor, index: Tensor) -> Tensor:
    """Rows of a packed [1, h, T, d] at `index` [n, L] → [n, h, L, d]."""
    return t[0][:, index].transpose(0, 1)


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
