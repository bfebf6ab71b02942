"""One process, no wrapper: the gradients are read after the passes (nothing is reduced)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replicheck import fingerprint as fp
from replicheck.guard.checks.health import GradStats, sq_norm
from replicheck.guard.config import GuardConfig
from replicheck.guard.parallel.alone import AloneReplays
from replicheck.guard.parallel.base import Parallelism, Replays, module_device
from replicheck.guard.transport.comm import Comm


class LocalGradients(GradStats):
    """Gradient statistics read from ``.grad`` once the step's passes are done."""

    def after_passes(self, params: Sequence[torch.nn.Parameter]) -> None:
        grads = [p.grad for p in params if p.grad is not None]
        if grads:
            self._local_sq.extend(sq_norm(g) for g in grads)
        if self.digest_reduced and grads:
            for i, g in enumerate(grads):
                self._run_hooks(i, g)
            self._reduced[0] = fp.combine(fp.digests(grads))


class SingleProcess(Parallelism):
    """World size 1: a verification re-runs the probe on the same device (transient faults only)."""

    kind = "single"

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model, model, Comm(None, compute=module_device(model)))

    @classmethod
    def claim(cls, model: torch.nn.Module) -> SingleProcess | None:
        found = cls(model)
        return found if found.comm.world_size == 1 else None

    def install(self, config: GuardConfig) -> GradStats:
        return LocalGradients(digest_reduced=False)

    def replays(self, params: Sequence[torch.nn.Parameter]) -> Replays:
        return AloneReplays(params)
