"""End-to-end CLI runs on a tiny random model with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from leangrpo.cpu import onednn

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parent
# Subprocesses run this tree's code, wherever the venv's editable install points.
PYTHONPATH = os.pathsep.join([str(TESTS.parent / "src"), str(TESTS)])

METRIC_KEYS = {
    "step", "loss", "grad_norm", "learning_rate", "reward", "reward_std", "kl", "clip_ratio/region_mean",
    "completions/mean_length", "completions/max_length", "completions/clipped_ratio", "frac_reward_zero_std",
    "reward_failures", "tokens_per_s", "step_seconds", "peak_memory_mb", "entropy",
    "time/rollout", "time/score", "time/advantages", "time/reference", "time/update",
}  # fmt: skip


def write_config(path: Path, model_dir: Path, data: Path, out: Path, **sections) -> Path:
    cfg = {
        "model": {"name_or_path": str(model_dir), "gradient_checkpointing": False},
        "data": {"path": str(data), "limit": 64},
        "rewards": {"functions": [{"name": "toy_rewards:vowel_share"}]},
        "grpo": {"num_generations": 8, "max_completion_length": 8, "max_prompt_length": 128},
        "optim": {
            "learning_rate": 1e-3,
            "per_device_train_batch_size": 16,
            "gradient_accumulation_steps": 2,
            "max_steps": 6,
            "lr_scheduler_type": "constant",
        },
        "logging": {"log_completions_steps": 3, "progress_bar": False},
        "output_dir": str(out),
    }
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(*args: str, env_extra: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "leangrpo", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def torchrun(
    script: Path, *args: str, port: int, env_extra: dict | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    """`script` in 2 CPU processes under torchrun (what `accelerate launch` runs; gloo on CPU); `port`
    differs per test, so that tests in parallel do not meet on one rendezvous."""
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port),
         str(script), *args],
        capture_output=True, text=True, env=env, timeout=timeout,
    )  # fmt: skip


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_train_reward_rises(tmp_path, tiny_model_dir, gsm8k_dir):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", out)
    proc = run_cli("train", "-c", str(cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("cpu.matmul auto: " in proc.stdout + proc.stderr) == onednn.available()  # what auto chose

    rows = read_metrics(out)
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert METRIC_KEYS | {"rewards/vowel_share/mean"} <= rows[0].keys()
    first, last = rows[0]["reward"], sum(r["reward"] for r in rows[-2:]) / 2
    assert last > first + 0.2, [r["reward"] for r in rows]

    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["grpo"]["num_generations"] == 8 and resolved["grpo"]["loss_type"] == "dapo"
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [1, 3, 6]
    assert {"question", "completion", "extracted", "gold", "rewards"} <= samples[0].keys()
    assert (out / "model" / "model.safetensors").is_file()

    again = run_cli("train", "-c", str(cfg))  # an earlier run is never silently overwritten
    assert again.returncode == 2 and "--overwrite" in again.stderr


def test_lora_kl_iterations_and_overrides(tmp_path, tiny_model_dir, gsm8k_dir):
    """LoRA (reference = adapter disabled), beta > 0, micro-batching and CLI overrides."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", out)
    proc = run_cli(
        "train", "-c", str(cfg),
        "model.lora.enabled=true", "model.lora.r=4", "model.gradient_checkpointing=true",
        "grpo.beta=0.04", "grpo.loss_type=grpo", "grpo.num_generations=4",
        "optim.per_device_train_batch_size=4", "optim.max_steps=2", "optim.learning_rate=1e-2",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert len(rows) == 2
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the adapter starts as a no-op
    assert rows[1]["kl"] > 0  # ...and has moved the policy away from the reference since
    assert (out / "model" / "adapter" / "adapter_config.json").is_file()
    assert (out / "model" / "model.safetensors").is_file()  # merged for transformers / vLLM
    assert yaml.safe_load((out / "config.yaml").read_text())["model"]["lora"]["r"] == 4


def test_bad_input_is_one_line(tmp_path, tiny_model_dir, gsm8k_dir):
    cfg = write_config(tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "r")
    for args, needle in [
        (["grpo.num_generations=3"], "grpo.num_generations"),
        (["rewards.functions=[{name: no_such_reward}]"], "no_such_reward"),
        (["data.path=missing.jsonl"], "missing.jsonl"),
        (["model.name_or_path=/nonexistent/model"], "/nonexistent/model"),
        (["optim.optimizer_in_backward=true"], "set max_grad_norm: null"),
    ]:
        proc = run_cli("train", "-c", str(cfg), *args)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert needle in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_optimizer_in_backward_from_the_cli(tmp_path, tiny_model_dir, gsm8k_dir):
    """Full fine-tuning with each parameter stepped in the backward trains from the CLI (the gradient
    norm still logged), and is refused in one line on two processes."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", out)
    args = ["optim.optimizer_in_backward=true", "optim.max_grad_norm=null", "optim.max_steps=2",
            "optim.per_device_train_batch_size=8", "optim.gradient_accumulation_steps=1"]  # fmt: skip
    proc = run_cli("train", "-c", str(cfg), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert len(rows) == 2 and all(r["grad_norm"] > 0 for r in rows)
    assert yaml.safe_load((out / "config.yaml").read_text())["optim"]["optimizer_in_backward"] is True
    two = torchrun(TESTS / "ddp_worker.py", str(cfg), *args, f"output_dir={tmp_path / 'two'}", port=29518,
                   env_extra={"LEANGRPO_TEST_OUT": str(tmp_path)})  # fmt: skip
    assert two.returncode != 0 and "optimizer_in_backward runs on one process only" in two.stderr


def test_reference_on_disk_from_the_cli(tmp_path, tiny_model_dir, gsm8k_dir):
    """Full fine-tuning with its KL reference memory-mapped from disk trains from the CLI: the KL starts
    at 0 and grows once the policy moves."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", out)
    proc = run_cli("train", "-c", str(cfg), "grpo.beta=0.04", "cpu.reference_on_disk=true",
                   "optim.max_steps=2", "optim.learning_rate=1e-2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(out)
    assert len(rows) == 2
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6) and rows[1]["kl"] > 0
    assert yaml.safe_load((out / "config.yaml").read_text())["cpu"]["reference_on_disk"] is True


def test_two_processes_stay_in_sync_on_different_prompts(tmp_path, tiny_model_dir, gsm8k_dir):
    cfg = write_config(
        tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", tmp_path / "run",
        rewards={"functions": [{"name": "toy_rewards:vowel_share"}, {"name": "toy_rewards:record_prompts"}]},
        optim={"max_steps": 2, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        # a KL reference, each rank's memory-mapped from its own unnamed file (cpu.reference_on_disk)
        grpo={"num_iterations": 2, "loss_type": "dapo", "beta": 0.04},
        cpu={"reference_on_disk": True},
    )  # fmt: skip
    proc = torchrun(
        TESTS / "ddp_worker.py", str(cfg), port=29517, env_extra={"LEANGRPO_TEST_OUT": str(tmp_path)}
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    w0, w1 = ((tmp_path / f"weights-rank{r}.sha256").read_text() for r in (0, 1))
    assert w0 == w1
    p0, p1 = (set((tmp_path / f"prompts-rank{r}.txt").read_text().splitlines()) for r in (0, 1))
    assert len(p0) == len(p1) == 2  # 1 prompt × G=8 per step, 2 steps
    assert not p0 & p1
    assert all(r["kl"] is not None for r in read_metrics(tmp_path / "run"))


def test_a_process_of_a_multi_process_run_leaves_without_interpreter_teardown(tmp_path):
    """Under WORLD_SIZE > 1 the CLI ends the process with os._exit once atexit handlers have run and output
    is flushed (gloo's threads can abort a finalizing interpreter): what was printed is kept, the exit code
    passed on, nothing after it runs. With one process, nothing changes."""
    script = (
        "import atexit, pathlib\n"
        "from leangrpo.cli import _leave_if_one_of_many\n"
        f"atexit.register(pathlib.Path({str(tmp_path / 'atexit-ran')!r}).touch)\n"
        "print('kept', end='')\n"
        "_leave_if_one_of_many(3)\n"
        "print(' and on')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | {"PYTHONPATH": PYTHONPATH}
    many = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**env, "WORLD_SIZE": "2"}
    )
    assert (many.returncode, many.stdout) == (3, "kept"), many.stderr
    assert (tmp_path / "atexit-ran").is_file()
    one = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env={**env, "WORLD_SIZE": "1"}
    )
    assert (one.returncode, one.stdout) == (0, "kept and on\n"), one.stderr


def test_model_whose_logits_the_logprob_path_cannot_reproduce_is_refused(tmp_path, tiny_model_dir, gsm8k_dir):
    """A config that names a soft cap its architecture never applies (Llama ignores final_logit_softcapping):
    training would optimise another distribution than the one sampled, so `train` refuses in one line."""
    import shutil

    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "final_logit_softcapping": 1.0}))
    cfg = write_config(tmp_path / "run.yaml", model, gsm8k_dir / "train.jsonl", tmp_path / "r")
    proc = run_cli("train", "-c", str(cfg))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    (error,) = [line for line in proc.stderr.splitlines() if "error" in line]
    assert error.startswith("error: LlamaForCausalLM transforms its logits"), proc.stderr
