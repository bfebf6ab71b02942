"""Tolerant mode out of the box: the issue's clean runs stay silent with nothing but
``GuardConfig(verify_every=10, weights_every=10, mode="tolerant")``, in fp32 and bf16."""

from __future__ import annotations

import dataclasses

import pytest
import tolerant_runs as tr

from replicheck.faults.noise import KernelNoise, RankBias
from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobSpec
from replicheck.harness.launch import node_names, run_local
from replicheck.harness.workloads import DecoderConfig

MODEL = DecoderConfig(d_model=64, n_layers=2, n_heads=4, vocab=256, seq_len=32)
BLOCK = "blocks.1"


def _plan(seeds: tuple[int, ...]) -> list[tr.Run]:
    plan = []
    for loss in ("lm", "lm_bf16"):
        for bias in (False, True):
            for seed in seeds:
                # Kernel noise on every rank and pass: additive Gaussian, 1e-6 of the block
                # output's mean |value|; with ``bias`` rank 1 also scales it by (1 + 2e-6), as
                # another kernel choice on one node would.
                noise: tuple[KernelNoise | RankBias, ...] = (
                    KernelNoise(module=BLOCK, shape="additive", rel=1e-6, seed=100 + seed),
                )
                if bias:
                    noise += (RankBias(module=BLOCK, scale=2e-6, ranks=(1,)),)
                spec = JobSpec(
                    model=MODEL,
                    batch=4,
                    steps=41,
                    seed=seed,
                    loss=loss,  # type: ignore[arg-type]
                    guard=GuardConfig(verify_every=10, weights_every=10, mode="tolerant"),
                )
                plan.append(tr.Run(loss=loss, noise=noise, seed=seed, spec=spec))  # type: ignore[arg-type]
    return plan


@pytest.mark.timeout(600)
def test_clean_noisy_runs_with_default_tolerances_raise_nothing() -> None:
    """3 ranks on 3 nodes, 41 steps, defaults only, kernel noise on every rank (and a one-rank
    bias): no alarm in fp32 or bf16 over 3 seeds each; bf16 runs chose the bf16 tolerances."""
    plan = _plan(seeds=(0, 1, 2))
    results = run_local(tr.runs, node_names(3, 1), args=(plan,), timeout=540)
    alarms = [o for rank in results for o in rank if o.incident is not None or o.last_step != 40]
    assert not alarms, [(o.loss, o.seed, o.noise, o.incident and o.incident["check"]) for o in alarms]
    for o in results[0]:
        assert o.tolerance is not None
        expected = "bf16" if o.loss == "lm_bf16" else "fp32"
        assert o.tolerance["precision"] == expected, (o.loss, o.tolerance)
        assert o.threshold is not None and o.tolerance["floor"] <= o.threshold <= o.tolerance["ceiling"]


def test_plan_covers_both_precisions_and_the_bias() -> None:
    """The clean-run plan holds fp32 and bf16 runs, with and without the one-rank bias."""
    plan = _plan(seeds=(0,))
    assert {(r.loss, len(r.noise)) for r in plan} == {("lm", 1), ("lm", 2), ("lm_bf16", 1), ("lm_bf16", 2)}
    assert all(
        dataclasses.replace(r.spec).guard == GuardConfig(verify_every=10, weights_every=10, mode="tolerant")
        for r in plan
    )


@pytest.mark.timeout(120)
def test_ranks_in_different_precisions_are_a_misuse_on_every_rank() -> None:
    """One rank in fp32 among bf16 ranks: GuardMisuseError on every rank at the first
    verification, naming each rank's precision; never an incident."""
    spec = JobSpec(model=MODEL, batch=2, steps=3, guard=GuardConfig(verify_every=1, mode="tolerant"))
    seen = run_local(tr.mixed_precisions, node_names(3, 1), args=(spec,), timeout=100)
    assert all(s.startswith("GuardMisuseError") and "rank 1: fp32" in s for s in seen), seen
