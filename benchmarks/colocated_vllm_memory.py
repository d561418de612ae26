"""Per-process peak memory of colocated vLLM on 2 training processes (CPU, gloo), DDP against FSDP2, beside
`leangrpo plan`'s per-process figures for the same run.

    .venv-vllm/bin/python benchmarks/colocated_vllm_memory.py [--model small] [--steps 3]

Each launch is `accelerate launch --config_file configs/accelerate/{ddp,fsdp2}.yaml --num_processes 2 -m
leangrpo train` of full fine-tuning (AdamW, float32) on a random-weight model (rollout_vllm.py's
architectures), each process with its own vLLM engine (VLLM_CPU_KVCACHE_SPACE=1 GiB). Measured: rank 0's
peak RSS at the last step (metrics.jsonl's peak_memory_mb, before the final save, which under FSDP2 gathers
the model on rank 0) and rank 1's peak RSS over its whole life (VmHWM, polled). Planned: the peak of
tensors per process (`plan.estimate(...).peak`, --device cpu) without the engine, whose own weight copy and
KV cache are the same under both.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from rollout_vllm import ARCHS, build  # noqa: E402

from leangrpo.commands import plan  # noqa: E402
from leangrpo.run.resolve import load_config  # noqa: E402

MIB = 2**20


def write_config(model: Path, out: Path, steps: int) -> Path:
    cfg = {
        "model": {"name_or_path": str(model), "gradient_checkpointing": False},
        "data": {"path": str(ROOT / "tests" / "data" / "gsm8k" / "train.jsonl"), "limit": 64},
        "rewards": {"functions": [{"name": "int"}]},
        "grpo": {"use_vllm": True, "num_generations": 4, "max_completion_length": 8},
        "optim": {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": steps},
        "logging": {"progress_bar": False, "save_steps": 0},
        "output_dir": str(out / "run"),
    }
    path = out / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def peak_rss(pid: int) -> int:
    """VmHWM of a process, in bytes (0 once it has gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next(int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM"))


def launch(kind: str, config: Path, port: int) -> dict[str, float]:
    """One run; rank 0's last-step peak_memory_mb, rank 1's VmHWM and the run's seconds."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT / "src"),
        "OMP_NUM_THREADS": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / "configs" / "accelerate" / f"{kind}.yaml"), "--num_processes", "2",
           "--main_process_port", str(port), "-m", "leangrpo", "train", "-c", str(config)]  # fmt: skip
    start, rank1 = time.monotonic(), 0
    with subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        while proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                try:
                    if child.environ().get("RANK") == "1" and "leangrpo" in child.cmdline():
                        rank1 = max(rank1, peak_rss(child.pid))
                except psutil.Error:
                    continue
            time.sleep(0.5)
        log = proc.stdout.read() if proc.stdout else ""
    if proc.returncode:
        raise SystemExit(f"{kind} run failed:\n{log[-3000:]}")
    run = yaml.safe_load(config.read_text())["output_dir"]
    rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "loss" in r][-1]
    return {"rank0": last["peak_memory_mb"] * MIB, "rank1": rank1, "seconds": time.monotonic() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(ARCHS), default="small")
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args()
    model = build(a.model, "float32")
    print(f"model {a.model}; load before: {os.getloadavg()}", flush=True)
    rows = []
    for kind, fsdp, port in (("ddp", 1, 29571), ("fsdp2", 2, 29572)):
        with tempfile.TemporaryDirectory() as tmp:
            config = write_config(model, Path(tmp), a.steps)
            measured = launch(kind, config, port)
            knobs = plan.knobs_from_config(load_config(str(config)), fsdp=fsdp, device="cpu")
            est = plan.estimate(plan.resolve_shape(str(model)), knobs)
        rows.append((kind, measured, est.peak))
        ranks = f"rank 0 {measured['rank0'] / MIB:.0f} MiB, rank 1 {measured['rank1'] / MIB:.0f} MiB"
        print(f"{kind}: {ranks}, plan {est.peak / MIB:.0f} MiB of tensors ({est.phase}), "
              f"{measured['seconds']:.0f} s", flush=True)  # fmt: skip
    (_, ddp, ddp_plan), (_, fsdp, fsdp_plan) = rows
    for rank in ("rank0", "rank1"):
        print(
            f"DDP - FSDP2, {rank}: measured {(ddp[rank] - fsdp[rank]) / MIB:.0f} MiB, "
            f"planned {(ddp_plan - fsdp_plan) / MIB:.0f} MiB"
        )
    print(f"load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
