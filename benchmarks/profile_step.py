"""Where one of our vs-TRL row's steps goes: each phase's seconds and peak RSS, and a torch.profiler table.

    python benchmarks/profile_step.py --row a                      # phases of step 2, profile of update
    python benchmarks/profile_step.py --row f --profile rollout    # profile the rollout instead
    python benchmarks/profile_step.py --row d --profile none --ours-set grpo.reference_dtype=bfloat16

Builds our side of `benchmarks/vs_trl.py`'s row exactly as that script does (the same model, prompt
and config; its --steps, --model, --data, ... options), runs step 1 as a warm-up, then step 2 with
each phase wrapped: its seconds, the process's peak RSS within the phase (the kernel's high-water mark,
reset at the phase's start through /proc/self/clear_refs, Linux only) and the RSS it leaves behind.
The profiler runs around the phase named by --profile only, so the other phases' seconds are clean.
RESULTS.md's "Where row a's step goes" is this table.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_trl  # noqa: E402 (the sibling script, imported as a module)

PHASES = ("rollout", "score", "advantages", "reference", "update", "record")
ROLES = {"rollout": "source", "score": "scorer", "advantages": "scorer", "reference": "updater",
         "update": "updater", "record": "recorder"}  # fmt: skip
"""Which of the Trainer's roles (train/*.py) runs each phase."""


def rss_mb(field: str) -> float:
    """VmRSS (now) or VmHWM (peak since the last reset) of this process, in MiB."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{field}:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]


def reset_peak() -> None:
    """Start the kernel's peak-RSS count afresh (clear_refs "5": reset the high-water mark)."""
    Path("/proc/self/clear_refs").write_text("5")


def measured(name: str, fn: Callable[..., Any], profile: bool, out: dict[str, dict[str, float]]) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        reset_peak()
        start = time.perf_counter()
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                result = fn(*args, **kwargs)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        else:
            result = fn(*args, **kwargs)
        out[name] = {
            "seconds": time.perf_counter() - start,
            "peak_mb": rss_mb("VmHWM"),
            "after_mb": rss_mb("VmRSS"),
        }
        return result

    return wrapper


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", default="a", choices=sorted(vs_trl.ROWS))
    p.add_argument(
        "--profile", default="update", choices=[*PHASES, "none"], help="phase to run the profiler on"
    )
    vs_trl.add_settings_args(p)
    p.set_defaults(steps=2)
    a = p.parse_args()

    from leangrpo.run.resolve import validate_config
    from leangrpo.train.trainer import Trainer

    s = vs_trl.row_settings(a, a.row)
    with tempfile.TemporaryDirectory(prefix="profile_step-") as tmp:
        trainer = Trainer(validate_config(vs_trl.ours_config(s, Path(tmp)), "benchmark"), overwrite=True)
        print(f"row {a.row}: after loading, RSS {rss_mb('VmRSS'):.0f} MiB, peak {rss_mb('VmHWM'):.0f} MiB")
        trainer.step(1)
        phases: dict[str, dict[str, float]] = {}
        for name in PHASES:
            role = getattr(trainer, ROLES[name])
            setattr(role, name, measured(name, getattr(role, name), name == a.profile, phases))
        metrics = trainer.step(2)
    print(f"step 2: {metrics['step_seconds']:.2f} s, {torch.get_num_threads()} torch thread(s)")
    print(f"{'phase':12} {'seconds':>8} {'peak RSS MiB':>13} {'RSS after MiB':>14}")
    for name, m in phases.items():
        note = " (profiled)" if name == a.profile else ""
        print(f"{name:12} {m['seconds']:8.2f} {m['peak_mb']:13.0f} {m['after_mb']:14.0f}{note}")


if __name__ == "__main__":
    main()
