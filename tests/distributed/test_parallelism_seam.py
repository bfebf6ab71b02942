"""A parallelism added through the seam alone: the guard's step, passes, replays and judge ask it
and need no edit (issue 22). ``ManualDataParallel`` (seam_ranks.py) is not shipped with the guard."""

from __future__ import annotations

import pytest
import seam_ranks
import torch

from replicheck.harness.launch import node_names, run_local


@pytest.mark.timeout(200)
def test_a_new_parallelism_trains_as_its_plain_loop_and_names_a_persistent_fault() -> None:
    """Clean: every verification passes and the applied update equals the hand-written loop's.
    A persistent forward fault on rank 1 from step 3 is named at the first verification after it
    (step 5), persistent, by the ring replay, on every rank alike."""
    nodes = node_names(3, 1)
    clean = run_local(seam_ranks.guarded, nodes, args=(None,), timeout=150)
    ref = run_local(seam_ranks.plain, nodes, timeout=150)
    for r, want in zip(clean, ref):
        assert r["incident"] is None and r["kind"] == "manual-dp"
        assert r["verified"] == [0, 5, 10]
        for name, value in want.items():
            assert torch.allclose(r["state"][name], value, rtol=1e-6, atol=1e-7), name
    faulty = run_local(seam_ranks.guarded, nodes, args=(1,), timeout=150)
    incidents = [r["incident"] for r in faulty]
    assert all(i == incidents[0] for i in incidents) and incidents[0] is not None
    inc = incidents[0]
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (5, "replay", [1])
    assert inc["classification"] == "persistent"
