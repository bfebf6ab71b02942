"""An error in one rank's forward ends every rank in the same step, wherever it is raised (under
DDP the failed rank joins the step's all-reduces with zeros and its failure rides in the step's
row: no flag is shared per forward)."""

from __future__ import annotations

import pytest
from transfer_ranks import fail_once

from replicheck.harness.launch import node_names, run_local


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["before", "inside", "after", "first_of_two", "split_probe", "split_rest"])
def test_forward_error_on_one_rank_stops_every_rank_in_that_step(where: str) -> None:
    """Rank 1's error (before, inside or after the DDP forward, in the first of two micro-batches,
    or in a split probe or the pass after it) is raised there and PeerFailed on the other ranks at the same step, promptly,
    and no rank applies that step's update."""
    results = run_local(fail_once, node_names(3, 1), args=(where, 2), timeout=120)
    for rank, (outcome, seconds, kept) in enumerate(results):
        assert outcome == ("KeyError@2" if rank == 1 else "PeerFailed@2"), (rank, outcome)
        assert seconds < 60 and kept, (rank, seconds, kept)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("where", ["before", "first_of_two"])
def test_forward_error_with_unused_parameters_tracked_stops_every_rank(where: str) -> None:
    """The same with DistributedDataParallel(find_unused_parameters=True): the failed rank's
    zero all-reduces match its peers' buckets although its forward never told DDP which
    parameters it used."""
    results = run_local(fail_once, node_names(2, 1), args=(where, 2, True), timeout=120)
    for rank, (outcome, seconds, kept) in enumerate(results):
        assert outcome == ("KeyError@2" if rank == 1 else "PeerFailed@2"), (rank, outcome)
        assert seconds < 60 and kept, (rank, seconds, kept)
