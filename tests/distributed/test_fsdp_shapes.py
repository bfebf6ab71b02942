"""FSDP2 shapes the guard must not get silently wrong: a LossSum over micro-batches (no deferred
reduce-scatter), replicated training through FSDP2 (``replicate()``, an (N, 1) HSDP mesh), world
size 1, a forward whose units run in another order than they are registered, the user's own
reduce-scatter, per-parameter meshes, and equal meshes made by separate ``fully_shard`` calls.
gloo ranks on CPU."""

from __future__ import annotations

from typing import Any

import guard_faults as gf
import pytest
import torch
import torch.distributed as dist

from replicheck.guard import Guard, GuardConfig, current_pass, current_step
from replicheck.guard.errors import GuardConfigError, GuardError, LossContractError
from replicheck.harness.jobs import full_state, shard
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import (
    DecoderConfig,
    lm_loss,
    make_model,
    padded_batch,
    synthetic_batch,
    token_sum_loss,
)

TINY = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
QUIET = GuardConfig(verify_every=1000, weights_every=1000)


def _microbatches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return [dict(zip(batch, vals)) for vals in zip(*(v.chunk(n) for v in batch.values()))]


def _tokens(mb: dict[str, torch.Tensor]) -> int:
    """The items ``token_sum_loss`` counts in a micro-batch: its non-padding next-token labels."""
    return int((mb["labels"][:, 1:] != -100).sum())


def _count_job(ctx: RankContext, counted: bool) -> list[int]:
    """Reduce-scatters issued by each micro-batch of a LossSum step (between one training
    forward and the next; the last one up to the step's end)."""
    torch.set_num_threads(1)
    model = shard(make_model(TINY, seed=0), ctx.world_size)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [0]
    real = dist.reduce_scatter_single

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    marks: list[int] = []

    def loss(module: torch.nn.Module, batch: Any) -> Any:
        if current_step() == 2 and current_pass() == "train":
            marks.append(calls[0])
        return token_sum_loss(module, batch)

    cfg = GuardConfig(
        verify_every=1000, weights_every=1000, check_reduced=False, item_count=_tokens if counted else None
    )
    guard = Guard(model, opt, loss, config=cfg)
    dist.reduce_scatter_single = counting  # type: ignore[assignment]
    try:
        for s in range(3):
            mbs = _microbatches(padded_batch(TINY, step=s, rank=ctx.rank, batch=6), 3)
            guard.step(*mbs)
            if s == 2:
                marks.append(calls[0])
    finally:
        dist.reduce_scatter_single = real  # type: ignore[assignment]
    return [b - a for a, b in zip(marks, marks[1:])]


@pytest.mark.timeout(120)
def test_loss_sum_micro_batches_reduce_scatter_every_pass() -> None:
    """FSDP2 with a LossSum over three micro-batches and the item count known from the batch
    (GuardConfig.item_count): each micro-batch's backward reduce-scatters every unit (3: two
    blocks and the root), none is deferred to the last, so no rank holds the whole model's
    unsharded gradient across passes (finding 2). Without it the guard still defers (the
    division by each rank's own count is known only after the last forward)."""
    for per_mb in run_local(_count_job, node_names(2, 1), args=(True,), timeout=100):
        assert per_mb == [3, 3, 3], per_mb
    for per_mb in run_local(_count_job, node_names(2, 1), args=(False,), timeout=100):
        assert per_mb == [0, 0, 3], per_mb


def _equality_job(ctx: RankContext) -> dict[str, float]:
    """Weights after the user's FSDP2 loop (token count from the labels first, each micro-batch
    reduce-scattered as it ends) and after the guarded one given the same count."""
    torch.set_num_threads(1)
    steps = 6

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = shard(make_model(TINY, seed=0), ctx.world_size)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def mbs(s: int) -> list[dict[str, torch.Tensor]]:
        return _microbatches(padded_batch(TINY, step=s, rank=ctx.rank, batch=6), 2)

    plain, opt = fresh()
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        tokens = sum(_tokens(mb) for mb in mbs(s))
        for mb in mbs(s):
            (token_sum_loss(plain, mb).total / tokens).backward()
        opt.step()
    want = full_state(plain)
    model, opt = fresh()
    guard = Guard(
        model, opt, token_sum_loss, config=GuardConfig(verify_every=3, item_count=_tokens), node=ctx.node
    )
    verified = sum(guard.step(*mbs(s)).verified for s in range(steps))
    got = full_state(model)
    rel = max(float((got[k] - want[k]).norm() / want[k].norm()) for k in want)
    return {"rel": rel, "verified": float(verified)}


@pytest.mark.timeout(120)
def test_counted_loss_sum_update_equals_the_users_per_pass_loop() -> None:
    """Reduce-scattering every micro-batch does not change what the model learns: against the
    user's own loop that divides each part by the token count and reduces every backward, the
    guarded weights end within 1e-6 relative after 6 steps (2 verified), 2 ranks."""
    for r in run_local(_equality_job, node_names(2, 1), timeout=100):
        assert r["rel"] <= 1e-6, r
        assert r["verified"] == 2


def _replicated_nan_job(ctx: RankContext, shape: str) -> tuple[str, str]:
    """A NaN gradient on rank 1 at step 1 of a replicated job run through FSDP2: refused at
    construction, an incident, or (the failure) applied silently."""
    torch.set_num_threads(1)
    model = make_model(TINY, seed=0)
    if shape == "replicate":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (ctx.world_size,), mesh_dim_names=("replicate",))
        for block in model.blocks:  # type: ignore[union-attr]
            replicate(block, mesh=mesh)
        replicate(model, mesh=mesh)
    else:
        model = shard(model, ctx.world_size, replicas=ctx.world_size)  # an (N, 1) HSDP mesh
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        guard = Guard(model, opt, lm_loss, config=GuardConfig(verify_every=1), node=ctx.node)
    except GuardConfigError as exc:
        return "refused", str(exc)
    gf.nan_grad(ctx, model, opt, guard, rank=1, at=1)
    try:
        for s in range(3):
            guard.step(synthetic_batch(TINY, step=s, rank=ctx.rank, batch=4))
    except GuardError as exc:
        return "incident", type(exc).__name__
    finite = all(bool(torch.isfinite(p.full_tensor()).all()) for p in model.parameters())  # type: ignore[operator]
    return ("finished" if finite else "silent non-finite update"), ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", ["replicate", "hsdp_n_by_1"])
def test_replicated_fsdp2_with_a_nan_on_one_rank_is_refused(shape: str) -> None:
    """torch's FSDP2-based replicate() and HSDP on a (2, 1) mesh run no reduce-scatter, where the
    guard sees each rank's gradient: the Guard refuses them at construction, saying to use
    DistributedDataParallel or a shard dimension of 2+ ranks, instead of applying rank 1's NaN
    gradient to every replica with no incident (finding 5)."""
    for outcome, msg in run_local(_replicated_nan_job, node_names(2, 1), args=(shape,), timeout=100):
        assert outcome == "refused", (outcome, msg)
        assert "DistributedDataParallel" in msg and "shard over 2 or more ranks" in msg


def _alone_job(ctx: RankContext) -> tuple[str, int | None, str, int]:
    """World size 1 FSDP2: a NaN gradient at step 2 (a verification step); and the probe's
    fingerprint entries at step 0."""
    torch.set_num_threads(1)
    model = shard(make_model(TINY, seed=0), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = Guard(model, opt, lm_loss, config=GuardConfig(verify_every=2))
    gf.nan_grad(ctx, model, opt, guard, rank=0, at=2)
    entries = 0
    try:
        for s in range(4):
            guard.step(synthetic_batch(TINY, step=s, rank=0, batch=4))
            if s == 0:
                names = guard.parallelism.fingerprint_names()  # what the probe covered
                entries = len(names or ())
    except GuardError as exc:
        return "incident", guard.next_step, type(exc).__name__, entries
    return "silent", None, "", entries


@pytest.mark.timeout(120)
def test_world_size_one_fsdp2_sees_its_gradient() -> None:
    """Single-process FSDP2 runs no reduce-scatter: the guard reads the gradient in FSDP's hook
    after the (skipped) reduction instead, so a probe fingerprints every unit (3) and a NaN
    gradient is an incident at its step rather than applied silently (finding 5)."""
    [(outcome, step, kind, entries)] = run_local(_alone_job, node_names(1, 1), timeout=100)
    assert entries == 3
    assert (outcome, step) == ("incident", 2), kind


class _Reversed(torch.nn.Module):
    """Two units registered a, b; the forward runs b first."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(self.b(x)))


def _order_job(ctx: RankContext) -> list[str]:
    """The units a failed rank all-gathers, in order, after one real forward."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from replicheck.guard.parallel import detect

    mesh = init_device_mesh("cpu", (1,))
    model = _Reversed()
    fully_shard(model.a, mesh=mesh)
    fully_shard(model.b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    par = detect(model)
    model(torch.randn(3, 4)).sum().backward()
    seen: list[str] = []
    names = {id(m): n or "<root>" for n, m in model.named_modules()}
    for m in (model, model.a, model.b):
        real = m.unshard  # type: ignore[operator]

        def spy(*args: Any, _m: Any = m, _real: Any = real, **kwargs: Any) -> Any:
            seen.append(names[id(_m)])
            return _real(*args, **kwargs)

        m.unshard = spy  # type: ignore[method-assign]
    par.join_failed_forward(skipped=False)
    return seen


@pytest.mark.timeout(60)
def test_failed_rank_replays_all_gathers_in_the_forwards_order() -> None:
    """A rank whose loss function failed before calling the model replays the forward's
    all-gathers in the order the forward ran its units (root, b, a), not in the order the
    units are registered (finding 10)."""
    [seen] = run_local(_order_job, node_names(1, 1), timeout=50)
    assert seen == ["<root>", "b", "a"]


def _construct_job(ctx: RankContext, case: str) -> tuple[str, str]:
    """Guard construction on a world-size-1 FSDP2 model of one shape; then three steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    torch.set_num_threads(1)
    model = make_model(TINY, seed=0)
    if case == "custom_reduce_scatter":
        model = shard(model, 1)

        class Mine(DefaultReduceScatter):
            """The user's own reduce-scatter (e.g. one that logs)."""

        model.blocks[0].set_custom_reduce_scatter(Mine())  # type: ignore[index, operator]
    elif case == "per_parameter_mesh":
        # One 2-D mesh: the norms' weights sharded over its second dimension only (plain FSDP),
        # the rest HSDP, so each block has two parameter groups on the same mesh.
        mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        flat = FSDPMeshInfo(mesh=mesh, shard_mesh_dim=1)

        def placement(p: torch.nn.Parameter) -> Any:
            return ShardPlacementResult(placement=Shard(0), mesh_info=flat) if p.dim() == 1 else None

        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block, mesh=mesh, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh)
    else:  # fully_shard per unit without a mesh: each call makes its own, equal, mesh
        for block in model.blocks:  # type: ignore[union-attr]
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        guard = Guard(model, opt, lm_loss, config=GuardConfig(verify_every=2))
    except GuardConfigError as exc:
        return "refused", str(exc)
    except Exception as exc:  # noqa: BLE001 - the outcome under test
        return "crashed", f"{type(exc).__name__}: {exc}"
    for s in range(3):
        guard.step(synthetic_batch(TINY, step=s, rank=0, batch=4))
    return "trained", ""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("case", "outcome", "says"),
    [
        ("custom_reduce_scatter", "refused", "set_custom_reduce_scatter"),
        ("per_parameter_mesh", "refused", "per-parameter meshes"),
        ("meshes_per_call", "trained", ""),
    ],
)
def test_fsdp2_construction_shapes(case: str, outcome: str, says: str) -> None:
    """The user's own reduce-scatter is refused with what to do, not replaced silently; a unit
    with per-parameter meshes is refused with a GuardConfigError, not a crash; units sharded by
    separate fully_shard calls without a mesh (equal meshes, distinct objects) are one mesh and
    train (finding 10)."""
    [(got, msg)] = run_local(_construct_job, node_names(1, 1), args=(case,), timeout=100)
    assert got == outcome, msg
    assert says in msg


def _miscounted_job(ctx: RankContext) -> str:
    """A world-size-1 FSDP2 LossSum step over two micro-batches whose item_count disagrees with
    the LossSum's count."""
    torch.set_num_threads(1)
    model = shard(make_model(TINY, seed=0), 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = GuardConfig(verify_every=1000, item_count=lambda mb: _tokens(mb) + 1)
    guard = Guard(model, opt, token_sum_loss, config=cfg)
    try:
        for s in range(2):
            guard.step(*_microbatches(padded_batch(TINY, step=s, rank=0, batch=6), 2))
    except LossContractError as exc:
        return str(exc)
    return "accepted"


@pytest.mark.timeout(60)
def test_item_count_that_disagrees_with_the_loss_sum_is_a_contract_error() -> None:
    """GuardConfig.item_count must count what the LossSum counts: a step where they differ
    raises LossContractError instead of training on a wrong normaliser."""
    [msg] = run_local(_miscounted_job, node_names(1, 1), timeout=50)
    assert "item_count" in msg and "LossSum.count" in msg, msg
