"""A fault carried by the data is not a hardware fault (issue 10, item 2): a sample whose forward
gives inf on any device is re-run on another rank, classified ``data`` and blamed on no node; most
ranks going bad at once is ``divergence``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.controller.machine import initial_record, transition
from replicheck.controller.model import State, Tick
from replicheck.guard import CorruptionDetected, Guard, GuardConfig
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.incident import read_incident


def _loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (module(batch["x"]).squeeze(-1) - batch["y"]).square().mean()


def _job(ctx: RankContext, poisoned: list[int], incident_dir: str) -> dict[str, Any] | None:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = Guard(
        model, opt, _loss, config=GuardConfig(verify_every=5, incident_dir=incident_dir), node=ctx.node
    )
    try:
        for s in range(4):
            g = torch.Generator().manual_seed(s * 10 + ctx.rank)
            x = torch.randn(4, 4, generator=g)
            y = x.sum(-1)
            if s == 2 and ctx.rank in poisoned:
                y[3] = float("inf")  # a bad label: every device computing this sample gets inf
            guard.step({"x": x, "y": y})
    except CorruptionDetected as exc:
        return exc.incident.to_dict()
    return None


@pytest.mark.timeout(150)
def test_inf_from_the_data_is_classified_data_and_names_no_node(tmp_path: Path) -> None:
    """An inf label on one rank is reproduced by a peer on another node: the incident says ``data``,
    names no suspect, and the controller neither cordons nor replaces anything for it."""
    results = run_local(_job, node_names(3, 1), args=([1], str(tmp_path)), timeout=120)
    inc = results[0]
    assert inc is not None and all(r == inc for r in results)
    assert (inc["step"], inc["check"], inc["classification"]) == (2, "gradients", "data")
    assert inc["suspect_ranks"] == [] and inc["suspect_nodes"] == [] and inc["candidates"] == []
    (rerun,) = inc["evidence"]["gradients"]["reruns"]
    assert rerun["rank"] == 1 and rerun["peer"] == 2 and rerun["peer_rerun_norm"] in ("inf", "nan")
    path = next(tmp_path.glob("*.json"))
    written = read_incident(path)
    # Without a continuation the record is written as version 2, readable by older controllers.
    assert written.classification == "data" and json.loads(path.read_text())["version"] == 2
    # Once the job is verified (it names no node, so any allocation covers it): no action at all.
    verified = initial_record(written).evolve(allocation=("node0",))
    step = transition(verified, Tick(now="2026-01-01T00:00:00+00:00", auto_approve=True))
    assert step.actions == () and step.record.state is State.AWAITING_APPROVAL


@pytest.mark.timeout(150)
def test_most_ranks_non_finite_at_once_is_divergence(tmp_path: Path) -> None:
    """When most ranks' gradients are non-finite on the same step the incident says ``divergence``
    and names no node."""
    results = run_local(_job, node_names(3, 1), args=([0, 1, 2], str(tmp_path)), timeout=120)
    inc = results[0]
    assert inc is not None and inc["classification"] == "divergence"
    assert inc["suspect_ranks"] == [] and inc["candidates"] == []
