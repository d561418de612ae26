"""The chunked log-prob function of leangrpo.core.logprobs against the naive log_softmax, by value, gradient
and the memory it holds."""

from __future__ import annotations

import math

import pytest
import torch
from memtrack import PeakLargeTensors

from leangrpo.core.logprobs import LogitTransform, token_logprobs

# --------------------------------------------------------------------------- token_logprobs


def test_token_logprobs_hand_computed():
    hidden = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # [1, 2, 2]
    weight = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 0.0]])  # V = 3
    targets = torch.tensor([[0, 2]])
    # row 0 logits [1, 0, 0] -> logp[0] = 1 - log(e + 2); row 1 logits [0, 1, 0] -> logp[2] = -log(e + 2)
    out = token_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=1)
    torch.testing.assert_close(
        out, torch.tensor([[1 - math.log(math.e + 2), -math.log(math.e + 2)]]), atol=1e-6, rtol=0
    )
    # T = 0.5 doubles the logits: logp[0] = 2 - log(e^2 + 2)
    out = token_logprobs(hidden, weight, targets, temperature=0.5)
    torch.testing.assert_close(
        out, torch.tensor([[2 - math.log(math.e**2 + 2), -math.log(math.e**2 + 2)]]), atol=1e-6, rtol=0
    )


def _naive(hidden, weight, targets, temperature):
    logits = hidden @ weight.T / temperature
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)


def test_entropy_hand_computed():
    # Row 0: logits [0, 0, 0, 0] -> uniform over 4: log 4. Row 1: logits [log 3, 0] at T = 1 ->
    # p = [3/4, 1/4]: -(3/4 log 3/4 + 1/4 log 1/4); at T = 0.5 the logits double: p = [9/10, 1/10].
    hidden = torch.tensor([[[0.0, 0.0], [math.log(3), 0.0]]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]])  # the other two rows' logits 0
    _, entropy = token_logprobs(hidden, weight[:4], torch.tensor([[0, 1]]), chunk_size=1, with_entropy=True)
    # row 1 with V = 4: p ∝ [3, 1, 1, 1] = [1/2, 1/6, 1/6, 1/6]
    h1 = -(0.5 * math.log(0.5) + 3 * (1 / 6) * math.log(1 / 6))
    torch.testing.assert_close(entropy, torch.tensor([[math.log(4), h1]]), atol=1e-6, rtol=0)
    _, entropy = token_logprobs(
        hidden, weight[:2], torch.tensor([[0, 1]]), temperature=0.5, with_entropy=True
    )
    h1 = -(0.9 * math.log(0.9) + 0.1 * math.log(0.1))
    torch.testing.assert_close(entropy, torch.tensor([[math.log(2), h1]]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_entropy_matches_naive_and_an_unused_entropy_leaves_the_gradient_alone(chunk_size):
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 5, 8, generator=g) * 3, torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    logp, entropy = token_logprobs(h1, weight, targets, 0.7, chunk_size, with_entropy=True)
    logp.sum().backward()
    token_logprobs(h2, weight, targets, 0.7, chunk_size).sum().backward()
    logits = torch.log_softmax(hidden @ weight.T / 0.7, -1)
    torch.testing.assert_close(entropy, -(logits.exp() * logits).sum(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=0)


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("head", [LogitTransform(), LogitTransform(scale=0.5, softcap=4.0)])
def test_entropy_gradient_matches_naive(chunk_size, head):
    """A loss on the log-probs and the entropy (the entropy bonus): the chunked backward's gradients for
    the hidden states, weight and bias equal autograd's through the naive log_softmax."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 5, 8, generator=g, dtype=torch.float64), torch.randn(11, 8, generator=g)
    bias, targets = torch.randn(11, generator=g), torch.randint(0, 11, (2, 5), generator=g)
    up_logp, up_entropy = torch.randn(2, 5, generator=g), torch.randn(2, 5, generator=g)
    ours = [t.clone().double().requires_grad_() for t in (hidden, weight, bias)]
    logp, entropy = token_logprobs(
        ours[0], ours[1], targets, 0.7, chunk_size, with_entropy=True, bias=ours[2], head=head
    )
    ((logp * up_logp).sum() + (entropy * up_entropy).sum()).backward()
    naive = [t.clone().double().requires_grad_() for t in (hidden, weight, bias)]
    logits = (naive[0] @ naive[1].T + naive[2]) * head.scale
    if head.softcap is not None:
        logits = torch.tanh(logits / head.softcap) * head.softcap
    log_p = torch.log_softmax(logits / 0.7, -1)
    naive_entropy = -(log_p.exp() * log_p).sum(-1)
    (
        (log_p.gather(-1, targets[..., None]).squeeze(-1) * up_logp).sum()
        + (naive_entropy * up_entropy).sum()
    ).backward()
    torch.testing.assert_close(entropy.double(), naive_entropy.detach(), rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(ours, naive, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_matches_naive_values_and_grads(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 5, 8, 11
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = token_logprobs(h1, w1, targets, temperature=temperature, chunk_size=chunk_size)
    (out * upstream).sum().backward()

    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = _naive(h2, w2, targets, temperature)
    (ref * upstream).sum().backward()

    assert out.shape == (B, T)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-5, atol=1e-6)
    assert (out <= 0).all()


def test_token_logprobs_frozen_weight_gets_no_grad():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 4, 6, generator=g, requires_grad=True)
    weight = torch.randn(9, 6, generator=g)  # requires_grad=False
    targets = torch.randint(0, 9, (3, 4), generator=g)
    out = token_logprobs(hidden, weight, targets, chunk_size=5)
    out.sum().backward()
    assert weight.grad is None
    assert hidden.grad is not None

    h2 = hidden.detach().clone().requires_grad_()
    _naive(h2, weight, targets, 1.0).sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, rtol=1e-5, atol=1e-6)


def test_token_logprobs_weight_only_grad():
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(2, 3, 4, generator=g)  # frozen
    weight = torch.randn(7, 4, generator=g, requires_grad=True)
    targets = torch.randint(0, 7, (2, 3), generator=g)
    token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=2).sum().backward()
    w2 = weight.detach().clone().requires_grad_()
    _naive(hidden, w2, targets, 0.7).sum().backward()
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_token_logprobs_bf16_smoke():
    g = torch.Generator().manual_seed(3)
    hidden32 = torch.randn(2, 6, 16, generator=g)
    weight32 = torch.randn(32, 16, generator=g) * 0.3
    targets = torch.randint(0, 32, (2, 6), generator=g)
    hidden = hidden32.to(torch.bfloat16).requires_grad_()
    weight = weight32.to(torch.bfloat16).requires_grad_()
    out = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=4)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    ref = _naive(hidden.detach().float(), weight.detach().float(), targets, 0.7)
    torch.testing.assert_close(out, ref, rtol=5e-2, atol=5e-2)
    out.sum().backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    assert torch.isfinite(hidden.grad.float()).all() and torch.isfinite(weight.grad.float()).all()


@pytest.mark.parametrize("train_weight", [False, True])
def test_token_logprobs_holds_one_chunk_of_logits_at_a_time(train_weight):
    chunk, vocab, rows = 16, 512, 64  # four chunks; the weight and hidden states are far smaller
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, rows, 8, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 8, generator=g, requires_grad=train_weight)
    targets = torch.randint(0, vocab, (1, rows), generator=g)
    one_chunk = chunk * vocab * 4
    with PeakLargeTensors(chunk * vocab) as forward:
        out = token_logprobs(hidden, weight, targets, temperature=0.7, chunk_size=chunk)
    with PeakLargeTensors(chunk * vocab) as backward:
        out.sum().backward()
    assert forward.peak == one_chunk
    assert backward.peak == one_chunk


def test_entropy_holds_two_chunks_and_its_gradient_two_only_when_used():
    """with_entropy: two chunk-sized buffers in the forward; in the backward one, or two when a loss
    uses the entropy (the entropy bonus's p next to log p)."""
    chunk, vocab, rows = 16, 512, 64
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(1, rows, 8, generator=g, requires_grad=True)
    weight, targets = torch.randn(vocab, 8, generator=g), torch.randint(0, vocab, (1, rows), generator=g)
    one_chunk = chunk * vocab * 4
    for entropy_in_loss, chunks in ((False, 1), (True, 2)):
        with PeakLargeTensors(chunk * vocab) as forward:
            logp, entropy = token_logprobs(hidden, weight, targets, 0.7, chunk, with_entropy=True)
        with PeakLargeTensors(chunk * vocab) as backward:
            (logp.sum() + (entropy.sum() if entropy_in_loss else 0)).backward()
        assert forward.peak == 2 * one_chunk
        assert backward.peak == chunks * one_chunk, entropy_in_loss


# --------------------------------------------------------------------------- the architecture's lm_head


def _naive_head(hidden, weight, bias, targets, temperature, head):
    logits = (hidden @ weight.T + (0 if bias is None else bias)) * head.scale
    if head.softcap is not None:
        logits = torch.tanh(logits / head.softcap) * head.softcap
    return torch.log_softmax(logits.float() / temperature, -1).gather(-1, targets[..., None]).squeeze(-1)


@pytest.mark.parametrize(
    "head",
    [LogitTransform(), LogitTransform(scale=0.3), LogitTransform(softcap=2.0), LogitTransform(4.0, 3.0)],
)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 3, 1000])
def test_token_logprobs_bias_scale_softcap_values_and_grads(head, with_bias, chunk_size):
    g = torch.Generator().manual_seed(5)
    B, T, H, V = 2, 5, 8, 11
    leaves = [torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g)]
    leaves += [torch.randn(V, generator=g) * 2] if with_bias else []
    targets = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g)
    ours = [t.clone().requires_grad_() for t in leaves]
    bias = ours[2] if with_bias else None
    out = token_logprobs(ours[0], ours[1], targets, 0.7, chunk_size, bias=bias, head=head)
    (out * upstream).sum().backward()
    want = [t.clone().requires_grad_() for t in leaves]
    ref = _naive_head(want[0], want[1], want[2] if with_bias else None, targets, 0.7, head)
    (ref * upstream).sum().backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for got, expected in zip(ours, want, strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-5, atol=1e-5)


def test_token_logprobs_with_softcap_still_holds_one_chunk_of_logits():
    chunk, vocab, rows = 16, 512, 64
    g = torch.Generator().manual_seed(4)  # hidden size 4: the weight stays under the half-chunk threshold
    hidden = torch.randn(1, rows, 4, generator=g, requires_grad=True)
    weight = torch.randn(vocab, 4, generator=g, requires_grad=True)
    targets = torch.randint(0, vocab, (1, rows), generator=g)
    head = LogitTransform(scale=0.5, softcap=3.0)
    with PeakLargeTensors(chunk * vocab // 2) as forward:
        out = token_logprobs(hidden, weight, targets, 0.7, chunk, head=head)
    with PeakLargeTensors(chunk * vocab // 2) as backward:
        out.sum().backward()
    assert forward.peak == backward.peak == chunk * vocab * 4


def _tiny_config(name: str):
    """A one- or two-layer random config of each architecture whose head the log-prob path reproduces,
    with its logit transform set away from the identity."""
    import transformers as tf

    small = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=64)  # fmt: skip
    configs = {
        "llama": lambda: tf.LlamaConfig(**small),
        "phi": lambda: tf.PhiConfig(**small),  # lm_head with a bias
        "gemma2": lambda: tf.Gemma2Config(**small, head_dim=8, final_logit_softcapping=3.0),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**small, head_dim=8, final_logit_softcapping=3.0),
        "cohere": lambda: tf.CohereConfig(**small, logit_scale=0.25),
        "cohere2": lambda: tf.Cohere2Config(**small, logit_scale=0.25),
        "granite": lambda: tf.GraniteConfig(**small, logits_scaling=4.0),
        "granitemoe": lambda: tf.GraniteMoeConfig(**small, logits_scaling=4.0, num_local_experts=2),
        "minicpm3": lambda: tf.MiniCPM3Config(
            **small | dict(num_key_value_heads=4),
            dim_model_base=8,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_nope_head_dim=4,
            qk_rope_head_dim=4,
            v_head_dim=8,
        ),  # fmt: skip
        "hyperclovax": lambda: tf.HyperCLOVAXConfig(**small, logits_scaling=2.5),
        "falcon_h1": lambda: tf.FalconH1Config(
            **small,
            lm_head_multiplier=3.0,
            mamba_d_ssm=32,
            mamba_n_heads=4,
            mamba_d_state=8,
            mamba_chunk_size=16,
        ),  # fmt: skip
        "recurrent_gemma": lambda: tf.RecurrentGemmaConfig(
            **small | dict(num_hidden_layers=3), logits_soft_cap=3.0
        ),
    }
    return configs[name]()


ARCHITECTURES = ["llama", "phi", "gemma2", "gemma3_text", "cohere", "cohere2", "granite", "granitemoe",
                 "minicpm3", "hyperclovax", "falcon_h1", "recurrent_gemma"]  # fmt: skip


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_policy_logprobs_equal_the_models_own_logits(name):
    """Every architecture the log-prob path accepts: its log-probs are log_softmax(model(...).logits / T),
    the distribution generate() samples, with the lm_head bias, logit scale and soft cap applied."""
    from transformers import AutoModelForCausalLM

    from leangrpo.train.policy import Policy

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny_config(name)).float()
    lm_head = model.get_output_embeddings()
    with torch.no_grad():  # logits of tens, where a missing soft cap, scale or bias shows
        lm_head.weight.normal_(0, 3.0)
        if lm_head.bias is not None:
            lm_head.bias.normal_(0, 3.0)
    ids = torch.randint(0, 96, (2, 10))
    mask = torch.ones_like(ids)
    T, C = 0.7, 4
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -C - 1 : -1].float()
        want = torch.log_softmax(logits / T, -1).gather(-1, ids[:, -C:, None]).squeeze(-1)
        got = Policy(model, temperature=T)(ids, mask, C)
    assert want.std() > 0.5  # really spread out
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_policy_refuses_a_model_whose_logits_it_cannot_reproduce():
    """A head transform the path does not know (here a hook doubling the logits) is refused in one line
    when the Policy is built, not trained on silently."""
    from transformers import AutoModelForCausalLM

    from leangrpo.train.policy import HeadError, Policy

    model = AutoModelForCausalLM.from_config(_tiny_config("llama"))
    model.get_output_embeddings().register_forward_hook(lambda _m, _i, out: out * 2)
    with pytest.raises(HeadError) as info:
        Policy(model)
    assert "LlamaForCausalLM" in str(info.value) and "\n" not in str(info.value)


def test_the_head_check_runs_where_the_model_will_run(monkeypatch, tmp_path):
    """The trainer's policy and full fine-tuning's reference are checked on the device their wrapper
    places them on (here "meta" stands in for a GPU), not on the CPU they were loaded on: the check's
    forward must run the kernels (and attention) that training runs."""
    from types import SimpleNamespace

    from test_memory import make_cfg
    from transformers import AutoModelForCausalLM

    from leangrpo.train import policy as policy_module
    from leangrpo.train.distributed import Replicated
    from leangrpo.train.update import build_policy, build_reference

    checked_on: list[str] = []
    monkeypatch.setattr(policy_module, "check_head", lambda m, _h: checked_on.append(m.device.type))
    device = torch.device("meta")
    dist = Replicated(SimpleNamespace(device=device, prepare_model=lambda m: m.to(device)))
    cfg = make_cfg(grpo={"beta": 0.04})
    model = AutoModelForCausalLM.from_config(_tiny_config("llama"))
    build_reference(cfg, model, dist, None, 1, tmp_path, print)  # the reference copy
    assert checked_on == ["meta"]
    build_policy(cfg, model, dist, 1)
    assert checked_on == ["meta", "meta"]
