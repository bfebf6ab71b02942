"""Counting device→host synchronisations with PyTorch's sync debug mode.

``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call that PyTorch
instruments (``.item()``, ``.cpu()``/``.tolist()`` of a device tensor, blocking copies,
``nonzero``, ``torch.cuda.synchronize``...) raise a ``UserWarning`` "called a synchronizing CUDA
operation". Warnings raised on autograd's worker threads are replayed on the calling thread at
the end of ``backward``, and Python's warning filters are process-global, so warnings from the
guard's comm-hook callbacks are recorded too. PyTorch documents the mode as incomplete: the
``torch.distributed`` namespace is not instrumented, and neither are non-blocking copies the
driver stages through pageable memory. The count is therefore a lower bound of what the main
thread waits for, and exact for the guard's own ``.item()``/``.cpu()`` transfer points.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch

SYNC_MESSAGE = "called a synchronizing CUDA operation"


def count_sync_warnings(caught: list[warnings.WarningMessage]) -> int:
    """How many of ``caught`` are sync-debug-mode warnings (other warnings are ignored)."""
    return sum(SYNC_MESSAGE in str(w.message) for w in caught)


class SyncCounter:
    """Counts synchronisations per block of code on a CUDA device; ``None`` counts elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"

    @contextlib.contextmanager
    def count(self, out: list[int | None]) -> Iterator[None]:
        """Append the number of synchronisations inside the block to ``out`` (``None`` off CUDA)."""
        if not self.enabled:
            yield
            out.append(None)
            return
        torch.cuda.synchronize()  # work queued before the block must not be charged to it
        prev = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(prev)
        out.append(count_sync_warnings(caught))
