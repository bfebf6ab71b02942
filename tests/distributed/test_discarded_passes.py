"""``is_replaying()`` is true on every pass whose result the guard throws away."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig, current_pass, is_replaying
from replicheck.harness.launch import RankContext, node_names, run_local


def _mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]).squeeze(-1) - batch["y"]).square().mean()


def _job(ctx: RankContext) -> list[tuple[str, bool]]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # A resumed guard (start_step > 0) runs the bucket-rebuild pass; probe="extra" runs the
    # probe in addition to the batch. Neither result reaches the update.
    guard = Guard(
        model, opt, _mse, config=GuardConfig(start_step=5, probe="extra", verify_every=1), node=ctx.node
    )
    seen: list[tuple[str, bool]] = []
    model.module[0].register_forward_hook(lambda m, i, o: seen.append((current_pass(), is_replaying())))
    for s in range(5, 8):
        x = torch.randn(6, 4, generator=torch.Generator().manual_seed(s * 10 + ctx.rank))
        guard.step({"x": x, "y": x.sum(-1)})
    return seen


@pytest.mark.timeout(120)
def test_extra_probe_and_rebuild_pass_are_marked_discarded() -> None:
    """Hooks see is_replaying() on the rebuild pass, the extra probe and replays, and never on
    the training passes, which run exactly once per step."""
    seen = run_local(_job, node_names(2, 1), timeout=100)[0]
    kinds = {(p, r) for p, r in seen}
    assert ("rebuild", True) in kinds and ("probe", True) in kinds and ("replay", True) in kinds
    assert ("train", False) in kinds
    assert all(r for p, r in seen if p != "train"), seen
    assert all(not r for p, r in seen if p == "train"), seen
    assert sum(1 for p, _ in seen if p == "train") == 3
