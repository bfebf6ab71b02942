"""The gate the optimizer step passes through: ``optimizer.step()`` only from inside the guard."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from replicheck.guard.errors import GuardMisuseError


class StepGate:
    """Refuses ``optimizer.step()`` called outside the guard (it would apply an unchecked update).

    One gate per optimizer, shared by every guard built on it (a resumed job may build a new
    guard over the same optimizer): see :func:`step_gate`.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.open = False
        self._handle = optimizer.register_step_pre_hook(self._pre)

    def _pre(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.open:
            raise GuardMisuseError(
                "optimizer.step() was called outside Guard.step(): the guard already steps the "
                "optimizer once per step (a second call would apply the update twice, unchecked). "
                "Call only guard.step(batch)."
            )

    def remove(self) -> None:
        self._handle.remove()


_GATES: weakref.WeakKeyDictionary[torch.optim.Optimizer, StepGate] = weakref.WeakKeyDictionary()


def step_gate(optimizer: torch.optim.Optimizer) -> StepGate:
    """The optimizer's gate, installed on first use."""
    gate = _GATES.get(optimizer)
    if gate is None:
        gate = _GATES[optimizer] = StepGate(optimizer)
    return gate
