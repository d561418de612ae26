"""Vision-language GRPO on the HF engine (docs/vlm.md): TRL's image data contract, tiny random Qwen2.5-VL and
Idefics3 (SmolVLM) models with real processors (conftest), pixel inputs through the rollout, the reference
and the update."""

from __future__ import annotations

import pytest
from PIL import Image

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255)}


def colour_rows(n: int = 6) -> list[dict]:
    """TRL's image column with conversational prompts: which colour fills the picture."""
    names = sorted(COLOURS)
    return [
        {
            "prompt": [{"role": "user", "content": "Which colour?"}],
            "image": Image.new("RGB", (56, 56), COLOURS[names[i % len(names)]]),
            "colour": names[i % len(names)],
        }
        for i in range(n)
    ]


def names_colour(completions, colour, **kwargs):
    return [float(c in str(completion)) for completion, c in zip(completions, colour, strict=True)]


def varied(completions, **kwargs):
    """A reward that differs within a group, so that every step has advantages to learn from."""
    return [float(len(set(str(c)))) for c in completions]


def test_image_rows_take_trls_shapes():
    from leangrpo.config.schema import DataConfig
    from leangrpo.data.sources import DataError, load_rows
    from leangrpo.data.tasks import Task

    red = Image.new("RGB", (8, 8), "red")
    records = [
        {"prompt": [{"role": "user", "content": "What?"}], "image": red},
        {"prompt": [{"role": "user", "content": "What?"}], "images": [red, red]},
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image", "image": red}, {"type": "text", "text": "?"}]}
            ]
        },
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}],
            "images": [red],
        },
    ]
    data = DataConfig(path="memory")
    rows = load_rows(data, Task(), records).rows
    from leangrpo.data.rows import prompt_images, prompt_text

    assert [len(prompt_images(r["prompt"])) for r in rows] == [1, 2, 1, 1]
    [question] = load_rows(data, Task(), [{"question": "What?", "image": red}]).rows
    assert prompt_images(question["prompt"]) == [red]
    assert rows[0]["prompt"][0]["content"][0]["type"] == "image"
    assert prompt_text(rows[0]["prompt"]) == "What?"
    with pytest.raises(DataError, match="conversational prompt"):
        load_rows(data, Task(), [{"prompt": "plain text", "image": red}])


def test_grpo_trainer_trains_a_tiny_vlm(tmp_path, tiny_vlm):
    import torch

    from leangrpo import GRPOConfig, GRPOTrainer

    model, processor = tiny_vlm
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, report_to="none", beta=0.04, learning_rate=1e-2,
    )  # fmt: skip
    trainer = GRPOTrainer(model, [names_colour, varied], args, colour_rows(), processing_class=processor)
    trainer.train()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert any("visual" in n or "vision" in n for n in changed), "the vision tower got no gradient"
    assert any("layers" in n and "vision" not in n and "visual" not in n for n in changed)
