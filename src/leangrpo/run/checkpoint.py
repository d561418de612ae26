"""The run directory and its crash-safe checkpoints: atomic save, rotation, finding the last complete
checkpoint, and the state a resume restores.

A checkpoint is written into `.checkpoint-N.tmp/`, every file and the directory are fsynced, and only then
is it renamed to `checkpoint-N/`; `trainer_state.json` inside lists every file with its size. A crash at
any point leaves either the complete new checkpoint or none, and the previous ones untouched.
"""

from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from leangrpo.core.errors import UserError, error_reason
from leangrpo.run.rundir import (
    MAX_LOG_BYTES,
    RunDirError,
    RunLock,
    claim,
    fsync,
    is_run_dir,
    kind,
    make_dir,
    move,
    new_file,
    open_read,
    read_json,
    read_text,
    remove,
    replaced_note,
    write_text_atomic,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from leangrpo.config.schema import Config

log = logging.getLogger(__name__)
STATE_FILE = "trainer_state.json"
SHA_FILE = "leangrpo_sha256.json"  # in the final model/: every file's sha256
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_PARTIAL = re.compile(r"^\.(checkpoint-\d+|model)\.(tmp|old)$")
# Keys that may differ on resume: they change neither the weights nor the order of data and samples.
RESUMABLE_KEYS = (
    "optim.max_steps",
    "optim.max_nonfinite_steps",
    "output_dir",
    "logging.",
    "rewards.on_error",
)


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be written, found or resumed from."""


# ------------------------------------------------------------------------------------------ checkpoints


def checkpoint_dirs(run_dir: Path, complete: bool = True) -> list[Path]:
    """The `checkpoint-N` directories of a run, oldest first; only the complete ones by default."""
    found = []
    for path in run_dir.glob("checkpoint-*"):
        match = _CHECKPOINT.match(path.name)
        if match and path.is_dir() and (not complete or is_complete(path)):
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def is_complete(ckpt: Path) -> bool:
    """True when the checkpoint's state file is readable and every file it lists has its recorded size."""
    try:
        files = read_state(ckpt)["files"]
        return all(kind(ckpt / name, ckpt) == "file" and (ckpt / name).stat().st_size == size
                   for name, size in files.items())  # fmt: skip
    except (UserError, OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def last_checkpoint(run_dir: Path) -> Path | None:
    found = checkpoint_dirs(run_dir)
    return found[-1] if found else None


def sha256(path: Path, root: Path | None = None) -> str:
    import hashlib

    with open_read(path, root) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_hashes(directory: Path) -> dict[str, str]:
    """The sha256 of every file under `directory`, by relative path: recorded when a save is written
    (before its rename), verified before its files are used."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.name != SHA_FILE)
    return {str(p.relative_to(directory)): sha256(p) for p in files}


def corruption(saved: Path) -> str | None:
    """What is wrong with a checkpoint or final model: a file missing or whose sha256 differs from the one
    recorded when it was saved (None: intact, or saved before leangrpo recorded hashes)."""
    if kind(saved / STATE_FILE, saved) is not None:
        recorded = read_state(saved).get("sha256", {})
    else:
        recorded = read_json(saved / SHA_FILE, saved) if kind(saved / SHA_FILE, saved) is not None else {}
    if not isinstance(recorded, dict) or not all(
        isinstance(k, str) and isinstance(v, str) and _relative(k) for k, v in recorded.items()
    ):
        raise CheckpointError(f"{saved}: its recorded sha256 are not a map of file names inside it to hashes")
    for name, digest in recorded.items():
        if kind(saved / name, saved) != "file":
            return f"{saved / name} is missing"
        if sha256(saved / name, saved) != digest:
            return f"{saved / name} is corrupt (its sha256 differs from the one recorded when it was saved)"
    return None


def last_good_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint whose files verify; each incomplete or corrupt one is named in a
    warning."""
    for ckpt in reversed(checkpoint_dirs(run_dir, complete=False)):
        incomplete = f"{ckpt} is incomplete (a file it lists is missing or cut short)"
        problem = corruption(ckpt) if is_complete(ckpt) else incomplete
        if problem is None:
            return ckpt
        log.warning("%s; using the checkpoint before it", problem)
    return None


def _relative(name: str) -> bool:
    """A recorded file name that stays inside its directory."""
    return bool(name) and not Path(name).is_absolute() and ".." not in Path(name).parts


def remove_partial(run_dir: Path) -> None:
    """Remove what an interrupted save left behind (`.checkpoint-N.tmp`, `.model.old`...); a link there
    is removed, never followed."""
    for path in run_dir.glob(".*"):
        if _PARTIAL.match(path.name):
            remove(path, run_dir)


def read_state(ckpt: Path) -> dict[str, Any]:
    """A checkpoint's trainer_state.json: a JSON object with an integer `step` (and the `files` and
    `sha256` it records), else a one-line CheckpointError."""
    state = read_json(ckpt / STATE_FILE, ckpt)
    step = state.get("step") if isinstance(state, dict) else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{ckpt / STATE_FILE} is not a leangrpo state (no step number)")
    return state


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: PreTrainedModel | None,
    tokenizer: Any,
    optimizer_state: dict[str, Any],
    scheduler: Any,
    cfg: Config,
    state: dict[str, Any],
    rank: int,
    barrier: Callable[[], None],
    rng: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `checkpoint-{step}` atomically; every rank calls this (each saves its RNG state).

    `model` (the whole causal LM, needed on rank 0 only) and `optimizer_state` come from the trainer's
    `distributed` strategy, which gathers them when sharded. The checkpoint holds the trainable weights
    (`save_pretrained`: the adapter only for peft models, naming the base as the user did), the tokenizer
    (a VLM's processor), the optimizer and scheduler states, every rank's RNG states (`rng`: this rank's to
    record, by default the current one), the resolved config, `state` (step counters) and `extra` (file name
    → object for torch.save). Older checkpoints beyond `logging.save_total_limit` are deleted after the new
    one is complete. A failed write (disk full...) removes the partial files and raises a CheckpointError.
    """
    from leangrpo.models.load import name_adapter_base
    from leangrpo.run.resolve import save_config

    target = run_dir / f"checkpoint-{step}"
    tmp = run_dir / f".{target.name}.tmp"
    try:
        if rank == 0:
            remove(tmp, run_dir)
            make_dir(tmp, run_dir)
        barrier()
        _torch_save(rng or rng_state(), tmp / f"rng_state_{rank}.pt")
        barrier()
        if rank == 0:
            assert model is not None, "rank 0 saves the model"
            model.save_pretrained(tmp)
            if (tmp / "adapter_config.json").is_file():
                name_adapter_base(tmp, cfg.model.name_or_path)
            tokenizer.save_pretrained(tmp)
            _torch_save(optimizer_state, tmp / "optimizer.pt")
            _torch_save(scheduler.state_dict(), tmp / "scheduler.pt")
            for name, obj in (extra or {}).items():
                _torch_save(obj, tmp / name)
            save_config(cfg, tmp / "config.yaml")
            files = {str(p.relative_to(tmp)): p.stat().st_size for p in tmp.rglob("*") if p.is_file()}
            info = {**state, "step": step, "files": files, "sha256": file_hashes(tmp)}
            write_text_atomic(tmp / STATE_FILE, json.dumps(info, indent=1), run_dir)
            claim(run_dir, target.name)
            _commit(tmp, target)
    except Exception as e:  # noqa: BLE001 - torch and safetensors report a full disk as their own errors
        _discard(tmp)
        raise CheckpointError(f"cannot save {target}: {error_reason(e)}; {what_holds(run_dir)}") from None
    if rank == 0:
        rotate(run_dir, cfg.logging.save_total_limit)
    barrier()
    return target


def what_holds(run_dir: Path) -> str:
    """After a failure: the last complete checkpoint, which a resume continues from, or that there is none."""
    previous = last_checkpoint(run_dir)
    if previous is None:
        return "no complete checkpoint was written"
    return f"the last complete checkpoint, {previous}, is intact (leangrpo train --resume {run_dir})"


def _torch_save(obj: Any, path: Path) -> None:
    """torch.save through a Python file, so that a failed write keeps its OSError (errno) in the chain."""
    import torch

    with new_file(path, path.parent.parent) as f:
        torch.save(obj, f)


def _discard(tmp: Path) -> None:
    """Remove a partial save after a failure (the disk may be what failed: best effort)."""
    try:
        remove(tmp, tmp.parent)
    except (OSError, RunDirError):
        log.warning("could not remove the partial save %s", tmp)


def _commit(tmp: Path, target: Path) -> None:
    """fsync every file and directory under `tmp`, then rename it to `target` (replacing it) durably;
    in `target`'s folder, nothing is followed through a link."""
    root = target.parent
    for path in sorted(tmp.rglob("*"), reverse=True):
        fsync(path)
    fsync(tmp)
    old = target.with_name(f".{target.name}.old")
    remove(old, root)
    if kind(target, root) is not None:
        move(target, old, root)
    move(tmp, target, root)
    fsync(root)
    _discard(old)


def save_final_model(model: PreTrainedModel, tokenizer: Any, out_dir: Path, base_name: str) -> None:
    """The final model (merged, plus `adapter/` for LoRA naming `base_name`, the run's
    `model.name_or_path`, as its base: see `models.save_model`), written atomically."""
    from leangrpo.models.load import save_model

    tmp = out_dir.with_name(f".{out_dir.name}.tmp")
    try:
        remove(tmp, out_dir.parent)
        make_dir(tmp, out_dir.parent)
        save_model(model, tokenizer, tmp, merge=True, base_name=base_name)
        write_text_atomic(tmp / SHA_FILE, json.dumps(file_hashes(tmp), indent=1), out_dir.parent)
        claim(out_dir.parent, out_dir.name)
        _commit(tmp, out_dir)
    except Exception as e:  # noqa: BLE001 - as in save_checkpoint
        _discard(tmp)
        holds = what_holds(out_dir.parent)
        raise CheckpointError(
            f"cannot save the final model to {out_dir}: {error_reason(e)}; {holds}"
        ) from None


def rotate(run_dir: Path, keep: int | None) -> None:
    """Delete the oldest complete checkpoints beyond `keep` (None keeps all)."""
    if keep is None:
        return
    found = checkpoint_dirs(run_dir)
    for old in found[: max(len(found) - keep, 0)]:
        remove(old, run_dir)


# ------------------------------------------------------------------------------------------------ resume


def rng_state() -> dict[str, Any]:
    """Every random generator a step draws from: python, numpy, torch and, when present, the CUDA
    generator of this process's own device (not every visible device's: a run resumed where fewer
    devices are visible could not restore those)."""
    import numpy as np
    import torch

    # legacy=True (the default) gives MT19937's tuple (numpy's stubs also allow legacy=False's dict); it is
    # saved as plain types, so it loads with weights_only
    legacy = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
    kind, keys, pos, has_gauss, cached = legacy
    numpy_state = (kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state(torch.cuda.current_device())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is None or not torch.cuda.is_available():
        return
    device = torch.cuda.current_device()
    if isinstance(cuda, list | tuple):  # older checkpoints: every visible device's, by index
        if not cuda:
            return
        cuda = cuda[device] if device < len(cuda) else cuda[0]
    torch.cuda.set_rng_state(cuda, device)


def load_rank_state(ckpt: Path, rank: int) -> dict[str, Any]:
    """What one rank restores: optimizer, scheduler and its own RNG states (weights: `load_trainable`).
    Read with `weights_only=True`: tensors and plain values only, so a crafted file cannot run code."""
    names = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "rng": f"rng_state_{rank}.pt"}
    return {key: _torch_load(ckpt / name) for key, name in names.items()}


def load_extra(ckpt: Path, name: str) -> Any:
    """A file `save_checkpoint` wrote from `extra` (tensors and plain values only, as `load_rank_state`)."""
    return _torch_load(ckpt / name)


def _torch_load(path: Path) -> Any:
    import torch

    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001 - garbage, truncated or crafted files raise many kinds
        raise CheckpointError(f"cannot read {path}: {error_reason(e)}") from None


def _load_weights(path: Path, ckpt: Path) -> dict[str, torch.Tensor]:
    """A safetensors file of a checkpoint (a regular file); garbage in it is a one-line CheckpointError."""
    from safetensors.torch import load_file

    if kind(path, ckpt) != "file":
        raise CheckpointError(f"{path} is not a regular file")
    try:
        return load_file(path)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error kinds on garbage
        raise CheckpointError(f"cannot read {path}: {error_reason(e)}") from None


def load_trainable(model: torch.nn.Module, ckpt: Path) -> None:
    """Load a checkpoint's trainable weights into `model` (the adapter into a peft model). A model built
    empty (parameters on meta: an FSDP2 process other than rank 0) reads nothing: rank 0 sends it its
    shards of the weights rank 0 loaded."""
    from leangrpo.models.load import is_peft

    if any(p.is_meta for p in model.parameters()):
        return
    weights = [ckpt / "adapter_model.safetensors"] if is_peft(model) else sorted(ckpt.glob("*.safetensors"))
    if not weights or not weights[0].is_file():
        missing = weights[0].name if weights else "*.safetensors"
        raise CheckpointError(f"{ckpt} holds no trainable weights ({missing} is missing)")
    if is_peft(model):
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, _load_weights(weights[0], ckpt))
        # peft annotates the result as `namedtuple`; it is torch's load_state_dict result
        problems = list(result.unexpected_keys)  # type: ignore[attr-defined]
    else:
        state: dict[str, Any] = {}
        for path in weights:
            state.update(_load_weights(path, ckpt))
        result = model.load_state_dict(state, strict=False)
        params = dict(model.named_parameters())  # tied weights appear once, under the name that was saved
        problems = list(result.unexpected_keys) + [k for k in result.missing_keys if k in params]
    if problems:
        raise CheckpointError(f"{ckpt} does not match the model: {', '.join(problems[:3])}")


def resume_checkpoint(run_dir: Path) -> Path:
    """The last complete checkpoint of a run, or a CheckpointError."""
    if not is_run_dir(run_dir):
        raise CheckpointError(f"--resume {run_dir}: not a leangrpo run directory (no leangrpo config.yaml)")
    if pid := RunLock.holder(run_dir):
        raise CheckpointError(
            f"--resume {run_dir}: the run is in use: a leangrpo process (PID {pid}) is training it now; "
            "resume it once that process has ended"
        )
    ckpt = last_good_checkpoint(run_dir)
    if ckpt is None:
        advice = replaced_note(run_dir) or "; start it again with --overwrite"
        raise CheckpointError(
            f"--resume {run_dir}: the run has no complete, intact checkpoint to resume from "
            f"(none was saved, or none verifies){advice}"
        )
    return ckpt


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as `section.key` -> value (to name the keys two configs differ in)."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def truncate_log(path: Path, step: int) -> None:
    """Keep the rows of a JSONL log up to `step`: the steps after the checkpoint are run (and logged)
    again. A torn last line, left by a kill mid-write, is dropped too."""
    if kind(path, path.parent) is None:
        return
    kept = []
    for line in read_text(path, path.parent, MAX_LOG_BYTES).splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError, RecursionError):
            continue
    write_text_atomic(path, "".join(kept), path.parent)
