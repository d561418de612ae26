"""Image prompts of vision-language models: the processor's encoding of each prompt (its token ids, with an
image's placeholder expanded to its patches, and its pixel inputs), and those pixel inputs carried with the
rollout, one entry a completion, to the policy's forward (TRL's `pixel_values`, `image_grid_thw`,
`pixel_attention_mask`, `image_sizes`...)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from leangrpo.core.errors import UserError

# Per-token fields a processor returns beside the ids (Qwen-VL's image/video marks, Gemma 3's token types):
# the forward needs them over prompt + completion, so they are rebuilt from the ids (`VisionInputs.collate`)
TOKEN_TYPE_FIELDS = ("mm_token_type_ids", "token_type_ids")


class VisionError(UserError, ValueError):
    """Image prompts the run cannot take (no processor, tools with images, a processor that fails)."""


def image_processor(processing_class: Any) -> Any | None:
    """The multimodal processor in `processing_class` (an `AutoProcessor` with an image processor), or None
    for a tokenizer."""
    return processing_class if getattr(processing_class, "image_processor", None) is not None else None


def text_tokenizer(processing_class: Any) -> Any:
    """The tokenizer of `processing_class`: a processor's own tokenizer, or the tokenizer itself."""
    return processing_class.tokenizer if image_processor(processing_class) is not None else processing_class


@dataclass
class VisionInputs:
    """The pixel inputs of a rollout's prompts, one dict a completion (a group's completions share their
    prompt's tensors, not copies), each as the processor gave it for that prompt alone: every field's first
    dimension counts that prompt's images, patches or rows, so a micro-batch's are the rows' concatenated.
    `token_types`: the per-token fields the model reads, with the ids that mark images in them."""

    rows: list[dict[str, Tensor]]
    token_types: dict[str, dict[int, int]]

    def select(self, indices: list[int]) -> VisionInputs:
        return VisionInputs([self.rows[i] for i in indices], self.token_types)

    def to(self, device: torch.device) -> VisionInputs:
        moved: dict[int, dict[str, Tensor]] = {}  # the group's shared dict moves once
        rows = [moved.setdefault(id(r), {k: v.to(device) for k, v in r.items()}) for r in self.rows]
        return VisionInputs(rows, self.token_types)

    @staticmethod
    def cat(parts: list[VisionInputs]) -> VisionInputs:
        return VisionInputs([r for p in parts for r in p.rows], parts[0].token_types)

    def collate(self, rows: slice, input_ids: Tensor, prompt_width: int) -> dict[str, Tensor]:
        """The forward's keyword arguments for the completions at `rows`, whose sequences are `input_ids`,
        their first `prompt_width` columns the prompts: the token types mark the prompts' image tokens, and
        are 0 over the completions (as TRL extends them with zeros: a completion holds no image)."""
        picked = self.rows[rows]
        out = {key: torch.cat([r[key] for r in picked]) for key in picked[0]}
        for key, marks in self.token_types.items():
            types = torch.zeros_like(input_ids)
            for token, value in marks.items():
                types[:, :prompt_width][input_ids[:, :prompt_width] == token] = value
            out[key] = types
        return out


def encode(
    processor: Any,
    prompt_texts: list[str],
    images: list[list[Any]],
    max_prompt_length: int | None,
    repeat: int,
) -> tuple[Tensor, Tensor, VisionInputs]:
    """Left-padded prompt ids and mask, each prompt `repeat` times (one row a completion), and their pixel
    inputs. Each prompt goes through the processor alone, so its pixel inputs are its own; a prompt the
    image tokens make longer than `max_prompt_length` is refused (cutting would cut an image)."""
    if any(images) and not all(images):
        raise VisionError(
            "a batch mixes prompts with images and prompts without: not supported yet (their pixel inputs "
            "are not joined, so the log-probs would miss the images); give every row an image"
        )
    tokenizer = processor.tokenizer
    ids: list[list[int]] = []
    rows: list[dict[str, Tensor]] = []
    for text, imgs in zip(prompt_texts, images, strict=True):
        try:
            enc = processor(text=[text], images=[imgs] if imgs else None, return_tensors="pt")
        except (ValueError, TypeError) as e:
            raise VisionError(f"the processor could not encode an image prompt: {e}") from None
        tokens = enc["input_ids"][0].tolist()
        if max_prompt_length is not None and len(tokens) > max_prompt_length:
            raise VisionError(
                f"an image prompt takes {len(tokens)} tokens with its image tokens, over "
                f"grpo.max_prompt_length={max_prompt_length}: raise it, or make the images smaller"
            )
        ids.append(tokens)
        skip = {"input_ids", "attention_mask", *TOKEN_TYPE_FIELDS}
        row = {k: v for k, v in enc.items() if k not in skip and isinstance(v, Tensor)}
        rows += [row] * repeat
    width = max(map(len, ids))
    prompt_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(ids), width), dtype=torch.long)
    for r, seq in enumerate(ids):
        prompt_ids[r, width - len(seq) :], prompt_mask[r, width - len(seq) :] = torch.tensor(seq), 1
    return (
        prompt_ids.repeat_interleave(repeat, dim=0),
        prompt_mask.repeat_interleave(repeat, dim=0),
        VisionInputs(rows, token_types(processor, enc)),
    )


def token_types(processor: Any, enc: Any) -> dict[str, dict[int, int]]:
    """The per-token fields the processor returned, each with the ids it marks (image 1, video 2), which
    `collate` marks again over prompt + completion."""
    config = {"image": 1, "video": 2}
    marks: dict[int, int] = {}
    for kind, value in config.items():
        token = getattr(processor, f"{kind}_token_id", None)
        if isinstance(token, int):
            marks[token] = value
    return {key: marks for key in TOKEN_TYPE_FIELDS if key in enc}


def vision_processor(rows: list[dict[str, Any]], processing_class: Any) -> Any | None:
    """The processor that encodes the rows' images: None when no row has any; the run's processing class
    (`models.load.processing_class`: the one given, else the model's own); refused in one line when that is
    a tokenizer."""
    from leangrpo.data.rows import prompt_images

    if not any(prompt_images(row["prompt"]) for row in rows):
        return None
    processor = image_processor(processing_class)
    if processor is None:
        raise VisionError(
            "the rows have images, but no processor to encode them: pass the model's AutoProcessor as "
            "processing_class"
        )
    return processor
