"""The loss contract: what ``loss_fn`` returns and how the guard may weight its passes."""

from __future__ import annotations

from collections.abc import Callable
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
    """How many items ``total`` sums over."""


LossOutput = torch.Tensor | LossSum
"""What ``loss_fn`` returns: a scalar loss tensor, or a :class:`LossSum`."""
LossFn = Callable[[torch.nn.Module, Any], LossOutput]
"""``loss_fn(module, batch)``: a scalar loss tensor (see ``GuardConfig.loss_reduction``) or a
:class:`LossSum`."""


def unpack(out: object) -> tuple[torch.Tensor, float | None]:
    """The tensor to differentiate and the item count (``None`` for a plain scalar loss)."""
    if isinstance(out, LossSum):
        if not isinstance(out.total, torch.Tensor) or out.total.numel() != 1:
            raise LossContractError("LossSum.total must be a scalar tensor")
        # A device tensor count is one counted host transfer per pass (pass a Python number
        # to avoid it): the count sets the step's gradient scale on the host.
        count = float(
            to_host(out.count, "LossSum.count") if isinstance(out.count, torch.Tensor) else out.count
        )
        if not count >= 0:
            raise LossContractError(f"LossSum.count must be >= 0, got {count}")
        return out.total.reshape(()), count
    if isinstance(out, torch.Tensor) and out.numel() == 1:
        return out.reshape(()), None
    raise LossContractError(f"loss_fn must return a scalar tensor or a LossSum, got {type(out).__name__}")
