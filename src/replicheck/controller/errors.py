"""Typed errors of the controller. Backends raise the two BackendError kinds; the executor
turns them into retries (transient) or a ``failed`` incident (permanent)."""

from __future__ import annotations


class ControllerError(Exception):
    """Base of every error the controller reports to a user (never a stack trace)."""


class ConfigError(ControllerError):
    """The controller configuration (file, flags or arguments) is invalid."""


class StoreError(ControllerError):
    """The SQLite store cannot be opened or has a schema this build does not understand."""


class QuarantinedError(StoreError):
    """A stored row could not be read (damaged, or written by an incompatible build): it was set
    aside in the ``quarantine`` table and is skipped; the other rows are served."""


class UnknownIncidentError(ControllerError):
    """No incident with the given id is in the store."""


class InvalidTransitionError(ControllerError):
    """An operator command does not apply to the incident's current state."""


class DecisionConflictError(InvalidTransitionError):
    """An operator decision was refused because the incident is no longer in the state the
    operator decided on (another decision, or the controller, got there first)."""


class BackendError(ControllerError):
    """A backend call did not succeed."""


class TransientBackendError(BackendError):
    """A failure worth retrying (scheduler unreachable, timeout, busy)."""


class PermanentBackendError(BackendError):
    """A failure that retrying cannot fix (unknown node, invalid name, command missing)."""


class JoinNotBuiltError(PermanentBackendError):
    """The backend cannot start a replacement replica group yet: the path is designed
    (docs/no-restart.md, "The controller's join action") but not built. The incident fails with
    this message, for a person to start the group by hand; the job is never resumed instead."""

    def __init__(self, backend: str, job_id: str, replica_group: str) -> None:
        super().__init__(
            f"the {backend} backend cannot start a replacement replica group yet (designed in "
            f'docs/no-restart.md, "The controller\'s join action", not built): start one replacement '
            f"for replica group {replica_group} of job {job_id} by hand; the job was not resumed"
        )
        self.backend = backend
        self.job_id = job_id
        self.replica_group = replica_group


class NotYet(Exception):
    """An awaited condition (a replaced node coming back) does not hold yet; poll again later."""


class LeaseHeldError(ControllerError):
    """Another controller holds this database's lease; this one refuses to act."""
