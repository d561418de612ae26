"""The update reads values back from the device a fixed number of times a step, whatever its number of
micro-batches (on CUDA each read waits for the device to finish: issue 53, item 10), and in-backward
stepping costs one parameter's work a parameter. On CPU the reads are counted where Python makes them."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from leangrpo.run.resolve import validate_config
from leangrpo.train.optim import StepInBackward, build_optimizer

READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


@pytest.fixture
def host_reads(monkeypatch) -> Counter:
    """Counts the reads of a tensor's value into Python made by leangrpo's own code, by kind
    (transformers' sdpa mask makes one more a forward, `_ignore_causal_mask_sdpa`'s `.all()`: not ours)."""
    counts: Counter = Counter()
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counting(self, *args, _original=original, _name=name, **kwargs):
            if "/leangrpo/" in sys._getframe(1).f_code.co_filename:
                counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    return counts


def trainer_cfg(tmp_path, tiny_model_dir, gsm8k_dir, micro: int, accumulation: int):
    return validate_config({
        "model": {"name_or_path": str(tiny_model_dir)},
        "data": {"path": str(gsm8k_dir / "train.jsonl"), "limit": 4},
        "rewards": {"functions": [{"name": "int"}]},
        "grpo": {"num_generations": 4, "max_completion_length": 8, "beta": 0.04, "loss_type": "dapo"},
        "optim": {"per_device_train_batch_size": micro, "gradient_accumulation_steps": accumulation},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(tmp_path / f"run{micro}"),
    })  # fmt: skip


def test_reference_and_update_read_the_device_as_often_for_one_micro_batch_as_for_four(
    tmp_path, tiny_model_dir, gsm8k_dir, host_reads
):
    """The reference pass and the update of a 4-completion batch: one micro-batch of 4 or four of 1 make
    the same number of host reads (before: about 9 more a micro-batch, the metrics' float()s, the loss's
    item() and the crop's two int()s); the micro-batches' metrics are still each their own."""
    import leangrpo.train.trainer as trainer_mod

    reads, stats = {}, {}
    for micro, accumulation in ((4, 1), (1, 4)):  # the shared prompt layout's group: 4, then 1
        trainer = trainer_mod.Trainer(trainer_cfg(tmp_path, tiny_model_dir, gsm8k_dir, micro, accumulation))
        rollout = trainer.source.rollout(1).batch
        advantages = torch.linspace(-1, 1, len(rollout))
        host_reads.clear()
        update = trainer.updater.update(rollout, advantages, trainer.updater.reference(rollout))
        # less the shared layout's one check a step that each group's completions have one prompt
        reads[micro] = sum(host_reads.values()) - (trainer.updater.group > 1)
        stats[micro] = update.stats
    assert len(stats[1]) == 4 and len(stats[4]) == 1
    assert sum(float(s.tokens) for s in stats[1]) == float(stats[4][0].tokens) > 0
    assert reads[1] == reads[4], reads
    assert reads[4] <= 8, reads  # a handful a step: token count, loss, gradient norm, skip vote...


def step_in_backward_model() -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(6)))
    return model, list(model.parameters())


def optim_cfg(optimizer: str = "adamw"):
    return validate_config({
        "model": {"name_or_path": "m"}, "data": {"path": "d.jsonl"},
        "rewards": {"functions": [{"name": "int"}]},
        "optim": {"optimizer": optimizer, "max_grad_norm": None, "optimizer_in_backward": True,
                  "learning_rate": 1e-2},
    }).optim  # fmt: skip


def test_step_in_backward_visits_each_parameter_once_and_reads_the_device_once(host_reads):
    """Each in-backward step shows the optimizer one parameter (before: every step scanned all P of
    them, P² visits a backward), and the non-finite check stays on the device for fused AdamW (before:
    one host read a parameter); the result equals one ordinary step over all gradients."""
    model, params = step_in_backward_model()
    reference, ref_params = step_in_backward_model()
    optimizer = build_optimizer(params, optim_cfg())
    in_backward = StepInBackward(optimizer, params)
    visited = []
    init_group = optimizer._init_group

    def counting_init_group(group, *args, **kwargs):
        visited.append(len(group["params"]))
        return init_group(group, *args, **kwargs)

    optimizer._init_group = counting_init_group
    x = torch.randn(4, 8)
    host_reads.clear()
    with in_backward.stepping():
        model(x).square().mean().backward()
    assert sum(host_reads.values()) == 0, host_reads
    assert visited == [1] * len(params)
    norm = in_backward.grad_norm
    assert sum(host_reads.values()) == 1

    reference(x).square().mean().backward()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(ref_params, float("inf")))
    build_optimizer(ref_params, optim_cfg()).step()
    assert norm == pytest.approx(expected_norm, rel=1e-5)
    for a, b in zip(params, ref_params, strict=True):
        torch.testing.assert_close(a, b)


def test_step_in_backward_stops_at_a_non_finite_gradient_on_the_device(host_reads):
    """A non-finite gradient skips its own step and every later one of that backward (fused AdamW's
    found_inf, no host read); the norm is NaN; the next backward steps again."""
    model, params = step_in_backward_model()
    optimizer = build_optimizer(params, optim_cfg())
    in_backward = StepInBackward(optimizer, params)
    before = [p.detach().clone() for p in params]
    x = torch.randn(4, 8)
    x[0, 0] = float("nan")
    host_reads.clear()
    with in_backward.stepping():
        model(x).square().mean().backward()
    assert sum(host_reads.values()) == 0, host_reads
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    assert all(p.grad is None for p in params)
    assert in_backward.grad_norm != in_backward.grad_norm  # NaN
    assert all(int(optimizer.state[p]["step"]) == 0 for p in params if p in optimizer.state)
    with in_backward.stepping():
        model(torch.randn(4, 8)).square().mean().backward()
    assert all(not torch.equal(a, p) for a, p in zip(before, params, strict=True))
    assert in_backward.grad_norm > 0
