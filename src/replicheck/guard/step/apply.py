"""The end of a step that passed its checks: the edits of the reduced gradient (the user's, then
clipping), the optimizer step through the gate, the update check where the parallelism has one
(undone on every rank when it fails), or a loss-scale overflow skipped as the scaler skips it.

Order, on every rank alike: the loss scaler's ``unscale_`` (when there is a scaler and anything
edits the gradient, so edits see true gradients), the gradient edits in the order they were added,
clipping (``GuardConfig.max_grad_norm``: the bound holds on what the optimizer applies), the
update check's arming, then ``optimizer.step()``, whose pre-hooks run before the update check's
recording (:mod:`replicheck.guard.checks.update`), so every edit is part of the replayed update."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import NoReturn

import torch

from replicheck.guard.attribution.verdict import Finding
from replicheck.guard.checks import scaling
from replicheck.guard.context import running
from replicheck.guard.errors import GuardError, UpdateReplayError
from replicheck.guard.gate import step_gate
from replicheck.guard.parallel.base import UpdateCheck
from replicheck.guard.transport.transfer import to_host

log = logging.getLogger(__name__)

Raise = Callable[[int, list[Finding]], NoReturn]
"""Ends step ``s`` with an incident made of the findings (collective)."""
GradientEdit = Callable[[Sequence[torch.nn.Parameter]], None]
"""``edit(params)``: changes the reduced ``.grad`` of the guard's parameters in place, before the
optimizer step (called on every rank, under ``torch.no_grad()``)."""


class UpdateApplier:
    """Applies a checked step's update, or skips it, on every rank alike."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler | None,
        updates: UpdateCheck | None,
        raise_: Raise,
        *,
        params: Sequence[torch.nn.Parameter] = (),
        max_grad_norm: float | None = None,
    ) -> None:
        self._optimizer, self._scaler, self._updates = optimizer, scaler, updates
        self._gate = step_gate(optimizer)
        self._raise = raise_
        self._params = list(params)
        self._max_norm = max_grad_norm
        self.edits: list[GradientEdit] = []
        """The gradient edits, in the order they run."""

    def apply(self, s: int, verify: bool) -> float | None:
        """The gradient edits and clipping, then ``optimizer.step()`` (through the scaler when
        there is one); on a verification step the update is then checked where the parallelism
        checks it. Returns the total gradient norm before clipping (``None`` without clipping)."""
        updates = self._updates if verify else None
        scaler_state = self._scaler.state_dict() if updates is not None and self._scaler is not None else None
        norm = self._edit(s)
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
        return norm

    def _edit(self, s: int) -> float | None:
        """The user's gradient edits, then clipping, on unscaled gradients."""
        if not self.edits and self._max_norm is None:
            return None
        with running(s, "optimizer"):
            if self._scaler is not None:
                # scaler.step() then knows the gradients are unscaled and does not unscale again.
                self._scaler.unscale_(self._optimizer)
            with torch.no_grad():
                for edit in list(self.edits):
                    edit(self._params)
            if self._max_norm is None:
                return None
            total = torch.nn.utils.clip_grad_norm_(self._params, self._max_norm)
            return _host_norm(total)

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


def _host_norm(total: torch.Tensor) -> float:
    """The total norm ``clip_grad_norm_`` returned, as a number (a DTensor's full value)."""
    full = getattr(total, "full_tensor", None)
    value = full() if callable(full) else total
    return float(to_host(value, "gradient norm"))
