"""Rank function for test_phases.py: two guarded DDP steps with every check on, timed by phase."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from benchkit.phases import GUARD_PHASES, PhaseTimer  # noqa: E402
from replicheck.guard import Guard, GuardConfig  # noqa: E402
from replicheck.harness.launch import RankContext  # noqa: E402
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch  # noqa: E402


def timed_steps(ctx: RankContext) -> dict[str, int]:
    """Calls per component over two latency-first steps (replay, weights and optimizer state)."""
    cfg = DecoderConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    model = DistributedDataParallel(make_model(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, lm_loss, config=GuardConfig(verify_every=1, weights_every=1), node=ctx.node)
    timer = PhaseTimer(GUARD_PHASES)
    with timer.installed():
        for s in range(2):
            guard.step(synthetic_batch(cfg, step=s, rank=ctx.rank, batch=4))
    return dict(timer.calls)
