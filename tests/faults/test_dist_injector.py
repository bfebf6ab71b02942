"""The injector inside a real guarded multi-process job: only the chosen rank is touched."""

from __future__ import annotations

import functools

import pytest

from replicheck.campaign.runner import install_for_campaign
from replicheck.campaign.soak import soak_model
from replicheck.faults import Fault
from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobSpec, train
from replicheck.harness.launch import node_names, run_local


@pytest.mark.timeout(120)
def test_matmul_fault_on_rank_2_corrupts_rank_2_only_and_is_named() -> None:
    """A persistent matmul fault on rank 2 records corruptions on rank 2 only (train, probe and
    replay passes), ranks agree up to the onset, and the guard names rank 2 at the first check."""
    fault = Fault.at_forward("blocks.0.attn", ops="matmul").persistent(from_step=3).bitflip(bit=21).on_rank(2)
    spec = JobSpec(
        steps=8,
        batch=2,
        model=soak_model(),
        guard=GuardConfig(verify_every=5, weights_every=5),
        setup=functools.partial(install_for_campaign, fault=fault),
    )
    results = run_local(train, node_names(3, 1), args=(spec,), timeout=100)
    records = {r.rank: r.setup_result for r in results}
    assert records[0] == [] and records[1] == [] and records[2]
    assert {c.rank for c in records[2]} == {2} and min(c.step for c in records[2]) == 3
    assert {"train", "probe", "replay"} <= {c.pass_ for c in records[2]}
    assert all(c.tensor.startswith("blocks.0.attn:") for c in records[2])
    inc = results[0].incident
    assert (
        inc is not None
        and inc["step"] == 5
        and inc["suspect_ranks"] == [2]
        and inc["classification"] == "persistent"
    )
