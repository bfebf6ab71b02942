"""The guard on real multi-process gloo jobs with simulated nodes and injected faults."""

from __future__ import annotations

import dataclasses
import functools

import guard_faults as gf
import pytest
import torch

from replicheck.guard import GuardConfig
from replicheck.harness.jobs import JobResult, JobSpec, train
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig

TINY = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16)


def run(spec: JobSpec, nodes: list[str]) -> list[JobResult]:
    return run_local(train, nodes, args=(spec,), timeout=240)


def spec(**kw: object) -> JobSpec:
    guard = kw.pop("guard", GuardConfig(verify_every=10, weights_every=10))
    return JobSpec(model=TINY, batch=4, guard=guard, **kw)  # type: ignore[arg-type]


def incident(results: list[JobResult]) -> dict:
    incs = [r.incident for r in results]
    assert all(i is not None for i in incs), "every rank must raise"
    assert all(i == incs[0] for i in incs), "every rank must hold the same verdict"
    return incs[0]  # type: ignore[return-value]


@pytest.mark.timeout(300)
def test_clean_run_has_no_alarm_and_tracks_the_unguarded_loop() -> None:
    """100 clean steps on 3 nodes raise nothing and the loss curve matches the plain DDP loop."""
    nodes = node_names(3, 1)
    guarded = run(spec(steps=100, guard=GuardConfig(verify_every=5, weights_every=5)), nodes)
    plain = run(spec(steps=100, guard=None), nodes)
    assert all(r.incident is None and r.last_step == 99 for r in guarded)
    assert guarded[0].verified_steps == list(range(0, 100, 5))
    g = torch.tensor([guarded[0].losses[s] for s in range(100)])
    p = torch.tensor([plain[0].losses[s] for s in range(100)])
    assert torch.allclose(g, p, rtol=1e-3, atol=1e-4), (g - p).abs().max()
    assert g[-10:].mean() < g[:10].mean() * 0.8, "the model must actually train"


@pytest.mark.timeout(200)
def test_one_guarded_step_applies_the_unguarded_update() -> None:
    """A verification step (probe split from the batch) applies the same update as a plain step."""
    nodes = node_names(2, 1)
    guarded = run(spec(steps=1, keep_state=True, guard=GuardConfig(verify_every=1, weights_every=1)), nodes)
    plain = run(spec(steps=1, keep_state=True, guard=None), nodes)
    assert guarded[0].verified_steps == [0]
    for name, value in plain[0].state.items():  # type: ignore[union-attr]
        assert torch.allclose(guarded[0].state[name], value, rtol=1e-5, atol=1e-6), name  # type: ignore[index]


@pytest.mark.timeout(240)
def test_persistent_forward_fault_stopped_at_first_verification() -> None:
    """A fault from step 23 is named at step 30 (replay) with its node, and step 30 is not applied."""
    nodes = node_names(2, 2)
    fault = functools.partial(gf.forward_fault, rank=1, onset=23)
    results = run(spec(steps=40, setup=fault, keep_state=True), nodes)
    inc = incident(results)
    assert (inc["step"], inc["check"]) == (30, "replay")
    assert inc["suspect_ranks"] == [1] and inc["suspect_nodes"] == ["node0"]
    assert inc["classification"] == "persistent"
    assert inc["last_verified_step"] == 20
    ref = run(spec(steps=30, setup=fault, keep_state=True), nodes)
    for r in results:
        for name, value in ref[r.rank].state.items():  # type: ignore[union-attr]
            assert torch.equal(r.state[name], value), (r.rank, name)  # type: ignore[index]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", ["exact", "tolerant"])
def test_backward_only_gradient_fault_caught_at_first_verification(mode: str) -> None:
    """A weight-gradient-only fault is caught at the first verification step after onset."""
    fault = functools.partial(gf.grad_fault, rank=2, onset=3)
    guard = GuardConfig(verify_every=5, weights_every=5, mode=mode)  # type: ignore[arg-type]
    if mode == "tolerant":
        # Every rank's kernels are noisy; exact mode would alarm on this noise.
        fault = functools.partial(gf.with_noise, rel=1e-6, inner=fault)
    results = run(spec(steps=12, guard=guard, setup=fault), node_names(3, 1))
    inc = incident(results)
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (5, "replay", [2])


@pytest.mark.timeout(200)
def test_tolerant_mode_does_not_alarm_on_kernel_noise() -> None:
    """Tolerant mode stays quiet under simulated kernel noise that would break exact digests."""
    setup = functools.partial(gf.activation_noise, rel=1e-6)
    guard = GuardConfig(verify_every=1, weights_every=1, mode="tolerant")
    results = run(spec(steps=30, guard=guard, setup=setup), node_names(3, 1))
    assert all(r.incident is None and r.last_step == 29 for r in results)
    exact = run(spec(steps=3, guard=GuardConfig(verify_every=1), setup=setup), node_names(3, 1))
    assert incident(exact)["check"] == "replay", "the noise must be real enough to break exact mode"


@pytest.mark.timeout(200)
def test_every_rank_holds_one_incident_time_whatever_its_clock() -> None:
    """Ranks whose clocks differ (or that reach the verdict in different seconds) hold one
    identical incident: its time is agreed, not read from each rank's clock."""
    setups = [
        functools.partial(gf.forward_fault, rank=1, onset=3),
        functools.partial(gf.skewed_clock, rank=2),
    ]
    guard = GuardConfig(verify_every=5, weights_every=5)
    results = run(
        spec(steps=8, guard=guard, setup=functools.partial(gf.chain, setups=setups)), node_names(3, 1)
    )
    inc = incident(results)
    assert inc["step"] == 5 and not inc["time"].startswith("2001")


@pytest.mark.timeout(200)
def test_optimizer_update_fault_named_at_next_check() -> None:
    """A corrupted optimizer update on one rank is named at the next weights/verification step."""
    fault = functools.partial(gf.optimizer_fault, rank=1, at=7)
    results = run(
        spec(steps=15, setup=fault, guard=GuardConfig(verify_every=10, weights_every=5)), node_names(3, 1)
    )
    inc = incident(results)
    assert inc["step"] == 10
    assert inc["check"] == "weights" and inc["suspect_ranks"] == [1]
    assert "replay" in inc["checks_failed"] and inc["evidence"]["replay"]["suspects"] == [1]


@pytest.mark.timeout(200)
def test_optimizer_fault_with_two_ranks_blames_nobody() -> None:
    """With two replicas a corrupted update cannot be attributed: ambiguous, no healthy rank blamed."""
    fault = functools.partial(gf.optimizer_fault, rank=1, at=2)
    results = run(
        spec(steps=8, setup=fault, guard=GuardConfig(verify_every=5, weights_every=5)), node_names(2, 1)
    )
    inc = incident(results)
    assert inc["step"] == 5 and inc["suspect_ranks"] == []
    assert inc["classification"] == "ambiguous" and sorted(c["rank"] for c in inc["candidates"]) == [0, 1]


@pytest.mark.timeout(200)
def test_reduced_gradient_fault_caught_on_the_same_step() -> None:
    """Corruption of one rank's reduced gradient is caught on that step, naming that rank."""
    fault = functools.partial(gf.reduced_fault, rank=2, at=4)
    results = run(spec(steps=10, setup=fault), node_names(3, 1))
    inc = incident(results)
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (4, "reduced_gradients", [2])


@pytest.mark.timeout(200)
def test_one_shot_probe_fault_is_transient() -> None:
    """A fault that hits only the rank's own probe pass once is named and classified transient."""
    fault = functools.partial(gf.forward_fault, rank=0, onset=10, only_pass="probe", once=True)
    results = run(spec(steps=15, setup=fault), node_names(3, 1))
    inc = incident(results)
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (10, "replay", [0])
    assert inc["classification"] == "transient"
    assert inc["evidence"]["replay"]["arbitrations"][0]["odd_one_out"] == 0


@pytest.mark.timeout(200)
def test_nan_local_gradient_names_producing_rank() -> None:
    """A NaN in one rank's local gradient fires the gradients check naming that rank."""
    fault = functools.partial(gf.nan_grad, rank=1, at=3)
    results = run(spec(steps=8, setup=fault), node_names(2, 2))
    inc = incident(results)
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (3, "gradients", [1])
    assert inc["classification"] == "transient"


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("nodes", "per_node", "bad", "expect"),
    [(3, 1, 1, [1]), (2, 2, 2, [2]), (2, 1, 1, [])],
    ids=["3 ranks on 3 nodes", "4 ranks on 2 nodes", "2 ranks"],
)
def test_attribution(nodes: int, per_node: int, bad: int, expect: list[int]) -> None:
    """A persistent fault is attributed to its rank with 3 or 4 ranks and ambiguous with 2."""
    fault = functools.partial(gf.forward_fault, rank=bad, onset=0)
    results = run(spec(steps=3, setup=fault, guard=GuardConfig(verify_every=1)), node_names(nodes, per_node))
    inc = incident(results)
    assert inc["step"] == 0 and inc["check"] == "replay"
    assert inc["suspect_ranks"] == expect
    if expect:
        assert inc["classification"] == "persistent"
        assert inc["suspect_nodes"] == [f"node{bad // per_node}"]
    else:
        assert inc["classification"] == "ambiguous"


@pytest.mark.timeout(200)
def test_gradient_accumulation_verifies_and_trains() -> None:
    """Steps of several micro-batches verify cleanly and apply the same update as one batch."""
    guard = GuardConfig(verify_every=1, weights_every=1)
    accum = run(
        dataclasses.replace(spec(steps=3, guard=guard, keep_state=True), microbatches=2), node_names(2, 1)
    )
    whole = run(spec(steps=3, guard=guard, keep_state=True), node_names(2, 1))
    assert all(r.incident is None for r in accum) and accum[0].verified_steps == [0, 1, 2]
    for name, value in whole[0].state.items():  # type: ignore[union-attr]
        assert torch.allclose(accum[0].state[name], value, rtol=1e-4, atol=1e-6), name  # type: ignore[index]


@pytest.mark.timeout(200)
def test_shape_dependent_fault_is_persistent_on_rerun() -> None:
    """The gradients check re-runs the step as it ran (probe split off), so a persistent fault that
    only hits one-sample passes reproduces and is classified persistent."""
    fault = functools.partial(gf.nan_on_single_sample, rank=1, onset=3)
    results = run(spec(steps=8, setup=fault, guard=GuardConfig(verify_every=5)), node_names(3, 1))
    inc = incident(results)
    assert (inc["step"], inc["check"], inc["suspect_ranks"]) == (5, "gradients", [1])
    assert inc["classification"] == "persistent"


def _ordinary_step_grads(ctx: RankContext) -> dict[str, bool]:
    """One plain DDP step and one guarded ordinary step (no probe) on the same batch: are the
    reduced gradients and the SGD update equal bit for bit?"""
    from torch.nn.parallel import DistributedDataParallel

    from replicheck.guard import Guard
    from replicheck.harness.workloads import lm_loss, make_model, synthetic_batch

    torch.set_num_threads(1)
    batch = synthetic_batch(TINY, step=0, rank=ctx.rank, batch=4)
    plain = DistributedDataParallel(make_model(TINY, seed=0))
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    lm_loss(plain, batch).backward()
    want = [p.grad.clone() for p in plain.parameters()]  # type: ignore[union-attr]
    opt.step()
    guarded = DistributedDataParallel(make_model(TINY, seed=0))
    cfg = GuardConfig(
        start_step=1,
        verify_every=1000,
        weights_every=0,
        rebuild_buckets_on_resume=False,
        loss_reduction="sample_mean",
    )
    guard = Guard(guarded, torch.optim.SGD(guarded.parameters(), lr=0.1), lm_loss, cfg, node=ctx.node)
    assert not guard.step(batch).verified
    got = [p.grad for p in guarded.parameters()]
    return {
        "grads": all(g is not None and torch.equal(g, w) for g, w in zip(got, want)),
        "weights": all(torch.equal(a, b) for a, b in zip(guarded.parameters(), plain.parameters())),
    }


@pytest.mark.timeout(120)
def test_ordinary_step_is_bit_identical_to_plain_ddp_at_three_ranks() -> None:
    """At a world size that is not a power of two the guard's comm hook averages as DDP's reducer
    does (a multiply by the reciprocal, not a division, which rounds differently), so an ordinary
    guarded step's reduced gradient and update equal the plain DDP loop's bit for bit."""
    results = run_local(_ordinary_step_grads, node_names(3, 1), timeout=90)
    assert results == [{"grads": True, "weights": True}] * 3
