"""Test-only fault hooks for the guard's distributed tests (picklable setup functions).

They are deliberately plain torch hooks, independent of ``replicheck.faults``, so the guard's
tests do not rely on the injector they are used to validate.
"""

from __future__ import annotations

from typing import Any

import torch

from replicheck.guard import Guard, current_pass, current_step
from replicheck.harness.launch import RankContext


def _bare(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model)


def _on_grad(owner: torch.nn.Module, leaf: str, hook: Any) -> None:
    """``hook`` on the gradient of ``owner.<leaf>``. Under FSDP2 the stored parameter is a shard
    and backward differentiates the whole one the owner holds during its forward: hook that."""
    param = getattr(owner, leaf)
    if not hasattr(param, "device_mesh"):
        param.register_hook(hook)
        return
    seen: set[int] = set()

    def pre(mod: Any, inp: Any) -> None:
        whole = getattr(owner, leaf)
        if id(whole) not in seen:
            seen.add(id(whole))
            whole.register_hook(hook)

    owner.register_forward_pre_hook(pre)


def _stored(t: torch.Tensor) -> torch.Tensor:
    """The values this rank stores of ``t`` (its shard of a sharded parameter)."""
    return t.to_local() if hasattr(t, "to_local") else t


def forward_fault(
    ctx: RankContext,
    model: Any,
    opt: Any,
    guard: Guard,
    *,
    rank: int,
    onset: int,
    only_pass: str | None = None,
    once: bool = False,
) -> None:
    """Add 1.0 to one activation of block 0's feed-forward on ``rank`` from step ``onset``."""
    if ctx.rank != rank:
        return
    fired: list[int] = []

    def hook(mod: Any, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        if current_step() < onset or (once and fired) or (only_pass and current_pass() != only_pass):
            return None
        fired.append(current_step())
        out = out.clone()
        out.view(-1)[7] += 1.0
        return out

    _bare(model).blocks[0].ffn.register_forward_hook(hook)


def grad_fault(
    ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int, onset: int, factor: float = 1.5
) -> None:
    """Scale one weight's gradient on ``rank`` from step ``onset``; the forward is untouched."""
    if ctx.rank != rank:
        return

    def hook(g: torch.Tensor) -> torch.Tensor | None:
        return g * factor if current_step() >= onset else None

    _on_grad(_bare(model).blocks[0].attn.qkv, "weight", hook)


def nan_grad(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int, at: int) -> None:
    """Put a NaN into one local gradient value on ``rank`` in the training pass of step ``at``."""
    if ctx.rank != rank:
        return

    def hook(g: torch.Tensor) -> torch.Tensor | None:
        if current_step() != at or current_pass() != "train":
            return None
        g = g.clone()
        g.view(-1)[0] = float("nan")
        return g

    _on_grad(_bare(model).head, "weight", hook)


def activation_noise(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rel: float) -> None:
    """Every rank: relative noise on the embedding output from a private generator, like
    non-deterministic kernels (the guard's seeded probe RNG does not reach it)."""
    gen = torch.Generator().manual_seed(10_000 + ctx.rank * 7919 + int(torch.randint(0, 1 << 30, ()).item()))

    def hook(mod: Any, inp: Any, out: torch.Tensor) -> torch.Tensor:
        return out * (1 + rel * torch.randn(out.shape, generator=gen))

    _bare(model).embed.register_forward_hook(hook)


def with_noise(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rel: float, inner: Any) -> None:
    """Noise on every rank, then ``inner`` (another setup)."""
    activation_noise(ctx, model, opt, guard, rel=rel)
    inner(ctx, model, opt, guard)


def optimizer_fault(
    ctx: RankContext,
    model: Any,
    opt: torch.optim.Optimizer,
    guard: Guard,
    *,
    rank: int,
    at: int,
    persistent: bool = False,
) -> None:
    """After ``rank``'s optimizer update of step ``at`` (and of every later step when
    ``persistent``), nudge one weight (a corrupted update)."""
    if ctx.rank != rank:
        return
    weight = _bare(model).blocks[0].ffn.up.weight

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        if current_step() == at or (persistent and current_step() > at):
            with torch.no_grad():
                _stored(weight).view(-1)[3] += 0.01

    opt.register_step_post_hook(post)


def reduced_fault(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int, at: int) -> None:
    """Corrupt ``rank``'s reduced gradient after the all-reduce at step ``at``."""
    if ctx.rank != rank:
        return

    def hook(index: int, t: torch.Tensor) -> None:
        if current_step() == at and index == 0:
            t.view(-1)[5] += 1e-3

    guard.add_reduced_gradient_hook(hook)


def reduce_scatter_fault(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int, at: int) -> None:
    """Corrupt the output of ``rank``'s first reduce-scatter of step ``at`` inside the collective
    call itself (before FSDP's hooks see it): a reduction that delivered a wrong sum."""
    if ctx.rank != rank:
        return
    real = torch.distributed.reduce_scatter_single
    done: set[int] = set()

    def wrapped(output: torch.Tensor, input: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        work = real(output, input, *args, **kwargs)
        if current_step() == at and current_pass() == "train" and at not in done:
            done.add(at)
            output.view(-1)[2] += 1.0
        return work

    torch.distributed.reduce_scatter_single = wrapped  # type: ignore[assignment]


def nan_on_single_sample(
    ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int, onset: int
) -> None:
    """On ``rank`` from ``onset``: a NaN in block 0's feed-forward output whenever the pass holds
    one sample (the probe's shape) — a fault that depends on the shape of the work."""
    if ctx.rank != rank:
        return

    def hook(mod: Any, inp: Any, out: torch.Tensor) -> torch.Tensor | None:
        if current_step() < onset or out.shape[0] != 1:
            return None
        out = out.clone()
        out.view(-1)[0] = float("nan")
        return out

    _bare(model).blocks[0].ffn.register_forward_hook(hook)


def skewed_clock(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, rank: int) -> None:
    """``rank``'s wall clock reads 2001-01-01: ranks that stamp an incident with their own clock
    then disagree, whatever the load."""
    if ctx.rank != rank:
        return
    import datetime as dt
    import types

    from replicheck import timefmt

    fixed = dt.datetime(2001, 1, 1, tzinfo=dt.UTC)

    class _Clock(dt.datetime):
        @classmethod
        def now(cls, tz: dt.tzinfo | None = None) -> dt.datetime:  # type: ignore[override]
            return fixed

    timefmt._dt = types.SimpleNamespace(datetime=_Clock, UTC=dt.UTC)  # type: ignore[assignment]


def chain(ctx: RankContext, model: Any, opt: Any, guard: Guard, *, setups: Any) -> None:
    """Run several setups in order."""
    for setup in setups:
        setup(ctx, model, opt, guard)


def clamp_after_step(ctx: RankContext, model: Any, opt: torch.optim.Optimizer, guard: Guard) -> None:
    """On every rank, a user's step hook that clamps every weight after the update (software that
    changes what the optimizer applied, as weight constraints or an EMA swap do)."""

    def post(optimizer: Any, args: Any, kwargs: Any) -> None:
        with torch.no_grad():
            for g in optimizer.param_groups:
                for p in g["params"]:
                    _stored(p).clamp_(-0.05, 0.05)

    opt.register_step_post_hook(post)
