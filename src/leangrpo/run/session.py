"""A run directory while a run holds it: the lock (main process), the earlier run a fresh start replaces,
the config it writes first, its logs and trackers; and the run it replaced moved back when the new one
ends before finishing a step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from leangrpo.config.schema import Config
from leangrpo.core.errors import error_reason
from leangrpo.run.checkpoint import what_holds
from leangrpo.run.resolve import save_config, with_model_path
from leangrpo.run.rundir import (
    RunDirError,
    RunLock,
    claim,
    refuse_link,
    replaced_note,
    restore_replaced,
    start_run,
)
from leangrpo.run.tracking import MetricsLogger, open_trackers


class RunSession:
    """One run's hold on its directory, taken at construction (the main process's lock) and let go by
    `close`."""

    def __init__(self, run_dir: Path, is_main: bool, write: Callable[[str], None]):
        self.run_dir, self.is_main, self.write = run_dir, is_main, write
        self.lock = RunLock(run_dir) if is_main else None

    @contextmanager
    def opening(self, resuming: bool) -> Iterator[None]:
        """Around the start of a run (`open`, and a resume's restore): on any failure, the replaced run
        is moved back and the lock let go; a disk error becomes one line (with what a resumed run's
        checkpoints hold)."""
        try:
            yield
        except BaseException as e:
            self.close()
            if not isinstance(e, (OSError, RunDirError)):
                raise
            # a tracker's directory, a log... on a full or read-only disk
            why = e if isinstance(e, RunDirError) else f"cannot write in {self.run_dir}: {error_reason(e)}"
            raise RunDirError(f"{why}; {what_holds(self.run_dir)}" if resuming else why) from None

    def open(
        self, cfg: Config, overwrite: bool, resuming: bool, barrier: Callable[[], None]
    ) -> tuple[Config, MetricsLogger]:
        """Replace an earlier run (a fresh start) and write the config, then open the logs and trackers;
        returns the config as written (the model's path resolved) and the metrics logger."""
        if self.is_main and not resuming:
            cfg = with_model_path(cfg, start_run(self.run_dir, overwrite, cfg.model.name_or_path))
            save_config(cfg, self.run_dir / "config.yaml")  # first: it marks the directory as a run
        barrier()
        trackers = []
        if self.is_main:
            tracker_dirs = {"tensorboard", "wandb"} & set(cfg.logging.report_to)
            claim(self.run_dir, "metrics.jsonl", "completions.jsonl", *sorted(tracker_dirs))
            for folder in tracker_dirs:  # the trackers' libraries write there by name
                refuse_link(self.run_dir / folder, self.run_dir)
            name = cfg.logging.run_name or self.run_dir.name
            trackers = open_trackers(
                cfg.logging.report_to, self.run_dir, cfg.model_dump(mode="json"), cfg.logging.project, name
            )
        return cfg, MetricsLogger(self.run_dir, write=self.write, trackers=trackers)

    def restore_replaced(self) -> None:
        """When the new run ends before finishing a step, however it ends, the run it replaced is moved
        back (or, if that fails, where it is and how to restore it is said)."""
        if not self.is_main:
            return
        try:
            if restore_replaced(self.run_dir):
                self.write("the run stopped before its first step; the run it replaced is back")
        except OSError as e:
            why = f"cannot restore the replaced run: {error_reason(e)}{replaced_note(self.run_dir)}"
            self.write(f"error: {why}")

    def close(self) -> None:
        """The replaced run back if the new one never finished a step, and the lock let go."""
        self.restore_replaced()
        if self.lock is not None:
            self.lock.release()
