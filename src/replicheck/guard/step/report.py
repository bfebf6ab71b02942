"""Turning findings into the incident record, and writing it once."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from replicheck.guard.attribution.verdict import Evidence, Finding, primary
from replicheck.guard.config import Mode
from replicheck.guard.transport.comm import Comm
from replicheck.incident import (
    HARDWARE_CLASSIFICATIONS,
    INCIDENT_FILE_MODE,
    Classification,
    Incident,
    NodeIdentity,
    Suspect,
    json_safe,
    make_incident_id,
    write_incident,
)
from replicheck.timefmt import utc_iso

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IncidentBuilder:
    """Builds the incident every rank holds identically, and lets one healthy rank write it."""

    job_id: str
    """The job the incident belongs to."""
    rank: int
    """This process's rank."""
    nodes: tuple[NodeIdentity, ...]
    """Node of every rank, indexed by rank."""
    param_names: tuple[str, ...]
    """Names of the checked parameters (fingerprint rows are in this order)."""
    ring: tuple[int, ...]
    """The verification ring's rank order."""
    mode: Mode
    """The guard's comparison mode."""
    incident_dir: str | None
    """Where the incident is written, or ``None``."""
    attempt: str = ""
    """Which restart of the job this is (see RuntimeInfo.attempt); part of the incident id."""
    incident_mode: int = INCIDENT_FILE_MODE
    """Permission bits of the incident file (default 0o640: the group may read it)."""

    @property
    def world_size(self) -> int:
        return len(self.nodes)

    def build(
        self, step: int, findings: Sequence[Finding], last_verified_step: int | None, *, time: str
    ) -> Incident:
        """The incident of ``step``; ``time`` must be one value agreed by every rank (clocks and the
        moment each rank gets here differ, and every rank must hold the same record)."""
        main = primary(findings)
        suspects = tuple(Suspect(rank=r, node=self.nodes[r]) for r in main.suspects)
        candidates = tuple(Suspect(rank=r, node=self.nodes[r]) for r in main.candidates)
        names = [s.node.name for s in (suspects or candidates)]
        evidence: Evidence = {
            f.check: {
                **json_safe(f.evidence),
                "suspects": list(f.suspects),
                "candidates": list(f.candidates),
                "classification": _classification(f),
            }
            for f in findings
        }
        evidence["param_names"] = list(self.param_names)
        evidence["ring"] = list(self.ring)
        evidence["mode"] = self.mode
        return Incident(
            id=make_incident_id(self.job_id, step, main.check, self.attempt),
            job_id=self.job_id,
            step=step,
            check=main.check,
            suspect_ranks=tuple(main.suspects),
            suspect_nodes=tuple(dict.fromkeys(names)),
            classification=_classification(main),
            suspects=suspects,
            candidates=candidates,
            evidence=evidence,
            last_verified_step=last_verified_step,
            world_size=self.world_size,
            checks_failed=tuple(f.check for f in findings),
            time=time,
        )

    def raised_at(self, comm: Comm) -> str:
        """Collective: the incident's time, rank 0's clock as every rank's."""
        return comm.gather_objects(utc_iso())[0]

    def writer_rank(self, incident: Incident) -> int:
        """The lowest rank that is not a suspect: a faulty rank may write garbage."""
        named = set(incident.suspect_ranks)
        healthy = [r for r in range(self.world_size) if r not in named]
        return healthy[0] if healthy else 0

    def write(self, incident: Incident) -> None:
        if self.incident_dir is not None and self.rank == self.writer_rank(incident):
            path = write_incident(incident, self.incident_dir, mode=self.incident_mode)
            log.error("incident %s written to %s", incident.id, path)


def _classification(f: Finding) -> Classification:
    """A finding that names nobody is ambiguous, unless it says why nobody is to blame."""
    if f.suspects or f.classification not in HARDWARE_CLASSIFICATIONS:
        return f.classification
    return "ambiguous"
