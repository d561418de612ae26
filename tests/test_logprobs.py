"""The chunked log-prob function of leangrpo.logprobs against the naive log_softmax, by value, gradient
and the memory it holds."""

from __future__ import annotations

import math

import pytest
import torch
from memtrack import PeakLargeTensors

from leangrpo.logprobs import token_logprobs

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
def test_entropy_matches_naive_and_leaves_the_gradient_alone(chunk_size):
    g = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(2, 5, 8, generator=g) * 3, torch.randn(11, 8, generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    logp, entropy = token_logprobs(h1, weight, targets, 0.7, chunk_size, with_entropy=True)
    logp.sum().backward()
    token_logprobs(h2, weight, targets, 0.7, chunk_size).sum().backward()
    logits = torch.log_softmax(hidden @ weight.T / 0.7, -1)
    torch.testing.assert_close(entropy, -(logits.exp() * logits).sum(-1), rtol=1e-5, atol=1e-5)
    assert not entropy.requires_grad
    torch.testing.assert_close(h1.grad, h2.grad, rtol=0, atol=0)


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
