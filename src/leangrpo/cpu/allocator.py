"""glibc's allocator on CPU: freed activation memory goes back to the OS instead of staying in the
process, so each phase's peak does not carry into the next."""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

# glibc's mallopt() parameter number for the mmap threshold (malloc.h), and the value leangrpo sets.
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 4 * 2**20


def release_freed_memory() -> None:
    """Hand back the heap pages of freed blocks below the mmap threshold (`malloc_trim`), after the
    rollout and after the update: generation's packed weight copies (each Linear's under 4 MiB) and the
    update's small tensors stay resident otherwise, and RSS carries one phase's high-water mark into the
    next (benchmarks/RESULTS.md). Generation's and the update's tensors are already freed when they
    return (no reference cycles, see tests/test_memory.py)."""
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
    high-water mark of every phase (benchmarks/RESULTS.md). Smaller blocks, such as the KV cache growing
    token by token, stay on the heap: fresh mmaps there cost page faults (benchmarks/RESULTS.md).
    Idempotent. A MALLOC_MMAP_THRESHOLD_ in the environment wins. Returns the threshold set, or None when
    the environment or a non-glibc system decides.
    """
    mallopt = _glibc("mallopt")
    if (
        "MALLOC_MMAP_THRESHOLD_" in os.environ
        or mallopt is None
        or mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1
    ):
        return None
    return MMAP_THRESHOLD
