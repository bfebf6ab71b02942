"""Plain-text rendering of records and nodes for the cluster-side commands (all escaped)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from replicheck.cli._support import esc

if TYPE_CHECKING:
    from replicheck.controller.backends.base import NodeInfo
    from replicheck.controller.model import Record


RECORD_HEADER = esc(f"{'INCIDENT':<36} {'STATE':<18} {'JOB':<10} {'NODES':<16} REASON")
NODE_HEADER = esc(f"{'NODE':<16} {'STATE':<14} {'PARTITIONS':<12} REASON")


def record_line(r: Record) -> str:
    nodes = ",".join(r.targets) or "-"
    return esc(f"{r.incident_id:<36} {r.state.value:<18} {r.job_id:<10} {nodes:<16} {r.reason}")


def record_detail(r: Record) -> list[str]:
    lines = [
        f"state:          {r.state.value}",
        f"reason:         {r.reason}",
        f"classification: {r.classification}",
        f"job:            {r.job_id}",
        f"nodes:          {', '.join(r.targets) or '-'}",
        f"cordoned:       {', '.join(r.cordoned) or '-'}",
    ]
    lines += [f"not cordoned:   {n} ({why})" for n, why in r.cordon_skipped]
    if r.triage:
        lines.append("triage:")
        lines += [f"  {t.node}: {'passed' if t.passed else 'FAILED'} - {t.detail}" for t in r.triage]
    if r.checkpoint:
        lines.append(f"checkpoint:     step {r.checkpoint.get('step')} at {r.checkpoint.get('path')}")
    if r.approved_by:
        lines.append(f"approved:       by {r.approved_by} at {r.approved_at}")
    if r.dismissed_by:
        lines.append(f"dismissed:      by {r.dismissed_by} at {r.dismissed_at}")
    if r.resume:
        lines.append(f"resume:         {r.resume.get('detail', r.resume)}")
    return [esc(line) for line in lines]


def node_line(n: NodeInfo) -> str:
    return esc(f"{n.name:<16} {n.state:<14} {','.join(n.partitions):<12} {n.reason}")
