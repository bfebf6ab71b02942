"""The guard on FSDP2 (``fully_shard``) and HSDP jobs: gloo ranks on CPU, simulated nodes."""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import guard_faults as gf
import pytest
import torch

from replicheck.guard import Guard, GuardConfig, PeerFailed, current_step
from replicheck.harness.jobs import JobResult, JobSpec, full_state, shard, train
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import (
    DecoderConfig,
    lm_loss,
    make_model,
    padded_batch,
    synthetic_batch,
    token_mean_loss,
    token_sum_loss,
)

TINY = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)
CHECKS = GuardConfig(verify_every=5, weights_every=5)
STEPS = 12


def run(spec: JobSpec, ranks: int) -> list[JobResult]:
    return run_local(train, node_names(ranks, 1), args=(spec,), timeout=240)


def spec(parallel: str, **kw: Any) -> JobSpec:
    kw.setdefault("guard", CHECKS)
    return JobSpec(model=TINY, batch=4, parallel=parallel, **kw)  # type: ignore[arg-type]


def incident(results: list[JobResult]) -> dict[str, Any]:
    incs = [r.incident for r in results]
    assert all(i is not None for i in incs), "every rank must raise"
    assert all(i == incs[0] for i in incs), "every rank must hold the same verdict"
    return incs[0]  # type: ignore[return-value]


def _relative_gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - v).abs().max() / v.abs().max().clamp_min(1e-30)) for k, v in b.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("parallel", "ranks"), [("fsdp", 3), ("hsdp", 4)])
def test_clean_sharded_run_is_silent_and_applies_the_unguarded_update(parallel: str, ranks: int) -> None:
    """100 clean steps (FSDP2 over 3 ranks, HSDP 2×2) raise nothing, verify every 5th step, and
    end with the same weights as the unguarded loop of the same sharding (within 1e-6)."""
    guarded = run(spec(parallel, steps=100, keep_state=True), ranks)
    plain = run(spec(parallel, steps=100, keep_state=True, guard=None), ranks)
    assert all(r.incident is None and r.last_step == 99 for r in guarded)
    assert guarded[0].verified_steps == list(range(0, 100, 5))
    assert _relative_gap(guarded[0].state, plain[0].state) <= 1e-6  # type: ignore[arg-type]
    first, last = guarded[0].losses[0], guarded[0].losses[99]
    assert last < first * 0.8, "the model must actually train"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["exact", "tolerant"])
@pytest.mark.parametrize("fault", ["forward", "backward"])
def test_compute_fault_on_one_rank_named_at_first_verification(fault: str, mode: str) -> None:
    """On FSDP2 (3 ranks, 3 nodes) a forward fault or a backward-only gradient fault on rank 1
    from step 7 is named at step 10 by the ring replay, rank 1 persistent, in both modes."""
    setup = (
        functools.partial(gf.forward_fault, rank=1, onset=7)
        if fault == "forward"
        else functools.partial(gf.grad_fault, rank=1, onset=7)
    )
    guard = GuardConfig(verify_every=5, weights_every=5, mode=mode)  # type: ignore[arg-type]
    inc = incident(run(spec("fsdp", steps=20, setup=setup, guard=guard), 3))
    assert (inc["step"], inc["check"]) == (10, "replay")
    assert inc["suspect_ranks"] == [1] and inc["suspect_nodes"] == ["node1"]
    assert inc["classification"] == "persistent"
    assert all(name.startswith(("<root>", "blocks.")) for name in inc["evidence"]["param_names"])


@pytest.mark.timeout(240)
def test_replay_only_fault_is_arbitrated_in_lockstep() -> None:
    """A fault only in rank 1's replays fails one ring pair alone; the arbitration and the re-run
    (every rank taking part in each sharded pass) name rank 1 without a hang."""
    setup = functools.partial(gf.forward_fault, rank=1, onset=5, only_pass="replay")
    inc = incident(run(spec("fsdp", steps=8, setup=setup), 4))
    assert (inc["step"], inc["check"]) == (5, "replay")
    assert inc["suspect_ranks"] == [1]
    assert inc["evidence"]["replay"]["arbitrations"], "the lone failing pair must be arbitrated"


@pytest.mark.timeout(240)
def test_non_finite_gradient_named_on_the_rank_that_produced_it() -> None:
    """A NaN in one local gradient on rank 1 (step 7, before the reduce-scatter) is named on
    rank 1 in that step, and every rank stops before the update."""
    setup = functools.partial(gf.nan_grad, rank=1, at=7)
    inc = incident(run(spec("fsdp", steps=10, setup=setup), 3))
    assert (inc["step"], inc["check"]) == (7, "gradients")
    assert inc["suspect_ranks"] == [1]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("fault", "check", "at"),
    [("optimizer", "weights", 10), ("reduced", "reduced_gradients", 7)],
)
def test_hsdp_state_faults_need_a_majority_of_replica_groups(fault: str, check: str, at: int) -> None:
    """An optimizer-update or reduced-gradient fault on rank 1 of an HSDP job is seen by comparing
    the shard across replica groups: with two groups (2×2) it is ambiguous between rank 1 and its
    replica rank 3; with three groups (3×2: a (3, 1) mesh runs no reduce-scatter and is refused)
    rank 1 is named."""
    setup = (
        functools.partial(gf.optimizer_fault, rank=1, at=7)
        if fault == "optimizer"
        else functools.partial(gf.reduced_fault, rank=1, at=7)
    )
    two = incident(run(spec("hsdp", steps=12, setup=setup, replicas=2), 4))
    assert (two["step"], two["check"]) == (at, check)
    assert two["suspect_ranks"] == [] and two["classification"] == "ambiguous"
    assert [c["rank"] for c in two["candidates"]] == [1, 3]
    three = incident(run(spec("hsdp", steps=12, setup=setup, replicas=3), 6))
    assert (three["step"], three["check"]) == (at, check)
    assert three["suspect_ranks"] == [1]


@pytest.mark.timeout(240)
def test_fsdp_reduced_gradient_changed_after_the_reduce_scatter_is_named() -> None:
    """Plain FSDP2 (3 ranks): rank 1's reduced gradient shard changed after the reduce-scatter
    (step 7) differs from the sum of every rank's input; rank 1 is named in that step."""
    setup = functools.partial(gf.reduced_fault, rank=1, at=7)
    inc = incident(run(spec("fsdp", steps=10, setup=setup), 3))
    assert (inc["step"], inc["check"]) == (7, "reduced_gradients")
    assert inc["suspect_ranks"] == [1]
    assert inc["evidence"]["reduced_gradients"]["reduce_scatter"][1] == "changed after the reduce-scatter"


@pytest.mark.timeout(240)
def test_fsdp_wrong_reduce_scatter_output_is_ambiguous() -> None:
    """Plain FSDP2 (3 ranks): a reduce-scatter that delivers a wrong sum to rank 1 (step 7) stops
    the step; the reduction runs through every rank, so the incident names none (ambiguous)."""
    setup = functools.partial(gf.reduce_scatter_fault, rank=1, at=7)
    inc = incident(run(spec("fsdp", steps=10, setup=setup), 3))
    assert (inc["step"], inc["check"]) == (7, "reduced_gradients")
    assert inc["suspect_ranks"] == [] and inc["classification"] == "ambiguous"
    assert [c["rank"] for c in inc["candidates"]] == [0, 1, 2]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("ranks", "named"), [(3, True), (2, False)])
def test_fsdp_optimizer_update_fault_is_replayed_named_and_undone(ranks: int, named: bool) -> None:
    """Plain FSDP2: a corrupted optimizer update on rank 1 from step 7 disagrees with the ring
    verifier's replay at step 10; a third rank's replay names rank 1 (persistent), with two ranks
    it is ambiguous; either way every rank's step-10 update is undone (state equals step 9's)."""
    setup = functools.partial(gf.optimizer_fault, rank=1, at=7, persistent=True)
    results = run(spec("fsdp", steps=20, setup=setup, keep_state=True), ranks)
    inc = incident(results)
    assert (inc["step"], inc["check"]) == (10, "optimizer_update")
    if named:
        assert inc["suspect_ranks"] == [1] and inc["classification"] == "persistent"
    else:
        assert inc["suspect_ranks"] == [] and [c["rank"] for c in inc["candidates"]] == [0, 1]
    before = run(spec("fsdp", steps=10, setup=setup, keep_state=True), ranks)
    assert before[0].incident is None and before[0].last_step == 9
    assert all(torch.equal(v, before[0].state[k]) for k, v in results[0].state.items())  # type: ignore[index, union-attr]


def _hooked_job(ctx: RankContext) -> tuple[str, bool]:
    """A guarded FSDP2 job whose every rank clamps weights in an optimizer step hook."""
    from replicheck.guard import UpdateReplayError

    spec_ = spec("fsdp", steps=3, setup=gf.clamp_after_step, keep_state=True)
    try:
        train(ctx, spec_)
    except UpdateReplayError as exc:
        return str(exc), True
    return "", False


@pytest.mark.timeout(240)
def test_an_update_every_replay_disputes_is_software_and_blames_no_node() -> None:
    """Plain FSDP2 (3 ranks) with a user's step hook that clamps weights: every rank's update
    differs from its replay, so every rank raises UpdateReplayError at step 0 (no incident, no
    node named) saying what to do."""
    results = run_local(_hooked_job, node_names(3, 1), timeout=200)
    assert all(raised for _, raised in results)
    assert all("replay_update=False" in msg and "No node is blamed" in msg for msg, _ in results)


def _plain_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, loss: str, micro: int, rank: int
) -> None:
    """The user's own FSDP2 loop: one backward, or token-mean accumulation over ``micro`` parts
    that divides by the step's token count once, before the last backward."""
    for s in range(STEPS):
        opt.zero_grad(set_to_none=True)
        mbs = _microbatches(padded_batch(TINY, step=s, rank=rank, batch=6), micro)
        if loss == "bf16":
            _bf16_mean(model, mbs[0]).backward()
        elif micro == 1:
            token_mean_loss(model, mbs[0]).backward()
        else:
            # Gradients of a sharded model are reduced per backward, so the token count divides
            # each part (counted from the labels first), accumulated unreduced until the last.
            tokens = sum(int((mb["labels"][:, 1:] != -100).sum()) for mb in mbs)
            for i, mb in enumerate(mbs):
                model.set_requires_gradient_sync(i == len(mbs) - 1)  # type: ignore[operator]
                (token_sum_loss(model, mb).total / tokens).backward()
        opt.step()


def _bf16_mean(module: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return token_mean_loss(module, batch).float()


def _microbatches(batch: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    return [dict(zip(batch, vals)) for vals in zip(*(v.chunk(n) for v in batch.values()))]


def _equality_job(ctx: RankContext, loss: str, micro: int, checkpointing: str) -> dict[str, float]:
    """Weights after the plain FSDP2 loop and after the guarded one, compared on every rank."""
    torch.set_num_threads(1)
    cfg = dataclasses.replace(TINY, checkpointing=checkpointing)

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = shard(make_model(cfg, seed=0), ctx.world_size)
        if micro > 1:
            # Dividing the sum (guard) or each part (the loop above) rounds differently, ~1e-7;
            # AdamW's normalisation turns that into ~1e-5 in 12 steps, SGD keeps it where it is.
            return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    plain, opt = fresh()
    start = full_state(plain)
    _plain_steps(plain, opt, loss, micro, ctx.rank)
    want = full_state(plain)
    model, opt = fresh()
    mode = "tolerant" if loss == "bf16" else "exact"
    loss_fn = _bf16_mean if loss == "bf16" else token_sum_loss
    guard = Guard(
        model, opt, loss_fn, config=GuardConfig(verify_every=5, weights_every=5, mode=mode), node=ctx.node
    )
    verified = [
        s
        for s in range(STEPS)
        if guard.step(*_microbatches(padded_batch(TINY, step=s, rank=ctx.rank, batch=6), micro)).verified
    ]
    got = full_state(model)
    return {
        "rel": _relative_gap(got, want),
        "trained": max(float((want[k] - start[k]).norm() / want[k].norm()) for k in want),
        "verified": float(len(verified)),
    }


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("loss", "micro", "checkpointing"),
    [
        ("token_sum", 1, "none"),
        ("token_sum", 2, "none"),
        ("bf16", 1, "none"),
        ("token_sum", 1, "non-reentrant"),
        ("token_sum", 1, "reentrant"),
    ],
)
def test_guarded_fsdp_update_equals_the_users_loop(loss: str, micro: int, checkpointing: str) -> None:
    """Against the user's own FSDP2 loop (2 ranks, 12 steps, padded batches): a token-mean loss
    stated as a LossSum (one batch, or two micro-batches), a bf16-autocast token mean in tolerant
    mode, and activation checkpointing each end within 1e-6 relative of the plain weights."""
    for r in run_local(_equality_job, node_names(2, 1), args=(loss, micro, checkpointing), timeout=200):
        assert r["rel"] <= 1e-6, r
        assert r["trained"] > 1e-3, "the model must actually move"
        assert r["verified"] == 3


def _error_job(ctx: RankContext, where: str) -> tuple[str, int, float]:
    model = shard(make_model(TINY), ctx.world_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss(module: torch.nn.Module, batch: Any) -> torch.Tensor:
        if ctx.rank == 1 and current_step() == 2:
            if where in ("before_model", "training"):
                raise KeyError("missing field on rank 1")
            out = lm_loss(module, batch)
            if where == "after_model":
                raise ValueError("loss failed on rank 1")
            return out
        return lm_loss(module, batch)

    guard = Guard(
        model,
        opt,
        loss,
        config=GuardConfig(verify_every=2 if where not in ("training", "hook_ordinary") else 100),
        node=ctx.node,
    )
    if where in ("hook", "hook_ordinary") and ctx.rank == 0:

        def hook(index: int, t: torch.Tensor) -> None:
            if current_step() == 2:
                raise OSError("logging hook failed on rank 0")

        guard.add_reduced_gradient_hook(hook)
    t0 = time.monotonic()
    try:
        for s in range(4):
            guard.step(synthetic_batch(TINY, step=s, rank=ctx.rank, batch=4))
    except (KeyError, ValueError, OSError, PeerFailed) as exc:
        return type(exc).__name__, guard.next_step, time.monotonic() - t0
    return "finished", guard.next_step, time.monotonic() - t0


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("where", "failing", "error"),
    [
        ("before_model", 1, "KeyError"),
        ("after_model", 1, "ValueError"),
        ("training", 1, "KeyError"),
        ("hook", 0, "OSError"),
        ("hook_ordinary", 0, "OSError"),
    ],
)
def test_error_on_one_rank_ends_every_sharded_rank(where: str, failing: int, error: str) -> None:
    """An error in loss_fn on one rank (before it calls the sharded model, or after, in a
    verification step's probe pass; before it, in an ordinary step's training pass) or in a
    reduced-gradient hook (of a verification step: stopped by the flag after the passes; of an
    ordinary step: by the step's row) is raised there and as PeerFailed on the others at step 2,
    without waiting for the process group's timeout."""
    for rank, (outcome, step, seconds) in enumerate(
        run_local(_error_job, node_names(3, 1), args=(where,), timeout=60)
    ):
        assert outcome == (error if rank == failing else "PeerFailed"), (rank, outcome)
        assert step == 2 and seconds < 30
