"""Rank functions for the host-transfer tests (picklable: run in spawned ranks)."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig
from replicheck.guard.transport.transfer import COUNTER
from replicheck.harness.launch import RankContext


def _mlp(layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(16, 16), torch.nn.LayerNorm(16), torch.nn.Tanh()]
    return torch.nn.Sequential(*mods, torch.nn.Linear(16, 1))


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    out: torch.Tensor = torch.nn.functional.mse_loss(model(x).squeeze(-1), y)
    return out


def count_per_step(ctx: RankContext, layers: int, steps: int, period: int) -> list[dict[str, int]]:
    """Train ``steps`` guarded steps (verify and weights every ``period``); transfers per step."""
    model = DistributedDataParallel(_mlp(layers))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(model, opt, _loss, GuardConfig(verify_every=period, weights_every=period), node=ctx.node)
    g = torch.Generator().manual_seed(ctx.rank)
    out: list[dict[str, int]] = []
    for _ in range(steps):
        batch = (torch.randn(8, 16, generator=g), torch.randn(8, generator=g))
        COUNTER.reset()
        guard.step(batch)
        out.append({"total": COUNTER.total, **COUNTER.by_reason})
    COUNTER.reset()
    guard.check_replicas()
    out.append({"total": COUNTER.total, **COUNTER.by_reason})
    return out


def fail_once(ctx: RankContext, where: str, at: int, find_unused: bool = False) -> tuple[str, float, bool]:
    """Rank 1 fails at step ``at`` (``where``: before / inside / after the DDP forward, in the
    first of two micro-batches, or at a verification step in ``split`` mode with two micro-batches:
    in the probe that takes all of the first, or in the pass after it); what each rank raised, how
    long it took, and whether its weights stayed as they were before that step."""
    import time

    from replicheck import fingerprint as fp
    from replicheck.guard import PeerFailed

    model = DistributedDataParallel(_mlp(2), find_unused_parameters=find_unused)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    armed = {"on": False, "passes": 0}
    two = where in ("first_of_two", "split_probe", "split_rest")

    def loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
        fail = armed["on"] and ctx.rank == 1
        if fail:
            armed["passes"] += 1
        if fail and where in ("before", "first_of_two", "split_probe") and armed["passes"] == 1:
            raise KeyError("bad sample")
        if fail and where == "split_rest" and armed["passes"] == 2:
            raise KeyError("bad sample")
        out = _loss(module, batch)
        if fail and where == "after":
            raise KeyError("bad sample")
        return out

    def hook(module: torch.nn.Module, args: Any) -> None:
        if armed["on"] and ctx.rank == 1 and where == "inside":
            raise KeyError("bad sample")

    model.module[0].register_forward_pre_hook(hook)
    split = where.startswith("split")
    cfg = GuardConfig(
        verify_every=at if split else 1000,
        weights_every=0,
        probe="split" if split else "auto",
        probe_size=4,
        loss_reduction="sample_mean",
    )
    guard = Guard(model, opt, loss, cfg, node=ctx.node)
    g = torch.Generator().manual_seed(ctx.rank)
    before = 0
    t0 = time.monotonic()
    for s in range(at + 1):
        mbs = [(torch.randn(4, 16, generator=g), torch.randn(4, generator=g)) for _ in range(2)]
        armed["on"] = s == at
        if s == at:
            before = fp.model_digest(model.module, "all")
        try:
            guard.step(*(mbs if two else mbs[:1]))
        except (KeyError, PeerFailed) as exc:
            kept = fp.model_digest(model.module, "all") == before
            return f"{type(exc).__name__}@{s}", time.monotonic() - t0, kept
    return "finished", time.monotonic() - t0, True
