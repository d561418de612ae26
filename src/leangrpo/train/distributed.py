"""How the policy spreads over processes: replicated (DDP, what `accelerate launch` gives by default) or
sharded (FSDP2, `fully_shard`, with `leangrpo accelerate-config fsdp2`).

The trainer talks to one of two small classes with the same methods, so the loop reads the same either
way. Accelerate 1.15 treats a CPU run as MULTI_CPU and ignores its FSDP plugin there, so sharding is done
here with PyTorch's own `fully_shard` on CPU (gloo) and GPU alike; accelerate still launches the processes
and forms the group. Everything FSDP-specific (gathering full weights for generation, clipping DTensor
gradients, full state dicts for checkpoints) lives in `Sharded`.
"""

from __future__ import annotations

import copy
import os
import shlex
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from leangrpo.core.errors import UserError
from leangrpo.engines.vllm import applied_weights

MASTERS_KEY = "leangrpo_master_weights"  # where fp32 master weights travel in an optimizer state dict

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedModel

    from leangrpo.train.policy import Policy


def fsdp_requested() -> bool:
    """True when `accelerate launch` was given an FSDP2 config (it sets these variables for every process)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return False
    if os.environ.get("FSDP_VERSION", "1") != "2":
        raise UserError(
            "accelerate config: FSDP1 is not supported; set fsdp_version: 2 "
            "(see `leangrpo accelerate-config fsdp2`)"
        )
    return True


def launcher_processes(cmdline: list[str]) -> int | None:
    """How many processes an `accelerate launch` command line asks for (`--num_processes N`); None when
    it is not one or does not say."""
    if not any("accelerate" in arg for arg in cmdline[:2]) or "launch" not in cmdline:
        return None
    for i, arg in enumerate(cmdline):
        value = arg.partition("=")[2] if arg.startswith("--num_processes=") else None
        if arg == "--num_processes" and i + 1 < len(cmdline):
            value = cmdline[i + 1]
        if value is not None and value.isdigit():
            return int(value)
    return None


def launch_warning(formed: int, cmdline: list[str] | None = None) -> str | None:
    """A line when `accelerate launch` (its command line: default the parent's) asked for more processes
    than `formed`: why, and the command that forms them. Accelerate starts several processes only with
    --multi_gpu (or a config file naming a multi-process type), and never with --cpu: it then runs its
    single-process launcher whatever --num_processes says, on a CPU machine too."""
    cmdline = _parent_cmdline() if cmdline is None else cmdline
    asked = launcher_processes(cmdline)
    if asked is None or asked <= formed:
        return None
    args = cmdline[cmdline.index("launch") + 1 :]
    script = next((i for i, arg in enumerate(args) if arg == "-m" or arg.endswith(".py")), len(args))
    options, cpu = args[:script], "--cpu" in args[:script]
    fixed = [arg for arg in options if arg != "--cpu"]
    # a config file names the launch type itself (--multi_gpu would override an FSDP one)
    if "--multi_gpu" not in fixed and not (cpu and any(a.startswith("--config_file") for a in fixed)):
        fixed.insert(0, "--multi_gpu")
    why = "--cpu always starts one process" if cpu else "without --multi_gpu it starts one process"
    command = shlex.join(["accelerate", "launch", *fixed, *args[script:]])
    return (
        f"warning: accelerate launch asked for {asked} processes but {formed} formed: {why}; "
        f"for {asked} processes: {command} (docs/distributed.md)"
    )


def _parent_cmdline() -> list[str]:
    """The parent process's command line (Linux); empty elsewhere."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return []
    return raw.decode(errors="replace").split("\0")


class Replicated:
    """Every process holds the whole model; DDP averages gradients (one process: a plain model)."""

    def __init__(self, acc: Accelerator):
        self.acc = acc

    @property
    def loads_weights(self) -> bool:
        """Whether this process reads the model's weights from disk (`Sharded`: rank 0 only)."""
        return True

    def describe(self) -> str:
        n = self.acc.num_processes
        return f"{n} processes, data parallel (DDP)" if n > 1 else "1 process"

    def any_process(self, flag: bool) -> bool:
        """True on every process when `flag` is true on any (so that all stop, skip or save together)."""
        return bool(self.acc.reduce(torch.tensor(float(flag), device=self.acc.device), "sum") > 0)

    def wrap(self, policy: Policy) -> nn.Module:
        """The policy on this process's device, its head checked there, then wrapped for DDP."""
        policy.to(self.acc.device).prepare()
        return self.acc.prepare_model(policy)

    def place_frozen(self, module: Policy) -> nn.Module:
        """A frozen module (the full-fine-tuning reference): a whole copy on this process's device."""
        module.to(self.acc.device).prepare()
        return module

    def release_frozen(self, module: nn.Module) -> None:
        """After a frozen module's pass: free what the pass left gathered. Nothing here (always whole)."""

    def sync_gradients(self, policy: nn.Module, sync: bool) -> Any:
        """Within gradient accumulation, only the last micro-batch's backward synchronises."""
        return nullcontext() if sync else self.acc.no_sync(policy)

    @contextmanager
    def full_weights(self, policy: nn.Module) -> Iterator[None]:
        """Whole weights on every process for generation and evaluation: they always are."""
        yield

    def engine_weights(self, policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]] | None:
        """None: the weights are whole on every process, so a colocated vLLM engine reads what it needs
        from the model itself (a LoRA adapter alone, or `applied_weights`)."""
        return None

    def clip_grad_norm(self, policy: nn.Module, max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(policy.parameters(), max_norm))

    def saveable(self, policy: nn.Module) -> PreTrainedModel | None:
        """The causal LM to save (adapter included), on the main process; None on the others.
        Every process must call it (the sharded version gathers)."""
        return self.acc.unwrap_model(policy).lm if self.acc.is_main_process else None

    def optimizer_state(self, policy: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return optimizer.state_dict()

    def load_optimizer_state(
        self, policy: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        optimizer.load_state_dict(state)

    def mix_into(self, target: nn.Module, source: nn.Module, alpha: float) -> None:
        """target = alpha·source + (1 - alpha)·target in place, parameter by parameter (same names):
        grpo.sync_ref_model's move of the reference toward the policy."""
        _mix(target.named_parameters(), dict(source.named_parameters()), alpha)

    def frozen_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """A frozen module's parameters, whole and on CPU, for a checkpoint."""
        return {name: p.detach().cpu() for name, p in module.named_parameters()}

    def load_frozen_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Restore `frozen_state`'s parameters (the whole tensors, given to every process)."""
        with torch.no_grad():
            for name, p in module.named_parameters():
                p.copy_(state[name])


class Sharded(Replicated):
    """FSDP2: each decoder layer (the model's `_no_split_modules`) is its own shard group, the rest
    (embeddings, final norm, LM head) the root's. Weights, gradients and optimizer state are split across
    processes; a layer's full weights exist only during its own forward and backward.

    fp32 master weights the FSDP2 way (`optim.master_weights`; null: on a GPU): a policy whose trainable
    weights are bf16 is sharded in fp32 and gathered in bf16 for compute (FSDP2's `MixedPrecisionPolicy`,
    gradients reduced in fp32), so the optimizer steps fp32 shards and updates below half a bf16 step
    accumulate. `compute_dtype` is then bf16: checkpoints and the export hold bf16 weights, the fp32
    shards travel in the optimizer state (`MASTERS_KEY`), as `MasterWeights`' masters do."""

    def __init__(self, acc: Accelerator, master_weights: bool | None = None):
        super().__init__(acc)
        self.master_weights = master_weights if master_weights is not None else acc.device.type == "cuda"
        self.compute_dtype: torch.dtype | None = None  # bf16 once `wrap` kept a policy's shards in fp32

    def describe(self) -> str:
        return f"{self.acc.num_processes} processes, sharded (FSDP2)"

    @property
    def loads_weights(self) -> bool:
        """Rank 0 only: the others build the model empty and take their shards from it (`wrap`)."""
        return bool(self.acc.is_main_process)

    def wrap(self, policy: Policy) -> nn.Module:
        """Sharded, then only this process's shards on its device: the whole model never is on one device,
        and in host memory only on rank 0, which loaded it and sends each process its shards (`_shard`;
        the others built it empty, `loads_weights`). The head is checked on the device with only the
        root's group (embeddings, final norm, head) gathered; each layer gathers itself in its forward."""
        from torch.distributed.fsdp import FSDPModule

        _shard(policy, self.acc.device, self.any_process(_is_empty(policy)), self._mixed_precision(policy))
        assert isinstance(policy, FSDPModule)
        policy.unshard()
        try:
            policy.prepare()
        finally:
            policy.reshard()
        return policy

    def _mixed_precision(self, policy: Policy) -> Any:
        """FSDP2's policy for `policy`: with master weights and bf16 full fine-tuning, the module cast to
        fp32 (the shards the optimizer steps) and gathered in bf16, gradients reduced in fp32; else
        None (gathered in the weights' own dtype). A frozen module (the reference) stays as it is."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from leangrpo.models.load import is_peft

        trained = {p.dtype for p in policy.parameters() if p.requires_grad}
        if not self.master_weights or torch.bfloat16 not in trained or is_peft(policy.lm):
            return None  # LoRA: the adapter is fp32 already (peft) and the frozen base stays as it is
        self.compute_dtype = torch.bfloat16
        policy.to(torch.float32)
        # inputs are not cast: a layer's hidden states are bf16 already (the gathered embeddings are), and
        # casting rebuilds dataclass inputs, so the shared-prompt layout would never see its `used` flag
        return MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False
        )

    def place_frozen(self, module: Policy) -> nn.Module:
        """The frozen reference is sharded like the policy, so it costs 1/N of its weights per process."""
        return self.wrap(module)

    def release_frozen(self, module: nn.Module) -> None:
        """Back to its shards: FSDP2 keeps a root gathered after its forward for the backward, which a
        frozen module never runs, so its embeddings, final norm and head would stay whole on every
        process between passes."""
        _reshard(module)

    def sync_gradients(self, policy: nn.Module, sync: bool) -> Any:
        policy.set_requires_gradient_sync(sync)  # type: ignore[operator]
        return nullcontext()

    @contextmanager
    def full_weights(self, policy: nn.Module) -> Iterator[None]:
        """Gather every layer's weights and keep them gathered: `generate` calls the layers outside the
        root's forward, once per token, and must not re-gather each time. Costs the whole model's
        weights on each process for the duration (as every FSDP generation does without vLLM)."""
        from torch.distributed.fsdp import FSDPModule

        modules = [m for m in policy.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.unshard()
            m.set_reshard_after_forward(False)
        try:
            yield
        finally:
            for m in modules:
                m.set_reshard_after_forward(True)
                m.reshard()

    def engine_weights(self, policy: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights a colocated vLLM engine loads, gathered one shard group (a decoder layer, or the
        root's embeddings, final norm and head) at a time and freed before the next: the engine's sync
        never holds the whole model. Each gather is a collective, so every process must consume this in
        full, as each process's sync does; the groups come in module order, the same on all."""
        from torch.distributed.fsdp import FSDPModule

        owner: dict[nn.Module, nn.Module] = {}  # each module's shard group: its nearest FSDP ancestor
        for module in policy.modules():  # pre-order: a parent is seen before its children
            for child in module.children():
                owner[child] = child if isinstance(child, FSDPModule) else owner.get(module, module)
        lm = _as_policy(policy).lm
        for group in [m for m in policy.modules() if isinstance(m, FSDPModule)]:

            def in_group(module: nn.Module, group: nn.Module = group) -> bool:
                return owner[module] is group

            group.unshard()
            try:
                yield from applied_weights(lm, in_group)
            finally:
                group.reshard()

    def clip_grad_norm(self, policy: nn.Module, max_norm: float) -> float:
        """The global norm over every shard (a DTensor reduced across processes), then clipping with it."""
        from torch.distributed.tensor import DTensor

        grads = [p.grad for p in policy.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(policy.parameters(), max_norm, norm)
        return float(norm)

    def saveable(self, policy: nn.Module) -> PreTrainedModel | None:
        """An unsharded copy of the causal LM on the main process, built from the gathered full state dict
        (offloaded to CPU, so no process holds two copies on its device), in the compute dtype (bf16
        weights from fp32 shards: the model's dtype, as without FSDP)."""
        state = _whole_state(policy)
        if not self.acc.is_main_process:
            return None
        lm, dtype = _as_policy(policy).lm, self.compute_dtype
        state = {k.removeprefix("lm."): v if dtype is None else v.to(dtype) for k, v in state.items()}
        return _unsharded_copy(lm, state, dtype)

    def optimizer_state(self, policy: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The full optimizer state keyed by parameter name (gathered; complete on the main process), with
        the whole fp32 weights under `MASTERS_KEY` when shards are kept in fp32 (the checkpoint's model
        files hold them rounded to bf16)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_optimizer_state_dict(policy, optimizer, options=options)
        return state if self.compute_dtype is None else {**state, MASTERS_KEY: _whole_state(policy)}

    def load_optimizer_state(
        self, policy: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """`optimizer_state`'s state back (each process reads it whole), and the fp32 weights it holds
        into the shards: a resumed run continues them, not their bf16 rounding."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        state = dict(state)
        masters = state.pop(MASTERS_KEY, None)
        if masters is not None and self.compute_dtype is not None:
            set_model_state_dict(policy, masters, options=StateDictOptions(full_state_dict=True))
        options = StateDictOptions(full_state_dict=True)
        set_optimizer_state_dict(policy, optimizer, optim_state_dict=state, options=options)

    def mix_into(self, target: nn.Module, source: nn.Module, alpha: float) -> None:
        """Shard by shard: the two are sharded alike (`place_frozen`), so each process mixes its own local
        shards, with no communication. Both are resharded first: a root left gathered by a no-grad
        forward would otherwise take the mix into a gathered copy that its next reshard drops."""
        _reshard(target, source)
        shards = ((name, _local(p)) for name, p in target.named_parameters())
        _mix(shards, {name: _local(p) for name, p in source.named_parameters()}, alpha)

    def frozen_state(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """Gathered as the policy is for `saveable` (offloaded to CPU, complete on the main process only),
        keyed like the unsharded module's parameters, so checkpoints hold the same file either way."""
        state = _whole_state(module)
        names = {name for name, _ in module.named_parameters()}
        return {name: t for name, t in state.items() if name in names}

    def load_frozen_state(self, module: nn.Module, state: dict[str, torch.Tensor]) -> None:
        """Each process keeps its own shards of the whole tensors, loaded into the registered (sharded)
        parameters (`state` is left as it was: torch replaces the entries of the dict it is given)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        _reshard(module)
        options = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(module, dict(state), options=options)


def setup(acc: Accelerator, master_weights: bool | None = None) -> Replicated:
    """Sharded when launched with an FSDP2 accelerate config and more than one process, else replicated
    (`master_weights`: optim.master_weights, which a sharded policy keeps as fp32 shards)."""
    if fsdp_requested() and acc.num_processes > 1:
        return Sharded(acc, master_weights)
    return Replicated(acc)


def _whole_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """A sharded module's full state dict, gathered to CPU (complete on the main process)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast("dict[str, torch.Tensor]", get_model_state_dict(module, options=options))


def _is_empty(module: nn.Module) -> bool:
    """True for a model built without its weights (parameters on the meta device: `weights=False`)."""
    return any(p.is_meta for p in module.parameters())


def _shard(policy: nn.Module, device: torch.device, from_rank0: bool, mixed: Any = None) -> nn.Module:
    """`fully_shard` each decoder layer, then the root (`mixed`: their `MixedPrecisionPolicy`, if any),
    then only this process's shards on `device`.

    `from_rank0`: a process holds the weights (rank 0, which loaded them) and the others an empty model
    (parameters on meta): the empty ones get their shards' memory on `device`, and every process
    takes its shards of rank 0's weights, broadcast one tensor at a time (`set_model_state_dict`,
    `broadcast_from_rank0`). So the whole model sits in host memory on rank 0 only, never on the others.
    The root's lazy init runs now rather than at its first forward, because generation reaches the
    layers without going through the root."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    no_split = set(getattr(_base_model(policy), "_no_split_modules", None) or [])
    layers = [m for m in policy.modules() if type(m).__name__ in no_split]
    if not layers:
        raise UserError(
            f"FSDP: {type(_base_model(policy)).__name__} names no decoder layer class (_no_split_modules)"
        )
    empty = _is_empty(policy)
    whole = policy.state_dict() if from_rank0 and not empty else {}  # rank 0's loaded tensors, not copies
    kwargs = {} if mixed is None else {"mp_policy": mixed}
    for layer in layers:
        fully_shard(layer, **kwargs)
    fully_shard(policy, **kwargs)
    if empty:  # memory for this process's shards; the buffers (not sent) are kept as they were built
        buffers = {name: b.clone() for name, b in policy.named_buffers()}
        policy.to_empty(device=device)
        with torch.no_grad():
            for name, b in policy.named_buffers():
                b.copy_(buffers[name])
    else:
        policy.to(device)
    if from_rank0:
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(policy, whole, options=options)
        del whole
    policy._get_fsdp_state()._lazy_init()  # type: ignore[operator]  # fully_shard adds it to the class
    return policy


def _reshard(*modules: nn.Module) -> None:
    """Every shard group of `modules` back to its shards (FSDP2 leaves a root gathered after a no-grad
    forward), so that their registered parameters are the sharded DTensors."""
    from torch.distributed.fsdp import FSDPModule

    for module in (m for top in modules for m in top.modules()):
        if isinstance(module, FSDPModule):
            module.reshard()


def _mix(target: Iterable[tuple[str, torch.Tensor]], source: dict[str, torch.Tensor], alpha: float) -> None:
    """target = alpha·source + (1 - alpha)·target for each named tensor, in the target's dtype."""
    with torch.no_grad():
        for name, t in target:
            t.mul_(1.0 - alpha).add_(source[name].to(t.dtype), alpha=alpha)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This process's shard of an FSDP2 parameter (a DTensor)."""
    from torch.distributed.tensor import DTensor

    assert isinstance(t, DTensor), "resharded FSDP2 parameters are DTensors"
    return t.to_local()


def _as_policy(module: nn.Module) -> Policy:
    """The Policy that `wrap` sharded in place (FSDP2 makes its class a subclass)."""
    from leangrpo.train.policy import Policy

    assert isinstance(module, Policy)
    return module


def _base_model(policy: nn.Module) -> nn.Module:
    return _as_policy(policy).base


def _unsharded_copy(
    lm: PreTrainedModel, state: dict[str, Any], dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """A plain (unsharded) model of `lm`'s class and config (its LoRA adapter too), holding `state`, in
    `dtype` (default `lm`'s).

    Built on the meta device, then given the gathered tensors. Buffers that are not in the state dict
    (non-persistent ones, e.g. rotary frequencies) come from `lm`, where FSDP leaves them whole."""
    from leangrpo.models.load import is_peft, peft_base

    base = peft_base(lm) if is_peft(lm) else lm
    with torch.device("meta"):
        clone = type(base)._from_config(base.config, dtype=dtype or base.dtype)
        if is_peft(lm):
            from peft import get_peft_model

            # the peft model stands in for the transformers model, as in models.apply_lora
            clone = cast("PreTrainedModel", get_peft_model(clone, copy.deepcopy(lm.peft_config["default"])))
    clone.load_state_dict(state, assign=True, strict=False)
    buffers = dict(lm.named_buffers())
    for name, buf in list(clone.named_buffers()):
        if buf.is_meta:
            owner, _, leaf = name.rpartition(".")
            whole = buffers[name].detach().cpu().clone()
            clone.get_submodule(owner).register_buffer(leaf, whole, persistent=False)
    clone.tie_weights()
    missing = [n for n, p in clone.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"FSDP save: no gathered tensor for {missing[:3]}")
    return clone.eval()
