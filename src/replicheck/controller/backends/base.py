"""The interface between the executor and a cluster. Every call is keyed and must be
idempotent: a backend observes before it acts, so repeating a call whose result was lost
(controller killed mid-action) does not repeat the side effect."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from replicheck.controller.errors import PermanentBackendError

_NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_node_name(name: str) -> str:
    """Return ``name`` if it is one plain node name; hostlist expressions and options are refused."""
    if not isinstance(name, str) or not _NODE_NAME.match(name):
        raise PermanentBackendError(f"refusing invalid node name {name!r}")
    return name


@dataclass(frozen=True)
class NodeInfo:
    """One node as the backend reports it."""

    name: str
    state: str
    """Backend state word (idle, allocated, drained, fail, ...)."""
    reason: str = ""
    partitions: tuple[str, ...] = ()
    schedulable: bool = True
    """Whether new work may start on it."""
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ResumeRequest:
    """What resuming a job needs: which job, from where, avoiding which nodes."""

    incident_id: str
    job_id: str
    checkpoint: Mapping[str, Any] | None
    """``{"step": int, "path": str}`` or None (the job picks its newest checkpoint)."""
    exclude: tuple[str, ...]
    """Nodes the resumed job must not use (replaced nodes not back yet)."""
    previous_attempt_at: str | None = None
    """When an earlier attempt of this resume started whose outcome was never recorded (the
    controller stopped during the call), ISO time; None when no attempt is in doubt. A backend
    that cannot observe an old side effect uses it to decide whether repeating is safe."""
    allocation: tuple[str, ...] | None = None
    """The job's nodes as the backend reported them when the incident was verified (None: the
    incident was never verified, e.g. one stored by an older controller). A backend that can
    tell a job id reused by another job from the incident's job compares against it."""


@dataclass(frozen=True)
class JoinRequest:
    """What starting one replacement replica group needs: which job (still running, never
    restarted), which group it replaces, on which nodes."""

    incident_id: str
    job_id: str
    replica_group: str
    """The replica group that left (the incident's ``continuation``); the replacement takes its id."""
    nodes: tuple[str, ...]
    """Nodes that took the replaced ones' place (or came back); empty: the backend picks."""
    exclude: tuple[str, ...]
    """Replaced nodes that are not back: the replacement group must not use them."""
    previous_attempt_at: str | None = None
    """When an earlier attempt of this join started whose outcome was never recorded (the
    controller stopped during the call), ISO time; None when no attempt is in doubt."""
    allocation: tuple[str, ...] | None = None
    """The job's nodes as the backend reported them when the incident was verified."""


class Backend(Protocol):
    """What the executor needs from a cluster. ``key`` is the action's idempotency key."""

    name: str

    def cordon(self, node: str, reason: str, key: str) -> Mapping[str, Any]: ...

    def uncordon(self, node: str, reason_prefix: str, key: str) -> Mapping[str, Any]: ...

    def selftest(self, node: str, key: str) -> Mapping[str, Any]:
        """Run the known-answer self-test pinned to ``node``: ``{"passed": bool, "detail": str}``."""

    def replace(self, node: str, key: str) -> Mapping[str, Any]: ...

    def await_return(self, node: str, key: str) -> Mapping[str, Any]:
        """``{"back": bool, "replacement": name|None}``; raise NotYet while still away."""

    def resume(self, request: ResumeRequest, key: str) -> Mapping[str, Any]: ...

    def join(self, request: JoinRequest, key: str) -> Mapping[str, Any]:
        """Start one replacement replica group that joins the running job live (never a restart
        of the job). Raise :class:`JoinNotBuiltError` where the path is designed but not built."""

    def schedulable_by_partition(self, node: str) -> Mapping[str, Sequence[str]]:
        """For each partition containing ``node``: its currently schedulable nodes."""

    def list_nodes(self) -> list[NodeInfo]: ...

    def allocation(self, job_id: str) -> frozenset[str] | None:
        """The nodes of job ``job_id`` as the cluster itself reports them (running, or finished
        while the cluster still remembers it), under every name an incident may use for them;
        None when the cluster knows no such job. Read-only."""
