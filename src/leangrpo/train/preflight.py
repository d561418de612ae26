"""Every check of a run's config against the machine and the launch it runs on, in one place, before any
model loads: the run directory (fresh or resumed), device-only and package-only options, what FSDP cannot
honour, the rollout engine's limits, the trackers' packages. Each refusal is one line naming the option
and the fix.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from leangrpo.config.schema import Config
from leangrpo.core.errors import DeviceOptionError, UserError
from leangrpo.engines.agents import AgentSpec
from leangrpo.engines.registry import engine_kind
from leangrpo.run.checkpoint import RESUMABLE_KEYS, CheckpointError, flatten, read_state
from leangrpo.run.rundir import check_output_dir, read_yaml
from leangrpo.run.tracking import TrackerError


@dataclass(frozen=True)
class World:
    """Where a run trains: its number of processes, their device type (cuda, cpu...), and whether FSDP
    shards the model over them."""

    num_processes: int = 1
    device: str = "cpu"
    sharded: bool = False


def preflight(cfg: Config, world: World, *, overwrite: bool = False, resume_from: Path | None = None) -> None:
    """Refuse, in one line, a config this run cannot honour. A fresh run needs an output_dir it may use
    (`overwrite`: replace an earlier run); a resume from checkpoint `resume_from`, the config it saved."""
    if resume_from is None:
        check_output_dir(Path(cfg.output_dir), overwrite)
    else:
        check_resumable(resume_from, cfg, world.num_processes)
    _device_options(cfg, world)
    _sharding(cfg, world)
    _engine(cfg, world)
    _async(cfg, world)
    _trackers(cfg)


def check_resumable(ckpt: Path, cfg: Config, world_size: int) -> None:
    """Refuse to resume when the new config (or process count) would change the trajectory."""
    saved = read_yaml(ckpt / "config.yaml", ckpt)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{ckpt / 'config.yaml'} is not a leangrpo config (not a mapping)")
    old = flatten(saved)
    new = flatten(cfg.model_dump(mode="json"))
    differ = [
        f"{key} ({old.get(key)!r} → {new.get(key)!r})"
        for key in sorted(old.keys() | new.keys())
        if old.get(key) != new.get(key) and not key.startswith(RESUMABLE_KEYS)
    ]
    saved_world = read_state(ckpt).get("world_size", 1)
    if saved_world != world_size:
        differ.append(f"number of processes ({saved_world} → {world_size})")
    if differ:
        raise CheckpointError(f"cannot resume from {ckpt}: the config differs in {'; '.join(differ)}")


def _device_options(cfg: Config, world: World) -> None:
    """Options this machine cannot provide: bitsandbytes' (8-bit AdamW, a 4-bit base: CPU or CUDA)
    without bitsandbytes, activation offload without CUDA, steps inside the backward on several
    processes; fp16 weights, which nothing loss-scales."""
    from leangrpo.models.load import require_bitsandbytes

    if cfg.model.dtype == "float16":
        raise UserError(
            "model.dtype float16 cannot train: nothing scales the loss, so small gradients (dapo's "
            "1/num_tokens) underflow to 0 in fp16; use bfloat16 (or float32)"
        )
    if cfg.optim.optimizer == "adamw_8bit":
        require_bitsandbytes("optim.optimizer=adamw_8bit")
    if cfg.model.load_in_4bit:
        require_bitsandbytes("model.load_in_4bit")
    if cfg.model.activation_offload and world.device != "cuda":
        raise DeviceOptionError(
            "model.activation_offload needs a CUDA GPU (on CPU the activations already live in CPU memory); "
            "set model.activation_offload=false"
        )
    if cfg.optim.optimizer_in_backward and world.num_processes > 1:
        raise UserError(
            "optim.optimizer_in_backward runs on one process only: the gradients of several are "
            "reduced after the backward, and it steps during it"
        )


def _sharding(cfg: Config, world: World) -> None:
    """Options that sharded training cannot honour."""
    if not world.sharded:
        return
    if cfg.model.load_in_4bit:
        raise UserError(
            "model.load_in_4bit cannot run under FSDP (bitsandbytes' 4-bit weights do not shard here); "
            "launch without the FSDP config, or train the bf16 model with LoRA"
        )
    if cfg.optim.optimizer == "adamw_8bit":
        raise UserError(
            "optim.optimizer=adamw_8bit cannot run under FSDP (bitsandbytes' state does not shard); "
            "use optim.optimizer=adamw, or launch without the FSDP config"
        )
    if cfg.whole_steps > 1:
        raise UserError(
            f"grpo.steps_per_generation × grpo.num_iterations = {cfg.micro_steps_per_step} is not a multiple "
            f"of optim.gradient_accumulation_steps={cfg.optim.gradient_accumulation_steps}, so an optimizer "
            "step spans two generations, whose pending gradient a checkpoint keeps only without FSDP: make "
            "it a multiple, or launch without the FSDP config"
        )


def _engine(cfg: Config, world: World) -> None:
    """What the rollout engine the config picks cannot run (vLLM missing, sleep mode off a GPU...)."""
    engine_kind(cfg).check(cfg, world.device, world.sharded)


def _async(cfg: Config, world: World) -> None:
    """What `grpo.async_rollouts` cannot run with: generating after the step's scoring, vLLM asleep during
    the update, a whole-model copy on each process of a sharded run (environments: `check_async_agent`)."""
    g = cfg.grpo
    if not g.async_rollouts:
        return
    why = {
        "grpo.dynamic_sampling": g.dynamic_sampling
        and "its extra rounds are drawn after scoring, while the next batch is already generating",
        "grpo.vllm_enable_sleep_mode": g.vllm_enable_sleep_mode
        and "vLLM would sleep during the update, when async rollouts generate",
        "FSDP": world.sharded
        and engine_kind(cfg).copy_in_process
        and "the engine would hold a whole unsharded copy of the weights on every process",
    }
    for option, reason in why.items():
        if reason:
            raise UserError(f"grpo.async_rollouts with {option}: {reason}; turn one of them off")


def check_async_agent(cfg: Config, agent: AgentSpec | None) -> None:
    """Async rollouts refuse a rollout_func (the Python API's), which generates with the trainer itself, not
    a snapshot of its weights, and environments (`tools.environment`, or the API's), which the next batch
    would reset while this step's rewards still read them."""
    if not cfg.grpo.async_rollouts or agent is None:
        return
    if agent.rollout_func is not None:
        raise UserError(
            "grpo.async_rollouts with a rollout_func: it generates with the trainer being updated"
        )
    if agent.factories is not None:
        raise UserError(
            "grpo.async_rollouts with environments: the next batch resets the environments this step's "
            "rewards still read; turn one of them off"
        )


def _trackers(cfg: Config) -> None:
    """A tracker whose package (named like the tracker) is missing; found without importing it."""
    for name in cfg.logging.report_to:
        if importlib.util.find_spec(name) is None:
            raise TrackerError(
                f"logging.report_to includes {name}, but the {name} package is not installed: "
                f"pip install {name}"
            )
