"""Trained models: where a run's, checkpoint's or export's weights are (`locate`), and loading them, or
any other model, for inference (`load_trained`): the one loader eval, chat and export share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from leangrpo.config.schema import ModelConfig
from leangrpo.core.errors import UserError
from leangrpo.models.load import (
    DTYPES,
    ModelError,
    auto_model_class,
    describe,
    load_base,
    load_model_and_tokenizer,
    load_tokenizer,
    merge_lora,
    processing_class,
    resolve_model_path,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin


EXPORT_INFO = "leangrpo_export.json"


@dataclass
class Trained:
    """Where a trained model's weights are, and the training config that made them."""

    source: Path
    full: Path | None  # a whole model (full fine-tune, or the run's merged final model)
    adapter: Path | None  # a peft adapter over the config's model.name_or_path
    config: dict[str, Any]
    step: int
    run_dir: Path | None  # where metrics.jsonl lives (None for an export)


def locate(source: str | Path) -> Trained | None:
    """The trained weights behind `source`, resolved the same way for eval, chat, export and compare:
    a run directory means its final `model/`, else its last complete checkpoint; a checkpoint or a
    leangrpo export means itself. None for anything else (a model directory, hub id or .gguf)."""
    from .checkpoint import STATE_FILE, corruption, last_good_checkpoint, read_state
    from .rundir import MANIFEST, is_run_dir, kind

    path = Path(source).expanduser()
    if kind(path / EXPORT_INFO, path) is not None:
        return _export(path)
    if kind(path / STATE_FILE, path) is not None and kind(path / MANIFEST, path) is None:  # save_state()'s
        ckpt, run_dir = path, path.parent
        if problem := corruption(ckpt):
            raise ModelError(problem)
    elif is_run_dir(path):
        run_dir, final = path, path / "model"
        if kind(final / "config.json", path) == "file":
            config = training_config(path / "config.yaml", path)
            if problem := corruption(final):
                raise ModelError(f"{problem}; use one of the run's checkpoints instead")
            adapter = final / "adapter"
            return Trained(path, final, adapter if kind(adapter, path) == "dir" else None, config,
                           _count(config.get("optim"), "max_steps", path / "config.yaml"), path)  # fmt: skip
        found = last_good_checkpoint(path)
        if found is None:
            raise ModelError(f"{path} has neither a final model nor a complete checkpoint")
        ckpt = found
    else:
        return None
    config = training_config(ckpt / "config.yaml", ckpt)
    is_adapter = kind(ckpt / "adapter_config.json", ckpt) == "file"
    return Trained(path, None if is_adapter else ckpt, ckpt if is_adapter else None, config,
                   read_state(ckpt)["step"], run_dir)  # fmt: skip


_FORMATS = {"peft adapter": True, "full model": False}  # an export's format: is it an adapter


def _export(path: Path) -> Trained:
    """A leangrpo export: its leangrpo_export.json validated (format, step, training config)."""
    from .rundir import read_json

    info_path = path / EXPORT_INFO
    info = read_json(info_path, path)
    if not isinstance(info, dict) or info.get("format") not in _FORMATS:
        raise ModelError(f"{info_path} is not a leangrpo export's (no format 'peft adapter' or 'full model')")
    config = _checked_config(info.get("config"), f"{info_path}'s config")
    adapter = _FORMATS[info["format"]]
    return Trained(path, None if adapter else path, path if adapter else None, config,
                   _count(info, "step", info_path), None)  # fmt: skip


def training_config(path: Path, root: Path) -> dict[str, Any]:
    """A run's or checkpoint's config.yaml, with what eval, chat and export read from it checked."""
    from .rundir import kind, read_yaml

    if kind(path, root) is None:
        raise ModelError(f"{path} is missing: {root} has no training config")
    return _checked_config(read_yaml(path, root), str(path))


def _checked_config(config: Any, where: str) -> dict[str, Any]:
    """`config` if it holds the sections eval, chat and export read (model name and dtype, data)."""
    if not isinstance(config, dict) or not isinstance(config.get("data"), dict):
        raise ModelError(f"{where} is not a leangrpo training config (no data section)")
    model = config.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("name_or_path"), str):
        raise ModelError(f"{where} is not a leangrpo training config (no model.name_or_path)")
    if model.get("dtype") not in DTYPES:
        raise ModelError(f"{where}: model.dtype {model.get('dtype')!r} is not one of {', '.join(DTYPES)}")
    return config


def _count(section: Any, key: str, where: Path) -> int:
    """A whole number `section[key]` (a step count) of a file a run wrote."""
    value = section.get(key) if isinstance(section, dict) else None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelError(f"{where} has no step count ({key})")
    return value


def load_trained(
    source: str,
    *,
    dtype: str | None = None,
    adapter: str | None = None,
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | ProcessorMixin, Trained | None]:
    """Load `source` for inference (eval mode, on the GPU when there is one): a run, checkpoint or export
    (see `locate`), or any model `load_model_and_tokenizer` takes, with an optional peft `adapter` merged
    in; and its processing class, as TRL's: a vision-language model's processor saved beside its weights
    (which encodes image prompts; `vision.text_tokenizer` gives its tokenizer), else the tokenizer.
    `dtype` defaults to the training config's. `trust_remote_code` comes from the caller only, never
    from a file being loaded."""
    trained = locate(source)
    cfg = ModelConfig(
        name_or_path=source, dtype=dtype or "float32", gradient_checkpointing=False,
        trust_remote_code=trust_remote_code,
    )  # fmt: skip
    if trained is None:
        model, tokenizer = load_model_and_tokenizer(cfg)
    else:
        kwargs: dict[str, Any] = {
            "dtype": DTYPES[dtype or trained.config["model"]["dtype"]],
            "trust_remote_code": trust_remote_code,
        }
        weights = trained.full or trained.adapter
        try:
            if trained.full is not None:
                full = str(trained.full)  # a vision-language model loads whole, as in training
                model = auto_model_class(full, trust_remote_code).from_pretrained(full, **kwargs)
            else:  # the base as it was trained on (4-bit for QLoRA), then the adapter merged in
                base_cfg = ModelConfig.model_validate(
                    {**trained.config["model"], "trust_remote_code": trust_remote_code}
                )
                base = resolve_model_path(base_cfg.name_or_path)
                # A 4-bit base is quantized from the training dtype, exactly as in training.
                model = load_base(base, base_cfg, None if base_cfg.load_in_4bit else dtype)
                model = _merge_adapter(model, str(trained.adapter), kwargs["dtype"])
        except UserError:
            raise
        except Exception as e:  # noqa: BLE001 - truncated or foreign weights raise many kinds
            raise ModelError(f"cannot load the trained model in {weights}: {describe(e)}") from None
        tokenizer = load_tokenizer(str(weights), trust_remote_code)
        cfg = cfg.model_copy(update={"name_or_path": str(weights)})  # its processor is saved beside them
    processing = processing_class(None, tokenizer, model, cfg)
    if adapter:
        model = _merge_adapter(model, adapter)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    # transformers wraps PreTrainedModel.to with functools.wraps, which the stubs do not bind as a method
    return model.to(device).eval(), processing, trained  # type: ignore[arg-type]


def _merge_adapter(model: PreTrainedModel, adapter: str, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """`model` with the peft adapter in `adapter` folded in (then cast to `dtype`); a mismatch is a
    one-line error."""
    from peft import PeftModel

    if not (Path(adapter) / "adapter_config.json").is_file():
        raise ModelError(f"{adapter} is not a peft adapter directory (no adapter_config.json)")
    try:
        return merge_lora(PeftModel.from_pretrained(model, adapter), dtype)
    except Exception as e:  # noqa: BLE001 - peft/torch raise many kinds on a mismatch
        detail = describe(e)
        detail = detail if len(detail) <= 300 else detail[:300] + "..."
        raise ModelError(f"adapter {adapter} does not fit model {model.name_or_path}: {detail}") from None
