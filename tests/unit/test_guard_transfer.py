"""The guard's counted host transfers and the device-side step row."""

from __future__ import annotations

import math

import pytest
import torch

from replicheck.guard.transport.records import StepRow
from replicheck.guard.transport.transfer import COUNTER, host_result, to_host_all

pytestmark = pytest.mark.timeout(60)


def test_a_row_of_tensors_encodes_like_the_same_row_of_numbers() -> None:
    """Tensor fields (float32/float64 losses, int64 digests, NaN, -0.0) give the very row plain numbers give."""
    numbers = StepRow(loss=-0.0, local_norm=math.nan, reduced=-(2**63), weights=5, optimizer=-7, failed=True)
    tensors = StepRow(
        loss=torch.tensor(-0.0, dtype=torch.float64),
        local_norm=torch.tensor(math.nan, dtype=torch.float64),
        reduced=torch.tensor(-(2**63), dtype=torch.int64),
        weights=torch.tensor(5),
        optimizer=-7,
        failed=True,
    )
    assert torch.equal(tensors.encode(), numbers.encode())
    (back,) = StepRow.decode(tensors.encode().view(1, -1))
    assert math.copysign(1.0, back.loss) == -1.0 and math.isnan(back.local_norm)
    assert (back.reduced, back.weights, back.optimizer, back.failed) == (-(2**63), 5, -7, True)
    single = StepRow(loss=torch.tensor(1.5, dtype=torch.float32), local_norm=0.0, reduced=0)
    assert StepRow.decode(single.encode().view(1, -1))[0].loss == 1.5


def test_several_tensors_reach_the_host_in_one_counted_transfer() -> None:
    """to_host_all keeps each tensor's dtype, shape and bits (misaligned sizes included) and counts once."""
    parts = [
        torch.tensor(True),
        torch.tensor(1.25, dtype=torch.float64),
        torch.arange(3, dtype=torch.int64),
        torch.randn(2, 3).to(torch.bfloat16),
        torch.randn(5, dtype=torch.float32),
    ]
    COUNTER.reset()
    got = host_result(torch.tensor(2.5), torch.tensor([1, -2]))
    back = to_host_all(parts, "test")
    assert COUNTER.total == 2 and COUNTER.by_reason == {"probe result": 1, "test": 1}
    assert got.loss == 2.5 and got.fingerprint.tolist() == [1, -2]
    for a, b in zip(parts, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
