"""Rank functions for the host-transfer tests (picklable: run in spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig
from replicheck.guard.transfer import COUNTER
from replicheck.harness.launch import RankContext


def _mlp(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(16, 1))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
    return out


def count_per_step(ctx: RankContext, layers: int, steps: int, period: int) -> list[dict[str, int]]:
    """Train ``steps`` guarded steps (verify and weights every ``period``); transfers per step."""
    model = DistributedDataParallel(_mlp(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, _loss, GuardConfig(verify_every=period, weights_every=period), node=ctx.node)
    g = torch.Generator().manual_seed(ctx.rank)
    out: list[dict[str, int]] = []
    for _ in range(steps):
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, generator=g))
        COUNTER.reset()
        guard.step(batch)
        out.append({"total": COUNTER.total, **COUNTER.by_reason})
    COUNTER.reset()
    guard.check_replicas()
    out.append({"total": COUNTER.total, **COUNTER.by_reason})
    return out
