"""The lean decode loop: every step's logits are the model's own, for each architecture it takes; it
declines what it would compute differently; EOS ends rows as generate() ends them."""

from __future__ import annotations

import peft
import pytest
import torch
import transformers

import leangrpo.engines.hf as hf
from leangrpo.config.schema import LoraConfig
from leangrpo.cpu.decode import lean_decoder
from leangrpo.engines.hf import kv_cache, prefill_once_per_group, shared_prefix
from leangrpo.engines.types import left_padded
from leangrpo.models.load import apply_lora

FAMILIES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),  # one it declines
}


def tiny(kind: str, **overrides):
    """A tiny random decoder with GQA (4 query heads over 2 key/value heads) and random biases, if any."""
    cfg_cls, model_cls = FAMILIES[kind]
    torch.manual_seed(0)
    cfg = cfg_cls(**{
        "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, **overrides,
    })  # fmt: skip
    model = model_cls(cfg).eval()
    for name, p in model.named_parameters():
        if name.endswith("bias"):  # transformers starts them at zero
            torch.nn.init.normal_(p, std=0.5)
    return model


def prompts(group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two left-padded prompts (7 and 4 tokens), each repeated for `group` rows."""
    ids = torch.randint(3, 1000, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids.repeat_interleave(group, dim=0), mask.repeat_interleave(group, dim=0)


def lean_logits(model, ids, mask, group: int, steps: int, pack_head: bool = True):
    """Greedy completions [B, steps] from the lean loop, and the logits [B, steps, V] it chose them from."""
    cache = kv_cache(model, ids.shape[1] + steps)
    lean = lean_decoder(model, len(ids), pack_head)
    assert lean is not None
    prefill_once_per_group(model, ids, mask, group, cache)
    seen = []

    def greedy(_ids, logits):
        seen.append(logits.clone())
        return logits.argmax(dim=-1)

    completions = lean.decode(cache, ids, mask, steps, greedy, eos=[], pad=0)
    return completions, torch.stack(seen, dim=1)


def own_logits(model, ids, mask, completions):
    """The model's forward over prompt + completion, at the positions that predict each completion token."""
    full_ids = torch.cat([ids, completions], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(completions)], dim=1)
    positions = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=full_ids, attention_mask=full_mask, position_ids=positions).logits
    return logits[:, ids.shape[1] - 1 : -1]


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
        ("qwen2", {}),  # q/k/v biases, o without
        ("qwen3", {}),  # per-head q/k norms
    ],
)
@pytest.mark.parametrize("pack_head", [True, False])
def test_every_step_has_the_models_own_logits(kind, overrides, pack_head):
    model = tiny(kind, **overrides)
    ids, mask = prompts(group=2)
    completions, got = lean_logits(model, ids, mask, group=2, steps=6, pack_head=pack_head)
    assert completions.shape == (4, 6)
    torch.testing.assert_close(got, own_logits(model, ids, mask, completions), rtol=1e-4, atol=1e-4)


def test_lora_adapters_are_folded_in():
    model = apply_lora(tiny("llama"), LoraConfig(enabled=True, r=4, target_modules="all-linear")).eval()
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # peft starts B at zero: make the adapter matter
    ids, mask = prompts(group=1)
    completions, got = lean_logits(model, ids, mask, group=1, steps=4)
    torch.testing.assert_close(got, own_logits(model, ids, mask, completions), rtol=1e-4, atol=1e-4)
    with model.disable_adapter():
        assert (own_logits(model, ids, mask, completions) - got).abs().max() > 1e-2


@pytest.mark.parametrize(
    "unsupported",
    [
        lambda: tiny("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0),
        lambda: tiny("llama").to(torch.bfloat16),
        lambda: tiny("llama", hidden_act="gelu"),
        lambda: tiny("mistral"),
        lambda: peft.get_peft_model(
            tiny("llama"), peft.LoraConfig(r=4, target_modules=["q_proj"], use_dora=True)
        ),
    ],
    ids=["sliding-window", "bfloat16", "gelu", "mistral", "dora"],
)
def test_declines_what_it_would_compute_differently(unsupported):
    assert lean_decoder(unsupported(), rows=2) is None


def test_declines_a_model_with_forward_hooks_it_would_skip():
    """The embedding is called as a module (its hooks run: LoRA with gradient checkpointing has one);
    a hook on any module the loop does not call means generate()."""
    model = tiny("llama")
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda *a: seen.append(1))
    lean = lean_decoder(model, rows=4)
    assert lean is not None
    ids, mask = prompts(group=2)
    lean_logits(model, ids, mask, group=2, steps=3)
    assert len(seen) == 1 + 3  # the prefill, then each step
    model.lm_head.register_forward_hook(lambda *a: None)
    assert lean_decoder(model, rows=4) is None


def test_a_row_that_ends_is_padded_and_decoding_stops_when_all_have():
    """Row 0 draws EOS (7) at its 2nd token, every row at the 4th: row 0 is padded after its EOS, and no
    5th token is decoded."""
    model = tiny("llama")
    ids, mask = prompts(group=1)
    cache = kv_cache(model, ids.shape[1] + 10)
    prefill_once_per_group(model, ids, mask, 1, cache)
    lean = lean_decoder(model, len(ids))
    assert lean is not None
    steps = []

    def scripted(so_far, logits):
        step = so_far.shape[1] - ids.shape[1]
        steps.append(step)
        if step == 1:
            return torch.tensor([7, 5])
        return torch.tensor([7, 7]) if step == 3 else torch.tensor([4, 5])

    out = lean.decode(cache, ids, mask, 10, scripted, eos=[7, 8], pad=0)
    assert steps == [0, 1, 2, 3]
    assert out.tolist() == [[4, 7, 0, 0], [5, 5, 5, 7]]


def test_a_shared_prefix_is_counted_on_real_tokens_past_the_left_padding():
    """The shared prefix starts at each row's first real token, ends where any row differs or the shortest
    prompt ends, and counts only from MIN_SHARED_PREFIX tokens and two rows up."""
    prefix = list(range(100, 140))  # 40 tokens
    ids, mask = left_padded([[*prefix, 5, 6], [*prefix, 5, 7, 8, 9, 10]], 0, torch.device("cpu"))
    assert shared_prefix(ids, mask) == 41
    ids, mask = left_padded([prefix, [*prefix, 5, 6]], 0, torch.device("cpu"))
    assert shared_prefix(ids, mask) == 40  # the shortest prompt, whole
    ids, mask = left_padded([prefix[:31] + [1], prefix[:31] + [2]], 0, torch.device("cpu"))
    assert shared_prefix(ids, mask) == 0  # 31 tokens: too few to pay
    assert shared_prefix(*left_padded([prefix], 0, torch.device("cpu"))) == 0  # one row: nothing to share


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_a_shared_prefix_fills_the_cache_that_prefilling_every_row_fills(kind, monkeypatch):
    """The prefix run once and copied to every row's columns (one row's tail longer than the prefix, so its
    padding spans the whole copied width) leaves each real token the keys and values that prefilling
    every row gives it, and the lean loop the same greedy tokens."""
    model = tiny(kind)
    prefix = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    tails = [[7], list(range(200, 260)), [9, 8, 7, 6]]
    ids, mask = left_padded([[*prefix, *t] for t in tails], 0, torch.device("cpu"))
    writes = []  # (rows, positions) of each layer's cache write: the lean loop writes its buffers itself
    update = hf.PreallocatedLayer.update
    monkeypatch.setattr(
        hf.PreallocatedLayer,
        "update",
        lambda layer, k, v, *a, **kw: writes.append(k.shape[::2]) or update(layer, k, v, *a, **kw),
    )
    shared, shared_logits = lean_logits(model, ids, mask, group=1, steps=4)
    layers = model.config.num_hidden_layers  # the prefix's pass, its copy to every row, the rest
    assert writes == [(1, 40)] * layers + [(3, 40)] * layers + [(3, ids.shape[1] - 1 - 40)] * layers
    monkeypatch.setattr(hf, "MIN_SHARED_PREFIX", 10**9)
    every_row, every_logits = lean_logits(model, ids, mask, group=1, steps=4)
    assert torch.equal(shared, every_row)
    torch.testing.assert_close(shared_logits, every_logits)
