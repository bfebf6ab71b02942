"""Tolerant mode's calibration cannot be poisoned by a fault present while it calibrates."""

from __future__ import annotations

import functools
import json
from typing import Any

import guard_faults as gf
import pytest
import torch

from replicheck.guard import Guard, GuardConfig, current_pass, current_step
from replicheck.harness.jobs import JobSpec, train
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig
from replicheck.incident import Incident

TINY = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)


def probe_fault(
    ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int, steps: tuple[int, ...], factor: float
) -> None:
    """On ``rank``, scale block 0's feed-forward output by ``factor`` in the probe pass of ``steps``."""
    if ctx.rank != rank:
        return

    def hook(mod: Any, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        return out * factor if current_step() in steps and current_pass() == "probe" else None

    getattr(model, "module", model).blocks[0].ffn.register_forward_hook(hook)


def _noisy(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, inner: Any) -> None:
    gf.activation_noise(ctx, model, opt, guard, rel=1e-6)
    if inner is not None:
        inner(ctx, model, opt, guard)


@pytest.mark.timeout(300)
def test_fault_during_calibration_is_caught() -> None:
    """A transient probe fault (x1.001, below the tolerance ceiling) at steps 0 and 5, during the
    first calibration verifications, is named at step 0 as transient, under kernel noise: the
    suspect's re-run is not over the threshold (the evidence says by how much each run was), and
    the incident states the tolerances and the smallest change they catch."""
    fault = functools.partial(probe_fault, rank=1, steps=(0, 5), factor=1.001)
    spec = JobSpec(
        model=TINY,
        batch=4,
        steps=12,
        guard=GuardConfig(verify_every=5, weights_every=5, mode="tolerant"),
        setup=functools.partial(_noisy, inner=fault),
    )
    results = run_local(train, node_names(3, 1), args=(spec,), timeout=240)
    inc = results[0].incident
    assert inc is not None, "a fault during calibration must not raise the tolerance to blind it"
    assert all(r.incident == inc for r in results)
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (0, "replay", [1])
    assert inc["classification"] == "transient"
    evidence = inc["evidence"]["replay"]
    (rerun,) = evidence["reruns"]
    assert rerun["rank"] == 1 and rerun["reproduced"] is False
    assert rerun["first_over_threshold"] > 1 > rerun["rerun_over_threshold"]
    tol = evidence["tolerance"]
    assert tol["precision"] == "fp32" and tol["threshold"] == evidence["threshold"]
    assert tol["floor"] <= tol["threshold"] <= tol["ceiling"] and "exact mode" in tol["smallest_change"]
    assert any(p["over_threshold"] > 1 for p in evidence["pairs"])
    # The controller reads it as it reads every incident (nesting, numbers, strings).
    assert Incident.from_json(json.dumps(inc)).evidence == inc["evidence"]
