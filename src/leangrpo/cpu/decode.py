"""A lean decode loop for Llama, Qwen2 and Qwen3 decoders on CPU in float32: the tokens transformers'
generate() would sample, without its per-layer Python.

Decoding a handful of rows, generate() with packed Linears spends much of a rollout outside the Linears:
in SDPA's attention, costly per call for one query row, and in Python and small ops around them
(benchmarks/RESULTS.md, "The lean decode loop"). Here each
layer is four packed oneDNN products (q/k/v and gate/up side by side, so a handful of rows reads each
weight in one call), attention is two batched matmuls over the in-place KV cache, and nothing else runs
per layer but the norms, the rotary embedding and the residual adds. The prompt is still prefilled by
the model's own forward (`engines.hf.prefill_once_per_group`); every other architecture, and any
`generation_kwargs`, keeps generate().
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor

from leangrpo.cpu import onednn
from leangrpo.engines.types import Sampling
from leangrpo.models.load import is_peft, linear_weight, peft_base

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

    from leangrpo.engines.hf import PreallocatedLayer

SUPPORTED = ("llama", "qwen2", "qwen3")


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The rotary embedding as transformers' apply_rotary_pos_emb computes it (rotate_half)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def wide_forward(weight: Tensor, bias: Tensor | None, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """x @ weight.T computed as (weight @ x.T).T: for the unpacked LM head against a few rows, the faster
    order of the two when the weight is not packed (benchmarks/RESULTS.md)."""
    y = torch.mm(weight, x.reshape(-1, x.shape[-1]).t()).t().reshape(*x.shape[:-1], -1)
    return y if bias is None else y + bias


def packed_forward(weight: Tensor, bias: Tensor | None, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """x @ W.T + bias, `weight` being W packed by oneDNN (`torch.ops.mkldnn._reorder_linear_weight`)."""
    return onednn.linear(x, weight, bias)


@dataclass
class Product:
    """One packed oneDNN product, possibly of several Linears side by side (their outputs concatenated)."""

    weight: Tensor  # packed
    bias: Tensor | None

    def __call__(self, x: Tensor) -> Tensor:
        return packed_forward(self.weight, self.bias, x)


@dataclass
class Layer:
    """One decoder layer's packed products and norm weights."""

    qkv: Product
    o: Product
    gate_up: Product
    down: Product
    input_norm: Tensor
    post_norm: Tensor
    eps: float
    qk_norm: Tensor | None  # Qwen3's per-head norm weights, the queries' (H rows) then the keys' (KV rows)
    scaling: float


def lean_decoder(model: PreTrainedModel, rows: int, pack_head: bool = True) -> LeanDecoder | None:
    """A LeanDecoder for `model` with its weights packed for `rows` rows, or None where the loop would not
    compute what the model's forward does (another architecture, sliding-window or DoRA layers, other
    dtypes or devices, forward hooks), and generate() must run."""
    base = peft_base(model) if is_peft(model) else model
    cfg = base.config
    if (
        cfg.model_type not in SUPPORTED
        or cfg.hidden_act != "silu"
        or any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or [])
        or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        or not torch.backends.mkldnn.is_available()
        or not all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    ):
        return None
    inner = cast(Any, base).model
    # The loop calls the embedding and the rotary embedding as modules (their hooks run: peft and gradient
    # checkpointing hook the embedding to make its output require grad); a hook anywhere else would not.
    called = {id(m) for part in (inner.embed_tokens, inner.rotary_emb) for m in part.modules()}
    if any(m._forward_hooks or m._forward_pre_hooks for m in model.modules() if id(m) not in called):
        return None
    pack = torch.ops.mkldnn._reorder_linear_weight
    with torch.no_grad():
        layers = []
        for block in inner.layers:
            layer = _layer(block, cfg, rows)
            if layer is None:
                return None
            layers.append(layer)
        head_module = cast(nn.Linear, base.get_output_embeddings())
        head_weight = linear_weight(head_module)
        if head_weight is None:
            return None
        if pack_head:
            head: Callable[[Tensor], Tensor] = Product(pack(head_weight, rows), head_module.bias)
        else:
            head = partial(wide_forward, head_weight, head_module.bias)
    return LeanDecoder(inner, layers, head, cfg)


def _product(rows: int, *linears: nn.Module) -> Product | None:
    """The Linears' weights (LoRA folded in) stacked and packed for `rows` rows; None for DoRA, or for
    biases on some but not all (transformers' Llama, Qwen2 and Qwen3 give q/k/v, and gate/up, one bias
    setting)."""
    weights = [linear_weight(m) for m in linears]
    biases = [cast(nn.Linear, getattr(m, "base_layer", m)).bias for m in linears]
    missing = sum(b is None for b in biases)
    if any(w is None for w in weights) or 0 < missing < len(biases):
        return None
    bias = None if biases[0] is None else torch.cat(cast(list[Tensor], biases))
    return Product(
        torch.ops.mkldnn._reorder_linear_weight(torch.cat(cast(list[Tensor], weights)), rows), bias
    )


def _layer(block: Any, cfg: Any, rows: int) -> Layer | None:
    """One decoder layer's (a Llama, Qwen2 or Qwen3 block's) packed products and norm weights; None where a
    product cannot be packed."""
    attn, mlp = block.self_attn, block.mlp
    products = (
        _product(rows, attn.q_proj, attn.k_proj, attn.v_proj),
        _product(rows, attn.o_proj),
        _product(rows, mlp.gate_proj, mlp.up_proj),
        _product(rows, mlp.down_proj),
    )
    if any(p is None for p in products):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    qk_norm = None
    if q_norm is not None and k_norm is not None:
        heads = [q_norm.weight] * cfg.num_attention_heads + [k_norm.weight] * cfg.num_key_value_heads
        qk_norm = torch.stack(heads)
    return Layer(
        *cast(tuple[Product, Product, Product, Product], products),
        input_norm=block.input_layernorm.weight,
        post_norm=block.post_attention_layernorm.weight,
        eps=block.input_layernorm.variance_epsilon,
        qk_norm=qk_norm,
        scaling=attn.scaling,
    )


class LeanDecoder:
    """Decodes from a prefilled in-place KV cache (`hf.PreallocatedLayer`), one token per row a step."""

    def __init__(self, inner: Any, layers: list[Layer], head: Callable[[Tensor], Tensor], cfg: Any):
        self.inner, self.layers, self.head = inner, layers, head  # inner: the decoder under the LM head
        self.final_norm, self.final_eps = inner.norm.weight, inner.norm.variance_epsilon
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def logits(
        self, tokens: Tensor, positions: Tensor, keys: list[Tensor], values: list[Tensor], bias: Tensor
    ) -> Tensor:
        """Next-token logits [B, V] for `tokens` [B] at `positions` [B], after writing their keys and values
        at slot `bias.shape[-1] - 1` of each layer's buffers [B, kv_heads, capacity, head_dim]; `bias`
        [B, 1, 1, slots] is 0 where a row may attend and -inf where not (its left padding)."""
        B, slot = len(tokens), bias.shape[-1] - 1
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        x = self.inner.embed_tokens(tokens[:, None])
        cos, sin = self.inner.rotary_emb(x, positions[:, None])  # [B, 1, D]: broadcast over the heads
        x = x[:, 0]
        for layer, k_buf, v_buf in zip(self.layers, keys, values, strict=True):
            qkv = layer.qkv(F.rms_norm(x, (x.shape[-1],), layer.input_norm, layer.eps))
            qk, v = qkv[:, : (H + KV) * D].view(B, H + KV, D), qkv[:, (H + KV) * D :].view(B, KV, D)
            if layer.qk_norm is not None:  # Qwen3: queries and keys each normed per head
                qk = F.rms_norm(qk, (D,), eps=layer.eps).mul_(layer.qk_norm)
            qk = rotate(qk, cos, sin)
            k_buf[:, :, slot], v_buf[:, :, slot] = qk[:, H:], v
            # each key/value head serves H // KV query heads: [B, KV, H // KV, D] @ [B, KV, D, slots]
            q = qk[:, :H].reshape(B, KV, H // KV, D)
            scores = torch.matmul(q, k_buf[:, :, : slot + 1].transpose(-1, -2)).mul_(layer.scaling).add_(bias)
            attended = torch.matmul(scores.softmax(dim=-1), v_buf[:, :, : slot + 1])
            x = x + layer.o(attended.reshape(B, H * D))
            gate, up = layer.gate_up(F.rms_norm(x, (x.shape[-1],), layer.post_norm, layer.eps)).chunk(
                2, dim=-1
            )
            x = x + layer.down(F.silu(gate).mul_(up))
        x = F.rms_norm(x, (x.shape[-1],), self.final_norm, self.final_eps)
        return self.head(x)

    @torch.no_grad()
    def decode(
        self,
        cache: DynamicCache,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        max_new_tokens: int,
        choose: Callable[[Tensor, Tensor], Tensor],
        eos: list[int],
        pad: int,
    ) -> Tensor:
        """Completion ids [B, ≤ max_new_tokens] after left-padded prompts whose tokens but the last are in
        `cache`: each step `choose(ids so far, fp32 logits)` picks the next token of every row; a row
        that has produced an EOS is padded with `pad`, and decoding stops when every row has, as in
        generate()."""
        B, P = prompt_ids.shape
        layers = [cast("PreallocatedLayer", layer) for layer in cache.layers]
        keys, values = [layer.key_buffer for layer in layers], [layer.value_buffer for layer in layers]
        capacity = keys[0].shape[2]
        allowed = torch.ones(B, capacity, dtype=torch.bool)
        allowed[:, :P] = prompt_mask.bool()
        bias = torch.zeros(B, 1, 1, capacity).masked_fill_(~allowed[:, None, None], -torch.inf)
        ids = torch.cat([prompt_ids, prompt_ids.new_full((B, max_new_tokens), pad)], dim=1)
        positions = prompt_mask.sum(dim=1) - 1  # as generate() numbers left-padded prompts
        eos_ids = torch.tensor(eos)
        running = torch.ones(B, dtype=torch.bool)
        tokens, steps = prompt_ids[:, -1], 0
        while steps < max_new_tokens and running.any():
            logits = self.logits(tokens, positions + steps, keys, values, bias[..., : P + steps])
            tokens = choose(ids[:, : P + steps], logits).masked_fill_(~running, pad)
            ids[:, P + steps] = tokens
            running &= ~torch.isin(tokens, eos_ids)
            steps += 1
        return ids[:, P : P + steps]


def decode_lean(
    lean: LeanDecoder,
    cache: DynamicCache,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    sampling: Sampling,
    processors: list[LogitsProcessor],
    eos: list[int],
    gen_cfg: GenerationConfig,
) -> Tensor:
    """Completion ids from the lean loop, drawn as generate() draws them with `gen_cfg`: the processors,
    then the greedy pick (the last processor samples); EOS never drawn under `ignore_eos` (generate()'s
    min_new_tokens); finished rows padded with the pad token (else the first EOS)."""
    if sampling.ignore_eos:
        eos_never = MinNewTokensLengthLogitsProcessor(
            prompt_ids.shape[1], sampling.max_completion_length, eos
        )
        processors = [eos_never, *processors]
    pick = LogitsProcessorList(processors)

    def choose(ids: Tensor, logits: Tensor) -> Tensor:
        return pick(cast("torch.LongTensor", ids), logits).argmax(dim=-1)

    pad = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else eos[0]
    return lean.decode(cache, prompt_ids, prompt_mask, sampling.max_completion_length, choose, eos, pad)


@contextmanager
def packed_linears(
    model: torch.nn.Module, batch_hint: int, pack_head: bool = True, enabled: bool = True
) -> Iterator[None]:
    """On CPU in float32, run every Linear (LoRA adapters folded in) through oneDNN with its weight
    packed once for the whole generate call.

    Decoding a handful of rows is bound by reading the weights; oneDNN's packed layout reads them
    faster than the default sgemm, and a LoRA layer becomes one matmul instead of three. The packed
    copies (one set of weights) live only inside the context. Without `pack_head`, the LM head (the
    largest weight) is multiplied unpacked as (weight @ x.T).T instead, which saves its copy for a
    slower rollout (docs/memory.md). Elsewhere a no-op.
    """
    pack = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
    if (
        not enabled
        or pack is None
        or not (
            torch.backends.mkldnn.is_available()
            and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
        )
    ):
        yield
        return
    patched: list[torch.nn.Module] = []
    done: set[int] = set()  # a LoRA layer's own Linears (base, A, B) are folded into its packed weight
    head = (
        None
        if pack_head or not hasattr(model, "get_output_embeddings")
        else cast("PreTrainedModel", model).get_output_embeddings()
    )
    try:
        with torch.no_grad():
            for module in model.modules():
                if module is head and isinstance(module, torch.nn.Linear):
                    forward = partial(wide_forward, module.weight, module.bias)
                else:
                    weight = None if id(module) in done else linear_weight(module)
                    if weight is None:
                        continue
                    # the Linear whose weight linear_weight found (a LoRA layer's base)
                    base = cast(torch.nn.Linear, getattr(module, "base_layer", module))
                    done.update(id(m) for m in module.modules())
                    forward = partial(packed_forward, pack(weight, batch_hint), base.bias)
                module.forward = forward
                patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward
