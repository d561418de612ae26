"""One run of TRL's generation buffer (steps_per_generation 4 over gradient_accumulation_steps 2) under
`trl` or `leangrpo`, as a user of either writes it, recording what the schedule decides: the learning rate
of every optimizer step (a global optimizer hook), the completions each generation scored, the final
global_step and the logged rows' learning rates and epochs. `python generation_buffer_run.py trl MODEL OUT
CHANGES` (JSON) writes OUT/record.json (TRL runs in a process of its own: it leaves accelerate's shared
state set)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROWS = [{"prompt": p} for p in ("Hi", "Yo", "Hey", "Ho", "Ha", "He", "Hu", "Hm")]
ARGS = dict(
    max_steps=4, per_device_train_batch_size=4, gradient_accumulation_steps=2, steps_per_generation=4,
    num_generations=4, max_completion_length=4, learning_rate=1e-3, lr_scheduler_type="linear",
    warmup_steps=1, logging_steps=1, save_steps=100, report_to="none",
)  # fmt: skip
"""TRL's max_steps counts optimizer steps: 4 here, 2 generations of 16 completions, 2 optimizer steps each."""


def run(lib: ModuleType, model: str, out: Path, **changes: Any) -> dict[str, Any]:
    """Train as configured (`changes` to ARGS; `rows`: on the first that many of ROWS); returns what the
    schedule decided."""
    from datasets import Dataset
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    scored: list[int] = []
    lrs: list[float] = []

    def short(completions: list[Any], **kwargs: Any) -> list[float]:
        scored.append(len(completions))
        return [-float(len(c)) for c in completions]

    hook = register_optimizer_step_pre_hook(
        lambda optimizer, args, kwargs: lrs.append(optimizer.param_groups[0]["lr"])
    )
    extra = {"use_cpu": True} if lib.__name__ == "trl" else {}
    rows = ROWS[: changes.pop("rows", len(ROWS))]
    args = lib.GRPOConfig(output_dir=str(out), **{**ARGS, **changes}, **extra)
    try:
        trainer = lib.GRPOTrainer(model, short, args, Dataset.from_list(rows))
        trainer.train()
    finally:
        hook.remove()
    rows = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    return {
        "optimizer_lrs": lrs,
        "scored": scored,
        "global_step": trainer.state.global_step,
        "logged_lrs": {r["step"]: r["learning_rate"] for r in rows},
        "epochs": {r["step"]: r["epoch"] for r in rows},
    }


if __name__ == "__main__":
    import os

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl

    target = Path(sys.argv[3])
    target.mkdir(parents=True, exist_ok=True)
    changes = json.loads(sys.argv[4])
    (target / "record.json").write_text(json.dumps(run(trl, sys.argv[2], target / "run", **changes)))
