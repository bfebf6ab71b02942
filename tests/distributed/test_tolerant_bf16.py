"""Tolerant mode under bf16 autocast with simulated kernel noise on every rank and pass, with the
sketch block, floor and ceiling the guard chooses for bf16 (none set)."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from replicheck.campaign.runner import install_for_campaign
from replicheck.campaign.scenarios import campaign_model, norm_noise
from replicheck.campaign.soak import SoakConfig, bf16_soak, run_soak
from replicheck.faults.injector import Fault
from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobResult, JobSpec, train
from replicheck.harness.launch import node_names, run_local

NOISE = norm_noise()
WGRAD = "blocks.0.ffn.down.weight"


def _run(steps: int, verify_every: int, fault: Fault | None) -> list[JobResult]:
    spec = JobSpec(
        model=campaign_model(),
        batch=4,
        steps=steps,
        loss="lm_bf16",
        guard=GuardConfig(verify_every=verify_every, weights_every=verify_every, mode="tolerant"),
        setup=functools.partial(install_for_campaign, fault=fault, noise=NOISE),
    )
    return run_local(train, node_names(3, 1), args=(spec,), timeout=240)


@pytest.mark.timeout(300)
def test_bf16_clean_run_has_no_alarm() -> None:
    """30 clean bf16 steps verified on every step (90 pairs) under kernel noise raise nothing."""
    results = _run(30, 1, None)
    assert all(r.incident is None and r.last_step == 29 for r in results), results[0].incident


@pytest.mark.timeout(300)
def test_bf16_backward_only_fault_caught_at_first_verification() -> None:
    """A weight-gradient-only fault (32 values zeroed) from step 6 is named at step 10."""
    fault = dataclasses.replace(
        Fault.at_weight_gradient(WGRAD).persistent(from_step=6).zero_chunk(), rank=1, seed=1
    )
    inc = _run(12, 5, fault)[0].incident
    assert inc is not None
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (10, "replay", [1])


@pytest.mark.timeout(300)
def test_bf16_sparse_backward_only_fault_caught_by_the_per_block_sketch() -> None:
    """x2 on 8 values of one weight gradient from step 6 is named at step 10 (per-block sketch;
    the whole-tensor sketch dilutes it below the bf16 floor in a third of probes)."""
    fault = dataclasses.replace(
        Fault.at_weight_gradient(WGRAD).persistent(from_step=6).scale(2.0, count=8), rank=1, seed=1
    )
    inc = _run(12, 5, fault)[0].incident
    assert inc is not None
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (10, "replay", [1])


@pytest.mark.slow
@pytest.mark.timeout(4 * 3600)
def test_bf16_soak_no_false_alarm_in_100000_pairs() -> None:
    """100,000 clean verification pairs under bf16 autocast, every noise shape and the guard's
    default tolerances: no false alarm (about 45 minutes on 2 cores; docs/results/soak-bf16.md)."""
    result = run_soak(bf16_soak(SoakConfig(pairs=100_000)))
    assert result.verification_pairs >= 100_000
    assert result.false_alarms == 0, result.incident
