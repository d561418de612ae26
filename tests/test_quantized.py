"""QLoRA (a 4-bit bitsandbytes base under LoRA), 8-bit AdamW and bf16, for real on CPU with the tiny model."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from click.testing import CliRunner
from test_e2e import read_metrics
from test_resume import make_config

from leangrpo.cli import main
from leangrpo.config.schema import ConfigError, ModelConfig
from leangrpo.core.logprobs import token_logprobs
from leangrpo.models.load import ModelError, load_base, load_model_and_tokenizer, load_tokenizer, merge_lora
from leangrpo.run.resolve import load_config, validate_config
from leangrpo.train.policy import Policy

bnb = pytest.importorskip("bitsandbytes")

QLORA = {"load_in_4bit": True, "lora": {"enabled": True, "r": 8, "dropout": 0.0}}


def qlora_cfg(model_dir, **model) -> ModelConfig:
    return ModelConfig(name_or_path=str(model_dir), **{**QLORA, **model})


def randomize_lora_b(model, seed: int = 0) -> None:
    """peft initialises lora_B to zero (the adapter is a no-op); make it matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.3)


def test_load_in_4bit_without_lora_is_one_line():
    data = {"model": {"name_or_path": "m", "load_in_4bit": True}, "data": {"path": "d.jsonl"}}
    with pytest.raises(ConfigError) as err:
        validate_config(data)
    assert str(err.value) == (
        "config error in config: model: load_in_4bit needs model.lora.enabled: true "
        "(the 4-bit base stays frozen; LoRA trains on it)"
    )


@pytest.mark.parametrize("mode", ["colocate", "server"])
def test_load_in_4bit_with_vllm_is_accepted(mode):
    """QLoRA on vLLM (issue 51): vLLM is sent the dequantized 4-bit base (real_vllm/test_vllm_qlora.py)."""
    data = {"model": {"name_or_path": "m", **QLORA}, "data": {"path": "d.jsonl"}}
    cfg = validate_config({**data, "grpo": {"use_vllm": True, "vllm_mode": mode}})
    assert cfg.model.load_in_4bit and cfg.grpo.use_vllm and cfg.grpo.vllm_mode == mode


def test_qlora_on_vllm_says_its_difference_from_trl(caplog):
    """The start-up line of both vLLM engines' from_config (docs/trl.md), for a 4-bit base only."""
    from leangrpo.engines.vllm import say_4bit_base

    data = {"model": {"name_or_path": "m", "dtype": "bfloat16", **QLORA}, "data": {"path": "d.jsonl"}}
    with caplog.at_level("INFO", logger="leangrpo.engines.vllm"):
        say_4bit_base(validate_config({**data, "grpo": {"use_vllm": True}}))
        say_4bit_base(validate_config({**data, "model": {"name_or_path": "m"}, "grpo": {"use_vllm": True}}))
    assert [r.getMessage() for r in caplog.records] == [
        "vLLM weight sync: the 4-bit base goes dequantized to bfloat16, as the trainer applies it (vLLM "
        "holds it so); TRL sends the adapter merged into the 4-bit layers, requantized"
    ]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_load_in_4bit_quantizes_every_decoder_linear(tiny_model_dir, quant_type):
    model, _ = load_model_and_tokenizer(qlora_cfg(tiny_model_dir, bnb_4bit_quant_type=quant_type))
    base = model.get_base_model()
    quantized = [m for m in base.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 2 * 7  # q k v o gate up down in each of the 2 layers
    state = quantized[0].weight.quant_state
    assert state.quant_type == quant_type and state.nested  # double quantization by default
    assert quantized[0].weight.dtype == torch.uint8
    assert base.get_output_embeddings().weight.dtype == torch.float32  # lm_head is left unquantized
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if "lora_" in n
    }


def test_4bit_gradients_survive_generation(tiny_model_dir):
    """bitsandbytes repacks a CPU 4-bit weight for inference the first time it runs in eval mode without
    gradients, and the repacked matmul has no backward: without the loader's guard the update after a
    rollout silently loses every gradient through the base weights."""
    model, _ = load_model_and_tokenizer(qlora_cfg(tiny_model_dir, dtype="bfloat16"))
    randomize_lora_b(model)
    policy = Policy(model)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model.train()
        policy(ids, mask, 6).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    before = grads()
    model.eval()
    with torch.no_grad():
        model.generate(ids[:, :4], attention_mask=mask[:, :4], max_new_tokens=3, do_sample=False)
    after = grads()
    for name, grad in before.items():
        torch.testing.assert_close(after[name], grad, msg=name)


def test_merge_lora_dequantizes_the_base(tiny_model_dir):
    """The merged model computes dequant(W) + BA, what training computed: greedy output equal, logits
    within 1e-4 in fp32. peft's own merge requantizes to 4 bits and loses most of the adapter."""
    model, tokenizer = load_model_and_tokenizer(qlora_cfg(tiny_model_dir, gradient_checkpointing=False))
    randomize_lora_b(model)
    model.eval()
    enc = tokenizer(["a b c d"], return_tensors="pt", add_special_tokens=False)
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        want_logits, want_tokens = model(**enc).logits, model.generate(**enc, **kw)
        requantized = copy.deepcopy(model).merge_and_unload()(**enc).logits
        merged = merge_lora(copy.deepcopy(model)).eval()
        assert not any(isinstance(m, bnb.nn.Linear4bit) for m in merged.modules())
        assert getattr(merged.config, "quantization_config", None) is None
        torch.testing.assert_close(merged(**enc).logits, want_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(merged.generate(**enc, **kw), want_tokens)
    assert (requantized - want_logits).abs().max() > 1e-2  # why peft's merge is not used


def test_4bit_model_without_quantizable_layers_is_one_line(tiny_model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(  # a model bitsandbytes leaves alone: every layer in its skip list
        AutoModelForCausalLM, "from_pretrained",
        lambda path, **kw: real(path, **{**kw, "quantization_config": None}),
    )  # fmt: skip
    with pytest.raises(ModelError) as err:
        load_base(str(tiny_model_dir), qlora_cfg(tiny_model_dir))
    assert "bitsandbytes quantized none of" in str(err.value) and "\n" not in str(err.value)


def test_bf16_logprobs_are_fp32():
    """bf16 hidden states and head: the chunked log-softmax, its log-probs and the max run in fp32."""
    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 64), torch.randn(300, 64) * 0.3
    targets = torch.randint(0, 300, (2, 5))
    want = torch.log_softmax(hidden @ weight.T, -1).gather(-1, targets[..., None]).squeeze(-1)
    got = token_logprobs(hidden.bfloat16(), weight.bfloat16(), targets, chunk_size=4)
    assert got.dtype == torch.float32
    # Only the logits' one rounding to bf16 remains (≈ 2^-8 of |logit| ≈ 3): a bf16 log-softmax is ~8x off.
    torch.testing.assert_close(got, want, rtol=0, atol=0.05)


@pytest.mark.slow
def test_qlora_8bit_bf16_trains_resumes_exports_and_chats(tmp_path, tiny_model_dir, gsm8k_dir):
    """The notebook setting end to end on CPU: 4-bit base, LoRA, 8-bit AdamW, bf16, beta > 0 (the
    reference is the adapter-disabled model). A resumed run repeats the uninterrupted one; the merged
    export matches the 4-bit base + adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    sections = {
        "model": {**QLORA, "dtype": "bfloat16", "gradient_checkpointing": True},
        "optim": {
            "optimizer": "adamw_8bit",
            "learning_rate": 0.05,
            "max_steps": 3,
            "warmup_ratio": 0.0,
            "lr_scheduler_type": "constant",
        },  # the schedule does not depend on max_steps
        "grpo": {"beta": 0.04},
    }
    cli = CliRunner()
    straight = make_config(tmp_path, tiny_model_dir, gsm8k_dir, "straight", **sections)
    assert cli.invoke(main, ["train", "-c", str(straight)]).exit_code == 0
    cut = make_config(tmp_path, tiny_model_dir, gsm8k_dir, "cut", **{**sections, "optim": {
        **sections["optim"], "max_steps": 2}})  # fmt: skip
    result = cli.invoke(main, ["train", "-c", str(cut)])
    assert result.exit_code == 0, result.output
    result = cli.invoke(
        main, ["train", "--resume", str(tmp_path / "cut"), "--trust-run-code", "optim.max_steps=3"]
    )
    assert result.exit_code == 0, result.output
    rows, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "cut")
    assert rows[-1]["kl"] > 0  # the reference (adapter disabled) differs from the trained policy
    for key in ("loss", "reward", "kl", "grad_norm"):  # 8-bit AdamW's state came back whole
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in rows], rel=1e-5), key

    run = tmp_path / "straight"
    for source, dtype in ((run, "float32"), (run / "checkpoint-2", "bfloat16")):
        out = tmp_path / f"merged-{dtype}"
        result = cli.invoke(main, ["export", str(source), "--out", str(out), "--merge", "--dtype", dtype])
        assert result.exit_code == 0, result.output
        info = json.loads((out / "config.json").read_text())
        assert "quantization_config" not in info and info["dtype"] == dtype
    # The merged checkpoint against what training computed: the 4-bit base + the adapter, in bf16.
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-bfloat16", dtype=torch.bfloat16).eval()
    base = load_base(str(tiny_model_dir), load_config(run / "config.yaml").model)
    with_adapter = PeftModel.from_pretrained(base, run / "checkpoint-2").eval()
    tokenizer = load_tokenizer(str(tmp_path / "merged-bfloat16"))
    enc = tokenizer(["Q: 2+2? A:"], return_tensors="pt", add_special_tokens=False)
    kw = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": tokenizer.pad_token_id}
    with torch.no_grad():
        tokens = with_adapter.generate(**enc, **kw)
        got, want = merged(tokens).logits.float(), with_adapter(tokens).logits.float()
    # Rounding W + BA to bf16 vs Wx + BAx in bf16: the error grows with the hidden states, not with each
    # logit, so it is bounded against the largest logit.
    tolerance = 0.02 * want.abs().max()
    assert (got - want).abs().max() <= tolerance
    # Greedy decoding agrees token by token, except where the adapter's top two logits lie within that
    # rounding of each other (a near-tie either model may break its own way).
    prompt = enc["input_ids"].shape[1]
    top2 = want[0, prompt - 1 : -1].topk(2).values
    picked = got[0, prompt - 1 : -1].argmax(-1) == tokens[0, prompt:]
    assert (picked | (top2[:, 0] - top2[:, 1] <= 2 * tolerance)).all()
    assert picked.float().mean() >= 0.5

    result = cli.invoke(main, ["chat", str(run), "What is 2+2?", "--max-new-tokens", "4"])
    assert result.exit_code == 0 and result.output.strip(), result.output
    out = tmp_path / "eval.json"
    args = ["--data", str(gsm8k_dir), "--limit", "1", "--max-new-tokens", "2", "--out", str(out)]
    result = cli.invoke(main, ["eval", "--model", str(run / "checkpoint-2"), *args])
    assert result.exit_code == 0 and out.is_file(), result.output


@pytest.mark.slow
def test_bf16_full_finetune_trains(tmp_path, tiny_model_dir, gsm8k_dir):
    from safetensors.torch import load_file

    cfg = make_config(
        tmp_path, tiny_model_dir, gsm8k_dir, "run", model={"dtype": "bfloat16"},
        optim={"max_steps": 2, "learning_rate": 0.01}, logging={"save_steps": 0},
    )  # fmt: skip
    result = CliRunner().invoke(main, ["train", "-c", str(cfg)])
    assert result.exit_code == 0, result.output
    rows = read_metrics(tmp_path / "run")
    assert all(torch.isfinite(torch.tensor(r["loss"])) and r["grad_norm"] > 0 for r in rows)
    trained = load_file(tmp_path / "run" / "model" / "model.safetensors")
    start = load_file(tiny_model_dir / "model.safetensors")
    name = "model.layers.0.mlp.up_proj.weight"
    assert trained[name].dtype == torch.bfloat16
    assert not torch.equal(trained[name], start[name].bfloat16())
