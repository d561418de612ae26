"""The shared-prompt layout: one copy of a prompt per decoder row gives the same log-probs and gradients
as one prompt copy per completion."""

from __future__ import annotations

import pytest
import torch
from test_models import LORA, assert_grads_close, load_tiny, randomize_lora_b

from leangrpo.core import shared_prompt
from leangrpo.engines.types import RolloutBatch
from leangrpo.models.load import apply_lora, enable_checkpointing
from leangrpo.train.policy import LayoutError, Policy, micro_batch_logprobs


def test_positions_and_predictors_by_hand():
    # One row: a left-padded 3-column prompt with 2 real tokens, then 2 completions of 2 tokens.
    position_ids, predictors = shared_prompt.positions(torch.tensor([[0, 1, 1]]), num_completion=2, group=2)
    assert position_ids.tolist() == [[0, 0, 1, 2, 3, 2, 3]]
    # Token 0 of both completions comes from the prompt's last column (2); token 1 from token 0 of its own.
    assert predictors.tolist() == [[2, 3], [2, 5]]
    # Two rows of 3 + 2 columns: the second row's flat indices start at 5.
    _, predictors = shared_prompt.positions(torch.ones(2, 3, dtype=torch.long), num_completion=2, group=1)
    assert predictors.tolist() == [[2, 3], [7, 8]]


def test_pack_lays_each_group_out_once():
    prompts = torch.tensor([[1, 2], [1, 2], [3, 4], [3, 4]])
    completions = torch.tensor([[5, 6], [7, 8], [9, 10], [11, 12]])
    assert shared_prompt.pack(prompts, completions, 2).tolist() == [[1, 2, 5, 6, 7, 8], [3, 4, 9, 10, 11, 12]]


def test_unsupported_reason_names_the_attention():
    from transformers import LlamaConfig

    cfg = LlamaConfig()
    cfg._attn_implementation = "sdpa"
    assert shared_prompt.unsupported_reason(cfg) is None
    cfg._attn_implementation = "eager"
    assert "eager" in shared_prompt.unsupported_reason(cfg)


@pytest.fixture
def rollout(tokenizer_for_rollout):
    """2 prompts of different lengths (left padding) × 4 completions; two end early (masked tails)."""
    tok = tokenizer_for_rollout
    enc = tok(
        ["x y", "the quick brown fox jumps over"], return_tensors="pt", padding=True, add_special_tokens=False
    )
    assert enc.attention_mask[0, 0] == 0  # left-padded
    g = torch.Generator().manual_seed(0)
    completion_ids = torch.randint(5, 1000, (8, 6), generator=g)
    completion_mask = torch.ones_like(completion_ids)
    completion_mask[1, 4:] = 0
    completion_mask[6, 2:] = 0
    return RolloutBatch(
        enc.input_ids.repeat_interleave(4, 0),
        enc.attention_mask.repeat_interleave(4, 0),
        completion_ids,
        completion_mask,
        torch.zeros(8, dtype=torch.bool),
        [""] * 8,
    )


@pytest.fixture(scope="module")
def tokenizer_for_rollout(tiny_model_dir):
    from leangrpo.models.load import load_tokenizer

    return load_tokenizer(str(tiny_model_dir))


def _weighted_logprobs(model, rollout, group, checkpointing, packed=False):
    if checkpointing:
        enable_checkpointing(model)
    model.train()
    logp, mask = micro_batch_logprobs(
        Policy(model, temperature=0.8, chunk_size=5, share_prompt=group > 1 or packed),
        rollout,
        slice(None),
        group=group,
        packed=packed,
    )
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    (logp * weights * mask).sum().backward()
    return logp.detach(), mask.bool()


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_matches_one_prompt_per_completion_full(tiny_model_dir, rollout, group, checkpointing):
    models = [load_tiny(tiny_model_dir) for _ in range(2)]
    want, mask = _weighted_logprobs(models[0], rollout, 1, checkpointing)
    got, _ = _weighted_logprobs(models[1], rollout, group, checkpointing)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    # Sensitive to a predictor off by one: the neighbouring token's log-probs differ.
    assert not torch.allclose(got[:, 1:][mask[:, 1:]], want[:, :-1][mask[:, 1:]], atol=1e-3)
    named = [dict(m.named_parameters()) for m in models]
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]:
        assert_grads_close(named[1][name].grad, named[0][name].grad, name)


@pytest.mark.parametrize("packed", [False, True], ids=["shared", "packed"])
def test_shared_prompt_and_packed_match_one_prompt_per_completion_lora(tiny_model_dir, rollout, packed):
    """Under LoRA too: the shared-prompt and the packed layouts give one-row-per-completion's log-probs
    and the same gradient on every adapter weight."""

    def lora_model():
        torch.manual_seed(3)
        m = apply_lora(load_tiny(tiny_model_dir), LORA)
        randomize_lora_b(m, seed=3)
        return m

    models = [lora_model(), lora_model()]
    want, mask = _weighted_logprobs(models[0], rollout, 1, True)
    got, _ = _weighted_logprobs(models[1], rollout, 4, True, packed=packed)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    named = [dict(m.named_parameters()) for m in models]
    for name in [n for n, p in named[0].items() if p.requires_grad]:
        assert_grads_close(named[1][name].grad, named[0][name].grad, name)


@pytest.mark.parametrize(
    ("kwargs", "option"), [({"group": 4}, "share_prompt"), ({"packed": True}, "padding_free")]
)
def test_attention_that_ignores_the_layout_is_refused(tiny_model_dir, rollout, kwargs, option):
    """A model whose attention never reaches shared_prompt's function would silently let every
    completion attend to the others: Policy notices and says which setting avoids it."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def ignores_layout(module, query, key, value, attention_mask, **kw):
        kw.pop(shared_prompt.KWARG, None)
        return sdpa_attention_forward(module, query, key, value, None, **kw)

    policy = Policy(load_tiny(tiny_model_dir), share_prompt=True)
    AttentionInterface.register(shared_prompt.ATTENTION, ignores_layout)
    try:
        with pytest.raises(LayoutError, match=f"set grpo.{option}: false"):
            micro_batch_logprobs(policy, rollout, slice(None), **kwargs)
    finally:
        AttentionInterface.register(shared_prompt.ATTENTION, shared_prompt._attention)


def test_the_layout_leaves_sdpa_and_other_models_alone(tiny_model_dir, rollout):
    """The layout's attention is registered under its own name: transformers' "sdpa" entry stays its own,
    and a model that was not switched keeps "sdpa"."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    switched, other = load_tiny(tiny_model_dir), load_tiny(tiny_model_dir)
    Policy(switched, share_prompt=True)
    assert switched.config._attn_implementation == shared_prompt.ATTENTION
    assert other.config._attn_implementation == "sdpa"
    assert AttentionInterface._global_mapping["sdpa"] is sdpa_attention_forward


def test_trainer_step_is_the_same_with_and_without_sharing(tmp_path, tiny_model_dir, gsm8k_dir):
    """The whole step (LoRA reference with beta > 0, old log-probs with 2 iterations, 2 prompts × G=4
    in micro-batches of 2, so each row shares a prompt between 2 completions) gives the same numbers.

    A vanishing learning rate keeps iteration 2 on the same weights: Adam's first step moves every
    weight by ~lr whatever its gradient's size, so float noise would otherwise decide signs. Then the
    policy equals the reference and the old policy: a misaligned reference shows up as a KL > 0, and
    misaligned old log-probs as a different loss. LoRA dropout is off: its random masks follow the
    layout's tensor shapes."""
    from test_memory import make_cfg

    from leangrpo.train.trainer import Trainer

    results = []
    for share in (True, False):
        cfg = make_cfg(
            model={"name_or_path": str(tiny_model_dir), "lora": {"enabled": True, "r": 4, "dropout": 0.0}},
            data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
            rewards={"functions": [{"name": "toy_rewards:vowel_share"}]},
            grpo={"num_generations": 4, "max_completion_length": 6, "beta": 0.04, "num_iterations": 2,
                  "share_prompt": share},
            optim={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 1,
                   "learning_rate": 1e-30},
            logging={"progress_bar": False, "log_completions_steps": 0},
            output_dir=str(tmp_path / f"run-{share}"),
        )  # fmt: skip
        trainer = Trainer(cfg)
        results.append((trainer.group, trainer.step(1)))
    (on_group, on), (off_group, off) = results
    assert (on_group, off_group) == (2, 1)
    for key in ("loss", "grad_norm", "kl", "reward"):
        assert on[key] == pytest.approx(off[key], rel=1e-5, abs=1e-7), key
    assert on["grad_norm"] > 0 and abs(on["kl"]) < 1e-7


def test_packed_layout_by_hand():
    """Two prompts (one left-padded) × 2 completions of 2, 1, 3 and 0 real tokens: the real tokens only,
    each group's prompt then its completions, positions counting on from the own prompt."""
    prompt_ids = torch.tensor([[0, 1, 2], [0, 1, 2], [3, 4, 5], [3, 4, 5]])
    prompt_mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[10, 11, 0], [12, 0, 0], [13, 14, 15], [0, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [0, 0, 0]])
    prompt_len, completion_len = prompt_mask[::2].sum(1).tolist(), completion_mask.sum(1).tolist()
    p = shared_prompt.packed(prompt_ids, completion_ids, prompt_len, completion_len, group=2)
    assert p.input_ids.tolist() == [[1, 2, 10, 11, 12, 3, 4, 5, 13, 14, 15]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3, 2, 0, 1, 2, 3, 4, 5]]
    # Token 0 of each completion comes from its prompt's last position (1, 1, 7), later ones from their own.
    assert p.predictors.tolist() == [1, 2, 1, 7, 8, 9]
    assert p.targets.tolist() == [10, 11, 12, 13, 14, 15]
    assert p.real.tolist() == completion_mask.bool().tolist()
    firsts, others = p.blocks
    # Each prompt with its first completion: one causal block (pad slots → 0).
    assert firsts.query.tolist() == [[0, 1, 2, 3, 0, 0], [5, 6, 7, 8, 9, 10]]
    causal = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert firsts.mask[0, 0, :4, :4].int().tolist() == causal
    # The second completion (position 4) sees its prompt (0, 1) and itself, not the first completion;
    # the empty one has no block.
    assert others.query.tolist() == [[4]] and others.key.tolist() == [[0, 1, 4]]
    assert others.mask.tolist() == [[[[True, True, True]]]]
    order = torch.cat([b.query[b.real] for b in p.blocks])[p.order]
    assert order.tolist() == list(range(11))


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_packed_matches_padded_full(tiny_model_dir, rollout, group, checkpointing):
    """Packed (with and without a shared prompt) against one padded prompt copy per completion: the same
    log-probs and gradients, and 0 where a completion has ended."""
    models = [load_tiny(tiny_model_dir) for _ in range(2)]
    want, mask = _weighted_logprobs(models[0], rollout, 1, checkpointing)
    got, _ = _weighted_logprobs(models[1], rollout, group, checkpointing, packed=True)
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    assert (got[~mask] == 0).all() and (~mask).any()
    assert not torch.allclose(got[:, 1:][mask[:, 1:]], want[:, :-1][mask[:, 1:]], atol=1e-3)
    named = [dict(m.named_parameters()) for m in models]
    for name in ["model.embed_tokens.weight", "model.layers.0.self_attn.k_proj.weight", "model.norm.weight"]:
        assert_grads_close(named[1][name].grad, named[0][name].grad, name)


def _fed_lengths(model) -> list[tuple[int, int]]:
    """Records the [batch, length] of every sequence the decoder's first layer is fed."""
    seen: list[tuple[int, int]] = []
    layer = model.get_decoder().layers[0]
    layer.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape[:2])))
    return seen


@pytest.mark.parametrize("group", [1, 4])
def test_packed_pass_feeds_the_real_tokens_only(tiny_model_dir, rollout, group):
    """The decoder runs over one sequence as long as the real tokens (each prompt once per group), not
    rows × the longest completion."""
    policy = Policy(load_tiny(tiny_model_dir), share_prompt=True)
    seen = _fed_lengths(policy.lm)
    micro_batch_logprobs(policy, rollout, slice(None), group=group, packed=True)
    prompts = int(rollout.prompt_mask[::group].sum())
    real = prompts + int(rollout.completion_mask.sum())
    assert seen == [(1, real)]
    padded = int(rollout.prompt_mask[::group].sum()) + len(rollout) * rollout.completion_ids.shape[1]
    assert real < padded


def test_trainer_step_is_the_same_packed_and_padded(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    """A whole step with a reference copy (beta > 0), old log-probs (2 iterations) and completions that end
    early: the same numbers with grpo.padding_free on (the default) and off, and with it on, every pass
    (the reference's, the old policy's, the update's) feeds the decoder the micro-batch's real tokens."""
    from test_memory import make_cfg

    from leangrpo.train.trainer import Trainer

    results = []
    for packed in (True, False):
        grpo = {"num_generations": 4, "max_completion_length": 6, "beta": 0.04, "num_iterations": 2}
        cfg = make_cfg(
            model={"name_or_path": str(tiny_model_dir), "gradient_checkpointing": False},
            data={"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
            rewards={"functions": [{"name": "toy_rewards:vowel_share"}]},
            grpo=grpo if packed else {**grpo, "padding_free": False},
            optim={"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 1,
                   "learning_rate": 1e-30},
            logging={"progress_bar": False, "log_completions_steps": 0},
            output_dir=str(tmp_path / f"run-{packed}"),
        )  # fmt: skip
        trainer = Trainer(cfg)
        policy_seen, ref_seen = _fed_lengths(trainer.unwrapped.lm), _fed_lengths(trainer.ref_policy.lm)
        real_rollout, rollouts = trainer.source.rollout, []

        def ragged(*args, real_rollout=real_rollout, rollouts=rollouts, policy_seen=policy_seen, **kwargs):
            out = real_rollout(*args, **kwargs)
            mask = out.batch.completion_mask  # rows end after 1 to 6 tokens
            mask.copy_(torch.arange(mask.shape[1]) < torch.tensor([[1], [6], [2], [3], [6], [4], [5], [2]]))
            rollouts.append(out.batch)
            policy_seen.clear()  # generation's calls
            return out

        monkeypatch.setattr(trainer.source, "rollout", ragged)
        results.append(trainer.step(1))
        if packed:
            (batch,) = rollouts
            want = [
                int(batch.prompt_mask[rows][:: trainer.group].sum() + batch.completion_mask[rows].sum())
                for rows in (slice(s, s + 2) for s in range(0, 8, 2))
            ]
            assert ref_seen == [(1, n) for n in want]
            assert policy_seen == [(1, n) for n in want * 3]  # old log-probs, then 2 iterations
        else:
            assert all(rows == 2 // trainer.group for rows, _ in policy_seen + ref_seen)
    on, off = results
    for key in ("loss", "grad_norm", "kl", "reward", "entropy"):
        assert on[key] == pytest.approx(off[key], rel=1e-5, abs=1e-7), key
    assert on["grad_norm"] > 0 and abs(on["kl"]) < 1e-7
