"""The local launcher forks ranks from a preloaded server yet gives each the launcher's present state."""

from __future__ import annotations

import os
import sys

import pytest

from replicheck.harness.launch import RankContext, run_local


def _seen(ctx: RankContext) -> tuple[str | None, bool, int]:
    import torch

    return (
        os.environ.get("REPLICHECK_H6_PROBE"),
        "replicheck.harness.jobs" in sys.modules,
        torch.get_num_threads(),
    )


@pytest.mark.timeout(120)
def test_ranks_see_the_environment_of_each_launch_and_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable set after an earlier launch (so after the server started) reaches the next
    launch's ranks; the guarded job is already imported there; each rank runs one torch thread."""
    monkeypatch.setenv("REPLICHECK_H6_PROBE", "first")
    assert [s[0] for s in run_local(_seen, ["a", "b"])] == ["first", "first"]
    monkeypatch.setenv("REPLICHECK_H6_PROBE", "second")
    seen = run_local(_seen, ["a", "b"])
    assert seen == [("second", True, 1), ("second", True, 1)]
