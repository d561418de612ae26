"""benchmarks/gpu_check.py's CPU dry run (--device cpu --tiny), so that the GPU check cannot rot unseen."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_e2e import PYTHONPATH

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
SECTIONS = ("tests", "train", "decode", "logprobs", "trl", "precision", "cli", "vllm")


def run_check(*args: str, timeout: int = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def positive(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_dry_run_runs_every_section_on_cpu(tmp_path, real_tokenizer_dir):
    out = tmp_path / "out"
    proc = run_check("--device", "cpu", "--tiny", "--out", str(out), "--work", str(tmp_path / "work"),
                     "--tokenizer", str(real_tokenizer_dir), "--budget-s", "3600", timeout=3000)  # fmt: skip
    report = json.loads((out / "gpu_check.json").read_text())
    sections = report["sections"]
    broken = {
        name: s.get("error") or s.get("rows") for name, s in sections.items() if s["status"] == "failed"
    }
    assert proc.returncode == 0 and not broken, (broken, proc.stderr[-3000:])
    assert list(sections) == list(SECTIONS)
    trl_missing = importlib.util.find_spec("trl") is None
    for name, s in sections.items():  # every section ran: only TRL's may be missing here, and vLLM's
        missing = (name == "trl" and trl_missing) or name == "vllm"  # sleep mode needs CUDA
        assert s["status"] == "ok" or (missing and s["status"] == "skipped"), s
        assert s["seconds"] >= 0
    markdown = (out / "gpu_check.md").read_text()
    assert "| section | status | seconds |" in markdown
    assert all(f"| {name} | {sections[name]['status']} |" in markdown for name in SECTIONS)

    tests = sections["tests"]["rows"]  # the CUDA tests, collected and skipped here
    assert tests and all(r["outcome"] == "skipped" and "CUDA" in r["reason"] for r in tests)

    train = sections["train"]["rows"]
    assert [r["config"] for r in train] == [
        "full",
        "full-no-ckpt",
        "lora",
        "lora-no-ckpt",
        "qlora",
        "full-oib",
        "full-adamw8bit",
        "full-offload",
        "lora-flash-attn",
    ]
    for r in train:
        if (
            "skipped" in r
        ):  # bitsandbytes' rows without it; activation offload and flash-attention on CUDA only
            no_bnb = importlib.util.find_spec("bitsandbytes") is None
            assert r["config"] in ("full-offload", "lora-flash-attn") or no_bnb, r
            continue
        assert positive(r["measured_mib"]) and positive(r["predicted_mib"]) and positive(r["ratio"]), r
        assert r["within_10pct"] is None  # judged on CUDA only: RSS holds more than tensors
        assert len(r["step_seconds"]) == 2 and all(map(positive, r["step_seconds"]))

    decode = sections["decode"]
    assert positive(decode["copy_bandwidth_gb_s"])
    assert {(r["model"], r["engine"]) for r in decode["rows"]} == {
        (m, e) for m in ("tiny-2", "tiny-4") for e in ("HF generate", "leangrpo rollout")
    }
    assert all(positive(r["tokens_per_s"]) and positive(r["share_of_limit"]) for r in decode["rows"])

    for r in sections["logprobs"]["rows"]:
        assert 0 <= r["mean_abs_nats"] <= r["max_abs_nats"] < 0.5, r  # finite, and a bf16-sized error
        assert math.isfinite(r["reference_mean_logp"]) and r["reference_mean_logp"] < 0

    precision = {
        (r["master_weights"], r["optimizer_in_backward"]): r["moved_fraction"]
        for r in sections["precision"]["rows"]
    }
    without = precision[
        False, False
    ]  # bf16 updates below half a step kept only with masters, in-backward too
    assert precision[True, False] > 4 * without and precision[True, True] > 4 * without

    assert sections["vllm"]["reason"].startswith("not available: ")

    cli = sections["cli"]["rows"]
    assert [r["step"] for r in cli] == ["train 2 steps", "resume to step 3", "export --merge", "checks"]
    assert cli[-1]["checkpoints"] and positive(cli[-1]["merged_params_m"])

    trl = sections["trl"]
    if trl_missing:
        assert "trl is not importable" in trl["reason"]
    else:
        assert [r["side"] for r in trl["rows"]] == ["ours", "trl"]
        assert all(positive(r[k]) for r in trl["rows"] for k in ("peak_mib", "median_step_s", "tokens_per_s"))
        assert all(map(positive, trl["ours_over_trl"].values()))


def test_bad_input_is_one_line(tmp_path):
    proc = run_check("--device", "cpu", "--tiny", "--out", str(tmp_path), "--sections", "train,nope")
    assert proc.returncode == 2 and "unknown section 'nope'" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "gpu_check.json").exists()
    (tmp_path / "file").write_text("")
    proc = run_check("--device", "cpu", "--out", str(tmp_path / "file"))
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: --out {tmp_path / 'file'} is a file, not a folder"
    ]
