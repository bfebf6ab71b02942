"""Probe passes, replays and the comparison of their fingerprints."""

from __future__ import annotations

import contextlib
import struct
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from replicheck import fingerprint as fp
from replicheck.guard.context import Pass, running

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def probe_seed(base: int, step: int, rank: int) -> int:
    """The seed of ``rank``'s probe at ``step`` (any rank replaying it uses the same)."""
    return ((base * 1_000_003 + step) * 65_537 + rank) & 0x7FFF_FFFF_FFFF_FFFF


def float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def bits_float(x: int) -> float:
    return struct.unpack("<d", struct.pack("<q", x))[0]


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """Deterministic kernels for the duration of one pass, restored afterwards."""
    if not enabled:
        yield
        return
    prev = torch.are_deterministic_algorithms_enabled()
    prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
    prev_cudnn = (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=prev_warn)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = prev_cudnn


@contextlib.contextmanager
def seeded(seed: int, device: torch.device) -> Iterator[None]:
    """Fork the RNG (the main stream is untouched) and seed the fork."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(seed)
        yield


@contextlib.contextmanager
def buffers_restored(module: torch.nn.Module) -> Iterator[None]:
    """Put every buffer back as it was (BatchNorm statistics, counters) after a replay."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, v in saved:
                b.copy_(v)


@dataclass(frozen=True)
class ProbeResult:
    """Loss and gradient fingerprint of one probe computation."""

    loss: float
    """The probe's loss (unweighted mean over the probe)."""
    fingerprint: torch.Tensor
    """int64 digests (exact mode) or float64 sketches (tolerant mode), one row per parameter."""

    def to_wire(self) -> dict[str, Any]:
        return {"loss": self.loss, "fingerprint": self.fingerprint}

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> ProbeResult:
        return cls(loss=float(data["loss"]), fingerprint=data["fingerprint"])


@dataclass(frozen=True)
class Fingerprinter:
    """Turns gradients into a fingerprint in the job's mode."""

    mode: str
    sketch_k: int

    def __call__(self, grads: Sequence[torch.Tensor | None], seed: int) -> torch.Tensor:
        if self.mode == "exact":
            return fp.digests(grads, fold_zero=True)
        return fp.sketches(grads, seed=seed, k=self.sketch_k)


def replay(
    module: torch.nn.Module,
    loss_fn: LossFn,
    batch: Any,
    *,
    weight: float,
    seed: int,
    params: Sequence[torch.nn.Parameter],
    fingerprinter: Fingerprinter,
    deterministic_kernels: bool,
    step: int,
    pass_: Pass = "replay",
) -> ProbeResult:
    """Recompute a probe on the bare module without touching ``.grad``, buffers or the main RNG."""
    device = params[0].device if params else torch.device("cpu")
    with running(step, pass_), seeded(seed, device), deterministic(deterministic_kernels), buffers_restored(module):
        loss = loss_fn(module, batch)
        grads = torch.autograd.grad(loss * weight, list(params), allow_unused=True)
    return ProbeResult(loss=float(loss.detach()), fingerprint=fingerprinter(list(grads), seed))


@dataclass(frozen=True)
class Comparison:
    """How two fingerprints of the same probe relate."""

    distance: float
    """0 when equal; exact mode: 1 when any bit differs; tolerant: max norm-scaled difference."""
    loss_equal: bool
    """Losses agree (bit for bit in exact mode, within the threshold in tolerant mode)."""
    differing: tuple[int, ...]
    """Indices of parameters whose fingerprints differ (exact) or exceed the threshold."""


def compare(a: ProbeResult, b: ProbeResult, mode: str, threshold: float) -> Comparison:
    """Compare two results; in tolerant mode ``threshold`` decides ``differing``."""
    if mode == "exact":
        diff = (a.fingerprint != b.fingerprint).nonzero().flatten().tolist()
        loss_equal = float_bits(a.loss) == float_bits(b.loss)
        return Comparison(distance=0.0 if not diff and loss_equal else 1.0, loss_equal=loss_equal, differing=tuple(diff))
    per_tensor = fp.sketch_distance(a.fingerprint, b.fingerprint)
    loss_scale = max(abs(a.loss), abs(b.loss), 1e-30)
    loss_dist = abs(a.loss - b.loss) / loss_scale if a.loss == a.loss and b.loss == b.loss else float("inf")
    if a.loss == b.loss:
        loss_dist = 0.0
    worst = max(float(per_tensor.max()) if per_tensor.numel() else 0.0, loss_dist)
    diff = (per_tensor > threshold).nonzero().flatten().tolist()
    return Comparison(distance=worst, loss_equal=loss_dist <= threshold, differing=tuple(diff))


def agrees(c: Comparison, mode: str, threshold: float) -> bool:
    return c.distance == 0.0 if mode == "exact" else c.distance <= threshold
