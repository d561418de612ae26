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

Long sequences (`--long`; points model/G/C/method/long, e.g. llama3.1-8b/8/20000/qlora/long): a step at
20K tokens costs hours on a CPU, so each phase runs once, bounded, with the tensors of its peak real:
- rollout: the real `hf.sample` (transformers' generate() on the preallocated KV cache of prompt +
  completion positions, G rows) whose prompt is the real prompt followed by C - k filler tokens. The
  prefill computes the real prompt once per group; the cache positions the C - k decode steps would have
  written are filled with random values in place (`fill_cache`); then k real decode steps run at the
  end of the cache, where the decode peak is.
- reference: `Updater.reference` on one completion of C tokens: one micro-batch (micro-batch 1), as each
  of the G micro-batches of the real pass.
- update: `Updater.update` on one completion of C tokens, the trainable parameters' gradients already
  present (as they are from the second of the G micro-batches on): one micro-batch's forward and
  backward, then the optimizer step.
Prompts are exactly P tokens (no padding), completions exactly C (no EOS), beta = 0.04 (so the reference
phase exists), micro-batch 1 × accumulation G, checkpointing on.

Usage: python benchmarks/live_peak.py [--only qwen2.5-0.5b/4/128/lora/on,...] [--layers N] [--markdown FILE]
       python benchmarks/live_peak.py --long [--only llama3.1-8b/8/4096/qlora/long,...] [--phases ...]
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
from plan_accuracy import MODELS, PROMPT_LEN, build_model, fixed_length_data, tokenizer_dir  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
METHODS = ("full", "lora", "qlora", "full-ib")  # full-ib: full with optim.optimizer_in_backward
# Llama-3.1-8B's config.json (width, heads, vocabulary, untied head, rope), with 2 decoder layers
LLAMA31_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                  num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                  max_position_embeddings=131072, rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192})  # fmt: skip
TINY_LONG = dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=8192)  # fmt: skip
# name: (architecture, dims, prompt tokens, completion lengths); `tiny` is for the test suite
LONG_MODELS = {"llama3.1-8b": ("llama", LLAMA31_8B, 256, (4096, 8192, 20000)),
               "tiny": ("llama", TINY_LONG, 32, (1024,))}  # fmt: skip
LONG_PHASES = ("rollout", "reference", "update")


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


def steady_trainer(config_path: str) -> Any:
    """The Trainer of a config, its optimizer state created by one zero-gradient step, so that the step
    measured is a steady-state one."""
    from leangrpo.run.resolve import load_config
    from leangrpo.train.trainer import Trainer

    trainer = Trainer(load_config(config_path), overwrite=True)
    for p in trainer.policy.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    gc.collect()
    return trainer


def worker(config_path: str, result_path: str) -> None:
    """One grid point: build the Trainer, warm the optimizer state, track one step phase by phase."""
    trainer = steady_trainer(config_path)
    tracker, phases = LiveTensors(), {}

    def phase(name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        tracker.peak = tracker.now
        out = fn(*args, **kwargs)
        phases[name] = tracker.peak
        return out

    for name, role in (
        ("rollout", trainer.source),
        ("reference", trainer.updater),
        ("update", trainer.updater),
    ):
        setattr(role, name, partial(phase, name, getattr(role, name)))
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


def fill_cache(cache: Any, end: int) -> None:
    """Each layer's cache extended to `end` positions with random values, written in place into its
    preallocated buffers: the positions the skipped decode steps would have written."""
    for layer in cache.layers:
        start = layer.get_seq_length()
        for buffer in (layer.key_buffer, layer.value_buffer):
            buffer[:, :, start:end].normal_()
        layer.keys, layer.values = layer.key_buffer[:, :, :end], layer.value_buffer[:, :, :end]


def long_rollout(trainer: Any, spec: dict) -> None:
    """The rollout's last `decode_steps` positions, through the real sample() on the full-size cache: the
    real prompt prefilled once per group, the positions before the last steps filled (`fill_cache`)."""
    from dataclasses import replace

    from leangrpo.cpu import levers
    from leangrpo.engines import hf
    from leangrpo.engines.types import eos_token_ids

    P, C, k = spec["prompt"], spec["completion"], spec["decode_steps"]
    engine, G = trainer.source.engine, trainer.cfg.grpo.num_generations
    real = hf.prefill_once_per_group

    def prefill(model: Any, ids: torch.Tensor, mask: torch.Tensor, group: int, cache: Any) -> None:
        real(model, ids[:, :P], mask[:, :P], group, cache)  # the prompt's P - 1 positions, computed
        fill_cache(cache, ids.shape[1] - 1)  # generate() then feeds the last filler token

    ids = torch.randint(0, spec["vocab"], (1, P + C - k)).repeat(G, 1)
    sampling = replace(trainer.source.sampling, max_completion_length=k, ignore_eos=True)
    hf.prefill_once_per_group = levers.prefill_once_per_group = prefill
    try:
        eos = eos_token_ids(engine.tokenizer, engine.model)
        out = hf.sample(
            engine.model, engine.tokenizer, ids, torch.ones_like(ids), sampling, eos, engine.levers
        )
    finally:
        hf.prefill_once_per_group = levers.prefill_once_per_group = real
    assert out.shape == (G, k), out.shape


def long_batch(spec: dict) -> Any:
    """One completion of C tokens after a prompt of P, as a RolloutBatch (no padding, no EOS)."""
    from leangrpo.engines.types import RolloutBatch

    prompt = torch.randint(0, spec["vocab"], (1, spec["prompt"]))
    completion = torch.randint(0, spec["vocab"], (1, spec["completion"]))
    ones = partial(torch.ones_like, dtype=torch.long)
    return RolloutBatch(
        prompt, ones(prompt), completion, ones(completion), torch.ones(1, dtype=torch.bool), [""]
    )


def long_reference(trainer: Any, spec: dict) -> None:
    """One micro-batch of the reference pass (adapter disabled)."""
    ref_logp = trainer.updater.reference(long_batch(spec)).ref_logp
    assert ref_logp is not None and ref_logp.shape == (1, spec["completion"])


def long_update(trainer: Any, spec: dict) -> None:
    """One micro-batch's forward and backward onto gradients that exist already, then the optimizer step."""
    for p in trainer.policy.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)  # what the earlier micro-batches accumulated
    from leangrpo.train.update import Reference

    ref = Reference(torch.zeros(1, spec["completion"]), None, None, None)
    trainer.updater.update(long_batch(spec), torch.ones(1), ref)


def long_worker(config_path: str, result_path: str, spec_path: str) -> None:
    """One long-sequence point: each phase of `spec` once, bounded (module docstring), under the tracker."""
    spec = json.loads(Path(spec_path).read_text())
    trainer = steady_trainer(config_path)
    run = {"rollout": long_rollout, "reference": long_reference, "update": long_update}
    tracker, phases, seconds = LiveTensors(), {}, {}
    with tracker:
        for name in spec["phases"]:
            gc.collect()
            tracker.peak, start = tracker.now, time.perf_counter()
            run[name](trainer, spec)
            phases[name], seconds[name] = tracker.peak, time.perf_counter() - start
            Path(result_path).write_text(json.dumps({"at_start": tracker.start, "phases": phases,
                                                     "phase_seconds": seconds}))  # fmt: skip


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
    return select(points, only)


def long_grid(only: list[str] | None, layers: int | None) -> list[dict]:
    """Each long model × completion length × LoRA/QLoRA at G = 8 (model/8/C/method/long)."""
    points = {}
    for name, (arch, dims, prompt, lengths) in LONG_MODELS.items():
        dims = {**dims, **({"num_hidden_layers": layers} if layers else {})}
        for c, method in itertools.product(lengths, ("lora", "qlora")):
            key = f"{name}/8/{c}/{method}/long"
            points[key] = dict(key=key, model=name, arch=arch, dims=dims, G=8, C=c, P=prompt, method=method,
                               ckpt=True, long=True)  # fmt: skip
    return select(points, only)


def select(points: dict[str, dict], only: list[str] | None) -> list[dict]:
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
    if point.get("long"):  # micro-batch 1 × accumulation G, a KL term (so a reference pass)
        batch = {"per_device_train_batch_size": 1, "gradient_accumulation_steps": g}
    return {
        "model": {"name_or_path": str(model_dir), "dtype": "bfloat16",
                  "gradient_checkpointing": point["ckpt"], "load_in_4bit": method == "qlora",
                  "lora": {"enabled": method not in ("full", "full-ib")}},
        "data": fixed_length_data(out.parent, point.get("P", PROMPT_LEN)),
        "rewards": {"functions": [{"name": "xmlcount_reward"}]},
        "grpo": {"num_generations": g, "max_prompt_length": point.get("P", PROMPT_LEN),
                 "max_completion_length": point["C"], "ignore_eos": True,
                 "beta": 0.04 if point.get("long") else 0},
        "optim": {**batch, "max_steps": 1, "optimizer": "adamw_8bit" if method == "qlora" else "adamw"},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(out),
    }  # fmt: skip


def predict(config_path: Path, layers: int | None = None) -> dict[str, int]:
    """The plan's tensor peak of each phase for the config (`--device cpu`), at `layers` decoder layers
    if given (the plan's per-layer terms scaled: the model is otherwise the same)."""
    from dataclasses import replace

    from leangrpo.commands import plan
    from leangrpo.run.resolve import load_config

    cfg = load_config(config_path)
    shape = plan.resolve_shape(cfg.model.name_or_path)
    shape = replace(shape, num_hidden_layers=layers or shape.num_hidden_layers)
    return plan.estimate(shape, plan.knobs_from_config(cfg, device="cpu")).phases


def measure(point: dict, work: Path, tok: Path, timeout: int, long: dict | None = None) -> dict:
    """One point in its own process; `long`: the long-sequence worker's phases and decode steps."""
    layers = point["dims"]["num_hidden_layers"]
    model_dir = work / f"{point['model']}-{layers}l-bf16"
    build_model(model_dir, point["arch"], dict(point["dims"]), tok, "bfloat16")
    stem = work / point["key"].replace("/", "_")
    config_path, result_path = Path(f"{stem}.yaml"), Path(f"{stem}.json")
    config_path.write_text(yaml.safe_dump(run_config(point, model_dir, stem)))
    args = ["--worker", str(config_path), str(result_path)]
    if long is not None:
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        spec = {**long, "prompt": point["P"], "completion": point["C"], "vocab": vocab}
        Path(f"{stem}.spec.json").write_text(json.dumps(spec))
        args = ["--long-worker", str(config_path), str(result_path), f"{stem}.spec.json"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks")])}
    load = Path("/proc/loadavg").read_text().split()[0]
    result_path.unlink(missing_ok=True)
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip
    if proc.returncode != 0 and not (long is not None and result_path.is_file()):
        raise SystemExit(f"{point['key']} failed:\n{proc.stderr[-3000:]}")
    if proc.returncode != 0:  # a long point keeps the phases it finished
        print(f"{point['key']} stopped after {json.loads(result_path.read_text())['phases']}:\n"
              f"{proc.stderr[-2000:]}", file=sys.stderr)  # fmt: skip
    result = json.loads(result_path.read_text())
    return {**point, **result, "plan": predict(config_path), "load": load, "layers": layers,
            "config": str(config_path)}  # fmt: skip


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


def long_table(rows: list[dict]) -> str:
    """Plan against measured, phase by phase."""
    mib = 2**20
    lines = ["| model | layers | method | completion | phase | plan MiB | measured MiB | error | phase s "
             "| load |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    worst = 0.0
    for r in rows:
        for name, measured in r["phases"].items():
            planned = r["plan"][PHASE_OF[name]]
            err = planned / measured - 1
            worst = max(worst, abs(err))
            lines.append(
                f"| {r['model']} | {r['layers']} | {r['method']} | {r['C']} | {name} | {planned / mib:,.0f} "
                f"| {measured / mib:,.0f} | {err:+.1%} | {r['phase_seconds'][name]:.0f} | {r['load']} |"
            )
    lines.append(f"\nworst error {worst:.1%} over {len(lines) - 2} phases (target ±10%)")
    return "\n".join(lines)


def scaled_table(rows: list[dict], layers: int) -> str:
    """Each long row's phases at `layers` decoder layers: the plan's figure, and the measured peak plus
    the plan's per-layer terms for the layers not run (plan at `layers` less plan at the layers run)."""
    gib, ran = 2**30, rows[0]["layers"] if rows else 0
    lines = [
        f"| method | completion | phase | measured GiB ({ran} layers) | plan GiB ({ran} layers) "
        f"| plan GiB ({layers} layers) | measured + plan's other {layers - ran} layers |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        plan_n, plan_run = predict(Path(r["config"]), layers), predict(Path(r["config"]))
        for name, measured in r["phases"].items():
            p = PHASE_OF[name]
            figures = (measured, plan_run[p], plan_n[p], measured + plan_n[p] - plan_run[p])
            cells = " | ".join(f"{b / gib:.2f}" for b in figures)
            lines.append(f"| {r['method']} | {r['C']} | {name} | {cells} |")
    return "\n".join(lines)


def replan(path: str, layers: int | None) -> None:
    """The rows of a --json file against the current plan (their configs are in the work directory), and
    with `layers`, scaled to that many decoder layers."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    for r in rows:
        r["plan"] = predict(Path(r["config"]))
    print(long_table(rows))
    if layers:
        print("\n" + scaled_table(rows, layers))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--long-worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--only", help="comma-separated grid points model/G/C/method/ckpt")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the architecture's own)")
    ap.add_argument("--long", action="store_true", help="the long-sequence points (module docstring)")
    ap.add_argument("--phases", default=",".join(LONG_PHASES), help="--long: the phases to run, in order")
    ap.add_argument("--decode-steps", type=int, default=4, help="--long: real decode steps at the end")
    ap.add_argument("--work", help="directory for the models and results (default: a temporary one)")
    ap.add_argument("--timeout", type=int, default=3600, help="seconds per point")
    ap.add_argument("--json", help="append each point's result to this JSON-lines file")
    ap.add_argument("--replan", help="--long: print the rows of this --json file against the current plan")
    ap.add_argument("--scale-to", type=int, help="--replan: also scale each row to this many layers")
    args = ap.parse_args()
    if args.replan:
        return replan(args.replan, args.scale_to)
    if args.worker:
        return worker(*args.worker)
    if args.long_worker:
        return long_worker(*args.long_worker)
    work = Path(args.work or tempfile.mkdtemp(prefix="live-peak-"))
    work.mkdir(parents=True, exist_ok=True)
    tok = tokenizer_dir(work)
    only = args.only.split(",") if args.only else None
    points = long_grid(only, args.layers) if args.long else grid(only, args.layers)
    long = {"phases": args.phases.split(","), "decode_steps": args.decode_steps} if args.long else None
    show = long_table if args.long else table
    rows = []
    for point in points:
        rows.append(measure(point, work, tok, args.timeout, long))
        print("\n".join(show(rows[-1:]).splitlines()[2:-2]), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
    print(show(rows))


if __name__ == "__main__":
    main()
