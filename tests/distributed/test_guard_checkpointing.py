"""The guard on models with activation checkpointing, reentrant and not."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from replicheck.guard import CorruptionDetected, Guard, GuardConfig, current_step
from replicheck.harness.launch import RankContext, node_names, run_local


class Checkpointed(nn.Module):
    """The middle layer's activations are recomputed in backward."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.a = nn.Linear(8, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
        self.out = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        h = checkpoint(self.mid, h, use_reentrant=self.reentrant)
        return self.out(h)


def _mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]).squeeze(-1) - batch["y"]).square().mean()


def _job(ctx: RankContext, reentrant: bool, fault_rank: int | None) -> dict[str, Any]:
    torch.manual_seed(0)
    model = DistributedDataParallel(Checkpointed(reentrant))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(
        model, opt, _mse, config=GuardConfig(verify_every=2, loss_reduction="sample_mean"), node=ctx.node
    )
    if ctx.rank == fault_rank:
        # Bad hardware on the checkpointed layer's weight gradient only, from step 3.
        model.module.mid[0].weight.register_hook(lambda g: g * 1.5 if current_step() >= 3 else None)
    verified = []
    try:
        for s in range(6):
            g = torch.Generator().manual_seed(s * 100 + ctx.rank)
            x = torch.randn(8, 8, generator=g)
            if guard.step({"x": x, "y": x.sum(-1)}).verified:
                verified.append(s)
    except CorruptionDetected as exc:
        return {"incident": exc.incident.to_dict(), "verified": verified}
    return {"incident": None, "verified": verified}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("reentrant", [True, False])
def test_activation_checkpointing_verifies_clean_and_catches_a_fault(reentrant: bool) -> None:
    """With reentrant or non-reentrant checkpointing, clean steps verify and a weight-gradient
    fault in the checkpointed layer is named at the first verification after onset."""
    clean = run_local(_job, node_names(3, 1), args=(reentrant, None), timeout=150)
    assert all(r["incident"] is None for r in clean), clean[0]["incident"]
    assert clean[0]["verified"] == [0, 2, 4]
    bad = run_local(_job, node_names(3, 1), args=(reentrant, 1), timeout=150)
    inc = bad[0]["incident"]
    assert inc is not None
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (4, "replay", [1])
