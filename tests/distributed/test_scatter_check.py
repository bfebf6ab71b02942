"""The reduce-scatter check of plain FSDP2 (``replicheck.guard.checks.scatter``) on real gloo
collectives: no alarm over many clean reduce-scatters of heavy-tailed gradients (float32 and
bfloat16, sum and mean), and one value changed after the collective is seen."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from replicheck.guard.checks.scatter import AFTER, COLLECTIVE, OK, ScatterCheck, finding
from replicheck.harness.launch import RankContext, node_names, run_local


def _gradient(g: torch.Generator, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Values over many orders of magnitude, with exact zeros, as real gradients have."""
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 3)
    x[torch.rand(n, generator=g) < 0.05] = 0
    return x.to(dtype)


def _status(check: ScatterCheck) -> int:
    s = check.status()
    return int(s) if isinstance(s, int) else int(s.item())


def _clean_job(ctx: RankContext, trials: int) -> list[int]:
    world = dist.get_world_size()
    out = []
    for t in range(trials):
        g = torch.Generator().manual_seed(t * 100 + ctx.rank)
        dtype = torch.bfloat16 if t % 3 == 0 else torch.float32
        op = dist.ReduceOp.SUM if t % 2 else dist.ReduceOp.AVG
        shard = 1 + (t * 37) % 900
        buffer = _gradient(g, world * shard, dtype)
        output = torch.empty(shard, dtype=dtype)
        check = ScatterCheck()
        check.reduce(output, buffer, dist.group.WORLD, op)
        check.after_hooks(output)
        out.append(_status(check))
    return out


@pytest.mark.timeout(120)
def test_clean_reduce_scatters_never_alarm() -> None:
    """300 reduce-scatters over 3 ranks (float32 and bfloat16, sum and mean, shards of 1–900
    values spanning ~10 orders of magnitude) all pass the check."""
    results = run_local(_clean_job, node_names(3, 1), args=(300,), timeout=100)
    assert all(s == OK for r in results for s in r)


def _fault_job(ctx: RankContext, relative: float) -> int:
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(ctx.rank)
    buffer = _gradient(g, world * 1000, torch.float32)
    output = torch.empty(1000)
    check = ScatterCheck()
    check.reduce(output, buffer, dist.group.WORLD, dist.ReduceOp.SUM)
    if ctx.rank == 1:
        block = output[256:512]
        block[7] += relative * float(block.abs().mean())  # a reduced-gradient hook gone wrong
    check.after_hooks(output)
    return _status(check)


@pytest.mark.timeout(120)
def test_one_value_changed_after_the_collective_is_seen_on_that_rank() -> None:
    """Rank 1 changes one value of its shard by 10 % of its block's mean magnitude after the
    reduce-scatter: rank 1 reports AFTER, the others OK."""
    results: list[Any] = run_local(_fault_job, node_names(3, 1), args=(0.1,), timeout=100)
    assert results == [OK, AFTER, OK]


def test_statuses_become_a_finding() -> None:
    """AFTER on one rank names it; a wrong collective output names nobody; all OK is no finding."""
    assert finding([OK, OK, OK]) is None
    named = finding([OK, AFTER, OK])
    assert named is not None and named.suspects == (1,) and named.check == "reduced_gradients"
    unresolved = finding([OK, COLLECTIVE, AFTER])
    assert unresolved is not None and unresolved.suspects == () and unresolved.candidates == (0, 1, 2)
