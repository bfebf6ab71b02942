"""Pure decisions over what the ranks reported: votes and pair attribution."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from replicheck.incident import Check, Classification, JsonValue

Evidence = dict[str, JsonValue]
"""JSON-ready evidence of one finding, recorded in the incident under its check."""

# Order in which failing checks are reported: the most direct evidence first.
PRIORITY: tuple[Check, ...] = (
    "gradients",
    "reduced_gradients",
    "weights",
    "optimizer_state",
    "optimizer_update",
    "replay",
)


@dataclass(frozen=True)
class Finding:
    """One failed check: who it names, or who it could not tell apart."""

    check: Check
    """The check that failed."""
    suspects: tuple[int, ...] = ()
    """Ranks the evidence names."""
    candidates: tuple[int, ...] = ()
    """Ranks the evidence could not tell apart (when it names nobody)."""
    classification: Classification = "ambiguous"
    """How the suspects' re-runs classify the fault."""
    evidence: Evidence = field(default_factory=dict)
    """JSON-ready evidence recorded in the incident under ``check``."""

    @property
    def ambiguous(self) -> bool:
        return not self.suspects


@dataclass(frozen=True)
class Vote:
    """Result of comparing one value across replicas."""

    agree: bool
    """Every rank reported the same value."""
    dissenters: tuple[int, ...]
    """Ranks outside a strict majority (empty when there is none or everyone agrees)."""
    candidates: tuple[int, ...]
    """When there is no strict majority: every rank outside the largest group... or all."""


def vote(values: Sequence[int]) -> Vote:
    """Majority vote: a strict majority names the others; a tie (2 ranks, 2-2) names nobody."""
    counts = Counter(values)
    if len(counts) <= 1:
        return Vote(agree=True, dissenters=(), candidates=())
    value, n = counts.most_common(1)[0]
    if n * 2 > len(values):
        return Vote(
            agree=False, dissenters=tuple(r for r, v in enumerate(values) if v != value), candidates=()
        )
    return Vote(agree=False, dissenters=(), candidates=tuple(range(len(values))))


@dataclass(frozen=True)
class PairAttribution:
    """Failing ring pairs explained by ranks that appear in two of them, and the rest."""

    suspects: tuple[int, ...]
    """Ranks in two failing pairs whose partners are otherwise clean."""
    unexplained: tuple[tuple[int, int], ...]
    """Failing ``(source, verifier)`` pairs that need an arbiter."""


def attribute_pairs(failing: Sequence[tuple[int, int]]) -> PairAttribution:
    """A rank in two failing pairs (once as source, once as verifier) is the suspect.

    A rank counts only if its partners in those pairs appear once: in a ring of two, both
    ranks share both pairs and nothing can be concluded without a third rank.
    """
    count: Counter[int] = Counter()
    for src, ver in failing:
        count[src] += 1
        count[ver] += 1
    doubles = {r for r, c in count.items() if c >= 2}
    suspects = []
    for r in sorted(doubles):
        partners = {s if v == r else v for s, v in failing if r in (s, v)}
        if not partners & doubles:
            suspects.append(r)
    explained = set(suspects)
    unexplained = tuple(p for p in failing if not (set(p) & explained))
    return PairAttribution(suspects=tuple(suspects), unexplained=unexplained)


def arbitrate(agrees_with_source: bool, agrees_with_verifier: bool, source: int, verifier: int) -> int | None:
    """The odd one out of source, verifier and arbiter; ``None`` when the arbiter sides with neither."""
    if agrees_with_verifier and not agrees_with_source:
        return source
    if agrees_with_source and not agrees_with_verifier:
        return verifier
    return None


def calibration_noise(noises: Sequence[float]) -> float:
    """One calibration step's noise from every rank's replay-to-replay noise: the lower median,
    so one faulty rank (a fault in one of its calibration replays) cannot raise the tolerance;
    noise from kernels is a property of the job and every rank measures it."""
    ordered = sorted(noises)
    return ordered[(len(ordered) - 1) // 2] if ordered else 0.0


def primary(findings: Sequence[Finding]) -> Finding:
    """The finding reported as the incident's ``check``: the most direct evidence first."""
    return min(findings, key=lambda f: (PRIORITY.index(f.check), f.ambiguous))
