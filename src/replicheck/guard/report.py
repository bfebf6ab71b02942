"""Turning findings into the incident record, and writing it once."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

from replicheck.guard.verdict import Finding, primary
from replicheck.incident import (
    Incident,
    Suspect,
    json_safe,
    make_incident_id,
    write_incident,
)

if TYPE_CHECKING:
    from replicheck.guard.core import Guard


class IncidentBuilder:
    """Builds the incident every rank holds identically, and lets one healthy rank write it."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard

    def build(self, step: int, findings: Sequence[Finding]) -> Incident:
        g = self.guard
        main = primary(findings)
        suspects = tuple(Suspect(rank=r, node=g.nodes[r]) for r in main.suspects)
        candidates = tuple(Suspect(rank=r, node=g.nodes[r]) for r in main.candidates)
        names = [s.node.name for s in (suspects or candidates)]
        evidence: dict[str, Any] = {
            f.check: {**json_safe(f.evidence), "suspects": list(f.suspects), "candidates": list(f.candidates),
                      "classification": f.classification if f.suspects else "ambiguous"}
            for f in findings
        }
        evidence["param_names"] = g.param_names
        evidence["ring"] = list(g.ring.order)
        evidence["mode"] = g.config.mode
        return Incident(
            id=make_incident_id(g.job_id, step, main.check),
            job_id=g.job_id,
            step=step,
            check=main.check,  # type: ignore[arg-type]
            suspect_ranks=tuple(main.suspects),
            suspect_nodes=tuple(dict.fromkeys(names)),
            classification=main.classification if main.suspects else "ambiguous",  # type: ignore[arg-type]
            suspects=suspects,
            candidates=candidates,
            evidence=evidence,
            last_verified_step=g.last_verified_step,
            world_size=g.world_size,
            checks_failed=tuple(f.check for f in findings),
        )

    def writer_rank(self, incident: Incident) -> int:
        """The lowest rank that is not a suspect: a faulty rank may write garbage."""
        g = self.guard
        named = set(incident.suspect_ranks)
        healthy = [r for r in range(g.world_size) if r not in named]
        return healthy[0] if healthy else 0

    def write(self, incident: Incident) -> None:
        directory = self.guard.config.incident_dir
        if directory is not None and self.guard.rank == self.writer_rank(incident):
            write_incident(incident, directory)
