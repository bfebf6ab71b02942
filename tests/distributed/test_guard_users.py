"""Where users train (issue 24, guard side): clipping and the gradient norm, gradient edits and
optimizer pre-hooks in any order, dropout under the automatic probe, a token count summed over
ranks, misuse refused before it can look like hardware, and the guard's state in checkpoints.
gloo ranks on CPU, each run against the plain loop it replaces."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from replicheck.checkpoint import CheckpointStore
from replicheck.guard import (
    Guard,
    GuardConfig,
    GuardConfigError,
    GuardMisuseError,
    LossSum,
    current_pass,
    current_step,
    is_replaying,
)
from replicheck.harness.jobs import full_state, shard
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig, make_model, padded_batch, token_mean_loss

STEPS = 12
TINY = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)


class _Net(nn.Module):
    """A small MLP, with dropout or without."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.drop(torch.relu(self.inp(x))))


def _net(dropout: float) -> nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _Net(dropout)


def _batch(step: int, rank: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {"x": torch.randn(n, 8, generator=g), "y": torch.randn(n, 4, generator=g)}


def _mse(module: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.mse_loss(module(batch["x"]), batch["y"])


def _tokens(step: int, rank: int) -> dict[str, torch.Tensor]:
    """A batch whose items (``mask``) are uneven across ranks and steps."""
    b = _batch(step, rank)
    keep = 2 + (step + 3 * rank) % 5
    b["mask"] = (torch.arange(6) < keep).to(torch.float32)
    return b


def _token_sum(module: nn.Module, batch: dict[str, torch.Tensor]) -> LossSum:
    per = ((module(batch["x"]) - batch["y"]) ** 2).mean(1) * batch["mask"]
    return LossSum(total=per.sum(), count=batch["mask"].sum())


def _probe_steps(model: nn.Module) -> list[int]:
    """Steps whose probe ran as part of the real batch (split): a probe forward outside a
    replay whose output the backward then reached (a split try given up has no backward)."""
    split: list[int] = []

    def seen(_m: nn.Module, _i: Any, o: torch.Tensor) -> None:
        if current_pass() == "probe" and not is_replaying():
            step = current_step()
            o.register_hook(lambda g: split.append(step))

    model.register_forward_hook(seen)
    return split


def _rel(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want])
    return float(diff.norm() / torch.cat([want[k].flatten() for k in want]).norm())


def _ddp_job(ctx: RankContext) -> dict[str, Any]:
    """Rank part of the DDP tests: plain loops and their guarded equivalents."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}

    def fresh(dropout: float = 0.2) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        ddp = DistributedDataParallel(_net(dropout))
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-2)

    # -- the judged figure: dropout, LinearLR, clipping at 0.05 ---------------------------------
    model, opt = fresh()
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=STEPS)
    torch.manual_seed(100 + ctx.rank)
    plain_norms = []
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        _mse(model, _batch(s, ctx.rank)).backward()
        plain_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)))
        opt.step()
        sched.step()
    want = {k: v.clone() for k, v in model.module.state_dict().items()}

    model, opt = fresh()
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=1.0, end_factor=0.1, total_iters=STEPS)
    split = _probe_steps(model.module)
    guard = Guard(
        model,
        opt,
        _mse,
        config=GuardConfig(verify_every=3, weights_every=3, loss_reduction="sample_mean", max_grad_norm=0.05),
        node=ctx.node,
    )
    torch.manual_seed(100 + ctx.rank)
    norms, verified = [], []
    for s in range(STEPS):
        r = guard.step(_batch(s, ctx.rank))
        norms.append(r.grad_norm)
        verified.append(r.verified)
        sched.step()
    out["clip"] = {
        "rel": _rel(model.module.state_dict(), want),
        "norms": norms,
        "plain_norms": plain_norms,
        "split": split,
        "verified": verified,
        "clipped": sum(n > 0.05 for n in plain_norms),
    }

    # -- dropout, default config: the same bits as the plain loop, probe extra ------------------
    model, opt = fresh()
    torch.manual_seed(7 + ctx.rank)
    for s in range(6):
        opt.zero_grad(set_to_none=True)
        _mse(model, _batch(s, ctx.rank)).backward()
        opt.step()
    want = {k: v.clone() for k, v in model.module.state_dict().items()}
    results = {}
    for name, dropout in (("dropout", 0.2), ("none", 0.0)):
        model, opt = fresh(dropout)
        split = _probe_steps(model.module)
        guard = Guard(model, opt, _mse, config=GuardConfig(verify_every=2, loss_reduction="sample_mean"))
        torch.manual_seed(7 + ctx.rank)
        for s in range(6):
            guard.step(_batch(s, ctx.rank))
        results[name] = {"split": split, "state": model.module.state_dict()}
    out["dropout"] = {
        "equal": all(torch.equal(results["dropout"]["state"][k], v) for k, v in want.items()),
        "split": results["dropout"]["split"],
        "split_without": results["none"]["split"],
    }

    # -- a LossSum over the global item count -----------------------------------------------------
    model, opt = fresh(0.0)
    world = dist.get_world_size()
    for s in range(6):
        opt.zero_grad(set_to_none=True)
        b = _tokens(s, ctx.rank)
        got = _token_sum(model, b)
        count = b["mask"].sum().double()
        dist.all_reduce(count)
        (got.total * (world / float(count))).backward()
        opt.step()
    want = {k: v.clone() for k, v in model.module.state_dict().items()}
    model, opt = fresh(0.0)
    split = _probe_steps(model.module)
    guard = Guard(model, opt, _token_sum, config=GuardConfig(verify_every=2, global_item_count=True))
    losses = [guard.step(_tokens(s, ctx.rank)).loss for s in range(6)]
    out["global"] = {
        "rel": _rel(model.module.state_dict(), want),
        "equal": all(torch.equal(model.module.state_dict()[k], v) for k, v in want.items()),
        "split": split,
        "losses": losses,
    }
    return out


@pytest.fixture(scope="module")
def ddp_results() -> list[dict[str, Any]]:
    return run_local(_ddp_job, node_names(2, 1), timeout=240)


@pytest.mark.timeout(300)
def test_clipping_applies_the_plain_loops_clipped_update_and_reports_the_norm(
    ddp_results: list[dict[str, Any]],
) -> None:
    """Dropout, a LinearLR schedule stepped after guard.step and GuardConfig(max_grad_norm=0.05)
    over 12 steps (verify every 3, 2 ranks): the same update as the plain loop with
    clip_grad_norm_(..., 0.05) (1e-6 relative, whole model), and StepResult.grad_norm equals
    clip_grad_norm_'s return within 1e-4 relative on every step and rank."""
    for r in ddp_results:
        c = r["clip"]
        assert c["rel"] <= 1e-6, c["rel"]
        assert c["clipped"] >= 6, "the bound must actually clip"
        assert c["verified"] == [s % 3 == 0 for s in range(STEPS)]
        for got, want in zip(c["norms"], c["plain_norms"], strict=True):
            assert got is not None and abs(got - want) <= 1e-4 * want, (got, want)
        assert c["split"] == [], "dropout: the probe must be extra"


def test_dropout_makes_auto_choose_extra_and_keeps_the_bits(ddp_results: list[dict[str, Any]]) -> None:
    """A model with dropout under the default config (probe auto): the guarded weights equal the
    plain loop's bit for bit after 6 steps (the training pass's random stream untouched), and
    the probe is never split; the same model without dropout still splits on every verification."""
    for r in ddp_results:
        d = r["dropout"]
        assert d["equal"]
        assert d["split"] == []
        assert d["split_without"] == [0, 2, 4]


def test_global_item_count_splits_exactly(ddp_results: list[dict[str, Any]]) -> None:
    """GuardConfig(global_item_count=True) with a LossSum of uneven counts across ranks: the
    update equals the plain loop that divides each rank's sum by the all-reduced count (times
    the world size), the probe splits from step 2 on, and the ranks' losses average to the
    global mean."""
    for r in ddp_results:
        g = r["global"]
        assert g["rel"] <= 1e-6, g["rel"]
        assert g["split"] == [2, 4]


def _misuse_job(ctx: RankContext, directory: str) -> dict[str, Any]:
    """Rank part of the misuse, edit-order, wrapper and checkpoint tests."""
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    model = DistributedDataParallel(_net(0.0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    class Wrapped:
        """What Accelerate's AcceleratedOptimizer looks like: .optimizer, .scaler, delegation."""

        def __init__(self, optimizer: torch.optim.Optimizer, scaler: object = None) -> None:
            self.optimizer, self.scaler = optimizer, scaler

        def step(self) -> None:
            self.optimizer.step()

        def zero_grad(self, set_to_none: bool = True) -> None:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    try:
        Guard(model, Wrapped(opt, scaler=object()), _mse, node=ctx.node)  # type: ignore[arg-type]
        out["scaler_wrapper"] = ""
    except GuardConfigError as exc:
        out["scaler_wrapper"] = str(exc)
    try:
        Guard(model, object(), _mse, node=ctx.node)  # type: ignore[arg-type]
        out["not_optimizer"] = ""
    except GuardConfigError as exc:
        out["not_optimizer"] = str(exc)

    wrapper = Wrapped(opt)
    seen: dict[str, float] = {}

    def edit(params: Any) -> None:
        seen["edit"] = float(torch.nn.utils.get_total_norm([p.grad for p in params]))

    def pre_hook(_opt: Any, _a: Any, _k: Any) -> None:
        seen["pre_hook"] = float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]))

    opt.register_step_pre_hook(pre_hook)
    guard = Guard(model, wrapper, _mse, config=GuardConfig(max_grad_norm=1e-3), node=ctx.node)  # type: ignore[arg-type]
    remove = guard.add_gradient_edit(edit)
    r = guard.step(_batch(0, ctx.rank))
    out["order"] = {"edit": seen["edit"], "pre_hook": seen["pre_hook"], "norm": r.grad_norm}
    remove()
    seen.clear()
    guard.step(_batch(1, ctx.rank))
    out["removed"] = "edit" not in seen
    try:
        wrapper.step()
        out["wrapper_step"] = ""
    except GuardMisuseError as exc:
        out["wrapper_step"] = str(exc)

    ran = []
    model.module.register_forward_hook(lambda *_: ran.append(1))
    with model.no_sync():
        try:
            guard.step(_batch(2, ctx.rank))
            out["no_sync"] = ""
        except GuardMisuseError as exc:
            out["no_sync"] = str(exc)
    out["passes_in_no_sync"] = len(ran)

    # The guard's state travels with the checkpoint; a fresh guard over a trained optimizer warns.
    store = CheckpointStore(directory)
    guard.step(_batch(2, ctx.rank))
    store.save(2, model, opt, guard=guard)
    state = guard.state_dict()
    model2 = DistributedDataParallel(_net(0.0))
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    guard2 = Guard(model2, opt2, _mse, node=ctx.node)
    store.load(store.resume_point(), model2, opt2, guard=guard2)
    out["restored"] = guard2.state_dict() == state and guard2.next_step == 3
    model3 = DistributedDataParallel(_net(0.0))
    opt3 = torch.optim.AdamW(model3.parameters(), lr=1e-2)
    opt3.load_state_dict(opt2.state_dict())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh = Guard(model3, opt3, _mse, node=ctx.node)
        fresh.step(_batch(3, ctx.rank))
    out["fresh_warning"] = [str(w.message) for w in caught if "restarts" in str(w.message)]
    return out


@pytest.mark.timeout(200)
def test_misuse_is_refused_and_edits_run_in_their_order(tmp_path: Path) -> None:
    """DDP, 2 ranks: a wrapper with its own scaler and a non-optimizer are refused with
    GuardConfigError; a delegating wrapper is unwrapped (its step() then refused by the gate);
    a gradient edit sees the unclipped gradient and a user pre-hook the clipped one, its remover
    works; guard.step inside ddp.no_sync() raises GuardMisuseError on every rank before any pass;
    CheckpointStore.save(guard=...) / load(guard=...) restores the guard's state, and a guard
    starting at step 0 over an optimizer with state warns that the schedule restarts."""
    results = run_local(_misuse_job, node_names(2, 1), args=(str(tmp_path),), timeout=180)
    for r in results:
        assert "own" in r["scaler_wrapper"] and "scaler=" in r["scaler_wrapper"]
        assert "torch.optim.Optimizer" in r["not_optimizer"]
        order = r["order"]
        assert order["edit"] == pytest.approx(order["norm"], rel=1e-6) and order["edit"] > 1e-3
        assert order["pre_hook"] <= 1e-3 * (1 + 1e-5)
        assert r["removed"]
        assert "outside Guard.step()" in r["wrapper_step"]
        assert "no_sync" in r["no_sync"] and "guard.step(mb1, mb2, ...)" in r["no_sync"]
        assert r["passes_in_no_sync"] == 0
        assert r["restored"]
        assert len(r["fresh_warning"]) == 1 and "load_state_dict" in r["fresh_warning"][0]


def _fsdp_job(ctx: RankContext) -> dict[str, Any]:
    """Rank part of the FSDP2 tests: a clipping pre-hook registered after the guard, and the
    guard's own clipping, each against the plain FSDP2 loop."""
    torch.set_num_threads(1)
    steps = 4

    def fresh() -> tuple[nn.Module, torch.optim.Optimizer]:
        model = shard(make_model(TINY, seed=0), ctx.world_size)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def clip(model: nn.Module) -> Any:
        def hook(*_: Any) -> None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

        return hook

    model, opt = fresh()
    opt.register_step_pre_hook(clip(model))
    norms = []
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        token_mean_loss(model, padded_batch(TINY, step=s, rank=ctx.rank, batch=4)).backward()
        norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).full_tensor()))
        opt.step()
    want = full_state(model)
    out: dict[str, Any] = {"plain_norms": norms}

    model, opt = fresh()
    guard = Guard(model, opt, token_mean_loss, config=GuardConfig(verify_every=1), node=ctx.node)
    opt.register_step_pre_hook(clip(model))  # after the guard: it must run before the record
    for s in range(steps):
        guard.step(padded_batch(TINY, step=s, rank=ctx.rank, batch=4))
    out["hook_rel"] = _rel(full_state(model), want)

    model, opt = fresh()
    guard = Guard(model, opt, token_mean_loss, config=GuardConfig(verify_every=1, max_grad_norm=0.05))
    got = [guard.step(padded_batch(TINY, step=s, rank=ctx.rank, batch=4)).grad_norm for s in range(steps)]
    out["clip_rel"] = _rel(full_state(model), want)
    out["norms"] = got

    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        guard.step(padded_batch(TINY, step=steps, rank=ctx.rank, batch=4))
        out["sync_off"] = ""
    except GuardMisuseError as exc:
        out["sync_off"] = str(exc)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_fsdp2_user_pre_hook_after_the_guard_and_clipping(ranks: int) -> None:
    """Plain FSDP2 (2 and 3 ranks, every step verified, update replay on): a clipping optimizer
    pre-hook registered after the guard is silent and applies the plain loop's update; the
    guard's own max_grad_norm (DTensor total norm) gives the same update and the plain norm;
    set_requires_gradient_sync(False) left on is refused with GuardMisuseError."""
    for r in run_local(_fsdp_job, node_names(ranks, 1), timeout=240):
        assert r["hook_rel"] <= 1e-6, r["hook_rel"]
        assert r["clip_rel"] <= 1e-6, r["clip_rel"]
        for got, want in zip(r["norms"], r["plain_norms"], strict=True):
            assert abs(got - want) <= 1e-4 * want, (got, want)
        assert "set_requires_gradient_sync" in r["sync_off"]
