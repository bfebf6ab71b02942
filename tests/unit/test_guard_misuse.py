"""Misuse of the guard in one process gets a clear, typed error (issue 10, part B)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from replicheck.guard import Guard, GuardConfig, GuardConfigError
from replicheck.guard.errors import GuardMisuseError

pytestmark = pytest.mark.timeout(60)


def _loss(module: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return module(batch).square().mean()


def _guard(model: nn.Module) -> tuple[Guard, torch.optim.Optimizer]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Guard(model, opt, _loss, config=GuardConfig(verify_every=1), node="solo"), opt


def test_optimizer_step_outside_the_guard_is_refused() -> None:
    """A user's own optimizer.step() after a guarded step raises instead of applying the update twice;
    the guard's own steps keep working."""
    model = nn.Linear(3, 2)
    guard, opt = _guard(model)
    guard.step(torch.randn(4, 3))
    before = model.weight.detach().clone()
    with pytest.raises(GuardMisuseError, match="outside Guard.step"):
        opt.step()
    assert torch.equal(model.weight, before)
    guard.step(torch.randn(4, 3))
    assert not torch.equal(model.weight, before)


def test_loss_fn_of_the_wrong_signature_or_result_is_named() -> None:
    """A loss_fn that cannot take (module, batch) is refused at construction; one that returns a
    non-scalar is named at the first step, not deep inside torch."""
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GuardConfigError, match=r"\(module, batch\)"):
        Guard(model, opt, lambda batch: batch.sum(), node="solo")  # type: ignore[arg-type,misc]
    guard = Guard(model, opt, lambda m, b: m(b), node="solo")
    with pytest.raises(GuardMisuseError, match="scalar"):
        guard.step(torch.randn(4, 3))


def test_world_size_one_warns_that_only_transient_faults_are_caught() -> None:
    """A guard in a single process says once, at construction, that only transient faults can be caught."""
    model = nn.Linear(3, 2)
    with pytest.warns(UserWarning, match="only transient faults"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, node="solo")


def test_sync_batchnorm_is_refused_with_what_to_use() -> None:
    """A model with SyncBatchNorm (a collective inside forward) is refused at construction, with the
    per-rank alternatives named."""
    model = nn.Sequential(nn.Linear(3, 4), nn.SyncBatchNorm(4), nn.Linear(4, 1))
    with pytest.raises(GuardConfigError, match="SyncBatchNorm.*BatchNorm"):
        Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), _loss, node="solo")


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan"), True, "1"])
def test_max_grad_norm_must_be_positive_and_finite(bad: object) -> None:
    """GuardConfig(max_grad_norm=...) refuses zero, negatives, infinities, NaN and non-numbers."""
    from replicheck.guard import GuardConfig, GuardConfigError

    with pytest.raises(GuardConfigError, match="max_grad_norm"):
        GuardConfig(max_grad_norm=bad)  # type: ignore[arg-type]
    assert GuardConfig(max_grad_norm=0.5).max_grad_norm == 0.5
