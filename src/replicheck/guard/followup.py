"""The failure path of a verification step: arbitration and re-runs, in lockstep on every rank.

Every rank calls :func:`resolve_replay` with the same failing pairs (they come from one
all-gather), so every rank takes part in the same exchanges and reaches the same verdict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from replicheck.guard.comm import Comm
from replicheck.guard.probe import ProbeResult, agrees, compare
from replicheck.guard.ring import Ring
from replicheck.guard.verdict import Finding, arbitrate, attribute_pairs

Replayer = Callable[[dict[str, Any]], ProbeResult]
"""Replays a probe payload (as sent by its source) on this rank."""


@dataclass(frozen=True)
class LocalView:
    """What this rank knows of the step's probes."""

    own_payload: dict[str, Any]
    """The payload this rank sent (its probe, seed and claimed result)."""
    received: dict[str, Any]
    """The payload this rank received from its source."""
    replayed: ProbeResult
    """This rank's replay of ``received``."""


def resolve_replay(
    *,
    comm: Comm,
    ring: Ring,
    failing: Sequence[tuple[int, int]],
    view: LocalView,
    replayer: Replayer,
    mode: str,
    threshold: float,
    pair_evidence: list[dict[str, Any]],
) -> Finding:
    """Name the rank behind failing pairs, arbitrating lone pairs, then classify the fault."""
    rank = comm.rank
    attribution = attribute_pairs(failing)
    suspects = list(attribution.suspects)
    unresolved: list[tuple[int, int]] = []
    arbitrations: list[dict[str, Any]] = []

    # Arbitration: the verifier forwards the disputed payload and its own replay to a third rank.
    tasks: list[tuple[int, int, int]] = []
    busy: list[int] = []
    for src, ver in attribution.unexplained:
        arb = ring.arbiter_for(src, ver, busy=busy)
        if arb is None:
            unresolved.append((src, ver))
        else:
            tasks.append((src, ver, arb))
            busy.append(arb)
    if tasks:
        sends = [(arb, {"payload": view.received, "verifier_result": view.replayed.to_wire()})
                 for src, ver, arb in tasks if ver == rank]
        recv_from = [ver for src, ver, arb in tasks if arb == rank]
        inbox = comm.exchange(sends, recv_from)
        mine = []
        for src, ver, arb in tasks:
            if arb != rank:
                continue
            msg = inbox[ver]
            result = replayer(msg["payload"])
            claim = ProbeResult.from_wire(msg["payload"]["result"])
            verifier_result = ProbeResult.from_wire(msg["verifier_result"])
            mine.append({
                "source": src, "verifier": ver, "arbiter": arb,
                "agrees_with_source": agrees(compare(claim, result, mode, threshold), mode, threshold),
                "agrees_with_verifier": agrees(compare(verifier_result, result, mode, threshold), mode, threshold),
            })
        for reports in comm.gather_objects(mine):
            arbitrations.extend(reports)
        for a in sorted(arbitrations, key=lambda a: (a["source"], a["verifier"])):
            odd = arbitrate(a["agrees_with_source"], a["agrees_with_verifier"], a["source"], a["verifier"])
            a["odd_one_out"] = odd
            if odd is None:
                unresolved.append((a["source"], a["verifier"]))
            elif odd not in suspects:
                suspects.append(odd)

    # Classification: each suspect recomputes what it is blamed for and compares with its first answer.
    role_source = {src for src, _ in failing}
    mine_cls: dict[str, Any] | None = None
    if rank in suspects:
        if rank in role_source:
            again = replayer(view.own_payload)
            first = ProbeResult.from_wire(view.own_payload["result"])
            what = "own probe"
        else:
            again = replayer(view.received)
            first = view.replayed
            what = "replay of its source's probe"
        same = agrees(compare(first, again, mode, threshold), mode, threshold)
        mine_cls = {"rank": rank, "rerun": what, "same_answer": same,
                    "classification": "persistent" if same else "transient"}
    reruns = [c for c in comm.gather_objects(mine_cls) if c is not None]

    candidates = sorted({r for pair in unresolved for r in pair})
    evidence: dict[str, Any] = {"pairs": pair_evidence, "arbitrations": arbitrations, "reruns": reruns,
                                "threshold": threshold if mode == "tolerant" else None}
    if not suspects:
        return Finding(check="replay", candidates=tuple(candidates), evidence=evidence)
    by_rank = {c["rank"]: c["classification"] for c in reruns}
    suspects.sort()
    classification = by_rank.get(suspects[0], "ambiguous")
    if unresolved:
        evidence["unresolved_pairs"] = [list(p) for p in unresolved]
    return Finding(check="replay", suspects=tuple(suspects), candidates=tuple(candidates),
                   classification=classification, evidence=evidence)
