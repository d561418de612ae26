"""What generation runs with besides its engine (`engines.registry` builds that): the device's speed levers
(leangrpo.cpu's, for a model on CPU only) and the tools and environments the config's rollouts call."""

from __future__ import annotations

from typing import TYPE_CHECKING

from leangrpo.config.schema import CPUConfig, ToolsConfig
from leangrpo.data.rewards.registry import import_object
from leangrpo.engines.tools import AgentSpec, ToolError

if TYPE_CHECKING:
    import torch

    from leangrpo.cpu.levers import CPULevers


def cpu_levers(device: torch.device, cfg: CPUConfig) -> CPULevers | None:
    """The CPU's levers for models on `device`, or None on any other device: leangrpo.cpu is imported
    here and nowhere else."""
    if device.type != "cpu":
        return None
    from leangrpo.cpu.levers import CPULevers

    return CPULevers(cfg)


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
