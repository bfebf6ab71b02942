"""Fault-injector mistakes are clear errors on every rank (issue 12 item 14)."""

from __future__ import annotations

import pytest
from injector_ranks import try_install

from replicheck.faults import Fault
from replicheck.faults.errors import FaultConfigError
from replicheck.harness.launch import node_names, run_local
from replicheck.harness.workloads import DecoderConfig, make_model

TINY = DecoderConfig(vocab=32, d_model=8, n_layers=1, n_heads=2, seq_len=4)


@pytest.mark.timeout(120)
def test_wrong_module_name_is_the_same_clear_error_on_every_rank() -> None:
    """A misspelt module fails with FaultConfigError listing the valid names on every rank, not
    only on the target rank."""
    results = run_local(
        try_install, node_names(2, 1), args=(Fault.at_forward("blocks.0.fnn").on_rank(1),), timeout=100
    )
    messages = [r for r in results]
    assert len(messages) == 2 and messages[0] == messages[1]
    assert "no module named 'blocks.0.fnn'" in messages[0] and "'blocks.0.ffn'" in messages[0]


@pytest.mark.timeout(120)
def test_fault_without_rank_in_a_multi_rank_job_is_refused() -> None:
    """Without .on_rank() a 2-rank job refuses the fault on both ranks; .on_all_ranks() installs it."""
    bare = Fault.at_forward("blocks.0.ffn").nan()
    refused = run_local(try_install, node_names(2, 1), args=(bare,), timeout=100)
    assert all("choose .on_rank(R) with R in 0..1, or .on_all_ranks()" in m for m in refused)
    everywhere = run_local(try_install, node_names(2, 1), args=(bare.on_all_ranks(),), timeout=100)
    assert everywhere == ["installed", "installed"]
    assert "on every rank" in bare.on_all_ranks().describe()


def test_rank_outside_the_job_is_refused() -> None:
    """.on_rank(5) in a 1-rank job is a FaultConfigError naming the job's ranks."""
    with pytest.raises(FaultConfigError, match=r"rank 5 but the job has 1 rank\(s\)"):
        Fault.at_forward("blocks.0.ffn").nan().on_rank(5).install(make_model(TINY, seed=0))


def test_wrong_parameter_name_lists_valid_names() -> None:
    """A misspelt parameter names the valid parameter names in its error."""
    with pytest.raises(FaultConfigError, match=r"no parameter named 'head.wieght'.*'head.weight'"):
        Fault.at_weight_gradient("head.wieght").install(make_model(TINY, seed=0), rank=0)
