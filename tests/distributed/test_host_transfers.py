"""Device→host transfers per guarded step, counted at the guard's transfer points (issue 11 item 4)."""

from __future__ import annotations

import pytest
from transfer_ranks import count_per_step

from replicheck.harness.launch import node_names, run_local

PERIOD = 3
STEPS = 7


@pytest.mark.timeout(200)
def test_one_transfer_per_ordinary_step_and_a_fixed_few_on_verification_steps() -> None:
    """An ordinary step makes exactly one host transfer (its row); a verification + weights step
    makes the same small number (5) whatever the model's number of tensors; check_replicas makes one."""
    by_depth = {
        layers: run_local(count_per_step, node_names(2, 1), args=(layers, STEPS, PERIOD), timeout=150)
        for layers in (1, 6)
    }
    for layers, ranks in by_depth.items():
        for rank, counts in enumerate(ranks):
            *steps, replicas = counts
            for s, c in enumerate(steps):
                where = (layers, rank, s, c)
                if s % PERIOD:
                    assert c == {"total": 1, "step row": 1}, where
                else:
                    # The row, this rank's own probe result and its replay of its source's probe;
                    # the exchange's lengths; the received message read back to the host once
                    # (decoded there): none depends on the model.
                    assert c == {
                        "total": 5,
                        "step row": 1,
                        "probe result": 2,
                        "exchange lengths": 1,
                        "received message": 1,
                    }, where
            assert replicas == {"total": 1, "step row": 1}, (layers, rank)
