"""Lockstep re-runs (sharded models) after an error between passes: the failing rank still takes
part in the passes it owes the other ranks, so none is left in a pass's collectives."""

from __future__ import annotations

from typing import Any

import pytest

from replicheck.guard.parallel.lockstep import LockstepReplays


class _Comm:
    """The one collective ``together`` needs, answered as if another rank runs ``most`` passes."""

    def __init__(self, most: int) -> None:
        self.most = most

    def max_int(self, value: int) -> int:
        return max(value, self.most)


def _replays(most: int) -> LockstepReplays:
    return LockstepReplays(_Comm(most), tap=None, forwards=None, order=None, params=[])  # type: ignore[arg-type]


def test_an_error_between_passes_pads_the_passes_owed_then_raises() -> None:
    """run() raising before its passes (a comparison, a decode, a copy to the host): the rank
    runs filler passes up to the most any rank runs, then the error goes on to the caller."""
    replays = _replays(most=3)
    fillers: list[Any] = []

    def run() -> None:
        raise RuntimeError("compare failed")

    with pytest.raises(RuntimeError, match="compare failed"):
        replays.together(1, run, fillers.append)
    assert len(fillers) == 3


def test_an_error_every_rank_raised_at_a_pass_is_not_padded() -> None:
    """An error raised where every rank raised it (a pass's shared flag, or inside a backward's
    collectives) runs no filler: the other ranks left the phase at the same point."""
    replays = _replays(most=2)
    shared = RuntimeError("out of memory in a re-run")
    replays._shared = shared  # noqa: SLF001 - as _gradients marks it
    fillers: list[Any] = []

    def run() -> None:
        raise shared

    with pytest.raises(RuntimeError, match="out of memory"):
        replays.together(2, run, fillers.append)
    assert fillers == []
