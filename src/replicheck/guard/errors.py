"""Exceptions raised by the guard."""

from __future__ import annotations

from replicheck.incident import Incident


class GuardError(Exception):
    """Base class of replicheck's training-side errors."""


class GuardConfigError(GuardError, ValueError):
    """A guard configuration or argument is invalid."""


class BatchError(GuardError, ValueError):
    """A batch is not a pytree of tensors sharing their first (sample) dimension."""


class CorruptionDetected(GuardError):
    """A check failed: the step's update was not applied. Raised on every rank alike."""

    def __init__(self, incident: Incident) -> None:
        self.incident = incident
        who = ", ".join(f"rank {r} on {n}" for r, n in zip(incident.suspect_ranks, incident.suspect_nodes))
        super().__init__(
            f"silent data corruption at step {incident.step}: check {incident.check!r}, "
            f"{incident.classification}, suspect: {who or 'undetermined'}"
        )
