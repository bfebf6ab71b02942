"""The guard on model features the published method left untested: BatchNorm in train mode,
unused parameters, and forward hooks with side effects."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import (
    CorruptionDetected,
    Guard,
    GuardConfig,
    current_step,
    is_replaying,
)
from replicheck.harness.launch import RankContext, node_names, run_local


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.bn = nn.BatchNorm1d(16)
        self.fc2 = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.bn(self.fc1(x))))


class Branchy(nn.Module):
    """``skip`` is used only when the batch asks for it: an unused parameter on other steps."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.skip = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, use_skip: bool) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_skip:
            h = h + self.skip(x)
        return self.out(h)


def _mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]).squeeze(-1) - batch["y"]).square().mean()


def _data(step: int, rank: int, n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 100 + rank)
    x = torch.randn(n, 8, generator=g)
    return {"x": x, "y": x.sum(-1)}


def _bn_job(ctx: RankContext, fault_rank: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(BNNet())
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(model, opt, _mse, config=GuardConfig(verify_every=2, probe_size=2), node=ctx.node)
    if ctx.rank == fault_rank:
        model.module.fc2.register_forward_hook(lambda m, i, o: o * 1.01 if current_step() >= 3 else None)
    seen = []
    try:
        for s in range(8):
            before = model.module.bn.num_batches_tracked.item()
            guard.step(_data(s, ctx.rank))
            seen.append(model.module.bn.num_batches_tracked.item() - before)
    except CorruptionDetected as exc:
        return {"incident": exc.incident.to_dict(), "bn_increments": seen}
    return {"incident": None, "bn_increments": seen}


@pytest.mark.timeout(180)
def test_batchnorm_in_train_mode_uses_extra_probe_and_keeps_statistics() -> None:
    """With BatchNorm in train mode the probe is extra: clean steps update BN once, faults are named."""
    clean = run_local(_bn_job, node_names(3, 1), args=(None,), timeout=150)
    assert all(r["incident"] is None for r in clean)
    assert clean[0]["bn_increments"] == [1] * 8, "probe and replays must not touch BatchNorm statistics"
    bad = run_local(_bn_job, node_names(3, 1), args=(2,), timeout=150)
    inc = bad[0]["incident"]
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (4, "replay", [2])


def _branch_loss(module: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    return (module(batch["x"], bool(batch["use_skip"][0])).squeeze(-1) - batch["y"]).square().mean()


def _unused_job(ctx: RankContext, fault_rank: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(Branchy(), find_unused_parameters=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    guard = Guard(
        model,
        opt,
        _branch_loss,
        config=GuardConfig(verify_every=1, loss_reduction="sample_mean"),
        node=ctx.node,
    )
    side_effects: list[int] = []
    # A hook with a side effect (a counter, like logging or activation caching) skips replays.
    model.module.a.register_forward_hook(lambda m, i, o: None if is_replaying() else side_effects.append(1))
    if ctx.rank == fault_rank:
        model.module.skip.weight.register_hook(lambda g: g * 2 if current_step() >= 4 else None)
    try:
        for s in range(8):
            b = _data(s, ctx.rank)
            b["use_skip"] = torch.full((8,), s % 2 == 0)
            guard.step(b)
    except CorruptionDetected as exc:
        return {"incident": exc.incident.to_dict(), "side_effects": len(side_effects)}
    return {"incident": None, "side_effects": len(side_effects)}


@pytest.mark.timeout(180)
def test_unused_parameters_and_side_effect_hooks() -> None:
    """Steps that leave a parameter unused verify cleanly, hooks see replays, and a fault in the
    sometimes-unused branch is caught when it is used."""
    clean = run_local(_unused_job, node_names(3, 1), args=(None,), timeout=150)
    assert all(r["incident"] is None for r in clean)
    # 8 steps: each runs the probe and the rest of the batch through the hook; replays are skipped.
    assert clean[0]["side_effects"] == 16
    bad = run_local(_unused_job, node_names(3, 1), args=(1,), timeout=150)
    inc = bad[0]["incident"]
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (4, "replay", [1])
