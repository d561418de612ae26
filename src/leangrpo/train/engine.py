"""Building what generates: the device's speed levers (leangrpo.cpu's, for a model on CPU only) and the
rollout engine the config picks (HF generate, or a colocated vLLM)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from leangrpo.config.schema import Config, CPUConfig
from leangrpo.engines.rollout import HFEngine, RolloutEngine, eos_token_ids

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from leangrpo.cpu.levers import CPULevers


def cpu_levers(device: torch.device, cfg: CPUConfig) -> CPULevers | None:
    """The CPU's levers for models on `device`, or None on any other device: leangrpo.cpu is imported
    here and nowhere else."""
    if device.type != "cpu":
        return None
    from leangrpo.cpu.levers import CPULevers

    return CPULevers(cfg)


def rollout_engine(
    cfg: Config, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, levers: CPULevers | None
) -> RolloutEngine:
    """The engine `cfg.grpo.use_vllm` picks (vLLM's holds the checkpoint's weights until its first sync)."""
    if not cfg.grpo.use_vllm:
        return HFEngine(model, tokenizer, levers)
    from leangrpo.engines.vllm import VLLMEngine

    return VLLMEngine.from_config(cfg, tokenizer, eos_token_ids(tokenizer, model))
