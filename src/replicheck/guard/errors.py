"""Exceptions raised by the guard."""

from __future__ import annotations

from replicheck.incident import Incident


class GuardError(Exception):
    """Base class of replicheck's training-side errors."""


class GuardConfigError(GuardError, ValueError):
    """A guard configuration or argument is invalid."""


class DeterminismError(GuardConfigError):
    """A probe pass (exact mode, deterministic kernels) hit an operation with no deterministic kernel."""

    def __init__(self, message: str, op: str | None = None) -> None:
        self.op = op
        """The operation torch named, when it named one."""
        super().__init__(message)


class UpdateReplayError(GuardConfigError):
    """Plain FSDP2: every rank's optimizer update differed from its replay, so the optimizer (or a
    step hook that changes parameters) does not compute what a fresh optimizer of its class does;
    no node is blamed and the step's update is undone on every rank."""


class CommError(GuardError):
    """The guard's point-to-point exchange was asked for a pattern it cannot match."""


class BatchError(GuardError, ValueError):
    """A batch is not a pytree of tensors sharing their first (sample) dimension."""


class CorruptionDetected(GuardError):
    """A check failed: the step's update was not applied. Raised on every rank alike."""

    def __init__(self, incident: Incident, write_error: str | None = None) -> None:
        self.incident = incident
        self.write_error = write_error
        """Why the incident file could not be written, when it could not (the step is stopped anyway)."""
        who = ", ".join(f"rank {r} on {n}" for r, n in zip(incident.suspect_ranks, incident.suspect_nodes))
        super().__init__(
            f"silent data corruption at step {incident.step}: check {incident.check!r}, "
            f"{incident.classification}, suspect: {who or 'undetermined'}"
            + (f" (incident file NOT written: {write_error})" if write_error else "")
        )


class GuardMisuseError(GuardError, RuntimeError):
    """The guard was used in a way that would change or skip what it checks (a clear message says how)."""


class LossContractError(BatchError, GuardMisuseError):
    """``loss_fn`` returned something other than a scalar loss or a well-formed ``LossSum``."""


class PeerFailed(GuardError):
    """Another rank failed inside the same step (its error is raised there); this rank stops too."""

    def __init__(self, step: int, ranks: tuple[int, ...], *, incident: Incident | None = None) -> None:
        self.step = step
        self.ranks = ranks
        self.incident = incident
        """The incident the step was resolving when a rank's re-run failed (recorded as far as it
        was resolved), or ``None``."""
        super().__init__(
            f"step {step} stopped: rank(s) {', '.join(map(str, ranks))} raised an error inside the step "
            "(see that rank's traceback); no rank applied the update"
            + (f"; incident {incident.id} recorded as far as it was resolved" if incident is not None else "")
        )
