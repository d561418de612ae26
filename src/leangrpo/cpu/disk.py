"""grpo.reference_on_disk: the full-fine-tuning reference copy in an unnamed, memory-mapped file, resident
only during its own pass."""

from __future__ import annotations

import mmap
import os
import tempfile
from pathlib import Path

import torch

from leangrpo.core.errors import DeviceOptionError, os_reason


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
