"""A test helper that watches which large tensors are alive at once."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class PeakLargeTensors(TorchDispatchMode):
    """Peak total size of live op outputs with at least `min_numel` elements (by storage, so in-place
    results and views count once)."""

    def __init__(self, min_numel: int):
        super().__init__()
        self.min_numel, self.live, self.peak = min_numel, weakref.WeakValueDictionary(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.min_numel:
                self.live[t.untyped_storage().data_ptr()] = t
        self.peak = max(self.peak, sum(t.untyped_storage().nbytes() for t in self.live.values()))
        return out
