"""Agreement of state across replicas (weights, optimizer state, reduced gradients) and
the per-step gradient health finding."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from replicheck.guard.comm import Comm
from replicheck.guard.verdict import Finding, vote
from replicheck.incident import Check, Classification

_STATE_NOTE = (
    "replicas diverged in stored state; whether the fault recurs cannot be re-run from here, "
    "so the incident is classified transient and should be triaged"
)


def vote_finding(check: Check, values: Sequence[int]) -> Finding | None:
    """A finding when the ranks' digests of the same state disagree."""
    v = vote([int(x) for x in values])
    if v.agree:
        return None
    evidence: dict[str, Any] = {"digests": [f"{int(x) & 0xFFFF_FFFF_FFFF_FFFF:016x}" for x in values]}
    if not v.dissenters:
        evidence["note"] = "no strict majority: the replicas cannot be told apart"
        return Finding(check=check, candidates=v.candidates, evidence=evidence)
    evidence["note"] = _STATE_NOTE
    return Finding(check=check, suspects=v.dissenters, classification="transient", evidence=evidence)


def findings(weights: Sequence[int], optimizer_state: Sequence[int]) -> list[Finding]:
    """Findings of the weights and optimizer-state votes (empty when every replica agrees)."""
    votes = (vote_finding("weights", weights), vote_finding("optimizer_state", optimizer_state))
    return [f for f in votes if f is not None]


def healthy(norm: float, bound: float | None) -> bool:
    """A local gradient norm that raises no alarm: finite and within ``bound`` (when set)."""
    return math.isfinite(norm) and (bound is None or norm <= bound)


@dataclass(frozen=True)
class _GradientRerun:
    """A rank's re-run of the step whose gradient alarmed."""

    rank: int
    rerun_norm: float
    classification: Classification

    def to_evidence(self) -> dict[str, Any]:
        return {"rank": self.rank, "rerun_norm": self.rerun_norm, "classification": self.classification}


def gradient_finding(
    comm: Comm, bad: list[int], norms: list[float], bound: float | None, rerun_norm: Callable[[], float]
) -> Finding:
    """Ranks whose local gradient was non-finite or too large; each re-runs its step to classify.

    ``rerun_norm`` repeats this rank's passes of the step as they ran and returns the local
    gradient norm again; it runs on the ranks in ``bad`` only. Collective: every rank calls this
    with the same ``bad``.
    """
    evidence: dict[str, Any] = {"local_grad_norms": norms, "bound": bound}
    if len(bad) * 2 > comm.world_size and comm.world_size > 1:
        # Most ranks at once looks like divergence of the model, not one bad device.
        evidence["note"] = "most ranks produced bad gradients: not attributable to one device"
        comm.gather_objects(None)
        return Finding(check="gradients", candidates=tuple(bad), evidence=evidence)
    mine = None
    if comm.rank in bad:
        again = rerun_norm()
        mine = _GradientRerun(
            rank=comm.rank,
            rerun_norm=again,
            classification="transient" if healthy(again, bound) else "persistent",
        )
    reruns = [r for r in comm.gather_objects(mine) if r is not None]
    evidence["reruns"] = [r.to_evidence() for r in reruns]
    by_rank = {r.rank: r.classification for r in reruns}
    return Finding(
        check="gradients",
        suspects=tuple(bad),
        classification=by_rank.get(bad[0], "ambiguous"),
        evidence=evidence,
    )
