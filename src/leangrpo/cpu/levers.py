"""The one hook through which training, evaluation and chat use the CPU's speed levers: built only for a
model on CPU, so that on CUDA nothing in leangrpo.cpu is imported or called."""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING

from torch import Tensor

from leangrpo.config.schema import CPUConfig
from leangrpo.cpu import allocator, onednn
from leangrpo.cpu.decode import decode_lean, lean_decoder, packed_linears
from leangrpo.cpu.disk import DiskTensors
from leangrpo.engines.hf import prefill_once_per_group
from leangrpo.engines.types import Sampling
from leangrpo.models.load import ModelError

if TYPE_CHECKING:
    from transformers import DynamicCache, GenerationConfig, LogitsProcessor, PreTrainedModel


class CPULevers:
    """The CPU's levers, as `cpu` configures them: oneDNN products in the training step, the lean decode
    loop and packed weights while generating, glibc returning freed memory, the reference copy on disk."""

    def __init__(self, cfg: CPUConfig):
        self.cfg = cfg

    def before_loading(self) -> None:
        """Before anything large is allocated: glibc's mmap threshold fixed (`allocator`)."""
        allocator.return_freed_memory()

    def prepare(self, model: PreTrainedModel) -> str | None:
        """A model to train: its Linears' float32 products in oneDNN where `cpu.matmul` picks it.
        Returns what `auto` chose and why, for the run's log."""
        if self.cfg.matmul == "onednn" and not onednn.available():
            raise ModelError("cpu.matmul=onednn: this torch build has no oneDNN; set cpu.matmul=auto")
        speedup = onednn.measured_speedup() if self.cfg.matmul == "auto" and onednn.available() else None
        use = self.cfg.matmul == "onednn" or (speedup is not None and speedup >= onednn.FASTER)
        if use:
            onednn.use_onednn(model)
        if speedup is None:
            return None
        chosen = "oneDNN" if use else "torch's BLAS"
        return f"cpu.matmul auto: {chosen} (oneDNN measured {speedup:.2f}× torch's BLAS here)"

    def release(self) -> None:
        """After a phase: its freed heap pages back to the OS."""
        allocator.release_freed_memory()

    def reference_store(self, near: Path) -> DiskTensors:
        """cpu.reference_on_disk's file, on the disk of `near` (the run directory's nearest folder)."""
        return DiskTensors(near)

    def decode(
        self,
        model: PreTrainedModel,
        cache: DynamicCache,
        prompt_ids: Tensor,
        prompt_mask: Tensor,
        sampling: Sampling,
        processors: list[LogitsProcessor],
        eos: list[int],
        gen_cfg: GenerationConfig,
    ) -> Tensor | None:
        """The lean decode loop's completion ids (Llama, Qwen2, Qwen3 in float32); None elsewhere."""
        if not self.cfg.packed_generation:
            return None
        lean = lean_decoder(model, len(prompt_ids), self.cfg.packed_lm_head)
        if lean is None:
            return None
        prefill_once_per_group(model, prompt_ids, prompt_mask, sampling.num_generations, cache)
        return decode_lean(lean, cache, prompt_ids, prompt_mask, sampling, processors, eos, gen_cfg)

    def around_generate(self, model: PreTrainedModel, rows: int) -> AbstractContextManager[None]:
        """generate()'s Linears through packed oneDNN weights (float32)."""
        return packed_linears(model, rows, self.cfg.packed_lm_head, enabled=self.cfg.packed_generation)
