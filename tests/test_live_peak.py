"""benchmarks/live_peak.py's tracker: live tensor storages counted once, from creation to the last tensor."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "live_peak.py"
MIB = 2**20


def load_script():
    spec = importlib.util.spec_from_file_location("live_peak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["live_peak"] = module
    spec.loader.exec_module(module)
    return module


def test_live_tensors_counts_each_storage_while_any_tensor_on_it_lives():
    live_peak = load_script()
    before = torch.zeros(MIB // 4)  # 1 MiB alive when tracking starts
    tracker = live_peak.LiveTensors()
    with tracker:
        assert tracker.start >= MIB
        a = torch.ones(2 * MIB // 4)  # 2 MiB
        view = a[:10]
        a.mul_(2)  # in place: same storage
        assert tracker.now - tracker.start == 2 * MIB
        del a
        assert tracker.now - tracker.start == 2 * MIB  # the view keeps the storage alive
        del view
        assert tracker.now == tracker.start
        del before
        assert tracker.now == tracker.start - MIB
        b = torch.ones(3 * MIB // 4)
        del b
    assert tracker.peak - tracker.start == 2 * MIB  # the 3 MiB came after the 1 MiB was gone


def test_live_tensors_sees_what_autograd_saves_until_the_backward():
    live_peak = load_script()
    x = torch.randn(MIB // 4, requires_grad=True)
    tracker = live_peak.LiveTensors()
    with tracker:
        y = x.exp()  # exp saves its output for the backward
        z = y.sin()  # sin saves its input, y
        del y
        assert tracker.now - tracker.start == 2 * MIB  # y (saved) and z
        z.sum().backward()
        del z
        assert tracker.now - tracker.start == MIB  # x.grad only
    assert tracker.peak - tracker.start >= 3 * MIB  # y, z and a gradient at once in the backward


def test_logprob_workspace_of_the_update_forward_matches_the_plan():
    """The update's forward (log-probs + entropy) holds two fp32 chunks of logits at most, as planned."""
    from leangrpo.commands import plan
    from leangrpo.core.logprobs import token_logprobs

    live_peak = load_script()
    shape = plan.ModelShape.from_config(plan._llama(32, 64, 1, 4, 4, 40_000, True), "toy")
    knobs = plan.Knobs(dtype="bfloat16", logprob_chunk_size=64)
    hidden, weight = (
        torch.randn(1, 128, 32, dtype=torch.bfloat16),
        torch.randn(40_000, 32, dtype=torch.bfloat16),
    )
    targets = torch.randint(0, 40_000, (1, 128))
    for entropy in (False, True):
        tracker = live_peak.LiveTensors()
        with tracker, torch.no_grad():
            out = token_logprobs(hidden, weight, targets, chunk_size=64, with_entropy=entropy)
        del out
        want = plan.logprob_workspace(shape, knobs, 128, backward=False, entropy=entropy)
        assert abs((tracker.peak - tracker.start) / want - 1) < 0.02, (
            entropy,
            tracker.peak - tracker.start,
            want,
        )


def test_logprob_backward_workspace_with_a_trained_head_matches_the_plan():
    """Full fine-tuning: the fp32 lm_head gradient lives through every chunk, then through its bf16 cast."""
    from leangrpo.commands import plan
    from leangrpo.core.logprobs import token_logprobs

    live_peak = load_script()
    shape = plan.ModelShape.from_config(plan._llama(64, 64, 1, 4, 4, 40_000, True), "toy")
    knobs = plan.Knobs(method="full", dtype="bfloat16", logprob_chunk_size=32)
    hidden = torch.randn(1, 128, 64, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(40_000, 64, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 40_000, (1, 128))
    tracker = live_peak.LiveTensors()
    with tracker:
        token_logprobs(hidden, weight, targets, chunk_size=32).sum().backward()
    want = plan.logprob_workspace(shape, knobs, 128, backward=True)
    assert abs((tracker.peak - tracker.start) / want - 1) < 0.03, (tracker.peak - tracker.start, want)


@pytest.mark.slow
@pytest.mark.parametrize("point", ["tiny/4/128/qlora/on", "tiny/4/128/full-ib/on"])
def test_live_peak_script_measures_a_tiny_point(tmp_path, point):
    """The whole benchmark on a tiny model (4-bit base, LoRA, 8-bit AdamW, bf16; full fine-tuning with the
    optimizer stepped in the backward): it runs, and the plan is within 10% of the measured live peak."""
    import json
    import subprocess

    out = tmp_path / "points.jsonl"
    args = ["--only", point, "--work", str(tmp_path), "--json", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "worst error" in proc.stdout
    point = json.loads(out.read_text())
    assert point["completion_length_mean"] == 128
    measured = max(point["phases"].values())
    assert abs(max(point["plan"].values()) / measured - 1) < 0.10, point


def test_long_sequence_path_measures_each_phase_of_a_tiny_model(tmp_path):
    """--long on a tiny model: the rollout on a filled full-size KV cache with real decode steps at its end,
    one micro-batch of the reference and of the update; each phase's live peak within 10% of the plan."""
    import json
    import subprocess

    out = tmp_path / "points.jsonl"
    args = ["--long", "--only", "tiny/8/1024/lora/long", "--work", str(tmp_path), "--json", str(out)]
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    point = json.loads(out.read_text())
    assert set(point["phases"]) == {"rollout", "reference", "update"}, point
    plan_of = {"rollout": "generation", "reference": "reference", "update": "update"}
    for name, measured in point["phases"].items():
        assert abs(point["plan"][plan_of[name]] / measured - 1) < 0.10, (name, point)


def test_the_prefill_repeat_holds_one_layer_of_the_prompt_cache_beside_the_group_cache():
    """prefill_once_per_group repeats a prompt's cache for its group layer by layer: at the last layer the
    whole group-sized cache and that layer's one-prompt buffers are alive together, as the plan counts."""
    import transformers

    from leangrpo.commands import plan
    from leangrpo.engines.hf import kv_cache, prefill_once_per_group

    live_peak = load_script()
    dims = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=1000, **dims)).eval()
    shape = plan.ModelShape.from_config(plan._llama(64, 128, 2, 4, 2, 1000, True, 16), "toy")
    ids, capacity = torch.randint(0, 1000, (1, 8)).repeat(8, 1), 4096
    cache = kv_cache(model, capacity)
    tracker = live_peak.LiveTensors()
    with tracker, torch.no_grad():
        prefill_once_per_group(model, ids, torch.ones_like(ids), 8, cache)
    knobs = plan.Knobs(dtype="float32", num_generations=8, per_device_train_batch_size=8,
                       gradient_accumulation_steps=1, max_prompt_length=8,
                       max_completion_length=capacity - 8)  # fmt: skip
    want = plan.kv_cache_bytes(shape, 8, capacity, 4) + plan.generation_workspace(shape, knobs)
    assert abs((tracker.peak - tracker.start) / want - 1) < 0.02, (tracker.peak - tracker.start, want)
