"""A dispatch mode that tracks the bytes of the tensors allocated under it that are still alive:
the memory tests' measure (CPU-only, so no allocator statistics)."""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """``peak``: the most bytes, allocated by ops under the mode, alive at once (a storage counts
    from the op that made it until its last tensor is gone); ``calls``: ops seen, by name."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0
        self.calls: dict[str, int] = {}

    def now(self) -> int:
        """Bytes allocated under the mode and alive now."""
        self._live = {k: v for k, v in self._live.items() if not v[0].expired()}
        return sum(n for _, n in self._live.values())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket.__name__)
        self.calls[name] = self.calls.get(name, 0) + 1
        seen = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs or {}))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in seen or ptr == 0:
                continue  # a view or an in-place result: no new memory
            known = self._live.get(ptr)
            if known is None or known[0].expired():
                self._live[ptr] = (StorageWeakRef(storage), storage.nbytes())
        self.peak = max(self.peak, self.now())
        return out
