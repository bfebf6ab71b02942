"""The benchmark helpers' own logic: the interleaved-rounds method and the sync-warning count."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from benchkit.interleave import run_rounds, summary  # noqa: E402
from benchkit.syncs import SYNC_MESSAGE, count_sync_warnings  # noqa: E402


def test_headline_is_the_ratio_of_totals_not_the_median() -> None:
    """A costly verification step in one round moves the ratio of totals but not the median."""
    calls: list[tuple[bool, int]] = []

    def timed(guarded: bool, i: int) -> float:
        calls.append((guarded, i))
        round_no = (len(calls) - 1) // 20
        if guarded and i == 0 and round_no == 2:
            return 11.0  # one slow verification step
        return 1.1 if guarded else 1.0

    s = summary(run_rounds(timed, rounds=3, block=10, verify_every=10))
    assert s["median_ratio"] == pytest.approx(1.1)
    assert s["ratio_of_totals"] == pytest.approx((11 + 11 + 11 + 9 * 1.1) / 30)
    assert s["rounds"] == 3
    # Steps alternate, the order swapped every step: each batch index runs once per loop per round.
    assert sorted(calls) == sorted((g, i) for _ in range(3) for i in range(10) for g in (False, True))
    assert calls[0] == (False, 0) and calls[2] == (True, 1)


def test_rounds_must_be_whole_verification_periods() -> None:
    """A block that is not a multiple of verify_every is refused (rounds would differ in cost)."""
    with pytest.raises(ValueError, match="multiple"):
        run_rounds(lambda g, i: 1.0, rounds=1, block=5, verify_every=10)


def test_deadline_stops_after_the_running_round() -> None:
    """A deadline in the past still runs one round, then stops and says so."""
    r = run_rounds(lambda g, i: 1.0, rounds=5, block=2, verify_every=1, deadline=0.0)
    assert len(r.plain) == 1 and r.stopped_early


def test_only_sync_debug_warnings_are_counted() -> None:
    """The counter counts PyTorch's sync-debug warnings and ignores every other warning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn(
            f"{SYNC_MESSAGE} (Triggered internally at CUDAFunctions.cpp)", UserWarning, stacklevel=1
        )
        warnings.warn("replicheck: world size 1", UserWarning, stacklevel=1)
        warnings.warn(SYNC_MESSAGE, UserWarning, stacklevel=1)
    assert count_sync_warnings(caught) == 2
