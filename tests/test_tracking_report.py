"""Evaluation during training, experiment trackers read back for real (TensorBoard event files, W&B offline
files, trackio's database), the console table, and the run report opened in headless Chromium."""

from __future__ import annotations

import json
import shutil
import sqlite3
import struct
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from leangrpo.cli import main
from leangrpo.run.resolve import validate_config
from leangrpo.run.rundir import CURVES
from leangrpo.run.tracking import TrackerError
from leangrpo.train.preflight import World, preflight


@pytest.mark.slow
def test_train_with_eval_trackers_and_report(tmp_path, tiny_model_dir, gsm8k_dir, monkeypatch, capsys):
    from test_e2e import read_metrics, write_config

    from leangrpo.commands.report import write_report_after_training
    from leangrpo.run.resolve import load_config
    from leangrpo.train.trainer import train

    out = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.yaml", tiny_model_dir, gsm8k_dir / "train.jsonl", out,
        rewards={"functions": [{"name": "toy_rewards:vowel_share"}, {"name": "strict_format"}]},
        optim={"max_steps": 3, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1},
        eval={"enabled": True, "path": str(gsm8k_dir), "limit": 2, "eval_steps": 2, "max_new_tokens": 4,
              "num_samples": 2},
        logging={"report_to": "tensorboard,wandb,trackio", "run_name": "t1", "log_completions_steps": 1},
    )  # fmt: skip
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))
    # trackio reads TRACKIO_DIR once, at import: when another test imported it first, move it here too.
    for module in [m for name, m in sys.modules.items() if name.startswith("trackio")]:
        if hasattr(module, "TRACKIO_DIR"):
            monkeypatch.setattr(module, "TRACKIO_DIR", tmp_path / "trackio")
    train(load_config(cfg))
    write_report_after_training(out, print)  # as `leangrpo train` and GRPOTrainer.train() end
    printed = "".join(capsys.readouterr())

    rows = read_metrics(out)
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["step"] for r in evals] == [0, 2, 3]  # before training, every eval_steps, at the end
    assert {
        "eval/n",
        "eval/pass@2",
        "eval/format/strict_format_reward",
        "eval/completions/mean_length",
    } <= evals[0].keys()
    assert evals[0]["eval/n"] == 2
    assert (out / "eval" / "step-0.json").is_file() and (out / "eval" / "step-3.jsonl").is_file()
    assert "  step   reward" in printed and "eval at step 0: n=2" in printed

    # TensorBoard: the event file holds every logged value.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [(e.step, round(e.value, 5)) for e in events.Scalars("train/reward")] == [
        (r["step"], round(r["reward"], 5)) for r in train
    ]  # HF/TRL's tags: train/..., eval/...
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2, 3]
    trl_tags = {
        "train/completions/mean_length", "train/completions/min_length", "train/completions/max_length",
        "train/completions/clipped_ratio", "train/completions/mean_terminated_length",
        "train/frac_reward_zero_std", "train/clip_ratio/low_mean", "train/clip_ratio/high_mean",
        "train/clip_ratio/region_mean", "train/entropy", "train/rewards/strict_format_reward/mean",
        "train/rewards/strict_format_reward/std",
    }  # fmt: skip
    assert trl_tags <= set(events.Tags()["scalars"]), trl_tags - set(events.Tags()["scalars"])
    assert [e.step for e in events.Tensors("completions/text_summary")] == [1, 2, 3]
    first = events.Tensors("completions/text_summary")[0].tensor_proto.string_val[0].decode()
    assert first.startswith("| step | question | completion |") and "reward/strict_format" in first

    # W&B offline: the run's .wandb log holds every logged row.
    (log,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    history = [(step, row) for step, row in wandb_history(log)]
    assert [(s, round(r["train/reward"], 5)) for s, r in history if "train/reward" in r] == [
        (r["step"], round(r["reward"], 5)) for r in train
    ]
    assert [s for s, r in history if "eval/accuracy" in r] == [0, 2, 3]
    tables = [(s, r["completions/nrows"]) for s, r in history if r.get("completions/_type") == "table-file"]
    assert tables == [(1, 1), (2, 1), (3, 1)]  # a one-row wandb.Table at each sample

    # trackio: its local SQLite database has one metrics row per logged row.
    (db,) = (tmp_path / "trackio").glob("*.db")
    logged = sqlite3.connect(db).execute("select step, metrics from metrics where run_name='t1'").fetchall()
    by_step = [(step, json.loads(m)) for step, m in logged]
    assert [s for s, m in by_step if "train/reward" in m] == [1, 2, 3]
    assert [s for s, m in by_step if "eval/accuracy" in m] == [0, 2, 3]
    assert [s for s, m in by_step if "completions" in m] == [1, 2, 3]

    # The report is written at the end, with the reward curve beside it.
    assert (out / "report.html").is_file() and (out / "reward_curve.png").is_file()
    assert f"report: {out / 'report.html'}" in printed

    # `leangrpo eval` on the run directory: its model/, its config's rewards; then compare before/after.
    from leangrpo.commands.compare import compare
    from leangrpo.commands.evaluate import run_eval

    result, path = run_eval(str(out), data=str(gsm8k_dir), limit=2, max_new_tokens=4)
    assert path == out / "eval" / "eval-test.json"
    # the run's own import-path reward is code named by a run directory: skipped unless trusted
    assert set(result.records[0]["rewards"]) == {"strict_format_reward"}
    trusted, _ = run_eval(str(out), data=str(gsm8k_dir), limit=2, max_new_tokens=4, trust_run_code=True)
    assert set(trusted.records[0]["rewards"]) == {"vowel_share", "strict_format_reward"}
    text = compare(str(out / "eval" / "step-0.json"), str(out))
    assert f"B: {out} (eval-test.json)" in text and "train/reward (last step)" in text


def wandb_history(path: Path) -> list[tuple[int, dict]]:
    """(step, {key: value}) of each history record in a .wandb file: a LevelDB-style log (32 KiB blocks,
    7-byte chunk headers: crc32, length, type) of wandb_internal Record protobufs after a 7-byte header."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, payload, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST chunk: a whole record
            record = pb.Record()
            record.ParseFromString(payload)
            payload = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item
                }
                out.append((record.history.step.num, items))
    return out


def tracked(tmp_path, gsm8k_dir, report_to):
    return validate_config(
        {"model": {"name_or_path": "m"}, "data": {"path": str(gsm8k_dir / "train.jsonl")},
         "logging": {"report_to": report_to}, "output_dir": str(tmp_path / "run")}
    )  # fmt: skip


def test_missing_tracker_package_is_one_line(monkeypatch, tmp_path, gsm8k_dir):
    import importlib.util

    from test_e2e import write_config

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(TrackerError, match="the wandb package is not installed: pip install wandb"):
        preflight(tracked(tmp_path, gsm8k_dir, ["tensorboard", "wandb"]), World())
    preflight(tracked(tmp_path, gsm8k_dir, ["tensorboard"]), World())
    # From the CLI: one line, before any model loads (the model path does not even exist).
    cfg = write_config(tmp_path / "c.yaml", tmp_path / "no-model", gsm8k_dir / "train.jsonl", tmp_path / "r")
    result = CliRunner().invoke(main, ["train", "-c", str(cfg), "logging.report_to=[tensorboard, wandb]"])
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: logging.report_to includes wandb, but the wandb package is not installed: pip install wandb"
    )
    result = CliRunner().invoke(main, ["train", "-c", str(cfg), "logging.report_to=tensorbord"])
    assert result.exit_code == 2 and "logging.report_to.0" in result.output and "tensorboard" in result.output


def make_run(run_dir: Path, steps: int = 12) -> Path:
    """A run directory as training leaves it, with a truncated last metrics line (a crash)."""
    run_dir.mkdir(parents=True)
    rows = [{"step": 0, "eval/accuracy": 0.1, "eval/format/strict_format": 0.0, "eval/n": 8}]
    for s in range(1, steps + 1):
        rows.append({
            "step": s, "reward": 0.1 * s, "reward_std": 0.5 / s, "loss": 0.01 * (-1) ** s, "kl": 0.001 * s,
            "clip_ratio": 0.0, "completion_length/mean": 40.0 + s, "completion_length/max": 64.0,
            "rewards/correctness/mean": 0.05 * s, "rewards/strict_format/mean": 0.02 * s, "step_seconds": 2.0,
            "time/rollout": 1.5, "time/update": 0.5,
        })  # fmt: skip
    rows.append({"step": steps, "eval/accuracy": 0.4, "eval/format/strict_format": 0.5, "eval/n": 8})
    lines = [json.dumps(r) for r in rows]
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 13, "rew')
    samples = [
        {"step": s, "question": f"What is {s}+1?",
         "completion": f"<answer>{s + 1}</answer> & <b>not bold</b>", "extracted": str(s + 1),
         "gold": str(s + 1), "rewards": {"correctness": 2.0}}
        for s in (1, 5, 10, 12)
    ]  # fmt: skip
    (run_dir / "completions.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples))
    from test_evaluate import RUN_CONFIG

    (run_dir / "config.yaml").write_text(RUN_CONFIG)
    return run_dir


def test_earlier_metric_names_read_as_trls():
    """Run directories written before leangrpo took TRL's names read with TRL's names."""
    from leangrpo.run.rundir import with_trl_names

    old = {
        "completion_length/mean": 1, "truncated_frac": 2, "zero_std_frac": 3, "clip_ratio": 4,
        "rewards/correctness/mean": 5, "rewards/trl.rewards:accuracy_reward/mean": 6,
        "rewards//models/my-rm/mean": 7, "reward": 8,
    }  # fmt: skip
    assert with_trl_names(old) == {
        "completions/mean_length": 1, "completions/clipped_ratio": 2, "frac_reward_zero_std": 3,
        "clip_ratio/region_mean": 4, "rewards/correctness_reward/mean": 5, "rewards/accuracy_reward/mean": 6,
        "rewards/my-rm/mean": 7, "reward": 8,
    }  # fmt: skip


def test_report_cli_writes_pngs_and_notes_torn_line(tmp_path):
    run = make_run(tmp_path / "run")
    result = CliRunner().invoke(main, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert "skipped the truncated last line 15" in result.output
    for stem in (
        "reward_curve",
        "reward_std",
        "kl",
        "loss",
        "completion_length",
        "clip_ratio",
        "phase_seconds",
        "eval_accuracy",
    ):
        assert (run / f"{stem}.png").stat().st_size > 1000, stem
    page = (run / "report.html").read_text()
    assert page.count("<img") == 8 and "http" not in page.replace("http-equiv", "")  # nothing to fetch
    assert "&lt;b&gt;not bold&lt;/b&gt;" in page  # completions are escaped, not rendered
    # A rerun without evaluation: the eval plot of the earlier report does not linger.
    metrics = [line for line in (run / "metrics.jsonl").read_text().splitlines() if "eval/" not in line]
    (run / "metrics.jsonl").write_text("\n".join(metrics))
    assert CliRunner().invoke(main, ["report", str(run)]).exit_code == 0
    assert not (run / "eval_accuracy.png").exists() and (run / "report.html").read_text().count("<img") == 7
    one = CliRunner().invoke(main, ["report", str(tmp_path / "missing")])
    assert one.exit_code == 2 and "not a run directory" in one.output


def _chromium() -> tuple[str, str] | None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@pytest.mark.skipif(
    _chromium() is None, reason="needs Debian's chromium and chromium-driver (apt-get install)"
)
def test_report_renders_plots_in_headless_chromium(tmp_path):
    """Open the report in a real browser: every plot decodes (naturalWidth) and its screenshot shows the
    plotted line (matplotlib's first colour) on a mostly white canvas."""
    import io

    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    from leangrpo.commands.report import write_report

    run = make_run(tmp_path / "run")
    page, _ = write_report(run)
    browser, driver_path = _chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    flags = ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--window-size=1280,1000")  # fmt: skip
    for flag in (*flags, f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        driver.get(page.as_uri())
        images = driver.find_elements(By.TAG_NAME, "img")
        assert len(images) == len(CURVES)  # make_run records every curve
        for img in images:
            driver.execute_script("arguments[0].scrollIntoView();", img)
            width = driver.execute_script("return arguments[0].complete && arguments[0].naturalWidth;", img)
            assert width == 640, img.get_attribute("alt")  # 6.4 in at 100 dpi
            shot = Image.open(io.BytesIO(img.screenshot_as_png)).convert("RGB")
            pixels = list(shot.getdata())
            blue = sum(abs(r - 31) + abs(g - 119) + abs(b - 180) < 60 for r, g, b in pixels)
            white = sum(min(p) > 240 for p in pixels)
            assert blue > 100 and white > len(pixels) / 2, (img.get_attribute("alt"), blue, white)
        driver.execute_script("window.scrollTo(0, 0);")
        full = Image.open(io.BytesIO(driver.get_screenshot_as_png()))
        full.save(tmp_path / "screenshot.png")
        assert full.size[0] >= 1000
    finally:
        driver.quit()
