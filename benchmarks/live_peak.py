"""Live-tensor simulation of `leangrpo plan`: the peak bytes of live tensors during a real GRPO step.

That peak is what `torch.cuda.max_memory_allocated` reports on a GPU, less the allocator's rounding,
and it can be measured exactly on a CPU: every tensor an op returns is seen by a TorchDispatchMode
(`LiveTensors`), counted once per storage (views and in-place results share it) from the op that
makes it until the last tensor on that storage dies; the tensors alive when tracking starts (weights,
optimizer state) are counted from the start. Not seen: scratch memory inside a kernel (oneDNN, sdpa's
own buffers, bitsandbytes' CPU kernels), which a GPU's figure would include.

Each grid point runs in its own process: a random-weight model of the architecture (bf16, the
config's vocabulary, SmolLM2's tokenizer extended to it) is loaded by `leangrpo train`'s Trainer, the
optimizer state is created with one zero-gradient step (so the measured step is the steady state the
plan models), then one real step (rollout, score, reference, update) runs under the tracker, which
records the peak of each phase. The plan's figure is `estimate(...).peak` for the same config
(`--device cpu`: fp32 dropout masks and no CUDA context, as on this machine).

Usage: python benchmarks/live_peak.py [--only qwen2.5-0.5b/4/128/lora/on,...] [--layers N] [--markdown FILE]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_accuracy import MODELS, PROMPT_LEN, build_model, tokenizer_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("full", "lora", "qlora", "full-ib")  # full-ib: full with optim.optimizer_in_backward
GSM8K = ROOT / "tests" / "data" / "gsm8k" / "train.jsonl"  # the sample shipped with the tests


class LiveTensors(TorchDispatchMode):
    """Bytes of live tensor storages, now and at the peak. Storages under `min_bytes` are left out
    (they are many, small, and slow to track); the default leaves out < 0.1% of a step's peak here."""

    def __init__(self, min_bytes: int = 64 * 2**10):
        super().__init__()
        self.min_bytes = min_bytes
        self.storages: dict[int, list[int]] = {}  # data_ptr -> [live tensors on it, nbytes]
        self.refs: dict[int, weakref.ref] = {}  # id(tensor) -> weakref whose callback un-counts it
        self.now = self.peak = 0

    def __enter__(self) -> LiveTensors:
        for obj in gc.get_objects():  # what exists already: weights, buffers, optimizer state, grads
            if issubclass(type(obj), torch.Tensor):  # not isinstance: it reads __class__, which warns
                self._add(obj)
        self.start = self.peak = self.now
        return super().__enter__()

    def _add(self, t: torch.Tensor) -> None:
        if id(t) in self.refs or t.device.type == "meta" or t.is_sparse:
            return
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes < self.min_bytes or key == 0:
            return
        entry = self.storages.setdefault(key, [0, 0])
        entry[0] += 1
        if nbytes > entry[1]:  # a new storage, or one resized in place
            self.now += nbytes - entry[1]
            entry[1] = nbytes
        self.refs[id(t)] = weakref.ref(t, partial(self._drop, id(t), key))
        self.peak = max(self.peak, self.now)

    def _drop(self, tensor_id: int, key: int, _ref: weakref.ref) -> None:
        self.refs.pop(tensor_id, None)
        entry = self.storages[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.now -= entry[1]
            del self.storages[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out


def worker(config_path: str, result_path: str) -> None:
    """One grid point: build the Trainer, warm the optimizer state, track one step phase by phase."""
    from leangrpo.run.resolve import load_config
    from leangrpo.train.trainer import Trainer

    cfg = load_config(config_path)
    trainer = Trainer(cfg, overwrite=True)
    params = [p for p in trainer.policy.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    trainer.optimizer.step()  # creates the optimizer state: the step measured is a steady-state one
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()

    tracker, phases = LiveTensors(), {}

    def phase(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        tracker.peak = tracker.now
        out = fn(*args, **kwargs)
        phases[name] = tracker.peak
        return out

    for name in ("rollout", "reference", "update"):
        setattr(trainer, name, partial(phase, name, getattr(trainer, name)))
    start = time.perf_counter()
    with tracker:
        row = trainer.step(1)
    result = {
        "at_start": tracker.start,
        "phases": phases,
        "seconds": time.perf_counter() - start,
        "completion_length_mean": row["completions/mean_length"],
    }
    Path(result_path).write_text(json.dumps(result))


def grid(only: list[str] | None, layers: int | None) -> list[dict]:
    """model × G × completion × method × checkpointing, or the points named in `only`
    (model/G/C/method/ckpt, e.g. qwen2.5-0.5b/4/128/qlora/on; `tiny` is for the test suite)."""
    points = {}
    for (name, (arch, dims)), g, c, method, ckpt in itertools.product(
        {**MODELS["cpu"], **MODELS["cuda"]}.items(), (4, 8), (128, 256), METHODS, ("on", "off")
    ):
        dims = {**dims, **({"num_hidden_layers": layers} if layers else {})}
        key = f"{name}/{g}/{c}/{method}/{ckpt}"
        points[key] = dict(key=key, model=name, arch=arch, dims=dims, G=g, C=c, method=method,
                           ckpt=ckpt == "on")  # fmt: skip
    unknown = set(only or ()) - set(points)
    if unknown:
        raise SystemExit(f"unknown grid points: {', '.join(sorted(unknown))}")
    return [points[key] for key in only] if only else list(points.values())


def run_config(point: dict, model_dir: Path, out: Path) -> dict:
    g, method = point["G"], point["method"]
    # optimizer_in_backward steps during the backward: one micro-batch of G, no clipping
    batch = (
        {
            "per_device_train_batch_size": g,
            "gradient_accumulation_steps": 1,
            "optimizer_in_backward": True,
            "max_grad_norm": None,
        }
        if method == "full-ib"
        else {"per_device_train_batch_size": g // 2, "gradient_accumulation_steps": 2}
    )
    return {
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16",
                  "gradient_checkpointing": point["ckpt"], "load_in_4bit": method == "qlora",
                  "lora": {"enabled": method not in ("full", "full-ib")}},
        "data": {"path": str(GSM8K), "limit": 64},
        "rewards": {"functions": [{"name": "xmlcount_reward"}]},
        "grpo": {"num_generations": g, "max_prompt_length": PROMPT_LEN, "max_completion_length": point["C"],
                 "ignore_eos": True},
        "optim": {**batch, "max_steps": 1, "optimizer": "adamw_8bit" if method == "qlora" else "adamw"},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(out),
    }  # fmt: skip


def predict(config_path: Path) -> dict[str, int]:
    """The plan's tensor peak of each phase for the config (`--device cpu`)."""
    from leangrpo.run.resolve import load_config
    from leangrpo.tools import plan

    cfg = load_config(config_path)
    est = plan.estimate(plan.resolve_shape(cfg.model.name_or_path), plan.knobs_from_config(cfg, device="cpu"))
    return {"generation" if name == "generation" else name: b for name, b in est.phases.items()}


def measure(point: dict, work: Path, tok: Path, timeout: int) -> dict:
    layers = point["dims"]["num_hidden_layers"]
    model_dir = work / f"{point['model']}-{layers}l-bf16"
    build_model(model_dir, point["arch"], dict(point["dims"]), tok, "bfloat16")
    stem = work / point["key"].replace("/", "_")
    config_path, result_path = Path(f"{stem}.yaml"), Path(f"{stem}.json")
    config_path.write_text(yaml.safe_dump(run_config(point, model_dir, stem)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])}
    load = Path("/proc/loadavg").read_text().split()[0]
    proc = subprocess.run([sys.executable, __file__, "--worker", str(config_path), str(result_path)],
                          env=env, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"{point['key']} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(result_path.read_text())
    return {**point, **result, "plan": predict(config_path), "load": load, "layers": layers}


PHASE_OF = {"rollout": "generation", "reference": "reference", "update": "update"}


def table(rows: list[dict]) -> str:
    mib = 2**20
    lines = [
        "| model | layers | G | completion | method | ckpt | peak phase (plan/measured MiB per phase) "
        "| plan MiB | measured MiB | error | step s | load |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    worst = 0.0
    for r in rows:
        measured = {PHASE_OF[k]: v for k, v in r["phases"].items() if PHASE_OF[k] in r["plan"]}
        top = max(measured, key=measured.__getitem__)
        plan_peak = max(r["plan"].values())
        err = plan_peak / measured[top] - 1
        worst = max(worst, abs(err))
        detail = ", ".join(f"{p} {r['plan'][p] / mib:,.0f}/{measured[p] / mib:,.0f}" for p in measured)
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['G']} | {r['C']} | {r['method']} "
            f"| {'on' if r['ckpt'] else 'off'} "
            f"| {top} ({detail}) | {plan_peak / mib:,.0f} | {measured[top] / mib:,.0f} | {err:+.1%} "
            f"| {r['seconds']:.0f} | {r['load']} |"
        )
    lines.append(f"\nworst error {worst:.1%} over {len(rows)} points (target ±10%)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated grid points model/G/C/method/ckpt")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the architecture's own)")
    ap.add_argument("--work", help="directory for the models and results (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per point")
    ap.add_argument("--json", help="append each point's result to this JSON-lines file")
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)
    work = Path(args.work or tempfile.mkdtemp(prefix="live-peak-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir(work)
    rows = []
    for point in grid(args.only.split(",") if args.only else None, args.layers):
        rows.append(measure(point, work, tok, args.timeout))
        print(table(rows[-1:]).splitlines()[2], flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
