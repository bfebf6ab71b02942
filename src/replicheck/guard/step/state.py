"""Digests of the state replicas must hold alike: weights (frozen parameters and shared buffers
included) and optimizer state with the loss scaler's, over the part this rank holds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replicheck import fingerprint as fp
from replicheck.guard.checks import scaling
from replicheck.guard.parallel.base import Parallelism


class StateDigests:
    """This rank's digests of its stored state, on the device (no host transfer)."""

    def __init__(
        self,
        parallelism: Parallelism,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        per_rank_buffers: Sequence[str],
    ) -> None:
        self._par, self._optimizer, self._scaler = parallelism, optimizer, scaler
        self._per_rank = tuple(per_rank_buffers)

    def weights(self) -> torch.Tensor:
        """Every parameter (frozen ones too) and every buffer replicas share; this rank's part of
        them where the state is sharded."""
        return self._par.weights_digest(self._per_rank)

    def optimizer(self) -> torch.Tensor:
        """The optimizer state's digest, with the loss scaler's state when there is one."""
        digest = self._par.optimizer_digest(self._optimizer)
        if self._scaler is None:
            return digest
        return fp.combine(torch.stack([digest, scaling.state_digest(self._scaler).to(digest.device)]))

    def both(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights, optimizer)``, in that order."""
        return self.weights(), self.optimizer()
