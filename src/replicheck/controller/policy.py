"""Pure policy checks the executor applies before a destructive call."""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence


def cordon_refusal(node: str, schedulable_by_partition: Mapping[str, Sequence[str]]) -> str | None:
    """Why cordoning ``node`` is refused, or None when allowed.

    ``schedulable_by_partition`` maps each partition that contains ``node`` to the nodes of that
    partition that are schedulable right now. Cordoning the last one would leave the job's
    partition unable to run anything (including its own restart), so it is refused.
    """
    for partition, nodes in sorted(schedulable_by_partition.items()):
        others = [n for n in nodes if n != node]
        if node in nodes and not others:
            return f"last schedulable node of partition {partition}"
    return None


def retry_delay(attempt: int, base_s: float, max_s: float) -> float:
    """Exponential backoff: base, 2*base, 4*base, ... capped at ``max_s`` (attempt counts from 1)."""
    return float(min(max_s, base_s * (2 ** max(0, attempt - 1))))


def allocation_refusal(job_id: str, targets: Sequence[str], allocation: Sequence[str] | None) -> str | None:
    """Why an incident of ``job_id`` naming ``targets`` is refused, or None when every named node
    is in the job's allocation as the backend reported it (``None``: the backend knows no such
    job). The sender's own claims (``world_size``, node lists) are never the measure."""
    if allocation is None:
        return f"job {job_id} is not known to the backend, so its nodes cannot be verified"
    outside = [t for t in targets if t not in set(allocation)]
    if outside:
        shown = ", ".join(sorted(allocation)[:16]) or "no node"
        more = f" and {len(allocation) - 16} more" if len(allocation) > 16 else ""
        return (
            f"node(s) {', '.join(outside)} not in job {job_id}'s allocation as the backend reports it "
            f"({shown}{more})"
        )
    return None


def checkpoint_refusal(
    checkpoint: Mapping[str, object] | None, job_id: str, roots: Sequence[str]
) -> str | None:
    """Why resuming ``job_id`` from ``checkpoint`` is refused, or None when it may be used: its
    path must lie under one of ``roots`` (``{job_id}`` in a root is replaced by the job id), after
    ``..`` is collapsed. No checkpoint named: nothing to refuse (the job picks its own)."""
    if not checkpoint or checkpoint.get("path") in (None, ""):
        return None
    path = str(checkpoint.get("path"))
    if not roots:
        return f"checkpoint path {path!r} refused: no checkpoint_roots configured to resume from"
    if not path.startswith("/"):
        return f"checkpoint path {path!r} refused: not an absolute path"
    normal = posixpath.normpath(path)
    for template in roots:
        root = posixpath.normpath(template.replace("{job_id}", job_id))
        if normal == root or normal.startswith(root.rstrip("/") + "/"):
            return None
    allowed = ", ".join(r.replace("{job_id}", job_id) for r in roots)
    return f"checkpoint path {path!r} refused: not under a configured checkpoint root ({allowed})"
