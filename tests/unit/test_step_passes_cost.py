"""Costs of a step's passes on one rank (issue 23, finding 10): a ``LossSum`` whose count is a
device tensor is read once a step, not once a forward, and the earlier passes' gradients are
rescaled with one foreach call, not one ``mul_`` per parameter."""

from __future__ import annotations

import pytest
import torch
from live_bytes import LiveBytes

from replicheck.guard import Guard, GuardConfig, LossContractError
from replicheck.guard.loss import LossSum
from replicheck.guard.transport.transfer import COUNTER

pytestmark = pytest.mark.filterwarnings("ignore:replicheck. world size 1")


def _guard(counts: list[float]) -> tuple[Guard, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = iter(counts * 100)

    def loss_fn(m: torch.nn.Module, b: torch.Tensor) -> LossSum:
        return LossSum(total=m(b).square().sum(), count=torch.tensor(next(calls)))

    return Guard(model, opt, loss_fn, config=GuardConfig(verify_every=100), node="solo"), model


def _batches() -> list[torch.Tensor]:
    return [torch.randn(4, 8) for _ in range(3)]


def _ordinary_step() -> LiveBytes:
    """Three micro-batches with tensor counts, after a first (verification) step, counted."""
    guard, _ = _guard([4.0])
    guard.step(*_batches())
    COUNTER.reset()
    with LiveBytes() as ops:
        guard.step(*_batches())
    return ops


def test_a_tensor_loss_sum_count_is_read_once_a_step() -> None:
    """Three micro-batches with tensor counts: one counted read of the counts for the step, not
    one a forward."""
    _ordinary_step()
    assert COUNTER.by_reason["LossSum.count"] == 1, dict(COUNTER.by_reason)


def test_earlier_passes_are_rescaled_by_one_foreach_call() -> None:
    """The rescaling of the earlier passes' gradients is one ``_foreach_mul_``, no per-parameter
    ``mul_``."""
    ops = _ordinary_step()
    assert ops.calls.get("_foreach_mul_") == 1 and "mul_" not in ops.calls, ops.calls


def test_a_negative_tensor_count_is_still_refused() -> None:
    """A negative count read with the step's counts is the same clear error as before."""
    guard, _ = _guard([4.0, -1.0, 4.0])
    with pytest.raises(LossContractError, match="LossSum.count must be >= 0"):
        guard.step(*_batches())
