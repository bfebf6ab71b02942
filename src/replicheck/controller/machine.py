"""The incident state machine as pure functions: ``transition(record, event) -> Step``.

No I/O and no clock: every fact a decision needs arrives in the event. Operator events
(approve, dismiss) in the wrong state raise InvalidTransitionError; action results only
update the record; phase changes happen on ``Tick`` once no action is outstanding, so each
state change is one visible transition.
"""

from __future__ import annotations

from replicheck.controller.errors import InvalidTransitionError
from replicheck.controller.model import (
    DISMISSABLE,
    Action,
    ActionDone,
    ActionFailed,
    ActionKind,
    Approved,
    Dismissed,
    Event,
    Record,
    State,
    Step,
    Tick,
    TriageResult,
    action_key,
)
from replicheck.controller.policy import allocation_refusal
from replicheck.incident import HARDWARE_CLASSIFICATIONS, Classification, Incident

NEEDS_TRIAGE: frozenset[Classification] = frozenset({"ambiguous", "transient"})
JOINS_LIVE: frozenset[Classification] = frozenset({"persistent", "transient"})
"""Verdicts that name one suspect group, so a job that went on without it gets a replacement
group that joins live. ``ambiguous`` (no group can be trusted alone) keeps the resume path."""

_NO_NODE_NOTE = {
    "data": "another device reproduced the bad result, so the data or the model produces it",
    "divergence": "most ranks went bad at once, so the model diverged",
}


def initial_record(incident: Incident, vouched_by: str = "") -> Record:
    """The record of a newly ingested incident: the nodes to act on, in first-seen order.

    A ``data`` or ``divergence`` incident names no node to act on, whatever else it lists.
    ``vouched_by`` names the job-scoped credential that delivered it ("" when none did).
    """
    names = list(incident.suspect_nodes)
    names += [s.node.name for s in incident.suspects]
    if not names:
        names += [c.node.name for c in incident.candidates]
    if incident.classification not in HARDWARE_CLASSIFICATIONS:
        names = []
    targets = tuple(dict.fromkeys(names))
    checkpoint = dict(incident.recommended_checkpoint) if incident.recommended_checkpoint else None
    reason = f"{incident.classification} incident at step {incident.step} ({incident.check})"
    continuation = None
    cont = incident.continuation
    if cont is not None and incident.classification in JOINS_LIVE:
        continuation = {"mode": cont.mode, "replica_group": cont.replica_group}
        reason += f"; the job went on without replica group {cont.replica_group} ({cont.mode})"
    elif cont is not None:
        reason += f"; continuation ignored: a {incident.classification} verdict takes the resume path"
    return Record(
        incident_id=incident.id,
        job_id=incident.job_id,
        classification=incident.classification,
        targets=targets,
        checkpoint=checkpoint,
        reason=reason,
        vouched_by=vouched_by,
        continuation=continuation,
    )


def transition(record: Record, event: Event) -> Step:
    """Apply one event. Pure: the same inputs always give the same Step."""
    if isinstance(event, ActionDone):
        return Step(_record_outcome(record, event))
    if isinstance(event, ActionFailed):
        return _on_failure(record, event)
    if isinstance(event, Approved):
        return _on_approved(record, event)
    if isinstance(event, Dismissed):
        return _on_dismissed(record, event)
    return _on_tick(record, event)


def _action(record: Record, kind: ActionKind, node: str | None, **params: object) -> Action:
    target = node if node is not None else record.job_id
    return Action(action_key(record.incident_id, kind, target), record.incident_id, kind, node, params)


def _record_outcome(record: Record, event: ActionDone) -> Record:
    outstanding = tuple(k for k in record.outstanding if k != event.key)
    r = record.evolve(outstanding=outstanding)
    node, outcome = event.node, event.outcome
    if event.kind is ActionKind.CORDON and node is not None:
        if outcome.get("skipped"):
            if node not in dict(r.cordon_skipped):
                r = r.evolve(cordon_skipped=r.cordon_skipped + ((node, str(outcome["skipped"])),))
        elif node not in r.cordoned:
            r = r.evolve(cordoned=r.cordoned + (node,))
    elif event.kind is ActionKind.UNCORDON and node is not None:
        r = r.evolve(cordoned=tuple(n for n in r.cordoned if n != node))
    elif event.kind is ActionKind.SELFTEST and node is not None:
        if all(t.node != node for t in r.triage):
            result = TriageResult(node, bool(outcome.get("passed")), str(outcome.get("detail", "")))
            r = r.evolve(triage=r.triage + (result,))
    elif event.kind is ActionKind.REPLACE and node is not None:
        if node not in r.replaced:
            r = r.evolve(replaced=r.replaced + (node,))
    elif event.kind is ActionKind.AWAIT_RETURN and node is not None:
        if all(n != node for n, _, _ in r.returned):
            repl = outcome.get("replacement")
            entry = (node, bool(outcome.get("back")), None if repl is None else str(repl))
            r = r.evolve(returned=r.returned + (entry,))
    elif event.kind is ActionKind.RESUME:
        r = r.evolve(resume=dict(outcome))
    elif event.kind is ActionKind.JOIN:
        r = r.evolve(joined=dict(outcome))
    elif event.kind is ActionKind.VERIFY and r.allocation is None and not r.unverified:
        nodes = outcome.get("allocation")
        if isinstance(nodes, (list, tuple)):
            r = r.evolve(allocation=tuple(str(n) for n in nodes))
        else:
            r = r.evolve(unverified=str(allocation_refusal(r.job_id, r.targets, None)))
    return r


def _on_failure(record: Record, event: ActionFailed) -> Step:
    if event.key not in record.outstanding:
        # A side action (releasing a cleared node) failed: note it, the incident goes on.
        return Step(record.evolve(reason=f"{event.kind.value} {event.node} failed: {event.reason}"))
    others = tuple(k for k in record.outstanding if k != event.key)
    if event.kind is ActionKind.VERIFY:
        # Nothing was done yet; an incident whose job cannot be checked is never acted on.
        refused = record.evolve(
            state=State.REFUSED,
            outstanding=(),
            unverified=event.reason,
            reason=f"refused: job {record.job_id}'s allocation could not be read ({event.reason}); "
            "nothing cordoned",
        )
        return Step(refused, cancel=others)
    what = f"{event.kind.value} {event.node or record.job_id}"
    failed = record.evolve(
        state=State.FAILED,
        outstanding=(),
        reason=f"{what} failed: {event.reason}",
        cordoned=_with_pending_cordons(record, others),
    )
    return Step(failed, cancel=others)


def _with_pending_cordons(record: Record, keys: tuple[str, ...]) -> tuple[str, ...]:
    # A cordon that was in flight may have happened; count it so a later dismissal undoes it.
    pending = [n for n in record.targets if action_key(record.incident_id, ActionKind.CORDON, n) in keys]
    return tuple(dict.fromkeys(record.cordoned + tuple(pending)))


def _on_approved(record: Record, event: Approved) -> Step:
    allowed = record.state is State.AWAITING_APPROVAL
    reason = _decided(record, event, "approved", allowed, "only awaiting_approval can be approved")
    return Step(
        record.evolve(state=State.APPROVED, approved_by=event.by, approved_at=event.at, reason=reason)
    )


def _on_dismissed(record: Record, event: Dismissed) -> Step:
    allowed = record.state in DISMISSABLE
    reason = _decided(record, event, "dismissed", allowed, "it can no longer be dismissed")
    dismissed = record.evolve(
        state=State.DISMISSED,
        dismissed_by=event.by,
        dismissed_at=event.at,
        outstanding=(),
        cordoned=_with_pending_cordons(record, record.outstanding),
        reason=reason,
    )
    return Step(dismissed, cancel=record.outstanding)


def _decided(record: Record, event: Approved | Dismissed, verb: str, allowed: bool, refusal: str) -> str:
    """A person's decision: refused in a state that does not allow it (``refusal`` says why),
    else the reason it records, naming who decided and the OS account that ran the command."""
    if not allowed:
        raise InvalidTransitionError(f"incident {record.incident_id} is {record.state.value}; {refusal}")
    account = f" (os user {event.os_user})" if event.os_user else ""
    return f"{verb} by {event.by}{account}"


def _on_tick(record: Record, tick: Tick) -> Step:
    if record.outstanding:
        return Step(record)
    state = record.state
    if state is State.DETECTED:
        if record.unverified:
            return _move(record, State.REFUSED, f"refused: {record.unverified}; nothing cordoned")
        if record.allocation is None:
            # The job's nodes as the backend reports them, before anything is done on its word.
            verify = _action(record, ActionKind.VERIFY, None, job_id=record.job_id)
            return _wait(record, (verify,), f"verifying job {record.job_id}'s allocation")
        refusal = allocation_refusal(record.job_id, record.targets, record.allocation)
        if refusal is not None:
            return _move(record, State.REFUSED, f"refused: {refusal}; nothing cordoned")
    if state is State.DETECTED and record.classification not in HARDWARE_CLASSIFICATIONS:
        # Not a hardware fault: nothing is cordoned or replaced; a person decides what follows.
        return _move(
            record.evolve(targets=()),
            State.AWAITING_APPROVAL,
            f"{record.classification}: {_NO_NODE_NOTE.get(record.classification, 'not a hardware fault')}; "
            "no node is cordoned or replaced. Fix the cause, then dismiss, or approve to resume "
            "the job from its checkpoint",
        )
    if state is State.DETECTED:
        todo = [
            t for t in record.targets if t not in record.cordoned and t not in dict(record.cordon_skipped)
        ]
        if todo:
            if len(record.targets) > tick.max_cordons_per_incident:
                return _move(
                    record,
                    State.FAILED,
                    f"blast radius: the incident names {len(record.targets)} nodes, more than "
                    f"max_cordons_per_incident={tick.max_cordons_per_incident}; nothing cordoned",
                )
            if tick.cordons_in_window + len(todo) > tick.max_cordons:
                reason = (
                    f"blast radius: {tick.cordons_in_window} cordon(s) in the window, {len(todo)} more "
                    f"would exceed the limit of {tick.max_cordons}; waiting"
                )
                return Step(record if record.reason == reason else record.evolve(reason=reason))
            if tick.job_cordons_in_window + len(todo) > tick.max_cordons_per_job:
                reason = (
                    f"blast radius: job {record.job_id} has {tick.job_cordons_in_window} cordon(s) in the "
                    f"window, {len(todo)} more would exceed the per-job limit of "
                    f"{tick.max_cordons_per_job}; waiting"
                )
                return Step(record if record.reason == reason else record.evolve(reason=reason))
            return _wait(
                record,
                tuple(_action(record, ActionKind.CORDON, n) for n in todo),
                f"cordoning {', '.join(todo)}",
            )
        return _move(record, State.CORDONED, _cordon_summary(record))
    if state is State.CORDONED:
        if (
            tick.triage
            and record.targets
            and (record.classification in NEEDS_TRIAGE or tick.triage_persistent)
        ):
            actions = tuple(_action(record, ActionKind.SELFTEST, n) for n in record.targets)
            return _move(
                record,
                State.TRIAGING,
                f"{record.classification}: self-test on {', '.join(record.targets)}",
                actions,
            )
        return _move(record, State.AWAITING_APPROVAL, "waiting for a person to approve replacement")
    if state is State.TRIAGING:
        return _after_triage(record)
    if state is State.AWAITING_APPROVAL:
        # auto_approve is for replacing hardware; a data or divergence incident waits for a person.
        if tick.auto_approve and record.classification in HARDWARE_CLASSIFICATIONS:
            unverified = _not_verified(record)
            if unverified:
                reason = f"auto-approve does not act: {unverified}; waiting for a person"
                return Step(record if record.reason == reason else record.evolve(reason=reason))
            return _move(
                record.evolve(approved_by="auto-approve", approved_at=tick.now),
                State.APPROVED,
                "approved automatically (auto_approve is on)",
            )
        return Step(record)
    if state is State.APPROVED:
        return _start_replacement(record, tick)
    if state is State.REPLACING:
        back = {n for n, _, _ in record.returned}
        waiting = [n for n in record.replaced if n not in back]
        if waiting:
            actions = tuple(
                _action(record, ActionKind.AWAIT_RETURN, n, deadline=tick.return_deadline) for n in waiting
            )
            return _wait(record, actions, f"waiting for {', '.join(waiting)} to come back")
        return _move(record, State.REPLACED, _return_summary(record))
    if state is State.REPLACED and record.continuation is not None:
        return _join_replacement(record)
    if state is State.REPLACED:
        if record.resume is None:
            exclude = [n for n, is_back, _ in record.returned if not is_back]
            action = _action(
                record,
                ActionKind.RESUME,
                None,
                job_id=record.job_id,
                checkpoint=record.checkpoint,
                exclude=exclude,
                allocation=None if record.allocation is None else list(record.allocation),
            )
            return _wait(record, (action,), f"resuming job {record.job_id}")
        return _move(record, State.RESUMED, f"job {record.job_id} resumed: {_resume_summary(record)}")
    if state is State.DISMISSED:
        if record.cordoned:
            actions = tuple(_action(record, ActionKind.UNCORDON, n) for n in record.cordoned)
            return _wait(record, actions, f"uncordoning {', '.join(record.cordoned)}")
        return _move(record, State.UNCORDONED, "dismissed; no node left cordoned by this incident")
    return Step(record)


def _join_replacement(record: Record) -> Step:
    """The job never stopped: start one replacement group for the suspect's replica group on
    the nodes that took the replaced ones' place, and never resume (restart) the job."""
    group = str((record.continuation or {}).get("replica_group", ""))
    if record.joined is None:
        nodes = [repl if repl else node for node, back, repl in record.returned if back or repl]
        exclude = [n for n, is_back, repl in record.returned if not is_back]
        action = _action(
            record,
            ActionKind.JOIN,
            None,
            job_id=record.job_id,
            replica_group=group,
            nodes=list(dict.fromkeys(nodes)),
            exclude=exclude,
            allocation=None if record.allocation is None else list(record.allocation),
        )
        return _wait(
            record, (action,), f"starting a replacement for replica group {group} of job {record.job_id}"
        )
    detail = str(record.joined.get("detail") or record.joined)
    return _move(
        record,
        State.JOINED,
        f"replacement for replica group {group} started to join job {record.job_id} live (not resumed): {detail}",
    )


def _not_verified(record: Record) -> str:
    """Why auto-approve may not act on ``record`` ("" when its job and nodes were verified)."""
    if record.allocation is None:
        return f"the nodes were never checked against job {record.job_id}'s allocation"
    if not record.vouched_by:
        return (
            f"no job-scoped credential vouched for job {record.job_id} (delivered by a watched "
            "directory, an unscoped job token or the API)"
        )
    return ""


def _wait(record: Record, actions: tuple[Action, ...], reason: str) -> Step:
    return Step(record.evolve(outstanding=tuple(a.key for a in actions), reason=reason), actions)


def _move(record: Record, to: State, reason: str, actions: tuple[Action, ...] = ()) -> Step:
    r = record.evolve(state=to, reason=reason, outstanding=tuple(a.key for a in actions))
    return Step(r, actions)


def _cordon_summary(record: Record) -> str:
    parts = []
    if record.cordoned:
        parts.append(f"cordoned {', '.join(record.cordoned)}")
    parts += [f"not cordoned {n}: {why}" for n, why in record.cordon_skipped]
    return "; ".join(parts) or "no node named; nothing to cordon"


def _after_triage(record: Record) -> Step:
    failing = tuple(t.node for t in record.triage if not t.passed)
    summary = "; ".join(
        f"{t.node} {'passed' if t.passed else 'FAILED'} self-test ({t.detail})" for t in record.triage
    )
    if record.classification == "ambiguous" and failing:
        # The self-test told the candidates apart: act on the failing ones, free the rest.
        cleared = tuple(n for n in record.cordoned if n not in failing)
        actions = tuple(_action(record, ActionKind.UNCORDON, n) for n in cleared)
        r = record.evolve(
            targets=tuple(n for n in record.targets if n in failing),
            state=State.AWAITING_APPROVAL,
            reason=f"triage: {summary}",
        )
        return Step(r, actions)
    hint = "" if failing else "; no node failed the self-test (consider dismissing)"
    return _move(record, State.AWAITING_APPROVAL, f"triage: {summary}{hint}")


def _start_replacement(record: Record, tick: Tick) -> Step:
    if not record.targets or record.classification not in HARDWARE_CLASSIFICATIONS:
        return _move(record, State.REPLACED, "nothing to replace (no node named)")
    needed = len(record.targets)
    if tick.replacements_in_window + needed > tick.max_replacements:
        reason = (
            f"blast radius: {tick.replacements_in_window} replacement(s) in the window, "
            f"{needed} more would exceed the limit of {tick.max_replacements}; waiting"
        )
        return Step(record if record.reason == reason else record.evolve(reason=reason))
    actions = tuple(_action(record, ActionKind.REPLACE, n) for n in record.targets)
    return _move(record, State.REPLACING, f"replacing {', '.join(record.targets)}", actions)


def _return_summary(record: Record) -> str:
    parts = []
    for node, back, repl in record.returned:
        if back:
            parts.append(f"{node} is back")
        else:
            parts.append(f"{node} replaced by {repl}" if repl else f"{node} not back (excluded)")
    return "; ".join(parts)


def _resume_summary(record: Record) -> str:
    r = record.resume or {}
    return str(r.get("detail") or r)
