"""Agreement of state across replicas (weights, optimizer state, reduced gradients) and
the per-step gradient health finding."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from replicheck.guard.attribution.resolve import (
    RerunFailed,
    Together,
    alone,
    attempt,
    failed_ranks,
    failure_evidence,
)
from replicheck.guard.attribution.verdict import Evidence, Finding, vote
from replicheck.guard.transport.comm import Comm
from replicheck.guard.transport.records import GradientWork
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
    evidence: Evidence = {"digests": [f"{int(x) & 0xFFFF_FFFF_FFFF_FFFF:016x}" for x in values]}
    if not v.dissenters:
        evidence["note"] = "no strict majority: the replicas cannot be told apart"
        return Finding(check=check, candidates=v.candidates, evidence=evidence)
    evidence["note"] = _STATE_NOTE
    return Finding(check=check, suspects=v.dissenters, classification="transient", evidence=evidence)


def group_finding(
    check: Check, values: Sequence[int], groups: Sequence[Sequence[int]] | None
) -> Finding | None:
    """:func:`vote_finding` inside each group of ranks that hold the same state (all ranks when
    ``groups`` is None; for HSDP, the ranks holding one shard, one per replica group), with the
    groups' suspects and candidates named by global rank."""
    if groups is None:
        return vote_finding(check, values)
    found: list[tuple[Sequence[int], Finding]] = []
    for g in groups:
        f = vote_finding(check, [values[r] for r in g]) if len(g) > 1 else None
        if f is not None:
            found.append((g, f))
    if not found:
        return None
    suspects = sorted({g[i] for g, f in found for i in f.suspects})
    candidates = sorted({g[i] for g, f in found for i in f.candidates})
    evidence: Evidence = {
        "groups": [{"ranks": list(g), **f.evidence} for g, f in found],
        "note": _STATE_NOTE if suspects else "no strict majority: the replicas cannot be told apart",
    }
    if not suspects:
        return Finding(check=check, candidates=tuple(candidates), evidence=evidence)
    return Finding(
        check=check,
        suspects=tuple(suspects),
        candidates=tuple(candidates),
        classification="transient",
        evidence=evidence,
    )


def findings(
    weights: Sequence[int], optimizer_state: Sequence[int], groups: Sequence[Sequence[int]] | None = None
) -> list[Finding]:
    """Findings of the weights and optimizer-state votes (empty when every replica agrees)."""
    votes = (
        group_finding("weights", weights, groups),
        group_finding("optimizer_state", optimizer_state, groups),
    )
    return [f for f in votes if f is not None]


def healthy(norm: float, bound: float | None) -> bool:
    """A local gradient norm that raises no alarm: finite and within ``bound`` (when set)."""
    return math.isfinite(norm) and (bound is None or norm <= bound)


@dataclass(frozen=True)
class _GradientRerun:
    """A rank's re-run of the step whose gradient alarmed, and the same work re-run on a peer."""

    rank: int
    rerun_norm: float
    peer: int | None = None
    peer_norm: float | None = None

    def classification(self, bound: float | None) -> Classification:
        """``data`` when another device reproduces the bad gradient: any device computing this work
        gets it, so the data or the model produces it, not the hardware."""
        if self.peer_norm is not None and not healthy(self.peer_norm, bound):
            return "data"
        return "transient" if healthy(self.rerun_norm, bound) else "persistent"

    def to_evidence(self, bound: float | None) -> Evidence:
        out: Evidence = {"rank": self.rank, "rerun_norm": self.rerun_norm}
        if self.peer is not None:
            out.update(peer=self.peer, peer_rerun_norm=self.peer_norm)
        out["classification"] = self.classification(bound)
        return out


def peer_for(rank: int, bad: Sequence[int], nodes: Sequence[str]) -> int | None:
    """The healthy rank that re-runs ``rank``'s work: the next one after it on another node,
    else the next healthy one on any node; ``None`` when every rank alarmed."""
    world = len(nodes)
    order = [(rank + i) % world for i in range(1, world)]
    healthy_ranks = [r for r in order if r not in bad]
    elsewhere = [r for r in healthy_ranks if nodes[r] != nodes[rank]]
    choices = elsewhere or healthy_ranks
    return choices[0] if choices else None


def gradient_finding(
    comm: Comm,
    bad: list[int],
    norms: list[float],
    bound: float | None,
    rerun_norm: Callable[[], float],
    *,
    nodes: Sequence[str] | None = None,
    work: GradientWork | None = None,
    rerun_elsewhere: Callable[[GradientWork], float] | None = None,
    together: Together = alone,
    step: int = 0,
) -> Finding:
    """Ranks whose local gradient was non-finite or too large, with each one's work re-run twice.

    ``rerun_norm`` repeats this rank's passes of the step as they ran and returns the local
    gradient norm again (on the ranks in ``bad``): a different answer is transient. ``work`` (this
    rank's passes) is also sent to a healthy peer on another node, which re-runs it with
    ``rerun_elsewhere``: the same bad gradient there means the data (or the model) produces it,
    classified ``data`` and blamed on no node. When most ranks alarm at once it is divergence of
    the model, not one device. Collective: every rank calls this with the same ``bad``.
    """
    evidence: Evidence = {"local_grad_norms": norms, "bound": bound}
    if len(bad) * 2 > comm.world_size and comm.world_size > 1:
        evidence["note"] = (
            "most ranks produced bad gradients at once: the model diverged (learning rate, data, "
            "numerics); no device is blamed"
        )
        evidence["ranks"] = list(bad)
        return Finding(check="gradients", classification="divergence", evidence=evidence)
    peers: dict[int, int] = {}
    if nodes is not None and rerun_elsewhere is not None and work is not None and comm.world_size > 1:
        for b in bad:
            p = peer_for(b, bad, nodes)
            if p is not None:
                peers[b] = p
    me = comm.rank
    inbox = (
        comm.exchange(
            [(peers[me], work.encode())] if me in peers and work is not None else [],
            [b for b in sorted(peers) if peers[b] == me],
        )
        if peers
        else {}
    )
    received = {b: GradientWork.decode(w) for b, w in inbox.items()}
    passes = (len(work.passes) if me in bad and work is not None else 0) + sum(
        len(w.passes) for w in received.values()
    )

    def run() -> tuple[dict[int, float], float | None]:
        elsewhere = {b: rerun_elsewhere(w) for b, w in received.items()} if rerun_elsewhere else {}
        return elsewhere, rerun_norm() if me in bad else None

    # An error here (out of memory: a re-run holds another gradient set) travels in the gather.
    out, tried = attempt(together, passes, run, step)
    elsewhere, again = out if out is not None else ({}, None)
    reports = comm.gather_objects((tried.report, tried.error is not None, again, elsewhere))
    peer_norms = {b: n for *_, got in reports for b, n in got.items()}
    reruns = [
        _GradientRerun(
            rank=b,
            rerun_norm=_or_nan(reports[b][2]),
            peer=peers.get(b),
            peer_norm=peer_norms.get(b),
        )
        for b in bad
    ]
    evidence["reruns"] = [r.to_evidence(bound) for r in reruns]
    failed = failed_ranks([r[0] for r in reports], [r[1] for r in reports])
    if failed:
        # Without every re-run nothing separates data from a device: no rank is blamed.
        evidence["rerun_failed"] = failure_evidence("gradient re-run", failed)
        finding = Finding(check="gradients", candidates=tuple(bad), evidence=evidence)
        raise RerunFailed(step, tuple(sorted(failed)), tried.error, finding)
    device = [r for r in reruns if r.classification(bound) != "data"]
    if not device:
        evidence["note"] = (
            "every bad gradient was reproduced by another rank on another device: the data or the "
            "model produces it (for example a sample whose loss is inf), not the hardware; no node "
            "is blamed"
        )
        return Finding(check="gradients", classification="data", evidence=evidence)
    return Finding(
        check="gradients",
        suspects=tuple(r.rank for r in device),
        classification=device[0].classification(bound),
        evidence=evidence,
    )


def _or_nan(x: float | None) -> float:
    return math.nan if x is None else float(x)
