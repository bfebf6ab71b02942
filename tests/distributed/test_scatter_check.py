"""The reduce-scatter check of plain FSDP2 (``replicheck.guard.checks.scatter``) on real gloo
collectives: no alarm over many clean reduce-scatters of heavy-tailed gradients (float32 and
bfloat16, sum and mean, ranks' gradients independent, shared or both), and one value changed in
the collective or after it is seen at the size ``docs/sharded.md`` states."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from replicheck.guard.checks.scatter import AFTER, COLLECTIVE, OK, ScatterCheck, finding
from replicheck.harness.launch import RankContext, node_names, run_local

CALLS_PER_STEP = 3
"""Reduce-scatters per checked step (layer groups), judged together as the guard does."""


def _heavy(g: torch.Generator, n: int) -> torch.Tensor:
    """Student-t values (2 degrees of freedom: infinite variance) times lognormal magnitudes:
    many orders of magnitude, random signs."""
    t = torch.randn(n, generator=g) / (torch.randn(2, n, generator=g).square().mean(0).sqrt() + 1e-12)
    return t * torch.exp(torch.randn(n, generator=g) * 2)


def _gradient(trial: int, rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """One rank's buffer: a part shared by every rank (the same seed everywhere), a part of its
    own, mixed by a share that varies with the trial (identical ranks to independent ones), with
    exact zeros, as real gradients have."""
    shared = _heavy(torch.Generator().manual_seed(trial), n)
    own = _heavy(torch.Generator().manual_seed(trial * 1000 + rank + 1), n)
    a = (0.0, 0.5, 0.9, 1.0)[trial % 4]
    x = a * shared + (1 - a) * own
    x[torch.rand(n, generator=torch.Generator().manual_seed(trial * 7 + rank)) < 0.05] = 0
    return x.to(dtype)


def _status(check: ScatterCheck) -> int:
    s = check.status()
    return int(s) if isinstance(s, int) else int(s.item())


def _clean_steps(world: int, rank: int, steps: int) -> tuple[list[int], float, int]:
    """``steps`` checked steps of :data:`CALLS_PER_STEP` reduce-scatters each: every status, the
    largest |difference| / allowance seen, the reduce-scatters run."""
    statuses, worst, calls = [], 0.0, 0
    check = ScatterCheck()
    for t in range(steps):
        check.reset()
        dtype = torch.bfloat16 if t % 2 == 0 else torch.float32
        op = dist.ReduceOp.SUM if (t // 2) % 2 else dist.ReduceOp.AVG
        for c in range(CALLS_PER_STEP):
            shard = 1 + (t * 37 + c * 211) % 700
            buffer = _gradient(t * CALLS_PER_STEP + c, rank, world * shard, dtype)
            output = torch.empty(shard, dtype=dtype)
            check.reduce(output, buffer, dist.group.WORLD, op)
            check.after_hooks(output)
            calls += 1
        statuses.append(_status(check))
        ratio = check.noise_ratio
        assert ratio is not None
        worst = max(worst, float(ratio))
    return statuses, worst, calls


def _gaussian_call(
    check: ScatterCheck, rank: int, dtype: torch.dtype, *, after: float = 0.0, inside: float = 0.0
) -> None:
    """A reduce-scatter of independent Gaussian gradients (shard of 1,000 values); rank 1's shard
    gets one value of its second block changed by ``inside`` × that block's mean magnitude within
    the collective, or by ``after`` × it after the collective (a reduced-gradient hook)."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    buffer = torch.randn(world * 1000, generator=g).to(dtype)
    output = torch.empty(1000, dtype=dtype)
    real = dist.reduce_scatter_single

    def corrupting(out: torch.Tensor, inp: torch.Tensor, **kw: Any) -> Any:
        work = real(out, inp, **kw)
        if rank == 1:
            block = out[256:512]
            block[7] += inside * float(block.float().abs().mean())
        return work

    dist.reduce_scatter_single = corrupting  # type: ignore[assignment]
    try:
        check.reduce(output, buffer, dist.group.WORLD, dist.ReduceOp.SUM)
    finally:
        dist.reduce_scatter_single = real  # type: ignore[assignment]
    if rank == 1 and after:
        block = output[256:512]
        block[7] += after * float(block.float().abs().mean())
    check.after_hooks(output)


DETECT = {torch.float32: 0.001, torch.bfloat16: 6.0}
"""A single value changed by this many times its block's mean magnitude is seen at 8 ranks
(``docs/sharded.md``)."""


def _job(ctx: RankContext, steps: int, detect: dict[torch.dtype, float] | None) -> dict[str, Any]:
    """Clean steps, then (``detect``: the sizes per dtype) one value changed after, then within,
    the collective, in float32 and bfloat16; all in one process group."""
    start = time.perf_counter()
    statuses, worst, calls = _clean_steps(ctx.world_size, ctx.rank, steps)
    faults: dict[str, int] = {}
    if detect:
        check = ScatterCheck()
        for dtype, size in detect.items():
            for where in ("after", "inside"):
                check.reset()
                _gaussian_call(check, ctx.rank, dtype, **{where: size})
                faults[f"{where}-{dtype}"] = _status(check)
        check.reset()
        _gaussian_call(check, ctx.rank, torch.bfloat16)
        faults["clean-gaussian"] = _status(check)
    return {
        "statuses": statuses,
        "worst": worst,
        "calls": calls,
        "faults": faults,
        "s": time.perf_counter() - start,
    }


def _run(
    world: int, steps: int, detect: dict[torch.dtype, float] | None = None, timeout: float = 100
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = run_local(
        _job, node_names(world, 1), args=(steps, detect), timeout=timeout
    )
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("world", "steps"), [(2, 40), (4, 40), (8, 20)])
def test_clean_reduce_scatters_never_alarm(world: int, steps: int) -> None:
    """120 (2 and 4 ranks) and 60 (8 ranks) reduce-scatters, 3 per checked step (float32 and
    bfloat16, sum and mean, shards of 1–700 values of Student-t × lognormal gradients with a share
    common to every rank from none to all): every rank's verdict is OK on every step."""
    results = _run(world, steps, detect=DETECT if world == 8 else None)
    assert all(s == OK for r in results for s in r["statuses"])
    assert max(r["worst"] for r in results) < 1
    if world == 8:
        faults = [r["faults"] for r in results]
        assert all(f["clean-gaussian"] == OK for f in faults)
        for dtype in DETECT:
            # One value of rank 1's shard changed after the collective: rank 1 alone, AFTER.
            assert [f[f"after-{dtype}"] for f in faults] == [OK, AFTER] + [OK] * 6
            # ... changed within it: rank 1's output is not the sum, COLLECTIVE.
            assert [f[f"inside-{dtype}"] for f in faults] == [OK, COLLECTIVE] + [OK] * 6


@pytest.mark.slow
@pytest.mark.timeout(1500)
@pytest.mark.parametrize(("world", "steps"), [(16, 100), (32, 100)])
def test_clean_reduce_scatters_never_alarm_at_16_and_32_ranks(world: int, steps: int) -> None:
    """300 reduce-scatters at 16 and 32 ranks (figures in ``docs/results/scatter-noise.md``):
    every verdict OK, and the largest |difference| / allowance is printed."""
    results = _run(world, steps, timeout=1400)
    worst = max(r["worst"] for r in results)
    print(f"world {world}: {results[0]['calls']} reduce-scatters, largest |difference|/allowance {worst:.4f}")
    assert all(s == OK for r in results for s in r["statuses"])
    assert worst < 1


def test_statuses_become_a_finding() -> None:
    """AFTER on one rank names it; a wrong collective output names nobody; all OK is no finding."""
    assert finding([OK, OK, OK]) is None
    named = finding([OK, AFTER, OK])
    assert named is not None and named.suspects == (1,) and named.check == "reduced_gradients"
    unresolved = finding([OK, COLLECTIVE, AFTER])
    assert unresolved is not None and unresolved.suspects == () and unresolved.candidates == (0, 1, 2)
