"""Rank functions for test_parallelism_seam.py: a parallelism the guard does not ship, added
through the seam alone (no module of the guard edited).

``ManualDataParallel`` is data parallelism without a wrapper: every rank holds a bare module and
averages the gradients itself with one ``all_reduce`` per parameter after the step's last pass,
as hand-written data-parallel loops (and some frameworks) do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from replicheck import fingerprint as fp
from replicheck.guard import CorruptionDetected, Guard, GuardConfig, Parallelism
from replicheck.guard.checks.health import GradStats, sq_norm
from replicheck.guard.context import current_step
from replicheck.guard.parallel.alone import AloneReplays
from replicheck.guard.parallel.base import Replays
from replicheck.guard.transport.comm import Comm
from replicheck.harness.launch import RankContext

STEPS = 12


class _Stats(GradStats):
    """Filled by :class:`ManualDataParallel` around its all-reduce."""


class ManualDataParallel(Parallelism):
    """Bare module on every rank; gradients averaged by hand after the step's last pass."""

    kind = "manual-dp"

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__(module, module, Comm(None))
        self._stats: _Stats | None = None
        self._failed = False

    def install(self, config: GuardConfig) -> GradStats:
        self._stats = _Stats(digest_reduced=config.check_reduced and self.comm.world_size > 1)
        return self._stats

    def join_failed_backward(self) -> None:
        self._failed = True  # this step's reduction (on leaving accumulate) sends zeros

    def replays(self, params: Sequence[torch.nn.Parameter]) -> Replays:
        return AloneReplays(params)

    @contextlib.contextmanager
    def accumulate(self, sync: bool) -> Iterator[None]:
        yield
        if sync and self._stats is not None:
            self._reduce(self._stats)

    def _reduce(self, stats: _Stats) -> None:
        if self._failed:
            # A rank that failed takes part with zeros: its peers' sums complete, and the step's
            # row then stops every rank.
            self._failed = False
            for p in self.module.parameters():
                dist.all_reduce(torch.zeros_like(p))
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        stats._local_sq.extend(sq_norm(g) for g in grads)  # this rank's own gradient, before the sum
        for i, g in enumerate(grads):
            dist.all_reduce(g)
            g.div_(self.comm.world_size)
            stats._run_hooks(i, g)
        if stats.digest_reduced and grads:
            stats._reduced[0] = fp.combine(fp.digests(grads))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=g), torch.randn(4, 1, generator=g)


def _loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(module(x), y)


def guarded(ctx: RankContext, fault_rank: int | None) -> dict[str, Any]:
    """STEPS guarded steps through the seam; a persistent forward fault on ``fault_rank`` from
    step 3 (a scaled activation, as a bad multiplier would give)."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if fault_rank == ctx.rank:

        def corrupt(module: torch.nn.Module, args: object, out: torch.Tensor) -> torch.Tensor:
            return out * 1.5 if current_step() >= 3 else out

        model[0].register_forward_hook(corrupt)
    guard = Guard(
        model,
        opt,
        _loss,
        config=GuardConfig(verify_every=5, weights_every=5, loss_reduction="sample_mean"),
        node=ctx.node,
        parallelism=ManualDataParallel(model),
    )
    verified = []
    try:
        for s in range(STEPS):
            if guard.step(_batch(s, ctx.rank)).verified:
                verified.append(s)
    except CorruptionDetected as exc:
        return {"incident": exc.incident.to_dict(), "verified": verified}
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"incident": None, "verified": verified, "state": state, "kind": guard.parallelism.kind}


def plain(ctx: RankContext) -> dict[str, torch.Tensor]:
    """The same training written by hand, unguarded: the update the guarded run must apply."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _loss(model, _batch(s, ctx.rank)).backward()
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(ctx.world_size)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
