"""The guard's only way to bring a tensor from its device to the host, counted.

Every device→host copy the guard makes goes through :func:`to_host`, so the number per step can
be asserted in tests (on a CPU tensor the copy is a no-op, but the transfer point still counts)
and read by benchmarks. On an accelerator each such copy waits for the device's queued work, so
an ordinary step makes exactly one (its verdict row, after the all-gather).
"""

from __future__ import annotations

from collections import Counter

import torch


class TransferCounter:
    """Device→host transfers made through :func:`to_host`, in total and by reason."""

    def __init__(self) -> None:
        self.total = 0
        """Transfers since the last :meth:`reset`."""
        self.by_reason: Counter[str] = Counter()
        """The same, keyed by the ``why`` each call gave."""

    def reset(self) -> None:
        """Start counting from zero."""
        self.total = 0
        self.by_reason.clear()


COUNTER = TransferCounter()
"""The process's counter (one guard per process is the normal case)."""


def to_host(t: torch.Tensor, why: str) -> torch.Tensor:
    """``t`` on the CPU (a blocking copy from an accelerator), counted under ``why``."""
    COUNTER.total += 1
    COUNTER.by_reason[why] += 1
    return t.detach().cpu()
