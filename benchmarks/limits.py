"""Each phase of a leangrpo GRPO step against its physical limit on this CPU (issue 52 item 5): decode
bytes per second against the copy bandwidth, prefill/reference and update FLOP/s against the matmul rate,
so the table says how much is left.

    python benchmarks/limits.py --results benchmarks/RESULTS.md     # row f, 1 warm-up + 3 steps
    python benchmarks/limits.py --model <dir> --steps 2 --copy-mib 8 --matmul-rows 16 --repeats 1  # smoke

Default run: vs_trl.py's row f (the real SmolLM2-135M-Instruct, full fine-tuning, beta 0.04, G 8 x up to
96 tokens, EOS on), built by vs_trl's own `row_settings` and `ours_config`, trained in this process. The
limits are measured in the same process after the Trainer is built, so with the torch threads the step
uses: copy bandwidth (bytes read + written per second by `dst.copy_(src)` of `--copy-mib` MiB, best of
`--repeats`) and the float32 matmul rate (the three products of forward and backward of each of the
model's own Linears over `--matmul-rows` rows, in the library `cpu.matmul: auto` picks; total FLOPs over
the summed best times). `--steps` counts the warm-up step; each phase's figure is the median over the rest.

Formulas (N = layer Linear weights Nl + lm_head's V d, d = hidden size, L layers, kv = KV width, fp32):
  decode bytes  = sum over the T decode steps of (4 N  +  B * 2 L kv * 4 * (P + t)): every weight read once
                  per token step, plus each of the B rows' KV cache read up to its position; T = the
                  step's longest completion (the batch decodes until its last row stops), P = prompt tokens
  forward FLOPs = 2 Nl tokens + 2 V d completion tokens (the lm_head runs on completion positions only)
                  + 4 L d sum(S^2) over the S-token sequences (attention's QK^T and AV, S = P + the
                  completion's mean length: the metrics hold no per-row lengths)
  reference     = 1 forward;  update = 4 forwards' worth (forward, gradient checkpointing's recompute
                  forward -- the lm_head's chunked logits are recomputed too -- and backward = 2
                  forwards); tokens = the tokens the pass computes (the prompt once
                  per group when the shared-prompt layout is on, completions unpadded when padding-free)
The rollout's seconds also hold its prefill and sampling, the update's its optimizer step (memory-bound).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from matmul_rates import PRODUCTS, seconds  # noqa: E402
from vs_trl import add_settings_args, ours_config, row_settings, write_section  # noqa: E402

from leangrpo.cpu import onednn  # noqa: E402
from leangrpo.cpu.onednn import cpu_name  # noqa: E402

SECTION = "## Limits"


@dataclass(frozen=True)
class Shape:
    """The sizes the formulas need, from the model's config."""

    hidden: int
    intermediate: int
    layers: int
    kv: int  # KV width: key/value heads x head size
    vocab: int

    @classmethod
    def of(cls, config) -> Shape:
        head = config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(config.hidden_size, config.intermediate_size, config.num_hidden_layers, kv_heads * head,
                   config.vocab_size)  # fmt: skip

    def linears(self) -> dict[str, tuple[int, int, int]]:
        """Each layer's Linear shapes (in, out) with how many a layer has."""
        d, kv, i = self.hidden, self.kv, self.intermediate
        return {"q, o": (d, d, 2), "k, v": (d, kv, 2), "gate, up": (d, i, 2), "down": (i, d, 1)}

    @property
    def body(self) -> int:
        """Nl: the Linear weights of every layer (embeddings and norms cost no matmul)."""
        return self.layers * sum(k * n * count for k, n, count in self.linears().values())

    @property
    def params(self) -> int:
        """N: the layers' Linear weights plus the lm_head's, all read once per decode step."""
        return self.body + self.vocab * self.hidden


def decode_bytes(s: Shape, rows: int, prompt: int, steps: int) -> float:
    """Bytes the decode streams over `steps` token steps of `rows` rows after a `prompt`-token prompt."""
    kv_per_token = 2 * s.layers * s.kv * 4
    return sum(4 * s.params + rows * kv_per_token * (prompt + t) for t in range(1, steps + 1))


def forward_flops(s: Shape, tokens: float, head_tokens: float, lengths: list[int]) -> float:
    """One forward over `tokens` computed tokens, `head_tokens` of them through the lm_head, in
    sequences of `lengths` (for attention)."""
    attention = 4 * s.layers * s.hidden * sum(n * n for n in lengths)
    return 2 * s.body * tokens + 2 * s.vocab * s.hidden * head_tokens + attention


def pass_tokens(
    prompt: int, rows: int, group: int, mean: float, longest: int, packed: bool
) -> tuple[float, float]:
    """The tokens a log-prob pass over `rows` completions computes, and the completion tokens among them
    (the lm_head's): the prompt once per group of `group` rows, the completions unpadded (`mean` long)
    when packed (padding-free) else each padded to the `longest`."""
    completions = rows * (mean if packed else longest)
    return prompt * rows // group + completions, completions


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes read + written per second by one large tensor copy, best of `repeats`."""
    src = torch.ones(mib * 2**20 // 4)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / seconds(lambda: dst.copy_(src), repeats)


def matmul_rate(s: Shape, rows: int, repeats: int) -> tuple[float, str]:
    """FLOP/s of forward and backward products of the model's Linears over `rows` rows, in the library
    `cpu.matmul: auto` uses; with its name."""
    oned = onednn.preferred()
    flops = secs = 0.0
    for k, n, count in s.linears().values():
        x, w, g = torch.randn(rows, k), torch.randn(n, k), torch.randn(rows, n)
        for pair in PRODUCTS.values():
            fn: Callable[[], torch.Tensor] = partial(pair[1] if oned else pair[0], x, w, g)
            flops += 2 * rows * k * n * count
            secs += seconds(fn, repeats) * count
    return flops / secs, "oneDNN" if oned else "torch's BLAS"


def run_steps(a: argparse.Namespace, out_dir: Path) -> dict:
    """Build the Trainer, measure the limits in its process, then run --steps steps (the first a warm-up)."""
    from transformers import AutoConfig

    from leangrpo.run.resolve import validate_config
    from leangrpo.train.trainer import Trainer

    s = row_settings(a, "f")
    trainer = Trainer(validate_config(ours_config(s, out_dir), "benchmark"), overwrite=True)
    shape = Shape.of(AutoConfig.from_pretrained(s.model_dir))
    copy = copy_bandwidth(a.copy_mib, a.repeats)
    rate, library = matmul_rate(shape, a.matmul_rows, a.repeats)
    steps, tokens_seen = [], 0.0
    for step in range(1, s.steps + 1):
        m = trainer.step(step)
        new_tokens, tokens_seen = m["num_tokens"] - tokens_seen, m["num_tokens"]
        steps.append({**m, "new_tokens": new_tokens})
    rows = s.prompts * s.num_generations
    return {"settings": s, "shape": shape, "copy": copy, "rate": rate, "library": library, "steps": steps,
            "rows": rows, "group": trainer.group, "packed": trainer.updater.packed,
            "threads": torch.get_num_threads()}  # fmt: skip


def phase_rows(r: dict) -> list[tuple[str, str, float, float, float, float]]:
    """(phase, unit, work per step, median seconds, rate, limit) for decode, reference and update, each
    step's work from its own token counts; the warm-up step left out."""
    s, rows, measured = r["shape"], r["rows"], r["steps"][1:] or r["steps"]
    work: dict[str, list[float]] = {"rollout": [], "reference": [], "update": []}
    for m in measured:
        mean, longest = m["completions/mean_length"], int(m["completions/max_length"])
        prompt = round((m["new_tokens"] - mean * rows) / rows)
        work["rollout"].append(decode_bytes(s, rows, prompt, longest))
        tokens, head_tokens = pass_tokens(prompt, rows, r["group"], mean, longest, r["packed"])
        lengths = [prompt + round(mean)] * rows  # per-row lengths are not in the metrics
        fwd = forward_flops(s, tokens, head_tokens, lengths)
        work["reference"].append(fwd)
        work["update"].append(4 * fwd)
    out = []
    for phase, unit, limit in (("rollout", "GB/s", r["copy"]), ("reference", "GFLOP/s", r["rate"]),
                               ("update", "GFLOP/s", r["rate"])):  # fmt: skip
        if phase == "reference" and not any(m.get("time/reference", 0) for m in measured):
            continue  # beta 0: no reference pass
        secs = statistics.median(m[f"time/{phase}"] for m in measured)
        per_step = statistics.median(work[phase])
        out.append((phase, unit, per_step, secs, per_step / secs, limit))
    return out


def table(r: dict) -> str:
    lines = [
        "| phase | work per step | median s | rate | limit | fraction of limit |",
        "|---|---|---|---|---|---|",
    ]
    for phase, unit, work, secs, rate, limit in phase_rows(r):
        what = f"{work / 1e9:.3g} GB streamed" if unit == "GB/s" else f"{work / 1e9:.3g} GFLOP"
        name = "decode (rollout)" if phase == "rollout" else phase
        lines.append(f"| {name} | {what} | {secs:.2f} | {rate / 1e9:.1f} {unit} | {limit / 1e9:.1f} {unit} "
                     f"| {rate / limit:.2f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_settings_args(p)  # vs_trl's options; --steps counts the warm-up step
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the tensor copied for the bandwidth")
    p.add_argument("--matmul-rows", type=int, default=1024, help="rows of each timed matmul")
    p.add_argument("--repeats", type=int, default=5, help="best of this many timings per limit")
    p.add_argument("--results", help="write the table as the '## Limits' section of this file")
    a = p.parse_args()
    if a.steps < 2:
        sys.exit("error: --steps must be at least 2 (one warm-up step, then the measured ones)")
    load_before = Path("/proc/loadavg").read_text().split()[:3]
    with tempfile.TemporaryDirectory(prefix="limits-") as tmp:
        r = run_steps(a, Path(tmp))
    load_after = Path("/proc/loadavg").read_text().split()[:3]
    s, shape = r["settings"], r["shape"]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    args = " ".join(sys.argv[1:])
    body = (
        f"{SECTION}\n\nCommand: `python benchmarks/limits.py{' ' + args if args else ''}`\n\n"
        f"Date: {now}. Machine: {platform.machine()}, CPU, {os.cpu_count()} cores, {cpu_name()}, "
        f"torch {torch.__version__}, {r['threads']} torch threads. Run: vs_trl.py's row f settings "
        f"({Path(s.model_dir).name}, beta {s.beta}, G {s.num_generations} x up to "
        f"{s.row.completion_length} tokens, EOS {'on' if s.row.eos else 'off'}), {s.steps - 1} steps after "
        f"one warm-up, medians. N = {shape.params / 1e6:.1f} M (layer Linears {shape.body / 1e6:.1f} M + "
        f"lm_head). Limits: copy "
        f"bandwidth {r['copy'] / 1e9:.1f} GB/s (read + written, {a.copy_mib} MiB copy, best of {a.repeats}); "
        f"matmul rate {r['rate'] / 1e9:.1f} GFLOP/s (fp32, {r['library']}, the model's Linears, forward and "
        f"backward products over {a.matmul_rows} rows, best of {a.repeats}). Formulas: the docstring of "
        f"benchmarks/limits.py. Load (/proc/loadavg) before {' '.join(load_before)}, after "
        f"{' '.join(load_after)}.\n\n" + table(r)
    )
    print(body, flush=True)
    if a.results:
        write_section(Path(a.results), SECTION, body)


if __name__ == "__main__":
    main()
