"""The guard on ordinary setups it used to mishandle (issue 10, part B): setups it refuses with a
message that says what to do, errors on one rank that must stop every rank promptly, frozen
weights and buffers, and inputs of other dtypes and batch types."""

from __future__ import annotations

import dataclasses
import time
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import (
    CorruptionDetected,
    Guard,
    GuardConfig,
    GuardConfigError,
    current_pass,
    current_step,
)
from replicheck.guard.errors import PeerFailed
from replicheck.harness.launch import RankContext, node_names, run_local


class Tiny(nn.Module):
    """A frozen base layer (as under LoRA), a trainable head and a constant buffer."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.base = nn.Linear(4, 4, dtype=dtype)
        self.base.requires_grad_(False)
        self.head = nn.Linear(4, 1, dtype=dtype)
        self.register_buffer("scale", torch.full((4,), 0.5, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.base(x)) * self.scale)


def _loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return (module(batch["x"]).squeeze(-1) - batch["y"]).square().mean()


def _batch(step: int, rank: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 10 + rank)
    x = torch.randn(4, 4, generator=g).to(dtype)
    return {"x": x, "y": x.sum(-1)}


def _guard(model: nn.Module, ctx: RankContext, **cfg: Any) -> Guard:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    return Guard(model, opt, _loss, config=GuardConfig(**cfg), node=ctx.node)


# -- refused setups ---------------------------------------------------------------------------


def _refusals(ctx: RankContext) -> dict[str, str]:
    def attempt(build: Any) -> str:
        try:
            build()
        except GuardConfigError as exc:
            return str(exc)
        return "accepted"

    def static_graph() -> None:
        _guard(DistributedDataParallel(Tiny(), static_graph=True), ctx)

    def mixed_precision() -> None:
        from torch.nn.parallel.distributed import _MixedPrecision

        mp = _MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        _guard(DistributedDataParallel(Tiny(), mixed_precision=mp), ctx)

    def comm_hook() -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp = DistributedDataParallel(Tiny())
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        _guard(ddp, ctx)

    def zero() -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        ddp = DistributedDataParallel(Tiny())
        opt = ZeroRedundancyOptimizer(
            [p for p in ddp.parameters() if p.requires_grad], optimizer_class=torch.optim.SGD, lr=0.1
        )
        Guard(ddp, opt, _loss, node=ctx.node)

    def compiled() -> None:
        _guard(torch.compile(DistributedDataParallel(Tiny())), ctx)  # type: ignore[arg-type]

    def bad_signature() -> None:
        ddp = DistributedDataParallel(Tiny())
        opt = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
        Guard(ddp, opt, lambda batch: batch.sum(), node=ctx.node)  # type: ignore[arg-type,misc]

    cases = {
        "static_graph": static_graph,
        "mixed_precision": mixed_precision,
        "comm_hook": comm_hook,
        "zero": zero,
        "compiled": compiled,
        "bad_signature": bad_signature,
    }
    return {name: attempt(build) for name, build in cases.items()}


@pytest.mark.timeout(120)
def test_unsupported_setups_are_refused_with_what_to_do() -> None:
    """static_graph, DDP mixed_precision, a user comm hook, ZeroRedundancyOptimizer,
    torch.compile(ddp_model) and a loss_fn of the wrong signature are each refused at construction,
    on every rank, with a message naming the option and what to use instead."""
    results = run_local(_refusals, node_names(2, 1), timeout=100)
    assert results[0] == results[1]
    msg = results[0]
    assert "static_graph" in msg["static_graph"]
    assert "mixed_precision" in msg["mixed_precision"] and "autocast" in msg["mixed_precision"]
    assert "communication hook" in msg["comm_hook"]
    assert "ZeroRedundancyOptimizer" in msg["zero"]
    assert "torch.compile" in msg["compiled"] and "DistributedDataParallel(torch.compile" in msg["compiled"]
    assert "(module, batch)" in msg["bad_signature"]


# -- an error on one rank ends every rank -------------------------------------------------------


def _error_job(ctx: RankContext, where: str, at: int = 1) -> tuple[str, float]:
    torch.manual_seed(0)
    # Tiny buckets (one per parameter): the failing backward has launched some, not all.
    model = DistributedDataParallel(Tiny(), bucket_cap_mb=1e-6)

    def loss(module: nn.Module, batch: Any) -> torch.Tensor:
        if where == "loss_fn" and ctx.rank == 1 and current_step() == 2:
            raise KeyError("missing field on rank 1")
        return _loss(module, batch)

    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    # A known loss reduction makes the probe part of the real batch (its own backward pass).
    guard = Guard(
        model, opt, loss, config=GuardConfig(verify_every=2, loss_reduction="sample_mean"), node=ctx.node
    )
    if where == "hook" and ctx.rank == 0:

        def hook(index: int, t: torch.Tensor) -> None:
            if current_step() == 1:
                raise ValueError("logging hook failed on rank 0")

        guard.add_reduced_gradient_hook(hook)
    if where == "tensor_hook" and ctx.rank == 1:

        def grad_hook(g: torch.Tensor) -> None:
            if current_step() == at and current_pass() in ("train", "probe"):
                raise ValueError("tensor hook failed on rank 1")

        model.module.head.weight.register_hook(grad_hook)
    t0 = time.monotonic()
    try:
        for s in range(4):
            guard.step(_batch(s, ctx.rank))
    except (KeyError, ValueError, PeerFailed) as exc:
        return f"{type(exc).__name__}@{guard.next_step}", time.monotonic() - t0
    return "finished", time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("where", "failing", "at"),
    [("loss_fn", 1, 2), ("hook", 0, 1), ("tensor_hook", 1, 1), ("tensor_hook", 1, 2)],
)
def test_error_on_one_rank_stops_every_rank_in_the_same_step(where: str, failing: int, at: int) -> None:
    """An exception in loss_fn (during a verification step), in a reduced-gradient hook, or in a
    tensor hook during the gradient-synchronising backward (step 1) or the split probe's backward
    (step 2, a verification step) on one rank is re-raised there and raises PeerFailed on the
    others in the same step, long before the process group's 120 s timeout."""
    results = run_local(_error_job, node_names(3, 1), args=(where, at), timeout=60)
    for rank, (outcome, seconds) in enumerate(results):
        expected = ("KeyError" if where == "loss_fn" else "ValueError") if rank == failing else "PeerFailed"
        assert outcome == f"{expected}@{at}", (rank, outcome)
        assert seconds < 30


def _unwritable_job(ctx: RankContext, blocker: str) -> str:
    torch.manual_seed(0)
    model = DistributedDataParallel(Tiny())
    guard = _guard(model, ctx, verify_every=1, incident_dir=blocker + "/incidents")
    if ctx.rank == 2:
        model.module.head.weight.register_hook(lambda g: g * 1.5 if current_step() == 1 else None)
    try:
        for s in range(3):
            guard.step(_batch(s, ctx.rank))
    except CorruptionDetected as exc:
        return f"CorruptionDetected@{exc.incident.step}:{exc.write_error is not None}"
    return "finished"


@pytest.mark.timeout(120)
def test_incident_write_failure_still_raises_corruption_everywhere(tmp_path: Path) -> None:
    """When the incident directory cannot be created, every rank still raises CorruptionDetected
    (the writer's says the file was not written)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    results = run_local(_unwritable_job, node_names(3, 1), args=(str(blocker),), timeout=100)
    assert results == [
        "CorruptionDetected@1:True",
        "CorruptionDetected@1:False",
        "CorruptionDetected@1:False",
    ]


# -- frozen parameters and buffers --------------------------------------------------------------


def _frozen_job(ctx: RankContext, what: str) -> str:
    torch.manual_seed(0)
    model = DistributedDataParallel(Tiny())
    per_rank = ("scale",) if what == "per_rank_buffer" else ()
    guard = _guard(model, ctx, verify_every=100, weights_every=0, per_rank_buffers=per_rank)
    for s in range(2):
        guard.step(_batch(s, ctx.rank))
    if ctx.rank == 2:
        with torch.no_grad():
            if what == "frozen":
                model.module.base.weight[0, 0] += 1e-3
            else:
                model.module.scale[1] = 0.25
    try:
        guard.check_replicas()
    except CorruptionDetected as exc:
        return f"{exc.incident.check}:{list(exc.incident.suspect_ranks)}"
    return "passed"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["frozen", "buffer", "per_rank_buffer"])
def test_changed_frozen_weight_or_buffer_fails_check_replicas(what: str) -> None:
    """A frozen (requires_grad=False) weight or a constant buffer changed on one replica is seen by
    check_replicas(), which names that rank (and so no checkpoint is marked verified); a buffer the
    user declares per-rank is left out."""
    results = run_local(_frozen_job, node_names(3, 1), args=(what,), timeout=100)
    expected = "passed" if what == "per_rank_buffer" else "weights:[2]"
    assert results == [expected] * 3


# -- inputs -------------------------------------------------------------------------------------

Pair = namedtuple("Pair", ["x", "y"])


@dataclasses.dataclass(frozen=True)
class Sample:
    x: torch.Tensor
    y: torch.Tensor
    tag: str = "s"


class ComplexNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.complex128))
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x.to(torch.complex128) @ self.w).abs().float())


def _record_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    return (module(batch.x).squeeze(-1) - batch.y).square().mean()


def _inputs_job(ctx: RankContext, kind: str) -> list[float]:
    torch.manual_seed(0)
    dtype = torch.float64 if kind == "float64" else torch.float32
    net: nn.Module = ComplexNet() if kind == "complex" else Tiny(dtype)
    model = DistributedDataParallel(net)
    loss_fn = _record_loss if kind in ("namedtuple", "dataclass") else _loss
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    guard = Guard(model, opt, loss_fn, config=GuardConfig(verify_every=1, weights_every=1), node=ctx.node)
    losses = []
    for s in range(3):
        b = _batch(s, ctx.rank, dtype)
        batch: Any = b
        if kind == "namedtuple":
            batch = Pair(b["x"], b["y"])
        elif kind == "dataclass":
            batch = Sample(b["x"], b["y"])
        losses.append(guard.step(batch).loss)
    return losses


@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", ["float64", "complex", "namedtuple", "dataclass"])
def test_other_dtypes_and_batch_types_verify_cleanly(kind: str) -> None:
    """float64 and complex parameters, and named-tuple and dataclass batches, train and verify every
    step with no alarm."""
    results = run_local(_inputs_job, node_names(2, 1), args=(kind,), timeout=150)
    assert all(len(r) == 3 for r in results)
