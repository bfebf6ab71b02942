"""How two fingerprints of the same probe relate: bit for bit, or within a threshold."""

from __future__ import annotations

from dataclasses import dataclass

from replicheck import fingerprint as fp
from replicheck.guard.config import Mode
from replicheck.guard.transport.records import ProbeResult, float_bits


@dataclass(frozen=True)
class Comparison:
    """How two fingerprints of the same probe relate."""

    distance: float
    """0 when equal; exact mode: 1 when any bit differs; tolerant: max norm-scaled difference."""
    loss_equal: bool
    """Losses agree (bit for bit in exact mode, within the threshold in tolerant mode)."""
    differing: tuple[int, ...]
    """Indices of parameters whose fingerprints differ (exact) or exceed the threshold."""


def compare(a: ProbeResult, b: ProbeResult, mode: Mode, threshold: float) -> Comparison:
    """Compare two results; in tolerant mode ``threshold`` decides ``differing``."""
    if mode == "exact":
        diff = (a.fingerprint != b.fingerprint).nonzero().flatten().tolist()
        loss_equal = float_bits(a.loss) == float_bits(b.loss)
        return Comparison(
            distance=0.0 if not diff and loss_equal else 1.0, loss_equal=loss_equal, differing=tuple(diff)
        )
    per_tensor = fp.sketch_distance(a.fingerprint, b.fingerprint)
    loss_scale = max(abs(a.loss), abs(b.loss), 1e-30)
    loss_dist = abs(a.loss - b.loss) / loss_scale if a.loss == a.loss and b.loss == b.loss else float("inf")
    if a.loss == b.loss:
        loss_dist = 0.0
    worst = max(float(per_tensor.max()) if per_tensor.numel() else 0.0, loss_dist)
    diff = (per_tensor > threshold).nonzero().flatten().tolist()
    return Comparison(distance=worst, loss_equal=loss_dist <= threshold, differing=tuple(diff))


def agrees(c: Comparison, mode: Mode, threshold: float) -> bool:
    return c.distance == 0.0 if mode == "exact" else c.distance <= threshold
