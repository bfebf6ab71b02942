"""Resume fidelity of module buffers (BatchNorm running statistics) under DDP."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig
from replicheck.harness.launch import RankContext, run_local


def _loss(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return module(batch["x"]).square().mean()


def _first_step_buffers(ctx: RankContext, start_step: int) -> tuple[int, list[float]]:
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(
        model, opt, _loss, config=GuardConfig(start_step=start_step, probe_size=2), node=f"node{ctx.rank}"
    )
    guard.step({"x": torch.randn(4, 4, generator=torch.Generator().manual_seed(ctx.rank))})
    bn: Any = model.module[1]
    return int(bn.num_batches_tracked), bn.running_mean.tolist()


@pytest.mark.timeout(120)
def test_resumed_first_step_leaves_batchnorm_buffers_as_an_uninterrupted_step() -> None:
    """A resumed guard's first step changes BatchNorm buffers exactly as the same step of an
    uninterrupted run does (the bucket-rebuild pass must not count as a forward)."""
    fresh = run_local(_first_step_buffers, ["node0", "node1"], args=(10,), timeout=100)[0]
    # start_step=0 has no rebuild pass: the reference for "one forward's worth" of updates.
    reference = run_local(_first_step_buffers, ["node0", "node1"], args=(0,), timeout=100)[0]
    assert fresh == reference
