"""The rollout engines by name, and the one builder that maps a config to one of them.

TRL's `grpo.use_vllm` and `grpo.vllm_mode` stay the user-facing names; `engine_name` reads them here and
nowhere else (outside the config): preflight asks the engine's `EngineKind` what to check, and the trainer
asks the built engine whether it holds weights of its own (synced after each update) and whether its
batches carry the sampler's log-probs. Adding an engine is one entry in `ENGINES` and one line in
`engine_name`. Each engine's module is imported when it is built: the planner reads the registry without
torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.config.schema import Config, GRPOSection
    from leangrpo.engines.types import GenerateLevers, RolloutEngine

Builder = Callable[
    ["Config", "PreTrainedModel", "PreTrainedTokenizerBase", "GenerateLevers | None"], "RolloutEngine"
]
Check = Callable[["Config", str, bool], None]
"""A refusal, in one line, of what the engine cannot run (config, device type, sharded), before any model
loads."""


def _no_check(cfg: Config, device: str, sharded: bool) -> None:
    """HF generate runs wherever the policy does."""


@dataclass(frozen=True)
class EngineKind:
    """An engine: how to build it, and what to check of a run before any model loads. `copy_in_process`:
    its weights (or, for an engine that reads the policy, async rollouts' snapshot of them) are whole in
    this process, which FSDP2 with async rollouts refuses. What the trainer needs to know of a built
    engine, the engine says itself (`RolloutEngine`: holds_weights, sampler_logprobs, close)."""

    build: Builder
    check: Check = _no_check
    copy_in_process: bool = True


def _hf(
    cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, levers: GenerateLevers | None
) -> RolloutEngine:
    from leangrpo.engines.hf import HFEngine

    return HFEngine(model, tokenizer, levers)


def _vllm(
    cfg: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    levers: GenerateLevers | None,
    processor: Any | None = None,
) -> RolloutEngine:
    from leangrpo.engines.types import eos_token_ids
    from leangrpo.engines.vllm import VLLMEngine

    return VLLMEngine.from_config(cfg, tokenizer, eos_token_ids(tokenizer, model), processor)


def _vllm_server(
    cfg: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    levers: GenerateLevers | None,
    processor: Any | None = None,
) -> RolloutEngine:
    from leangrpo.engines.types import eos_token_ids
    from leangrpo.engines.vllm_client import VLLMServerEngine

    return VLLMServerEngine.from_config(cfg, model, tokenizer, eos_token_ids(tokenizer, model), processor)


def _check_vllm(cfg: Config, device: str, sharded: bool) -> None:
    from leangrpo.engines.vllm import check_colocate

    check_colocate(cfg, device)


def _check_vllm_server(cfg: Config, device: str, sharded: bool) -> None:
    from leangrpo.engines.vllm_client import check_server

    check_server(device, sharded)


ENGINES: dict[str, EngineKind] = {
    "hf": EngineKind(_hf),
    "vllm": EngineKind(_vllm, _check_vllm),
    "vllm_server": EngineKind(_vllm_server, _check_vllm_server, copy_in_process=False),
}


def engine_name(g: GRPOSection) -> str:
    """The engine TRL's names pick: HF generate, a colocated vLLM (`vllm_mode: colocate`) or a server."""
    if not g.use_vllm:
        return "hf"
    return "vllm_server" if g.vllm_mode == "server" else "vllm"


def engine_kind(cfg: Config) -> EngineKind:
    return ENGINES[engine_name(cfg.grpo)]


def build_engine(
    cfg: Config,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    levers: GenerateLevers | None,
    processor: Any | None = None,
) -> RolloutEngine:
    """The engine `cfg` picks (vLLM's holds the checkpoint's weights until its first sync; a server is
    waited for and checked against `model`). `processor`: a vision-language model's, for image prompts,
    which every engine takes."""
    if processor is None:
        return engine_kind(cfg).build(cfg, model, tokenizer, levers)
    if engine_name(cfg.grpo) == "vllm":
        return _vllm(cfg, model, tokenizer, levers, processor)
    if engine_name(cfg.grpo) == "vllm_server":
        return _vllm_server(cfg, model, tokenizer, levers, processor)
    from leangrpo.engines.hf import HFEngine

    return HFEngine(model, tokenizer, levers, processor)


def async_engine(
    engine: RolloutEngine,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    levers: GenerateLevers | None,
) -> RolloutEngine:
    """The engine async rollouts generate with while the update runs: one holding weights of its own, or for
    one that reads the policy, a snapshot of them (a copy of the trainable weights)."""
    from leangrpo.engines.hf import SnapshotEngine

    processor = getattr(engine, "processor", None)  # an HFEngine's, for image prompts
    return engine if engine.holds_weights else SnapshotEngine(model, tokenizer, levers, processor)
