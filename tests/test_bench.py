"""benchmarks/vs_trl.py on a tiny model for 2 steps, so the script cannot silently rot."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "vs_trl.py"


def load_script():
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["vs_trl"] = module  # dataclasses look their module up while the script executes
    spec.loader.exec_module(module)
    return module


def run_bench(tmp_path: Path, model: Path, data: Path, sides: str) -> tuple[str, list[dict]]:
    results, raw = tmp_path / "RESULTS.md", tmp_path / "raw.json"
    results.write_text("# Benchmarks\n\n## vs TRL\n\nold table\n\n## plan accuracy\n\nkeep me\n")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--model", str(model), "--data", str(data), "--rows", "a",
         "--steps", "2", "--num-generations", "2", "--completion-length", "4", "--sides", sides,
         "--results", str(results), "--json", str(raw)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return results.read_text(), json.loads(raw.read_text())


def test_write_section_replaces_only_its_own_section(tmp_path):
    vs_trl = load_script()
    path = tmp_path / "R.md"
    vs_trl.write_section(path, "## vs TRL\n\nfirst\n")
    assert path.read_text() == "# Benchmarks\n\n## vs TRL\n\nfirst\n"
    path.write_text(path.read_text() + "\n## plan accuracy\n\nother\n")
    vs_trl.write_section(path, "## vs TRL\n\nsecond\n")
    assert path.read_text() == "# Benchmarks\n\n## vs TRL\n\nsecond\n\n## plan accuracy\n\nother\n"


def test_bench_our_side_runs(tmp_path, tiny_model_dir, gsm8k_dir):
    text, raw = run_bench(tmp_path, tiny_model_dir, gsm8k_dir / "train.jsonl", "ours")
    assert "old table" not in text and "keep me" in text
    assert text.count("## vs TRL") == 1 and "| a | full fine-tune" in text
    ours = raw[0]["ours"]
    assert len(ours["step_seconds"]) == 2 and ours["completion_lengths"] == [4.0, 4.0]  # EOS ignored
    assert ours["peak_mb"] >= ours["peak_after_load_mb"] > 0 and ours["tokens_per_s"] > 0


@pytest.mark.slow
def test_bench_both_sides_run(tmp_path, tiny_model_dir, gsm8k_dir):
    pytest.importorskip("trl", reason="TRL is the [bench] extra")
    text, raw = run_bench(tmp_path, tiny_model_dir, gsm8k_dir / "train.jsonl", "ours,trl")
    ours, trl = raw[0]["ours"], raw[0]["trl"]
    assert trl["completion_lengths"] == [4.0, 4.0] == ours["completion_lengths"]  # the same work
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert f"{ours['peak_mb'] / trl['peak_mb']:.2f}" in row
