"""Which checkpoint is clean: the resume rule, as pure functions over manifests.

Rule ("last_pass"): let ``v`` be the newest step whose replay verification passed before the
incident. The guard applies a step's update only after that step's checks passed, so the update
of step ``v`` was computed by verified arithmetic, while steps ``v+1 .. incident-1`` were not
verified. A checkpoint at step ``s`` holds the state after step ``s``'s update, so it is clean
when ``s <= v``. The resume point is the newest such checkpoint.

Rule ("two_passes", for intermittent faults that may pass one verification by chance): the same
with ``v`` replaced by the passing verification before ``v``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from replicheck.checkpoint.errors import CheckpointConfigError
from replicheck.checkpoint.manifest import Manifest
from replicheck.incident import Incident

Policy = Literal["last_pass", "two_passes"]
POLICIES: tuple[str, ...] = ("last_pass", "two_passes")


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise CheckpointConfigError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")


def last_pass(incident: Incident, manifests: Sequence[Manifest]) -> int | None:
    """``v``: the incident's last passing verification; if the incident does not know it (a guard
    resumed without being told), the newest one recorded by a checkpoint saved before it."""
    if incident.last_verified_step is not None:
        return incident.last_verified_step
    known = [
        m.last_verified_step for m in manifests if m.step < incident.step and m.last_verified_step is not None
    ]
    return max(known) if known else None


def previous_pass(v: int, manifests: Sequence[Manifest]) -> int | None:
    """The passing verification before ``v``: ``v - verify_every`` (every multiple of the period
    up to ``v`` passed, or the job would have stopped), else the newest other one recorded."""
    periods = [
        m.verify_every
        for m in sorted(manifests, key=lambda m: m.step)
        if m.step <= v and m.verify_every is not None
    ]
    if periods:
        prev = v - periods[-1]
        return prev if prev >= 0 else None
    older = [
        m.last_verified_step
        for m in manifests
        if m.last_verified_step is not None and m.last_verified_step < v
    ]
    return max(older) if older else None


def clean_bound(
    incident: Incident | None, manifests: Sequence[Manifest], policy: str = "last_pass"
) -> int | None:
    """The newest step a clean checkpoint may hold; ``None`` without an incident means "any",
    and with an incident means no checkpoint is known clean (restart from the initial state)."""
    check_policy(policy)
    if incident is None:
        return None
    v = last_pass(incident, manifests)
    if v is None:
        return None
    if policy == "two_passes":
        return previous_pass(v, manifests)
    return v


def eligible(step: int, incident: Incident | None, bound: int | None) -> bool:
    """Whether a checkpoint at ``step`` may be resumed from under ``bound``."""
    if incident is None:
        return True
    return bound is not None and step <= bound and step < incident.step
