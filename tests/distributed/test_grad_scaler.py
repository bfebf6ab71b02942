"""fp16 autocast with a dynamic loss scaler (``torch.amp.GradScaler``) under the guard (issue 16,
mixed precision on DDP, FSDP2 and HSDP): an overflow the scaler skips is no incident when another
rank reproduces it, every rank skips it exactly as the scaler does, the applied updates equal the
plain loop's, and an overflow that only one rank sees and no other can reproduce is corruption,
named."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.faults import Fault
from replicheck.guard import CorruptionDetected, Guard, GuardConfig
from replicheck.harness.launch import RankContext, node_names, run_local

STEPS = 12
# Step 0 overflows on every rank (2**40), the scaler backs off to 2**10 where nothing overflows,
# and after 4 good steps grows back to 2**40: every decision is far from the edge.
SCALER = dict(init_scale=2.0**40, backoff_factor=2.0**-30, growth_factor=2.0**30, growth_interval=4)
POISONED_STEP = 2


def _loss(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        out = module(batch["x"]).squeeze(-1)
    return (out.float() - batch["y"]).square().mean()


def _batch(step: int, rank: int, poison: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step * 10 + rank)
    x = torch.randn(8, 4, generator=g)
    y = x.sum(-1)
    if poison and step == POISONED_STEP and rank == 1:
        # A far-off label: its fp16 output gradient overflows at any scale ≥ 2**10 on any device.
        y[5] = 1e5
    return {"x": x, "y": y}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))


def _wrapped(parallel: str, world_size: int) -> nn.Module:
    """The model under DDP, or sharded with FSDP2 (each layer, then the root) on a 1-D mesh, or
    with HSDP: the same on a 2-D mesh of two replica groups, each sharding over half the ranks."""
    if parallel == "ddp":
        return DistributedDataParallel(_model())
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    if parallel == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world_size,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # type: ignore[no-any-return]


def _two_loops(parallel: str, world_size: int) -> tuple[Any, ...]:
    """The plain loop's model, SGD and scaler, then the same three for the guarded loop."""
    out: list[Any] = []
    for _ in range(2):
        model = _wrapped(parallel, world_size)
        out += [model, torch.optim.SGD(model.parameters(), lr=0.05), torch.amp.GradScaler("cpu", **SCALER)]
    return tuple(out)


def _equality_job(ctx: RankContext, poison: bool, parallel: str) -> dict[str, Any]:
    plain, plain_opt, plain_scaler, guarded, opt, scaler = _two_loops(parallel, ctx.world_size)
    guard = Guard(
        guarded,
        opt,
        _loss,
        # probe="extra" (the default for a loss of unknown reduction): the training batch runs as
        # one pass, as in the plain loop, so the fp16 rounding of its gradient is the same.
        config=GuardConfig(verify_every=3, weights_every=3),
        node=ctx.node,
        scaler=scaler,
    )
    plain_scales, scales, skipped, plain_skipped = [], [], [], []
    for s in range(STEPS):
        b = _batch(s, ctx.rank, poison)
        plain_opt.zero_grad(set_to_none=True)
        plain_scaler.scale(_loss(plain, b)).backward()
        before = plain_scaler.get_scale()
        plain_scaler.step(plain_opt)
        plain_scaler.update()
        plain_scales.append(plain_scaler.get_scale())
        if plain_scales[-1] < before:  # the scaler backs off exactly when it skipped the step
            plain_skipped.append(s)
        result = guard.step(b)
        scales.append(scaler.get_scale())
        if result.skipped:
            skipped.append(s)
    diffs = [
        float((_whole(a) - _whole(b)).norm() / _whole(b).norm())
        for a, b in zip(guarded.parameters(), plain.parameters(), strict=True)
    ]
    clipped = _clipped_with_scaler(ctx, poison) if parallel == "ddp" else None
    return {
        "clipped": clipped,
        "diff": max(diffs),
        "scales": scales,
        "plain_scales": plain_scales,
        "skipped": skipped,
        "plain_skipped": plain_skipped,
    }


CLIP = 0.05


def _clipped_with_scaler(ctx: RankContext, poison: bool) -> dict[str, Any]:
    """The plain AMP loop's order (scale, backward, ``unscale_``, ``clip_grad_norm_``,
    ``scaler.step``, ``update``) against ``GuardConfig(max_grad_norm=...)`` with ``scaler=``."""
    plain, plain_opt, plain_scaler, guarded, opt, scaler = _two_loops("ddp", ctx.world_size)
    guard = Guard(
        guarded,
        opt,
        _loss,
        config=GuardConfig(verify_every=3, max_grad_norm=CLIP),
        node=ctx.node,
        scaler=scaler,
    )
    plain_norms: list[float | None] = []
    norms: list[float | None] = []
    for s in range(STEPS):
        b = _batch(s, ctx.rank, poison)
        plain_opt.zero_grad(set_to_none=True)
        plain_scaler.scale(_loss(plain, b)).backward()
        plain_scaler.unscale_(plain_opt)
        norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP))
        before = plain_scaler.get_scale()
        plain_scaler.step(plain_opt)
        plain_scaler.update()
        plain_norms.append(None if plain_scaler.get_scale() < before else norm)
        norms.append(guard.step(b).grad_norm)
    diff = max(
        float((a - b).norm() / b.norm())
        for a, b in zip(guarded.parameters(), plain.parameters(), strict=True)
    )
    return {"diff": diff, "norms": norms, "plain_norms": plain_norms}


# DDP and FSDP2 on 3 ranks; HSDP on a 2×2 mesh (two replica groups of two shards).
PARALLEL = [("ddp", 3), ("fsdp", 3), ("hsdp", 4)]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("parallel", "ranks"), PARALLEL)
@pytest.mark.parametrize("poison", [False, True])
def test_scaler_overflows_are_skipped_like_the_plain_loop_without_an_incident(
    poison: bool, parallel: str, ranks: int
) -> None:
    """Every-rank overflows (step 0 and whenever the scale grows back) and, with ``poison``, a
    one-rank overflow that another rank reproduces (a far-off label at step 2): no incident, every
    rank skips exactly the steps the plain scaler loop (DDP, FSDP2, or HSDP 2×2) skips, the scale
    follows the plain loop's, and the weights after 12 steps equal the plain loop's within 1e-6
    relative. Under DDP, ``max_grad_norm`` with the scaler clips after ``unscale_`` as the plain
    AMP loop does: the same weights, and ``grad_norm`` is ``clip_grad_norm_``'s return on every
    applied step (``None`` on a skipped one)."""
    results = run_local(_equality_job, node_names(ranks, 1), args=(poison, parallel), timeout=180)
    for r in results:
        assert r["scales"] == r["plain_scales"]
        assert r["skipped"] == r["plain_skipped"]
        assert r["skipped"][0] == 0 and len(r["skipped"]) >= 2
        assert (POISONED_STEP in r["skipped"]) == poison
        assert r["diff"] < 1e-6
        if parallel == "ddp":
            # Clipping sees the unscaled gradient: the plain AMP loop's unscale_ then clip order.
            c = r["clipped"]
            assert c["diff"] < 1e-6
            assert [n is None for n in c["norms"]] == [n is None for n in c["plain_norms"]]
            applied = [(g, w) for g, w in zip(c["norms"], c["plain_norms"]) if w is not None]
            assert len(applied) >= STEPS // 2 and sum(w > CLIP for _, w in applied) >= len(applied) // 2
            for got, want in applied:
                assert got == pytest.approx(want, rel=1e-4)
    assert all(r["scales"] == results[0]["scales"] for r in results)


def _fault_job(ctx: RankContext, parallel: str) -> dict[str, Any] | None:
    model = _wrapped(parallel, ctx.world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    guard = Guard(
        model,
        opt,
        _loss,
        config=GuardConfig(verify_every=5, loss_reduction="sample_mean"),
        node=ctx.node,
        scaler=scaler,
    )
    Fault.at_weight_gradient("0.weight").persistent(from_step=3).inf().on_rank(1).install(
        model, optimizer=opt, guard=guard
    )
    try:
        for s in range(6):
            guard.step(_batch(s, ctx.rank, poison=False))
    except CorruptionDetected as exc:
        return exc.incident.to_dict()
    return None


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("parallel", "ranks"), PARALLEL)
def test_an_overflow_only_one_rank_sees_is_corruption_named_on_that_rank(parallel: str, ranks: int) -> None:
    """An inf in one rank's weight gradient that its peer cannot reproduce from the same passes is
    not a scaler overflow: every rank raises CorruptionDetected at that step naming rank 1 (under
    DDP, and under FSDP2 and HSDP 2×2 where the check is in the reduce-scatter)."""
    results = run_local(_fault_job, node_names(ranks, 1), args=(parallel,), timeout=180)
    inc = results[0]
    assert inc is not None and all(r == inc for r in results)
    assert (inc["step"], inc["check"]) == (3, "gradients")
    assert inc["suspect_ranks"] == [1] and inc["suspect_nodes"] == ["node1"]
    assert inc["classification"] == "persistent"


def test_a_scaler_of_the_wrong_type_is_refused() -> None:
    """scaler= takes a torch.amp.GradScaler; anything else is a GuardConfigError naming the type,
    raised before any collective (here in a single process without a process group)."""
    from replicheck.guard import GuardConfigError

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(GuardConfigError, match="torch.amp.GradScaler, got dict"):
        Guard(model, opt, _loss, node="solo", scaler={"scale": 1.0})  # type: ignore[arg-type]
