"""The guard's point-to-point exchange: one grouped operation per phase, every pattern it uses."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from replicheck.guard.errors import CommError
from replicheck.guard.transport.comm import Comm
from replicheck.harness.launch import RankContext, node_names, run_local


@contextlib.contextmanager
def _p2p_spy() -> Iterator[dict[str, int]]:
    """Count grouped calls and bare ``isend``/``irecv`` calls made outside a grouped call.

    The spies replace torch's functions both where user code finds them (``torch.distributed``)
    and where ``P2POp`` and ``batch_isend_irecv`` look them up (``distributed_c10d``), so the
    grouped path still works and its inner sends are told apart from bare ones.
    """
    counts = {"batches": 0, "ops_in_batches": 0, "bare": 0}
    inside = [False]
    real_isend, real_irecv, real_batch = c10d.isend, c10d.irecv, c10d.batch_isend_irecv

    def spy(real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts["ops_in_batches" if inside[0] else "bare"] += 1
            return real(*args, **kwargs)

        return call

    isend, irecv = spy(real_isend), spy(real_irecv)

    def batch(ops: list[Any]) -> Any:
        counts["batches"] += 1
        inside[0] = True
        try:
            return real_batch(ops)
        finally:
            inside[0] = False

    with contextlib.ExitStack() as stack:
        for mod in (dist, c10d):
            stack.enter_context(mock.patch.object(mod, "isend", isend))
            stack.enter_context(mock.patch.object(mod, "irecv", irecv))
            stack.enter_context(mock.patch.object(mod, "batch_isend_irecv", batch))
        yield counts


def _patterns(world: int) -> list[tuple[str, dict[int, list[int]]]]:
    """The exchange patterns the guard uses, as ``{sender: [receivers]}``."""
    ring = {r: [(r + 1) % world] for r in range(world)}
    out = [
        ("ring", ring),
        ("ring, reversed", {r: [(r - 1) % world] for r in range(world)}),
        ("one pair (arbitration)", {1: [world - 1]} if world > 2 else {0: [1]}),
        ("nothing", {}),
        ("mutual pair", {0: [1], 1: [0]}),
    ]
    if world > 2:
        # gradient re-runs: two alarming ranks send their work to one healthy peer
        out.append(("two to one", {0: [2], 1: [2]}))
        out.append(("one to two", {0: [1, 2]}))
    return out


def _job(ctx: RankContext) -> list[tuple[str, dict[int, Any], dict[str, int]]]:
    comm = Comm()
    results = []
    for name, pattern in _patterns(ctx.world_size):
        sends = [
            (dst, {"from": ctx.rank, "to": dst, "x": torch.full((3,), float(ctx.rank)), "name": name})
            for dst in pattern.get(ctx.rank, [])
        ]
        recv_from = sorted(src for src, dsts in pattern.items() if ctx.rank in dsts)
        with _p2p_spy() as counts:
            inbox = comm.exchange(sends, recv_from)
        results.append((name, inbox, dict(counts)))
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_every_guard_pattern_completes_as_grouped_operations(world: int) -> None:
    """Each exchange pattern the guard uses delivers every message, through exactly two grouped
    batches (lengths, then data) on each rank that takes part and no bare isend/irecv."""
    results = run_local(_job, node_names(world, 1), timeout=100)
    for rank, per_rank in enumerate(results):
        for (name, pattern), (got_name, inbox, counts) in zip(_patterns(world), per_rank):
            assert got_name == name
            sources = sorted(src for src, dsts in pattern.items() if rank in dsts)
            assert sorted(inbox) == sources, (name, rank)
            for src in sources:
                msg = inbox[src]
                assert msg["from"] == src and msg["to"] == rank and msg["name"] == name
                assert torch.equal(msg["x"], torch.full((3,), float(src)))
            active = bool(sources) or bool(pattern.get(rank))
            assert counts["bare"] == 0, (name, rank, counts)
            assert counts["batches"] == (2 if active else 0), (name, rank, counts)
            assert counts["ops_in_batches"] == 2 * (len(sources) + len(pattern.get(rank, []))), (name, counts)


def test_a_peer_named_twice_is_refused() -> None:
    """Two messages to one peer (or from one source) cannot be matched by a grouped exchange: refused."""
    comm = Comm()
    comm.rank, comm.world_size = 0, 3  # the check runs before any communication
    with pytest.raises(CommError, match="twice"):
        comm.exchange([(1, "a"), (1, "b")], [])
    with pytest.raises(CommError, match="invalid source"):
        comm.exchange([], [0])
    with pytest.raises(CommError, match="invalid destination"):
        comm.exchange([(3, "a")], [])


def _flags_and_rows(ctx: RankContext) -> dict[str, Any]:
    """Comm.flagged and Comm.gather_rows on every rank, counting the collectives they issue."""
    comm = Comm(None, device=torch.device("cpu"))
    calls = {"all_reduce": 0, "gather": 0}
    real_reduce, real_gather = (
        dist.all_reduce,
        getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
    )

    def reduce(*a: Any, **k: Any) -> Any:
        calls["all_reduce"] += 1
        return real_reduce(*a, **k)

    def gather(*a: Any, **k: Any) -> Any:
        calls["gather"] += 1
        return real_gather(*a, **k)

    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    out: dict[str, Any] = {}
    with mock.patch.object(dist, "all_reduce", reduce), mock.patch.object(dist, name, gather):
        out["none"] = comm.flagged(False)
        out["none_calls"] = dict(calls)
        out["some"] = comm.flagged(ctx.rank in (1, 2))
        out["rows"] = comm.gather_rows(torch.tensor([ctx.rank, 10 * ctx.rank], dtype=torch.int64)).tolist()
    out["calls"] = calls
    return out


@pytest.mark.timeout(90)
def test_flags_cost_one_small_collective_unless_a_rank_raised_one() -> None:
    """Comm.flagged: when no rank raised its flag, one 8-byte all-reduce and nothing else (the
    same at any world size); when some did, every rank learns exactly which; gather_rows is one
    collective into a (world, len) tensor."""
    results = run_local(_flags_and_rows, node_names(2, 2), timeout=60)
    for r in results:
        assert r["none"] == [] and r["none_calls"] == {"all_reduce": 1, "gather": 0}
        assert r["some"] == [1, 2]
        assert r["rows"] == [[k, 10 * k] for k in range(4)]
        assert r["calls"] == {"all_reduce": 2, "gather": 2}
