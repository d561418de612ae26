"""Export a trained run: the peft adapter, or the merged full model, with tokenizer, chat template and a
small JSON of the training config and final metrics. Also loads a trained model for `leangrpo chat`."""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from .checkpoint import STATE_FILE, CheckpointError, last_checkpoint, read_state
from .rundir import is_run_dir

EXPORT_INFO = "leangrpo_export.json"


class ExportError(CheckpointError):
    """The export source or destination cannot be used."""


@dataclass
class Trained:
    """Where a run's trained weights are: a full model directory and/or a peft adapter directory."""

    source: Path
    full: Path | None  # loads with AutoModelForCausalLM (full fine-tune, or the run's merged final model)
    adapter: Path | None  # a peft adapter over config.model.name_or_path
    config: dict[str, Any]
    step: int
    run_dir: Path


def locate(source: str | Path) -> Trained:
    """A run directory (its final `model/`, else its last complete checkpoint) or one checkpoint."""
    path = Path(source)
    if (path / STATE_FILE).is_file():
        ckpt, run_dir = path, path.parent
    elif is_run_dir(path):
        run_dir, final = path, path / "model"
        cfg = yaml.safe_load((path / "config.yaml").read_text())
        if (final / "config.json").is_file():
            adapter = final / "adapter"
            return Trained(
                path, final, adapter if adapter.is_dir() else None, cfg, cfg["optim"]["max_steps"], path
            )
        ckpt = last_checkpoint(path)
        if ckpt is None:
            raise ExportError(f"{path} has neither a final model nor a complete checkpoint")
    else:
        raise ExportError(f"{path} is neither a leangrpo run directory nor a checkpoint")
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    is_adapter = (ckpt / "adapter_config.json").is_file()
    return Trained(
        path,
        None if is_adapter else ckpt,
        ckpt if is_adapter else None,
        cfg,
        read_state(ckpt)["step"],
        run_dir,
    )


def load_trained(trained: Trained) -> tuple[Any, Any]:
    """The trained model (an adapter merged into its base) and tokenizer, in eval mode."""
    from transformers import AutoModelForCausalLM

    from .models import DTYPES, load_tokenizer, resolve_model_path

    model_cfg = trained.config["model"]
    kwargs = {"dtype": DTYPES[model_cfg["dtype"]], "trust_remote_code": model_cfg["trust_remote_code"]}
    if trained.full is not None:
        model = AutoModelForCausalLM.from_pretrained(trained.full, **kwargs)
    else:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(resolve_model_path(model_cfg["name_or_path"]), **kwargs)
        model = PeftModel.from_pretrained(base, trained.adapter).merge_and_unload()
    tokenizer = load_tokenizer(str(trained.full or trained.adapter), model_cfg["trust_remote_code"])
    return model.eval(), tokenizer


def final_metrics(run_dir: Path, step: int) -> dict[str, Any] | None:
    """The last metrics row at or before `step`."""
    rows = []
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    rows = [r for r in rows if isinstance(r, dict) and r.get("step", 0) <= step]
    return rows[-1] if rows else None


def export(source: str | Path, out_dir: str | Path, merge: bool) -> Path:
    """Write the adapter (peft format) or, with `merge` or for a full fine-tune, the full model in
    safetensors; both with the tokenizer (and chat template) and `leangrpo_export.json`."""
    trained = locate(source)
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        if trained.adapter is not None and not merge:
            from .models import load_tokenizer

            for name in ("adapter_config.json", "adapter_model.safetensors"):
                shutil.copy2(trained.adapter / name, tmp / name)
            load_tokenizer(str(trained.adapter)).save_pretrained(tmp)
        else:
            model, tokenizer = load_trained(trained)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
        info = {
            "source": str(trained.source),
            "step": trained.step,
            "format": "peft adapter" if trained.adapter is not None and not merge else "full model",
            "base_model": trained.config["model"]["name_or_path"],
            "config": trained.config,
            "final_metrics": final_metrics(trained.run_dir, trained.step),
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot export to {out}: {e.strerror or e}") from None
    return out
