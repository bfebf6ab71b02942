"""The loss contract: what ``loss_fn`` returns and how the guard may weight its passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from replicheck.guard.errors import LossContractError
from replicheck.guard.transport.transfer import to_host

LossReduction = Literal["unknown", "sample_mean", "sum"]
"""What a plain scalar loss is over its batch: unknown, a mean over samples, or a plain sum."""


@dataclass(frozen=True)
class LossSum:
    """A loss stated as a sum over items with the item count (samples, non-padding tokens...).

    The loss the step trains on is the sum of ``total`` over every pass of the rank's step divided
    by the sum of ``count``, which is what lets the guard split a probe off a batch exactly.
    """

    total: torch.Tensor
    """Scalar: the loss summed over the pass's items."""
    count: torch.Tensor | int
    """How many items ``total`` sums over: a number, or a one-value tensor (not read per pass:
    the step reads all its passes' tensor counts in one host transfer, before its last backward)."""


LossOutput = torch.Tensor | LossSum
"""What ``loss_fn`` returns: a scalar loss tensor, or a :class:`LossSum`."""
LossFn = Callable[[torch.nn.Module, Any], LossOutput]
"""``loss_fn(module, batch)``: a scalar loss tensor (see ``GuardConfig.loss_reduction``) or a
:class:`LossSum`."""


Count = float | torch.Tensor
"""A pass's item count: a number, or a one-value tensor left where ``loss_fn`` made it."""


def unpack(out: object) -> tuple[torch.Tensor, Count | None]:
    """The tensor to differentiate and the item count (``None`` for a plain scalar loss).

    A tensor count is not read here (that would be a host transfer per forward): the step reads
    every pass's count together, once, with :func:`step_counts`.
    """
    if isinstance(out, LossSum):
        if not isinstance(out.total, torch.Tensor) or out.total.numel() != 1:
            raise LossContractError("LossSum.total must be a scalar tensor")
        if isinstance(out.count, torch.Tensor):
            if out.count.numel() != 1:
                raise LossContractError(
                    f"LossSum.count must be a number or a one-value tensor, got shape {tuple(out.count.shape)}"
                )
            return out.total.reshape(()), out.count.detach().reshape(())
        count = float(out.count)
        _check_count(count)
        return out.total.reshape(()), count
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.reshape(()), None
    raise LossContractError(f"loss_fn must return a scalar tensor or a LossSum, got {type(out).__name__}")


def step_counts(counts: Sequence[Count]) -> list[float]:
    """Every pass's item count as a number, in order: the tensor counts of a step reach the host
    together, in one counted transfer, and each is checked like a number."""
    tensors = [c for c in counts if isinstance(c, torch.Tensor)]
    read: list[float] = []
    if tensors:
        device = tensors[0].device
        read = to_host(torch.stack([t.to(device, torch.float64) for t in tensors]), "LossSum.count").tolist()
    values = iter(read)
    out = [next(values) if isinstance(c, torch.Tensor) else float(c) for c in counts]
    for c in out:
        _check_count(c)
    return out


def check_counts(counts: Sequence[float]) -> None:
    """Refuse a negative or NaN item count (``LossContractError``)."""
    for c in counts:
        _check_count(c)


def _check_count(count: float) -> None:
    if not count >= 0:
        raise LossContractError(f"LossSum.count must be >= 0, got {count}")
