"""The loss contract and the calibration statistic, without processes."""

from __future__ import annotations

import pytest
import torch

from replicheck.guard import BatchError, GuardConfig, GuardConfigError, LossSum
from replicheck.guard.attribution.verdict import calibration_noise
from replicheck.guard.loss import unpack


def test_unpack_reads_a_plain_loss_and_a_loss_sum() -> None:
    """A scalar tensor has no item count; a LossSum gives its total and count."""
    t = torch.tensor(2.5)
    assert unpack(t)[1] is None and float(unpack(t)[0]) == 2.5
    total, count = unpack(LossSum(total=torch.tensor(6.0), count=torch.tensor(3)))
    assert float(total) == 6.0 and count == 3.0


@pytest.mark.parametrize(
    "bad", [torch.zeros(2), "loss", LossSum(total=torch.zeros(3), count=1), LossSum(torch.tensor(1.0), -1)]
)
def test_unpack_refuses_what_is_not_a_loss(bad: object) -> None:
    """A non-scalar loss, a non-tensor or a negative count is a BatchError naming the contract."""
    with pytest.raises(BatchError):
        unpack(bad)


def test_loss_reduction_is_validated() -> None:
    """An unknown loss_reduction is refused at construction."""
    with pytest.raises(GuardConfigError):
        GuardConfig(loss_reduction="token_mean")  # type: ignore[arg-type]


def test_calibration_noise_ignores_one_outlier_rank() -> None:
    """One rank's inflated noise (a fault during calibration) does not set the step's noise."""
    assert calibration_noise([1e-7, 0.3, 2e-7]) == 2e-7
    assert calibration_noise([1e-7, 0.3]) == 1e-7
    assert calibration_noise([1e-7, 2e-7, 3e-7, 0.3]) == 2e-7
    assert calibration_noise([]) == 0.0
