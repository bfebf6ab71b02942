"""Plain and guarded steps interleaved in one run: the method of every step-time ratio here.

Steps alternate one by one (the order swapped every step), so anything that slows the machine
for a while slows both loops alike. A round is one whole verification period of each loop, so
every round carries the same share of verification steps; the headline is the ratio of the total
guarded time to the total plain time over all rounds (a median of per-round ratios would hide the
verification steps, where the cost is), with the median and quartiles as secondary figures.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Timed = Callable[[bool, int], float]
"""``timed(guarded, i)``: run one step of the plain (``False``) or guarded loop on batch ``i``
and return its wall time in seconds (the caller synchronises ranks and devices around it)."""


@dataclass
class Rounds:
    """Per-round totals and per-step paired differences of an interleaved run."""

    block: int
    """Steps per round and loop (a whole number of verification periods)."""
    verify_every: int
    """The guarded loop's verification period."""
    plain: list[float] = field(default_factory=list)
    """Total plain time of each round, seconds."""
    guarded: list[float] = field(default_factory=list)
    """Total guarded time of each round, seconds."""
    verify_extra: list[float] = field(default_factory=list)
    """Guarded minus plain time of each verification step, seconds."""
    ordinary_extra: list[float] = field(default_factory=list)
    """Guarded minus plain time of each ordinary step, seconds."""
    stopped_early: bool = False
    """True when the time budget ended the run before the rounds asked for."""


def run_rounds(
    timed: Timed, *, rounds: int, block: int, verify_every: int, deadline: float | None = None
) -> Rounds:
    """``rounds`` interleaved rounds, the guarded loop at the start of a verification period.

    ``deadline`` (``time.monotonic()`` value): no new round starts after it (at least one runs).
    """
    if block < 1 or block % verify_every:
        raise ValueError(f"block ({block}) must be a positive multiple of verify_every ({verify_every})")
    out = Rounds(block=block, verify_every=verify_every)
    for r in range(rounds):
        if deadline is not None and r > 0 and time.monotonic() > deadline:
            out.stopped_early = True
            break
        p = g = 0.0
        for i in range(block):
            if (i + r) % 2:
                tg = timed(True, i)
                tp = timed(False, i)
            else:
                tp = timed(False, i)
                tg = timed(True, i)
            g, p = g + tg, p + tp
            (out.verify_extra if i % verify_every == 0 else out.ordinary_extra).append(tg - tp)
        out.plain.append(p)
        out.guarded.append(g)
    return out


def summary(r: Rounds) -> dict[str, Any]:
    """The figures of a run: ratio of totals (headline), median and spread, per-step extras."""
    ratios = [g / p for g, p in zip(r.guarded, r.plain)]
    med = statistics.median
    return {
        "rounds": len(ratios),
        "steps_per_round": r.block,
        "verify_every": r.verify_every,
        "ratio_of_totals": round(sum(r.guarded) / sum(r.plain), 4),
        "median_ratio": round(med(ratios), 4),
        "quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)] if len(ratios) > 1 else [],
        "min_ratio": round(min(ratios), 4),
        "max_ratio": round(max(ratios), 4),
        "ratios": [round(x, 4) for x in ratios],
        "plain_step_ms_median": round(med(r.plain) / r.block * 1e3, 2),
        "verification_step_extra_ms_median": round(med(r.verify_extra) * 1e3, 2) if r.verify_extra else None,
        "ordinary_step_extra_ms_median": round(med(r.ordinary_extra) * 1e3, 2) if r.ordinary_extra else None,
        "stopped_early": r.stopped_early,
    }
