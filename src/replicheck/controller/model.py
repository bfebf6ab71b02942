"""The controller's immutable data: incident states, the stored record, events and actions."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from replicheck.incident import Classification


class State(str, enum.Enum):
    """Where an incident is in the recovery procedure."""

    DETECTED = "detected"
    CORDONED = "cordoned"
    TRIAGING = "triaging"
    AWAITING_APPROVAL = "awaiting_approval"
    APPROVED = "approved"
    REPLACING = "replacing"
    REPLACED = "replaced"
    RESUMED = "resumed"
    JOINED = "joined"
    """A replacement replica group was started to join the running job live (``no_restart``
    incidents): the job was never stopped or resumed."""
    DISMISSED = "dismissed"
    UNCORDONED = "uncordoned"
    FAILED = "failed"
    REFUSED = "refused"
    """The incident's job or nodes could not be verified against the backend: nothing was done."""


TERMINAL = frozenset({State.RESUMED, State.JOINED, State.UNCORDONED, State.REFUSED})
"""States in which nothing more happens. ``failed`` waits for a human (dismiss)."""

DISMISSABLE = frozenset(
    {
        State.DETECTED,
        State.CORDONED,
        State.TRIAGING,
        State.AWAITING_APPROVAL,
        State.APPROVED,
        State.FAILED,
    }
)
"""States from which an operator may dismiss: anything before a replacement is under way."""


class ActionKind(str, enum.Enum):
    """Side effects the executor performs through a backend."""

    CORDON = "cordon"
    SELFTEST = "selftest"
    UNCORDON = "uncordon"
    REPLACE = "replace"
    AWAIT_RETURN = "await_return"
    RESUME = "resume"
    VERIFY = "verify"
    """Ask the backend for the job's allocation (read-only, so it runs in dry-run too)."""
    JOIN = "join_replacement"
    """Start one replacement replica group that joins the running job live (instead of RESUME,
    for an incident whose job went on without the suspect's group: ``continuation``)."""


DESTRUCTIVE = frozenset(
    {ActionKind.CORDON, ActionKind.UNCORDON, ActionKind.REPLACE, ActionKind.RESUME, ActionKind.JOIN}
)
"""Actions held back in dry-run mode."""


@dataclass(frozen=True)
class Action:
    """One keyed side effect. The key is deterministic, so emitting it twice is harmless."""

    key: str
    """Idempotency key, made only by :func:`action_key` and never parsed back."""
    incident_id: str
    """The incident this action serves."""
    kind: ActionKind
    """What to do."""
    node: str | None = None
    """The node acted on (None for resume and join: they act on the job)."""
    params: Mapping[str, Any] = field(default_factory=dict)
    """Kind-specific parameters (JSON values)."""


def action_key(incident_id: str, kind: ActionKind, target: str) -> str:
    """The one place keys are made: ``<incident>:<kind>:<node or job>``. Code that needs an
    action's kind or node reads them from the action, or builds the key it looks for here;
    the grammar keeps ``:`` out of node names and job ids, so distinct actions get distinct keys."""
    return f"{incident_id}:{kind.value}:{target}"


@dataclass(frozen=True)
class TriageResult:
    """Outcome of the known-answer self-test on one node."""

    node: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class Record:
    """The controller's view of one incident. Replaced, never mutated."""

    incident_id: str
    job_id: str
    classification: Classification
    state: State = State.DETECTED
    targets: tuple[str, ...] = ()
    """Nodes the procedure acts on (suspects, or candidates while ambiguous)."""
    checkpoint: Mapping[str, Any] | None = None
    """Recommended checkpoint ``{"step", "path"}`` from the incident."""
    outstanding: tuple[str, ...] = ()
    """Keys of actions the current state waits for."""
    cordoned: tuple[str, ...] = ()
    cordon_skipped: tuple[tuple[str, str], ...] = ()
    """(node, why) for cordons the policy refused (last schedulable node)."""
    triage: tuple[TriageResult, ...] = ()
    approved_by: str | None = None
    approved_at: str | None = None
    dismissed_by: str | None = None
    dismissed_at: str | None = None
    replaced: tuple[str, ...] = ()
    returned: tuple[tuple[str, bool, str | None], ...] = ()
    """(node, back, replacement node name if a different one took its place)."""
    resume: Mapping[str, Any] | None = None
    continuation: Mapping[str, str] | None = None
    """The incident's ``continuation`` (``{"mode": "no_restart", "replica_group": ID}``) when the
    job went on without the suspect's replica group: recovery joins a replacement group instead
    of resuming the job. None: today's path (also for ambiguous, data and divergence incidents)."""
    joined: Mapping[str, Any] | None = None
    """What the backend reported for the replacement group's start (None: not started yet)."""
    reason: str = ""
    """Why the record is in its current state (or why it is waiting)."""
    vouched_by: str = ""
    """The job-scoped credential that delivered the incident and speaks for its job ("" when
    none did: a watched directory, an unscoped token, the Python API). Auto-approve needs one."""
    allocation: tuple[str, ...] | None = None
    """The job's nodes as the backend reported them (None: not asked yet)."""
    unverified: str = ""
    """Why the job's allocation could not be read (the incident is refused)."""

    def to_json(self) -> str:
        data = asdict(self)
        data["state"] = self.state.value
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Record:
        d = json.loads(text)
        d["state"] = State(d["state"])
        for key in ("targets", "outstanding", "cordoned", "replaced"):
            d[key] = tuple(d[key])
        if d.get("allocation") is not None:
            d["allocation"] = tuple(d["allocation"])
        d["cordon_skipped"] = tuple(tuple(x) for x in d["cordon_skipped"])
        d["returned"] = tuple(tuple(x) for x in d["returned"])
        d["triage"] = tuple(TriageResult(**t) for t in d["triage"])
        return cls(**d)

    def evolve(self, **changes: Any) -> Record:
        return replace(self, **changes)


# --- events -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ActionDone:
    """An action finished; ``outcome`` is what the backend reported."""

    key: str
    kind: ActionKind
    node: str | None
    outcome: Mapping[str, Any]


@dataclass(frozen=True)
class ActionFailed:
    """An action failed permanently (or ran out of retries)."""

    key: str
    kind: ActionKind
    node: str | None
    reason: str


@dataclass(frozen=True)
class Approved:
    """A person (or the auto-approve policy) approved the replacement."""

    by: str
    at: str
    os_user: str = ""
    """The operating-system account (``name uid N``) that ran the command, when known."""


@dataclass(frozen=True)
class Dismissed:
    """A person dismissed the incident (false alarm): undo the cordon."""

    by: str
    at: str
    os_user: str = ""
    """The operating-system account (``name uid N``) that ran the command, when known."""


@dataclass(frozen=True)
class Tick:
    """A reconcile pass: the facts policy decisions need, gathered by the controller."""

    now: str
    auto_approve: bool = False
    triage: bool = True
    triage_persistent: bool = False
    replacements_in_window: int = 0
    max_replacements: int = 1
    cordons_in_window: int = 0
    max_cordons: int = 2**31
    """At most this many cordons within the window, over all incidents (blast radius)."""
    max_cordons_per_incident: int = 2**31
    """An incident naming more nodes than this is not acted on (it fails, for a person)."""
    job_cordons_in_window: int = 0
    """Cordons within the window by the incidents of this record's job."""
    max_cordons_per_job: int = 2**31
    """At most this many cordons within the window for one job (blast radius per job)."""
    return_deadline: str = ""
    """ISO time until which a replaced node is awaited (now + return timeout)."""


Event = ActionDone | ActionFailed | Approved | Dismissed | Tick


@dataclass(frozen=True)
class Transition:
    """A state change, for display and the audit log."""

    incident_id: str
    from_state: State
    to_state: State
    reason: str
    at: str


@dataclass(frozen=True)
class Step:
    """What the pure transition function returns."""

    record: Record
    actions: tuple[Action, ...] = ()
    cancel: tuple[str, ...] = ()
    """Keys of pending actions that no longer apply."""
