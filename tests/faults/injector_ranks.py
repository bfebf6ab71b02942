"""Rank functions for the injector-error tests (picklable: run in spawned ranks)."""

from __future__ import annotations

from replicheck.faults import Fault
from replicheck.faults.errors import FaultConfigError
from replicheck.harness.launch import RankContext
from replicheck.harness.workloads import DecoderConfig, make_model


def try_install(ctx: RankContext, fault: Fault) -> str:
    """Install ``fault`` on this rank; the FaultConfigError message, or "installed"."""
    model = make_model(DecoderConfig(vocab=32, d_model=8, n_layers=1, n_heads=2, seq_len=4), seed=0)
    try:
        fault.install(model)
    except FaultConfigError as exc:
        return str(exc)
    return "installed"
