"""The memory options of the training step: 8-bit AdamW, optimizer steps inside the backward, (CPU
only) the reference copy on disk and (CUDA only) activation offload; handing back what each phase
freed before the next one starts; and having glibc return freed activation memory to the OS.

Everything else that keeps the step lean (chunked log-probs, completion-only positions, micro-batches,
gradient checkpointing) lives where its quantity is computed: `grpo.py`, `models.Policy`, `trainer.py`.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .errors import UserError
from .rundir import os_reason

if TYPE_CHECKING:
    from .config import Config, OptimConfig


# glibc's mallopt() parameter number for the mmap threshold (malloc.h), and the value leangrpo sets.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 * 2**20


class DeviceOptionError(UserError, RuntimeError):
    """A memory option was asked for on a machine that cannot provide it."""


def check_device_options(cfg: Config) -> None:
    """Refuse, before any model loads, options this machine cannot provide: bitsandbytes' (8-bit AdamW,
    a 4-bit base: CPU or CUDA) without bitsandbytes, activation offload without CUDA."""
    from .models import require_bitsandbytes

    cuda = torch.cuda.is_available()
    if cfg.optim.optimizer == "adamw_8bit":
        require_bitsandbytes("optim.optimizer=adamw_8bit")
    if cfg.model.load_in_4bit:
        require_bitsandbytes("model.load_in_4bit")
    if cfg.model.activation_offload and not cuda:
        raise DeviceOptionError(
            "model.activation_offload needs a CUDA GPU (on CPU the activations already live in CPU memory); "
            "set model.activation_offload=false"
        )


def build_optimizer(
    params: Iterable[torch.nn.Parameter], cfg: OptimConfig, learning_rate: float | None = None
) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit AdamW (optimizer state in 8 bits: ~2 bytes/param instead of 8), at
    `cfg.learning_rate` unless `learning_rate` is given (the cold start's).

    The AdamW is torch's fused kernel (as transformers' Trainer uses by default): one pass over each
    parameter, where the plain one allocates temporaries as large as the parameter."""
    kwargs: dict[str, Any] = {
        "lr": cfg.learning_rate if learning_rate is None else learning_rate,
        "betas": (cfg.adam_beta1, cfg.adam_beta2),
        "weight_decay": cfg.weight_decay,
    }
    if cfg.optimizer == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs, fused=True)


class StepInBackward:
    """`optim.optimizer_in_backward`: each parameter takes its optimizer step as soon as its gradient is
    complete, and that gradient is freed at once, so the full set of gradients (one more copy of the
    trainable weights) is never alive together (torchtune's `optimizer_in_bwd`).

    The hooks act only inside `stepping()`, so the cold start's own optimizer is left alone. With no
    gradients held, there is no global norm to clip by before stepping: the config requires
    `max_grad_norm: null` and one micro-batch per optimizer step. The norm is still summed for the
    metrics. A non-finite gradient stops the stepping for the rest of that backward; parameters stepped
    before it keep their step (a non-finite loss makes the first gradient non-finite, so nothing steps).
    That check reads each gradient's norm on the host: on CUDA one synchronisation per parameter (a few
    hundred a step), whose cost no GPU has measured yet."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: Iterable[torch.nn.Parameter]):
        self.optimizer, self.active = optimizer, False
        self.squared_norm, self.finite = 0.0, True
        for p in params:
            p.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: torch.Tensor) -> None:
        if not self.active:
            return
        assert param.grad is not None  # the hook runs right after the gradient was accumulated
        norm = float(torch.linalg.vector_norm(param.grad, dtype=torch.float32))
        self.finite = self.finite and math.isfinite(norm)
        if self.finite:
            self.squared_norm += norm**2
            self.optimizer.step()  # steps only `param`: every other gradient is None at this point
        param.grad = None

    @contextmanager
    def stepping(self) -> Iterator[None]:
        """Around one optimizer step's backward."""
        self.active, self.squared_norm, self.finite = True, 0.0, True
        try:
            yield
        finally:
            self.active = False

    @property
    def grad_norm(self) -> float:
        """The global gradient norm of the last `stepping()` (NaN if a gradient was not finite)."""
        return math.sqrt(self.squared_norm) if self.finite else math.nan


def build_scheduler(
    optimizer: torch.optim.Optimizer, kind: str, num_warmup_steps: int, num_training_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """transformers' `get_scheduler` for the config's schedule types, with the same formulas (checked
    against it in tests/test_memory.py): linear or cosine decay after a linear warm-up, or constant
    (which ignores warm-up, as transformers' does). transformers' own import pulls in `trainer_utils`,
    which imports peft and bitsandbytes: 69 MiB of RSS and 1.5 s of start-up in a full fine-tuning run
    that uses neither."""

    def factor(step: int) -> float:
        if kind == "constant":
            return 1.0
        if step < num_warmup_steps:
            return step / max(1, num_warmup_steps)
        progress = (step - num_warmup_steps) / max(1, num_training_steps - num_warmup_steps)
        if kind == "linear":
            return max(0.0, 1.0 - progress)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))  # cosine, half a cycle

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def activation_offload(enabled: bool) -> AbstractContextManager:
    """Around a training forward + backward: tensors saved for the backward go to pinned CPU memory and
    come back asynchronously when the backward needs them.

    With (non-reentrant) gradient checkpointing on, each layer keeps only its input for the backward, so
    what moves to the CPU are those layer inputs and the hidden states of the log-prob head; the layer
    internals are recomputed on the GPU as before.
    """
    if not enabled:
        return nullcontext()
    return torch.autograd.graph.save_on_cpu(pin_memory=True)


class DiskTensors:
    """Frozen tensors held in one unnamed file on disk (the run directory's), each memory-mapped: a
    pass that reads them pages them in from the kernel's page cache, and `drop_pages` then takes them
    out of the process's memory again. Between passes they are page cache, which the kernel keeps
    while memory is free and reclaims under pressure (re-reading the file at the next pass).

    For CPU runs (grpo.reference_on_disk): the full-fine-tuning reference copy is read by one pass a
    step, so its weights leave the peak of the other phases (benchmarks/RESULTS.md). The file has no
    name (O_TMPFILE where the system has it), so nothing is left behind, even after a crash."""

    def __init__(self, directory: Path):
        self.directory, self.size = directory, 0
        self.maps: list[mmap.mmap] = []
        try:
            self.file = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 (open while the run lasts)
        except OSError as e:
            raise DeviceOptionError(
                f"grpo.reference_on_disk: cannot write in {directory}: {os_reason(e)}"
            ) from None

    def copy(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A copy of `t` in `dtype`, stored in the file (a page-aligned region of its own). The region's
        disk blocks are reserved first: writing a mapped page the disk has no room for kills the
        process (SIGBUS), where a full disk here is one clear error."""
        nbytes = t.numel() * dtype.itemsize
        if nbytes == 0:
            return t.detach().to(dtype, copy=True)
        offset, length = self.size, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
        try:
            os.posix_fallocate(self.file.fileno(), offset, length)
        except OSError as e:
            raise DeviceOptionError(
                f"grpo.reference_on_disk: no room for the reference copy in {self.directory} "
                f"({os_reason(e)}; {(offset + length) / 2**20:.0f} MiB so far); free some or set "
                "grpo.reference_on_disk=false"
            ) from None
        self.size += length
        region = mmap.mmap(self.file.fileno(), nbytes, flags=mmap.MAP_SHARED, offset=offset)
        self.maps.append(region)
        return torch.frombuffer(region, dtype=dtype).view(t.shape).copy_(t.detach())

    def drop_pages(self) -> None:
        """Take the tensors' pages out of this process's memory (they stay readable, from the file)."""
        for region in self.maps:
            region.madvise(mmap.MADV_DONTNEED)


def release_freed_memory() -> None:
    """Hand back what a phase freed before the next one allocates: called after the rollout and after
    the update. On CUDA, the allocator's cached blocks (KV cache, sampling buffers, activations). With
    glibc, the heap pages of freed blocks below the mmap threshold (`malloc_trim`): generation's packed
    weight copies (each Linear's under 4 MiB) and the update's small tensors stay resident otherwise,
    and RSS carries one phase's high-water mark into the next (benchmark row a, full fine-tuning with
    optim.optimizer_in_backward: peak RSS 2647 -> 2572 MiB, medians of three, at the same step time;
    benchmarks/RESULTS.md). Generation's and the update's tensors are already freed when they return (no
    reference cycles, see tests/test_memory.py)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


def _glibc(name: str) -> Any:
    """A glibc function by name, or None on other systems."""
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None), name, None)


def return_freed_memory() -> int | None:
    """Fix glibc's mmap threshold at 4 MiB, so that every freed block of 4 MiB or more (activations,
    log-prob chunks, gradients) goes back to the OS at once instead of staying in the process.

    By default glibc raises the threshold to 32 MiB after the first large free; from then on the
    update's activations come from the heap, whose freed middle is never returned, and RSS keeps the
    high-water mark of every phase (benchmarks/RESULTS.md: 5.0 instead of 3.1 GB on row c). Smaller
    blocks, such as the KV cache growing token by token, stay on the heap: fresh mmaps there cost page
    faults (a 1 MiB threshold made row c's step 50% slower). Idempotent. A MALLOC_MMAP_THRESHOLD_ in
    the environment wins. Returns the threshold set, or None when the environment or a non-glibc
    system decides.
    """
    mallopt = _glibc("mallopt")
    if (
        "MALLOC_MMAP_THRESHOLD_" in os.environ
        or mallopt is None
        or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1
    ):
        return None
    return MMAP_THRESHOLD
