"""JSON views of incidents for the API and the page, including the plain-language account of
what a decision will do. Pure functions over stored data; standard library only."""

from __future__ import annotations

import dataclasses
from typing import Any

from replicheck.controller.config import ControllerConfig
from replicheck.controller.controller import IncidentView
from replicheck.controller.model import DISMISSABLE, Record, State


def record_json(record: Record) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["state"] = record.state.value
    return data


def summary_json(record: Record) -> dict[str, Any]:
    """One line of the incident list."""
    return {
        "id": record.incident_id,
        "job_id": record.job_id,
        "state": record.state.value,
        "classification": record.classification,
        "nodes": list(record.targets),
        "reason": record.reason,
        "decision_pending": record.state is State.AWAITING_APPROVAL,
    }


def detail_json(view: IncidentView, config: ControllerConfig, applies: bool | None) -> dict[str, Any]:
    """Everything the page shows about one incident."""
    record = view.record
    return {
        "incident": view.incident.incident.to_dict(),
        "record": record_json(record),
        "source": view.incident.source,
        "first_seen": view.incident.first_seen,
        "deliveries": view.incident.deliveries,
        "actions": [dataclasses.asdict(a) | {"kind": a.kind.value} for a in view.actions],
        "audit": [dataclasses.asdict(a) for a in view.audit],
        "decision_pending": record.state is State.AWAITING_APPROVAL,
        "can_dismiss": record.state in DISMISSABLE,
        "consequences": consequences(view, config, applies),
    }


def consequences(view: IncidentView, config: ControllerConfig, applies: bool | None) -> dict[str, str]:
    """What approving and dismissing will do, in words, from the record and the policy."""
    r = view.record
    nodes = ", ".join(r.targets) or "no node"
    ck = r.checkpoint or {}
    if ck.get("step") is not None:
        where = f"from checkpoint step {ck.get('step')} ({ck.get('path', 'path not given')})"
    else:
        where = "with no checkpoint named by the incident (the job's own restart logic decides)"
    hours = config.return_timeout_s / 3600
    approve = (
        f"Node(s) {nodes} will be taken out of service and replaced (a spare or the repaired node "
        f"takes each one's place; the controller waits up to {hours:g} h), then job {r.job_id} is "
        f"resumed {where}, without {nodes}."
    )
    if r.continuation is not None:
        group = r.continuation.get("replica_group")
        approve = (
            f"Node(s) {nodes} will be taken out of service and replaced (a spare or the repaired node "
            f"takes each one's place; the controller waits up to {hours:g} h), then one replacement "
            f"for replica group {group} starts there and joins job {r.job_id} live. The job, which "
            f"went on without that group, is not restarted or resumed."
        )
    if len(r.targets) > config.max_replacements:
        approve += (
            f" Note: this needs {len(r.targets)} replacements but the policy allows "
            f"{config.max_replacements} per {config.replacement_window_s / 3600:g} h; it will wait."
        )
    dismiss = (
        f"The incident is treated as a false alarm: the cordon on {', '.join(r.cordoned) or 'no node'} "
        f"is lifted and nothing is replaced. Job {r.job_id} is NOT resumed by the controller; "
        f"restart it yourself if it stopped."
    )
    if applies is False:
        note = " The controller runs in dry-run mode: it records the decision but performs no cluster action."
        approve, dismiss = approve + note, dismiss + note
    status = {
        State.AWAITING_APPROVAL: "A decision is needed.",
        State.APPROVED: f"Approved by {r.approved_by} at {r.approved_at}; {r.reason}.",
        State.DISMISSED: f"Dismissed by {r.dismissed_by} at {r.dismissed_at}; {r.reason}.",
        State.UNCORDONED: f"Dismissed by {r.dismissed_by}; closed: {r.reason}.",
        State.RESUMED: f"Closed: {r.reason}.",
        State.JOINED: f"Closed: {r.reason}.",
        State.REFUSED: (
            f"Refused: nothing was done and nothing will be ({r.reason}). If job {r.job_id} really "
            "runs on these nodes, check how the cluster reports its allocation, then act by hand."
        ),
    }.get(r.state, f"No decision yet: {r.state.value} ({r.reason}).")
    return {"approve": approve, "dismiss": dismiss, "status": status}
