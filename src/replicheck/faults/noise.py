"""Simulated kernel non-determinism: tiny per-rank noise, for tolerant-mode drills.

Real default kernels (atomics, split reductions) give answers that differ in the last bits from
run to run. This adds relative noise of size ``rel`` to a module's output, drawn from the rank's
*own* generator — never the torch global RNG, which the guard seeds per (step, rank) for probe
passes and replays, so noise drawn from it would repeat exactly in a replay.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replicheck.faults.errors import FaultConfigError
from replicheck.guard.modules import unwrap


@dataclass(frozen=True, kw_only=True)
class KernelNoise:
    """Relative noise on one module's output, every call, on every rank it is installed on."""

    module: str
    """Module name in the bare model."""
    rel: float = 1e-6
    """Standard deviation of the relative perturbation."""
    seed: int | None = None
    """Seed of the private generator (mixed with the rank); ``None``: fresh entropy."""

    def install(self, model: torch.nn.Module, rank: int = 0) -> Callable[[], None]:
        """Hook the noise in; returns the remover."""
        bare = unwrap(model)
        modules = dict(bare.named_modules())
        if self.module not in modules:
            raise FaultConfigError(f"no module named {self.module!r} in the model")
        gen = torch.Generator()
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed * 7919 + rank)
        rel = self.rel

        def hook(_m: torch.nn.Module, _inp: Any, out: Any) -> None:
            if isinstance(out, torch.Tensor) and out.is_floating_point():
                noise = torch.randn(out.shape, generator=gen, dtype=out.dtype)
                out.data.mul_(noise.mul_(rel).add_(1.0))

        return modules[self.module].register_forward_hook(hook).remove
