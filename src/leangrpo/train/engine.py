"""Building what generates: the device's speed levers (leangrpo.cpu's, for a model on CPU only), the
rollout engine the config picks (HF generate, a colocated vLLM or a vLLM server) and the tools its
rollouts call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from leangrpo.config.schema import Config, CPUConfig, ToolsConfig
from leangrpo.data.rewards.registry import import_object
from leangrpo.engines.agents import AgentSpec
from leangrpo.engines.hf import HFEngine, SnapshotEngine
from leangrpo.engines.tools import ToolError
from leangrpo.engines.types import RolloutEngine, eos_token_ids

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
    """The engine `cfg.grpo.use_vllm` and `vllm_mode` pick (vLLM's holds the checkpoint's weights until its
    first sync; a server is waited for and checked against `model`)."""
    if not cfg.grpo.use_vllm:
        return HFEngine(model, tokenizer, levers)
    eos = eos_token_ids(tokenizer, model)
    if cfg.grpo.vllm_mode == "server":
        from leangrpo.engines.vllm_client import VLLMServerEngine

        return VLLMServerEngine.from_config(cfg, model, tokenizer, eos)
    from leangrpo.engines.vllm import VLLMEngine

    return VLLMEngine.from_config(cfg, tokenizer, eos)


def async_engine(
    engine: RolloutEngine,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    levers: CPULevers | None,
) -> RolloutEngine:
    """The engine async rollouts generate with while the update runs: one holding weights of its own (vLLM's
    copy), or for HF generate, which shares the policy's, a snapshot of them (a copy of the trainable
    weights)."""
    return SnapshotEngine(model, tokenizer, levers) if isinstance(engine, HFEngine) else engine


def agent_from_config(cfg: ToolsConfig) -> AgentSpec | None:
    """The `tools:` section's tools and environment, imported like rewards; None when it names none."""
    if not cfg.enabled:
        return None
    tools = [import_object(path, "tool") for path in cfg.functions]
    for path, tool in zip(cfg.functions, tools, strict=True):
        if not callable(tool):
            raise ToolError(f"tool {path!r} is not callable (it is a {type(tool).__name__})")
    env = cfg.environment
    factories = (
        None
        if env is None
        else import_object(env, "environment")
        if isinstance(env, str)
        else {name: import_object(path, "environment") for name, path in env.items()}
    )
    return AgentSpec(tools, factories, timeout_s=cfg.timeout_s)
