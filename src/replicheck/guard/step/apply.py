"""The end of a step that passed its checks: the optimizer step through the gate, the update
check where the parallelism has one (undone on every rank when it fails), or a loss-scale
overflow skipped as the scaler skips it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NoReturn

import torch

from replicheck.guard.attribution.verdict import Finding
from replicheck.guard.checks import scaling
from replicheck.guard.context import running
from replicheck.guard.errors import GuardError, UpdateReplayError
from replicheck.guard.gate import step_gate
from replicheck.guard.parallel.base import UpdateCheck

log = logging.getLogger(__name__)

Raise = Callable[[int, list[Finding]], NoReturn]
"""Ends step ``s`` with an incident made of the findings (collective)."""


class UpdateApplier:
    """Applies a checked step's update, or skips it, on every rank alike."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        updates: UpdateCheck | None,
        raise_: Raise,
    ) -> None:
        self._optimizer, self._scaler, self._updates = optimizer, scaler, updates
        self._gate = step_gate(optimizer)
        self._raise = raise_

    def apply(self, s: int, verify: bool) -> None:
        """``optimizer.step()`` (through the scaler when there is one); on a verification step the
        update is then checked where the parallelism checks it."""
        updates = self._updates if verify else None
        scaler_state = self._scaler.state_dict() if updates is not None and self._scaler is not None else None
        if updates is not None:
            updates.arm()
        self._gate.open = True
        try:
            with running(s, "optimizer"):
                if self._scaler is not None:
                    self._scaler.step(self._optimizer)
                    self._scaler.update()
                else:
                    self._optimizer.step()
        finally:
            self._gate.open = False
        if updates is not None:
            self._check_update(s, updates, scaler_state)

    def _check_update(self, s: int, updates: UpdateCheck, scaler_state: dict[str, object] | None) -> None:
        """The ring replays every rank's update; a disputed one is undone on every rank (with the
        scaler's update) before the incident is raised."""
        try:
            with running(s, "optimizer"):
                finding = updates.check(s)
        except UpdateReplayError:
            self._undo_update(updates, scaler_state)
            raise
        if finding is None:
            return
        self._undo_update(updates, scaler_state)
        self._raise(s, [finding])

    def _undo_update(self, updates: UpdateCheck, scaler_state: dict[str, object] | None) -> None:
        updates.restore()
        if self._scaler is not None and scaler_state is not None:
            self._scaler.load_state_dict(scaler_state)

    def skip_overflow(self, s: int) -> None:
        """Every rank skips step ``s`` as the loss scaler does (:mod:`replicheck.guard.checks.scaling`)."""
        scaler = self._scaler
        if scaler is None:
            raise GuardError("internal: an overflow skip without a scaler")
        if not scaling.skip(scaler, self._optimizer):
            log.warning("step %d: the scaler saw no overflow in the reduced gradient; step skipped anyway", s)
        log.info("step %d: loss-scale overflow reproduced, skipped on every rank (scale lowered)", s)
