"""Attribution on the failure path of a verification step: arbitration and re-runs, in lockstep.

Every rank calls :func:`resolve_replay` with the same pair outcomes (they come from one
all-gather), so every rank takes part in the same exchanges and reaches the same verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
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


class RerunFailed(Exception):
    """A re-run of the failure path (arbitration, a suspect's or a peer's re-run) raised on some
    rank. Every rank raises it after the same gather, with the finding as far as it was resolved;
    the guard records that incident, then re-raises ``error`` on the failing rank and
    :class:`PeerFailed` on the others."""

    def __init__(
        self, step: int, ranks: tuple[int, ...], error: BaseException | None, finding: Finding
    ) -> None:
        self.step = step
        self.ranks = ranks
        """Ranks whose re-run raised."""
        self.error = None if isinstance(error, PeerFailed) else error
        """This rank's own error (``None`` on the other ranks, also where a lockstep pass raised
        :class:`PeerFailed` for another rank's error)."""
        self.findings: list[Finding] = [finding]
        """The step's findings so far, the unresolved one last."""
        super().__init__(f"step {step}: a re-run failed on rank(s) {', '.join(map(str, ranks))}")


@dataclass(frozen=True)
class Attempt:
    """How one rank's protected re-runs went: its own error, or a peer's error it learnt of."""

    error: Exception | None = None
    """The exception the re-runs raised on this rank (a :class:`PeerFailed` when a lockstep pass
    learnt of another rank's error)."""

    @property
    def report(self) -> str | None:
        """What the other ranks learn in the next gather: this rank's own error, or ``None``."""
        if self.error is None or isinstance(self.error, PeerFailed):
            return None
        first = (str(self.error).splitlines() or [""])[0][:300]
        return f"{type(self.error).__name__}: {first}"


def attempt(together: Together, passes: int, run: Callable[[], T], step: int) -> tuple[T | None, Attempt]:
    """``together(passes, run, step)`` with its error kept, not raised: it travels in the gather
    that follows, so every rank learns of it at the same point (no rank is left in a collective)."""
    try:
        return together(passes, run, step), Attempt()
    except Exception as exc:  # noqa: BLE001 - reported in the next gather, then raised on every rank
        return None, Attempt(exc)


def failed_ranks(reports: Sequence[str | None], peer_errors: Sequence[bool]) -> dict[int, str]:
    """Ranks whose re-run raised, with what they reported. A lockstep pass raises PeerFailed on
    the ranks that did not fail themselves; if only such reports came, those ranks are named."""
    own = {r: text for r, text in enumerate(reports) if text is not None}
    if own:
        return own
    return {r: "PeerFailed" for r, peer in enumerate(peer_errors) if peer}


def failure_evidence(phase: str, failed: Mapping[int, str]) -> Evidence:
    """The evidence of a re-run that raised: where, on which ranks, what they raised."""
    return {
        "phase": phase,
        "ranks": sorted(failed),
        "errors": {str(r): text for r, text in sorted(failed.items())},
        "note": "a re-run raised before the fault was resolved: the finding holds what was known then",
    }


@dataclass(frozen=True)
class Criterion:
    """When two results of the same probe count as the same answer."""

    mode: Mode
    """``exact``: bit for bit; ``tolerant``: within ``threshold``."""
    threshold: float
    """Tolerant mode: the calibrated threshold (ignored in exact mode)."""
    context: Evidence | None = field(default=None, compare=False)
    """Tolerant mode: what the threshold came from (precision, floor, ceiling, calibration),
    recorded in the incident."""

    def accepts(self, distance: float) -> bool:
        """Whether a pair's distance counts as agreement."""
        return distance == 0.0 if self.mode == "exact" else distance <= self.threshold

    def agree(self, a: ProbeResult, b: ProbeResult) -> bool:
        return agrees(compare(a, b, self.mode, self.threshold), self.mode, self.threshold)

    def distance(self, a: ProbeResult, b: ProbeResult) -> float:
        """How far apart two results are (exact mode: 0 or 1)."""
        return compare(a, b, self.mode, self.threshold).distance

    def over(self, distance: float) -> float | None:
        """Tolerant mode: ``distance`` as a multiple of the threshold (``None`` in exact mode)."""
        if self.mode == "exact":
            return None
        return distance / self.threshold if self.threshold > 0 else None


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
    to_source: float = 0.0
    """Distance of the arbiter's replay from the source's claimed result."""
    to_verifier: float = 0.0
    """Distance of the arbiter's replay from the verifier's replay."""

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
            "distance_to_source": self.to_source,
            "distance_to_verifier": self.to_verifier,
            "odd_one_out": self.odd_one_out,
        }


@dataclass(frozen=True)
class _Rerun:
    """A suspect's recomputation of what it is blamed for.

    Exact mode: the fault is persistent when the re-run gives the same (wrong) answer bit for bit.
    Tolerant mode: when the re-run is again over the threshold from the reference (the other
    party's answer), so an exceedance the re-run does not reproduce is never called persistent."""

    rank: int
    rerun: str
    same_answer: bool
    """The re-run agrees with the suspect's first answer (bit for bit, or within the threshold)."""
    mode: Mode = "exact"
    first: float = 0.0
    """Tolerant mode: distance of the suspect's first answer from the reference."""
    again: float = 0.0
    """Tolerant mode: distance of the re-run from the reference."""
    threshold: float = 0.0
    """Tolerant mode: the threshold of the step."""

    @property
    def reproduced(self) -> bool:
        """The re-run shows the fault again."""
        if self.mode == "exact":
            return self.same_answer
        return self.again > self.threshold

    @property
    def classification(self) -> Classification:
        return "persistent" if self.reproduced else "transient"

    def to_evidence(self) -> Evidence:
        evidence: Evidence = {
            "rank": self.rank,
            "rerun": self.rerun,
            "same_answer": self.same_answer,
            "classification": self.classification,
        }
        if self.mode == "tolerant":
            over = self.threshold if self.threshold > 0 else 1.0
            evidence.update(
                {
                    "distance_first": self.first,
                    "distance_rerun": self.again,
                    "first_over_threshold": self.first / over,
                    "rerun_over_threshold": self.again / over,
                    "reproduced": self.reproduced,
                }
            )
        return evidence


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
    """Name the rank behind failing pairs, arbitrating lone pairs, then classify the fault.

    A re-run that raises on any rank ends the resolution on every rank after the same gather:
    :class:`RerunFailed` carries the finding as far as it got (an arbitration that did not finish
    leaves its pair unresolved; a suspect whose re-run did not finish is ``ambiguous``).
    """
    failing = [(p.source, p.verifier) for p in pairs if not p.agree]
    attribution = attribute_pairs(failing)
    suspects = list(attribution.suspects)
    tasks, unresolved = _arbiters(ring, attribution.unexplained)
    arbitrations: list[_Arbitration] = []
    reruns: list[_Rerun] = []
    failure: tuple[str, dict[int, str], Exception | None] | None = None
    if tasks:
        arbitrations, failed, error = _arbitrate(comm, tasks, view, replay, criterion, together)
        if failed:
            failure = ("arbitration", failed, error)
            done = {(a.source, a.verifier) for a in arbitrations}
            unresolved += [(src, ver) for src, ver, _ in tasks if (src, ver) not in done]
    for a in sorted(arbitrations, key=lambda a: (a.source, a.verifier)):
        odd = a.odd_one_out
        if odd is None:
            unresolved.append((a.source, a.verifier))
        elif odd not in suspects:
            suspects.append(odd)
    if failure is None:
        reruns, failed, error = _classify(
            comm, ring, suspects, {src for src, _ in failing}, view, replay, criterion, together
        )
        if failed:
            failure = ("rerun", failed, error)

    candidates = sorted({r for pair in unresolved for r in pair})
    evidence: Evidence = {
        "pairs": [_pair_evidence(p, criterion) for p in pairs],
        "arbitrations": [a.to_evidence() for a in arbitrations],
        "reruns": [r.to_evidence() for r in reruns],
        "threshold": criterion.threshold if criterion.mode == "tolerant" else None,
    }
    if criterion.context is not None:
        evidence["tolerance"] = criterion.context
    if failure is not None:
        evidence["rerun_failed"] = failure_evidence(failure[0], failure[1])
    if not suspects:
        finding = Finding(check="replay", candidates=tuple(candidates), evidence=evidence)
    else:
        by_rank = {r.rank: r.classification for r in reruns}
        suspects.sort()
        if unresolved:
            evidence["unresolved_pairs"] = [list(p) for p in unresolved]
        finding = Finding(
            check="replay",
            suspects=tuple(suspects),
            candidates=tuple(candidates),
            classification=by_rank.get(suspects[0], "ambiguous"),
            evidence=evidence,
        )
    if failure is not None:
        raise RerunFailed(view.own.step, tuple(sorted(failure[1])), failure[2], finding)
    return finding


def _pair_evidence(p: PairOutcome, criterion: Criterion) -> Evidence:
    evidence = p.to_evidence()
    over = criterion.over(p.distance)
    if over is not None:
        evidence["over_threshold"] = over
    return evidence


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
) -> tuple[list[_Arbitration], dict[int, str], Exception | None]:
    """Each verifier forwards the disputed payload and its own replay to the pair's arbiter.

    Returns the arbitrations every rank finished, the ranks whose part raised (with what they
    reported) and this rank's own error."""
    rank = comm.rank
    request = ArbitrationRequest(payload=view.received, verifier_result=view.replayed)
    sends = [(arb, request.encode()) for _, ver, arb in tasks if ver == rank]
    inbox = comm.exchange(sends, [ver for _, ver, arb in tasks if arb == rank])
    mine: list[_Arbitration] = []
    jobs: list[tuple[int, int, int, ArbitrationRequest]] = []
    decoding: Exception | None = None
    try:
        jobs = [
            (src, ver, arb, ArbitrationRequest.decode(inbox[ver])) for src, ver, arb in tasks if arb == rank
        ]
    except Exception as exc:  # noqa: BLE001 - reported in the gather below, like a replay's error
        decoding = exc

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
                    to_source=criterion.distance(msg.payload.result, result),
                    to_verifier=criterion.distance(msg.verifier_result, result),
                )
            )

    # A message that did not decode runs no pass (lockstep: the others pad with fillers).
    _, tried = attempt(together, len(jobs), run, view.own.step)
    if decoding is not None:
        tried = Attempt(decoding)
    reports = comm.gather_objects(
        (tried.report, tried.error is not None, mine if tried.error is None else [])
    )
    failed = failed_ranks([r for r, _, _ in reports], [p for _, p, _ in reports])
    return [a for _, _, done in reports for a in done], failed, tried.error


def _classify(
    comm: Comm,
    ring: Ring,
    suspects: Sequence[int],
    sources: set[int],
    view: LocalView,
    replay: Replayer,
    criterion: Criterion,
    together: Together,
) -> tuple[list[_Rerun], dict[int, str], Exception | None]:
    """Each suspect recomputes what it is blamed for and compares with its first answer and, in
    tolerant mode, with the reference: the other party's answer (a suspect source gets its
    verifier's replay first). Returns the re-runs every rank finished, the ranks whose re-run
    raised (with what they reported) and this rank's own error."""
    mine: list[_Rerun] = []
    rank = comm.rank
    suspect = rank in suspects
    blamed_sources = sorted(s for s in suspects if s in sources)
    reference: ProbeResult | None = None
    received: object = None
    if criterion.mode == "tolerant":
        # Every rank knows the suspects and the ring, so every rank enters this exchange.
        verifiers = {ring.verifier_of(s): s for s in blamed_sources}
        sends = [(verifiers[rank], _reference_request(view))] if rank in verifiers else []
        inbox = comm.exchange(sends, [ring.verifier_of(rank)] if rank in blamed_sources else [])
        received = next(iter(inbox.values()), None)

    def run() -> None:
        nonlocal reference
        if rank in sources:
            again, first, what = replay(view.own), view.own.result, "own probe"
            if received is not None:
                reference = ArbitrationRequest.decode(received).verifier_result
        else:
            again, first, what = replay(view.received), view.replayed, "replay of its source's probe"
            reference = view.received.result
        rerun = _Rerun(rank=rank, rerun=what, same_answer=criterion.agree(first, again), mode=criterion.mode)
        if criterion.mode == "tolerant" and reference is not None:
            rerun = _Rerun(
                rank=rank,
                rerun=what,
                same_answer=rerun.same_answer,
                mode="tolerant",
                first=criterion.distance(first, reference),
                again=criterion.distance(again, reference),
                threshold=criterion.threshold,
            )
        mine.append(rerun)

    _, tried = attempt(together, 1 if suspect else 0, run if suspect else _nothing, view.own.step)
    done = mine[0] if mine and tried.error is None else None
    reports = comm.gather_objects((tried.report, tried.error is not None, done))
    failed = failed_ranks([r for r, _, _ in reports], [p for _, p, _ in reports])
    return [r for _, _, r in reports if r is not None], failed, tried.error


def _reference_request(view: LocalView) -> object:
    """What a verifier sends its blamed source: the disputed payload and its own replay of it."""
    return ArbitrationRequest(payload=view.received, verifier_result=view.replayed).encode()


def _nothing() -> None:
    return None
