"""The guard's only way to bring tensors from their device to the host, counted.

Every device→host copy the guard makes goes through :func:`to_host` or :func:`to_host_all`, so
the number per step can be asserted in tests (on a CPU tensor the copy is a no-op, but the
transfer point still counts) and read by benchmarks. On an accelerator each such copy waits for
the device's queued work, so an ordinary step makes exactly one (its verdict row, after the
all-gather) and a verification step a small fixed number (one per probe result, plus the row).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from replicheck.guard.transport.records import ProbeResult


class TransferCounter:
    """Device→host transfers made through this module, in total and by reason."""

    def __init__(self) -> None:
        self.total = 0
        """Transfers since the last :meth:`reset`."""
        self.by_reason: Counter[str] = Counter()
        """The same, keyed by the ``why`` each call gave."""

    def reset(self) -> None:
        """Start counting from zero."""
        self.total = 0
        self.by_reason.clear()

    def count(self, why: str) -> None:
        self.total += 1
        self.by_reason[why] += 1


COUNTER = TransferCounter()
"""The process's counter (one guard per process is the normal case)."""


def to_host(t: torch.Tensor, why: str) -> torch.Tensor:
    """``t`` on the CPU (a blocking copy from an accelerator), counted under ``why``."""
    COUNTER.count(why)
    return t.detach().cpu()


def to_host_all(tensors: Sequence[torch.Tensor], why: str) -> list[torch.Tensor]:
    """Several tensors of one device on the CPU in one copy (their bytes packed together).

    Shapes and dtypes are kept; the tensors may differ in both. Counted once under ``why``.
    """
    if not tensors:
        return []
    devices = {t.device for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"to_host_all needs tensors of one device, got {sorted(map(str, devices))}")
    flat = [t.detach().contiguous().reshape(-1) for t in tensors]
    parts: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    offset = 0
    for f in flat:
        n = f.numel() * f.element_size()
        parts.append(f.view(torch.uint8))
        pad = -n % _ALIGN  # every part starts aligned, so it can be viewed as its dtype again
        if pad:
            parts.append(torch.zeros(pad, dtype=torch.uint8, device=f.device))
        spans.append((offset, n))
        offset += n + pad
    packed = to_host(torch.cat(parts), why)
    return [
        packed[start : start + n].view(f.dtype).reshape(t.shape)
        for t, f, (start, n) in zip(tensors, flat, spans)
    ]


_ALIGN = 16


def host_result(loss: torch.Tensor, fingerprint: torch.Tensor) -> ProbeResult:
    """A probe's loss and fingerprint brought to the host together: one counted transfer."""
    value = loss.detach().reshape(()).to(torch.float64)
    if fingerprint.device == value.device:
        host_loss, host_fp = to_host_all([value, fingerprint], "probe result")
    elif fingerprint.device.type == "cpu":  # a fingerprint already on the host
        host_loss, host_fp = to_host(value, "probe loss"), fingerprint
    else:  # a loss already on the host
        host_loss, host_fp = value, to_host(fingerprint, "probe fingerprint")
    return ProbeResult(loss=float(host_loss), fingerprint=host_fp)
