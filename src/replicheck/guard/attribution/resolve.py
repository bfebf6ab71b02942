"""Attribution on the failure path of a verification step: arbitration and re-runs, in lockstep.

Every rank calls :func:`resolve_replay` with the same pair outcomes (they come from one
all-gather), so every rank takes part in the same exchanges and reaches the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from replicheck.guard.attribution.compare import agrees, compare
from replicheck.guard.attribution.ring import Ring
from replicheck.guard.attribution.verdict import Evidence, Finding, arbitrate, attribute_pairs
from replicheck.guard.config import Mode
from replicheck.guard.errors import PeerFailed
from replicheck.guard.transport.comm import Comm
from replicheck.guard.transport.records import ArbitrationRequest, ProbePayload, ProbeResult
from replicheck.incident import Classification

Replayer = Callable[[ProbePayload], ProbeResult]
"""Replays a probe payload (as sent by its source) on this rank."""

T = TypeVar("T")


class Together(Protocol):
    """Runs ``run`` (``passes`` re-runs on this rank) so that every rank leaves after the same
    collectives: a sharded model's passes are collectives (:mod:`replicheck.guard.parallel.lockstep`)."""

    def __call__(self, passes: int, run: Callable[[], T], step: int) -> T: ...


def alone(passes: int, run: Callable[[], T], step: int) -> T:
    """:class:`Together` for a model whose re-runs need no other rank (DDP, one process)."""
    return run()


@dataclass(frozen=True)
class Criterion:
    """When two results of the same probe count as the same answer."""

    mode: Mode
    """``exact``: bit for bit; ``tolerant``: within ``threshold``."""
    threshold: float
    """Tolerant mode: the calibrated threshold (ignored in exact mode)."""

    def accepts(self, distance: float) -> bool:
        """Whether a pair's distance counts as agreement."""
        return distance == 0.0 if self.mode == "exact" else distance <= self.threshold

    def agree(self, a: ProbeResult, b: ProbeResult) -> bool:
        return agrees(compare(a, b, self.mode, self.threshold), self.mode, self.threshold)


@dataclass(frozen=True)
class PairOutcome:
    """One ring pair's comparison of the step, as every rank sees it."""

    source: int
    verifier: int
    source_node: str
    verifier_node: str
    distance: float
    agree: bool

    def to_evidence(self) -> Evidence:
        return {
            "source": self.source,
            "verifier": self.verifier,
            "source_node": self.source_node,
            "verifier_node": self.verifier_node,
            "distance": self.distance,
            "agree": self.agree,
        }


@dataclass(frozen=True)
class LocalView:
    """What this rank knows of the step's probes: the payload it sent (``own``: its probe, seed
    and claimed result), the payload it received from its source (``received``) and its replay
    of that (``replayed``)."""

    own: ProbePayload
    received: ProbePayload
    replayed: ProbeResult


@dataclass(frozen=True)
class _Arbitration:
    """An arbiter's replay of a disputed probe, compared with both parties."""

    source: int
    verifier: int
    arbiter: int
    agrees_with_source: bool
    agrees_with_verifier: bool

    @property
    def odd_one_out(self) -> int | None:
        return arbitrate(self.agrees_with_source, self.agrees_with_verifier, self.source, self.verifier)

    def to_evidence(self) -> Evidence:
        return {
            "source": self.source,
            "verifier": self.verifier,
            "arbiter": self.arbiter,
            "agrees_with_source": self.agrees_with_source,
            "agrees_with_verifier": self.agrees_with_verifier,
            "odd_one_out": self.odd_one_out,
        }


@dataclass(frozen=True)
class _Rerun:
    """A suspect's recomputation of what it is blamed for."""

    rank: int
    rerun: str
    same_answer: bool

    @property
    def classification(self) -> Classification:
        return "persistent" if self.same_answer else "transient"

    def to_evidence(self) -> Evidence:
        return {
            "rank": self.rank,
            "rerun": self.rerun,
            "same_answer": self.same_answer,
            "classification": self.classification,
        }


def resolve_replay(
    *,
    comm: Comm,
    ring: Ring,
    pairs: Sequence[PairOutcome],
    view: LocalView,
    replay: Replayer,
    criterion: Criterion,
    together: Together = alone,
) -> Finding:
    """Name the rank behind failing pairs, arbitrating lone pairs, then classify the fault."""
    failing = [(p.source, p.verifier) for p in pairs if not p.agree]
    attribution = attribute_pairs(failing)
    suspects = list(attribution.suspects)
    tasks, unresolved = _arbiters(ring, attribution.unexplained)
    arbitrations = _arbitrate(comm, tasks, view, replay, criterion, together) if tasks else []
    for a in sorted(arbitrations, key=lambda a: (a.source, a.verifier)):
        odd = a.odd_one_out
        if odd is None:
            unresolved.append((a.source, a.verifier))
        elif odd not in suspects:
            suspects.append(odd)
    reruns = _classify(comm, suspects, {src for src, _ in failing}, view, replay, criterion, together)

    candidates = sorted({r for pair in unresolved for r in pair})
    evidence: Evidence = {
        "pairs": [p.to_evidence() for p in pairs],
        "arbitrations": [a.to_evidence() for a in arbitrations],
        "reruns": [r.to_evidence() for r in reruns],
        "threshold": criterion.threshold if criterion.mode == "tolerant" else None,
    }
    if not suspects:
        return Finding(check="replay", candidates=tuple(candidates), evidence=evidence)
    by_rank = {r.rank: r.classification for r in reruns}
    suspects.sort()
    if unresolved:
        evidence["unresolved_pairs"] = [list(p) for p in unresolved]
    return Finding(
        check="replay",
        suspects=tuple(suspects),
        candidates=tuple(candidates),
        classification=by_rank.get(suspects[0], "ambiguous"),
        evidence=evidence,
    )


def _arbiters(
    ring: Ring, unexplained: Sequence[tuple[int, int]]
) -> tuple[list[tuple[int, int, int]], list[tuple[int, int]]]:
    """A distinct arbiter for each unexplained pair where one exists: ``(tasks, pairs left)``."""
    tasks: list[tuple[int, int, int]] = []
    unresolved: list[tuple[int, int]] = []
    busy: list[int] = []
    for src, ver in unexplained:
        arb = ring.arbiter_for(src, ver, busy=busy)
        if arb is None:
            unresolved.append((src, ver))
        else:
            tasks.append((src, ver, arb))
            busy.append(arb)
    return tasks, unresolved


def _arbitrate(
    comm: Comm,
    tasks: Sequence[tuple[int, int, int]],
    view: LocalView,
    replay: Replayer,
    criterion: Criterion,
    together: Together,
) -> list[_Arbitration]:
    """Each verifier forwards the disputed payload and its own replay to the pair's arbiter."""
    rank = comm.rank
    request = ArbitrationRequest(payload=view.received, verifier_result=view.replayed)
    sends = [(arb, request.encode()) for _, ver, arb in tasks if ver == rank]
    inbox = comm.exchange(sends, [ver for _, ver, arb in tasks if arb == rank])
    mine: list[_Arbitration] = []
    error: Exception | None = None
    jobs: list[tuple[int, int, int, ArbitrationRequest]] = []
    try:
        jobs = [
            (src, ver, arb, ArbitrationRequest.decode(inbox[ver])) for src, ver, arb in tasks if arb == rank
        ]
    except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank has gathered
        error = exc

    def run() -> None:
        for src, ver, arb, msg in jobs:
            result = replay(msg.payload)
            mine.append(
                _Arbitration(
                    source=src,
                    verifier=ver,
                    arbiter=arb,
                    agrees_with_source=criterion.agree(msg.payload.result, result),
                    agrees_with_verifier=criterion.agree(msg.verifier_result, result),
                )
            )

    try:
        together(len(jobs), run, view.own.step)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank has gathered
        error = error or exc
    reports = comm.gather_objects((error is None, mine))
    _stop_on_failure(view.own.step, [ok for ok, _ in reports], error)
    return [a for _, done in reports for a in done]


def _classify(
    comm: Comm,
    suspects: Sequence[int],
    sources: set[int],
    view: LocalView,
    replay: Replayer,
    criterion: Criterion,
    together: Together,
) -> list[_Rerun]:
    """Each suspect recomputes what it is blamed for and compares with its first answer."""
    mine: list[_Rerun] = []
    error: Exception | None = None

    def run() -> None:
        if comm.rank in sources:
            again, first, what = replay(view.own), view.own.result, "own probe"
        else:
            again, first, what = replay(view.received), view.replayed, "replay of its source's probe"
        mine.append(_Rerun(rank=comm.rank, rerun=what, same_answer=criterion.agree(first, again)))

    try:
        together(1 if comm.rank in suspects else 0, run if comm.rank in suspects else _nothing, view.own.step)
    except Exception as exc:  # noqa: BLE001 - re-raised below, after every rank has gathered
        error = exc
    reports = comm.gather_objects((error is None, mine[0] if mine else None))
    _stop_on_failure(view.own.step, [ok for ok, _ in reports], error)
    return [r for _, r in reports if r is not None]


def _nothing() -> None:
    return None


def _stop_on_failure(step: int, ok: Sequence[bool], error: Exception | None) -> None:
    """After a gather: a rank whose re-run failed raises its error, every other rank PeerFailed,
    so no rank is left waiting in a later collective of the failure path."""
    failed = tuple(r for r, fine in enumerate(ok) if not fine)
    if not failed:
        return
    if error is not None:
        raise error
    raise PeerFailed(step, failed)
