"""Per-step gradient checks: local health before the reduction, agreement after it.

:class:`GradStats` is what every parallelism fills from the place it sees gradients (DDP's
communication hook, FSDP2's reduce-scatter, or the gradients themselves after the passes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from replicheck import fingerprint as fp
from replicheck.guard.attribution.verdict import Finding
from replicheck.guard.checks.replicas import group_finding

ReducedHook = Callable[[int, torch.Tensor], None]
"""``hook(bucket_index, reduced_bucket)``: sees (and may modify) a bucket after its all-reduce."""


class GradStats:
    """One step's local gradient norm, reduced-gradient digests and reduced-gradient hooks: what
    the guard reads from DDP's comm hook (:class:`~replicheck.guard.parallel.ddp_hook.GradHealth`)
    or FSDP2's reduce-scatter (:class:`~replicheck.guard.parallel.fsdp_tap.GradTap`). Results are
    0-dim device tensors."""

    def __init__(self, digest_reduced: bool) -> None:
        self.digest_reduced = digest_reduced
        self.reduced_hooks: list[ReducedHook] = []
        self.reset()

    def reset(self) -> None:
        """Start a step."""
        self._local_sq: list[torch.Tensor] = []
        self._reduced: dict[int, torch.Tensor] = {}
        self.errors: list[Exception] = []
        """Errors raised by reduced-gradient hooks this step (reported in the step's row, so
        every rank stops instead of the failing one leaving the others in a collective)."""

    def _run_hooks(self, index: int, t: torch.Tensor) -> None:
        for hook in self.reduced_hooks:
            try:
                hook(index, t)
            except Exception as exc:  # noqa: BLE001 - reported through the step's row
                self.errors.append(exc)

    def local_norm(self) -> torch.Tensor | float:
        """The local gradient norm (float64, on the device), or 0.0 when no gradient was seen."""
        if not self._local_sq:
            return 0.0
        return torch.stack(self._local_sq).sum().sqrt()

    def after_passes(self, params: Sequence[torch.nn.Parameter]) -> None:
        """The step's passes are done: see what no hook saw (nothing, where hooks see it all)."""
        return None

    def reduced_finding(
        self, values: Sequence[int], groups: Sequence[Sequence[int]] | None
    ) -> Finding | None:
        """The step's reduced-gradient finding from every rank's :meth:`reduced_digest`: replicas
        (``groups`` of ranks holding the same state; ``None``: all ranks) must agree bit for bit."""
        if not self.digest_reduced:
            return None
        return group_finding("reduced_gradients", values, groups)

    def reduced_digest(self) -> torch.Tensor | int:
        """The reduced gradient's digest (on the device), or 0 when not checked."""
        if not self._reduced:
            return 0
        return fp.combine(torch.stack([self._reduced[i] for i in sorted(self._reduced)]))


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm as float64: low-precision and float32 buckets are reduced in float32, float64
    in float64, complex as the norm of the magnitudes (NaN and Inf propagate)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    norm: torch.Tensor = torch.linalg.vector_norm(t, dtype=dtype)
    return norm.double().square()
