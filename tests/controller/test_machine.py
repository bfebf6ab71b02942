"""The pure state machine: every transition, with no store and no backend."""

from __future__ import annotations

import pytest
from ctlkit import make_incident

from replicheck.controller.errors import InvalidTransitionError
from replicheck.controller.machine import initial_record as _initial_record
from replicheck.controller.machine import transition
from replicheck.controller.model import (
    ActionDone,
    ActionFailed,
    ActionKind,
    Approved,
    Dismissed,
    Record,
    State,
    Step,
    Tick,
    TriageResult,
)

pytestmark = pytest.mark.timeout(30)
NOW = "2025-01-01T00:00:00+00:00"


def initial_record(incident, vouched_by: str = "job token test (jobs=*)"):  # type: ignore[no-untyped-def]
    """The record as the controller keeps it once the allocation check passed (the check's
    own transitions are tested in test_job_authority.py): every named node in the allocation."""
    record = _initial_record(incident, vouched_by)
    return record.evolve(allocation=record.targets)


def tick(**kw: object) -> Tick:
    return Tick(now=NOW, return_deadline="2025-01-01T01:00:00+00:00", **kw)  # type: ignore[arg-type]


def done(step: Step, **outcome: object) -> Record:
    """Complete every action of ``step`` with ``outcome`` (plus per-kind defaults)."""
    r = step.record
    for a in step.actions:
        r = transition(r, ActionDone(a.key, a.kind, a.node, dict(outcome))).record
    return r


def to_awaiting(classification: str = "persistent", nodes: tuple[str, ...] = ("n2",)) -> Record:
    r = initial_record(make_incident(classification=classification, nodes=nodes))
    r = done(transition(r, tick()))
    r = transition(r, tick()).record  # cordoned
    return transition(r, tick()).record


def test_named_suspect_is_cordoned_first() -> None:
    """A new incident naming a node emits exactly one cordon action per node and waits for it."""
    r = initial_record(make_incident(nodes=("n2", "n3")))
    step = transition(r, tick())
    assert [(a.kind, a.node) for a in step.actions] == [(ActionKind.CORDON, "n2"), (ActionKind.CORDON, "n3")]
    assert step.record.state is State.DETECTED and len(step.record.outstanding) == 2
    assert transition(step.record, tick()).actions == ()


def test_cordon_done_moves_to_cordoned() -> None:
    """detected -> cordoned once every cordon action has completed."""
    r = done(transition(initial_record(make_incident()), tick()))
    step = transition(r, tick())
    assert step.record.state is State.CORDONED and step.record.cordoned == ("n2",)


def test_persistent_skips_triage() -> None:
    """cordoned -> awaiting_approval directly for a persistent incident."""
    assert to_awaiting("persistent").state is State.AWAITING_APPROVAL


@pytest.mark.parametrize("classification", ["transient", "ambiguous"])
def test_ambiguous_and_transient_are_triaged(classification: str) -> None:
    """cordoned -> triaging with one self-test per node for transient and ambiguous incidents."""
    r = initial_record(make_incident(classification=classification, nodes=("n1", "n2")))
    r = transition(done(transition(r, tick())), tick()).record
    step = transition(r, tick())
    assert step.record.state is State.TRIAGING
    assert sorted(a.node for a in step.actions if a.kind is ActionKind.SELFTEST) == ["n1", "n2"]


def test_persistent_is_triaged_when_the_operator_asks() -> None:
    """With triage_persistent on, a persistent incident is self-tested before approval too."""
    r = initial_record(make_incident(classification="persistent"))
    r = transition(done(transition(r, tick())), tick()).record
    step = transition(r, tick(triage_persistent=True))
    assert step.record.state is State.TRIAGING
    assert [a.kind for a in step.actions] == [ActionKind.SELFTEST]


def test_triage_can_be_turned_off() -> None:
    """With triage off a transient incident goes straight to awaiting_approval."""
    r = initial_record(make_incident(classification="transient"))
    r = transition(done(transition(r, tick())), tick()).record
    assert transition(r, tick(triage=False)).record.state is State.AWAITING_APPROVAL


def test_ambiguous_triage_narrows_to_failing_node_and_frees_the_rest() -> None:
    """After triage of an ambiguous incident only the node that failed stays a target; the others are uncordoned."""
    r = initial_record(make_incident(classification="ambiguous", nodes=("n1", "n2")))
    r = transition(done(transition(r, tick())), tick()).record
    step = transition(r, tick())
    r = step.record
    for a in step.actions:
        r = transition(r, ActionDone(a.key, a.kind, a.node, {"passed": a.node != "n2", "detail": "x"})).record
    after = transition(r, tick())
    assert after.record.state is State.AWAITING_APPROVAL
    assert after.record.targets == ("n2",)
    assert [(a.kind, a.node) for a in after.actions] == [(ActionKind.UNCORDON, "n1")]
    assert "n2 FAILED" in after.record.reason


def test_triage_all_passing_keeps_targets_and_says_so() -> None:
    """If every node passes the self-test the approval request says so and nothing is freed."""
    r = initial_record(make_incident(classification="transient"))
    r = transition(done(transition(r, tick())), tick()).record
    r = done(transition(r, tick()), passed=True, detail="ok")
    after = transition(r, tick())
    assert after.record.state is State.AWAITING_APPROVAL and after.actions == ()
    assert "consider dismissing" in after.record.reason


def test_awaiting_approval_waits_without_auto_approve() -> None:
    """Without approval nothing happens, however many ticks pass."""
    r = to_awaiting()
    for _ in range(3):
        step = transition(r, tick())
        assert step.record.state is State.AWAITING_APPROVAL and step.actions == ()


def test_auto_approve_records_who() -> None:
    """With auto_approve the record is approved by 'auto-approve' at the tick's time."""
    r = transition(to_awaiting(), tick(auto_approve=True)).record
    assert (r.state, r.approved_by, r.approved_at) == (State.APPROVED, "auto-approve", NOW)


def test_approval_records_person_and_time() -> None:
    """awaiting_approval -> approved stores who approved and when."""
    r = transition(to_awaiting(), Approved(by="alice", at=NOW)).record
    assert (r.state, r.approved_by, r.approved_at) == (State.APPROVED, "alice", NOW)


@pytest.mark.parametrize("state", [State.DETECTED, State.CORDONED, State.REPLACING, State.RESUMED])
def test_approval_outside_awaiting_is_refused(state: State) -> None:
    """Approving in any other state raises InvalidTransitionError."""
    r = to_awaiting().evolve(state=state)
    with pytest.raises(InvalidTransitionError):
        transition(r, Approved(by="bob", at=NOW))


def test_blast_radius_blocks_replacement() -> None:
    """approved stays approved, with the reason, when the replacement budget is spent."""
    r = transition(to_awaiting(), Approved(by="a", at=NOW)).record
    step = transition(r, tick(replacements_in_window=1, max_replacements=1))
    assert step.record.state is State.APPROVED and step.actions == ()
    assert "blast radius" in step.record.reason


def test_replacement_then_return_then_resume() -> None:
    """approved -> replacing -> replaced -> resumed with a replace, an await_return and a resume action."""
    r = transition(to_awaiting(), Approved(by="a", at=NOW)).record
    step = transition(r, tick())
    assert step.record.state is State.REPLACING
    assert [(a.kind, a.node) for a in step.actions] == [(ActionKind.REPLACE, "n2")]
    r = done(step)
    step = transition(r, tick())
    assert [a.kind for a in step.actions] == [ActionKind.AWAIT_RETURN]
    r = done(step, back=False, replacement="s1")
    step = transition(r, tick())
    assert step.record.state is State.REPLACED
    step = transition(step.record, tick())
    (resume,) = step.actions
    assert resume.kind is ActionKind.RESUME
    assert resume.params == {
        "job_id": "job1",
        "checkpoint": {"step": 30, "path": "/ck/30"},
        "exclude": ["n2"],
        "allocation": ["n2"],
    }
    r = done(step, detail="ok")
    assert transition(r, tick()).record.state is State.RESUMED


def test_node_back_is_not_excluded() -> None:
    """A replaced node that came back is not in the resume's exclude list."""
    r = transition(to_awaiting(), Approved(by="a", at=NOW)).record
    r = done(transition(r, tick()))
    r = done(transition(r, tick()), back=True)
    r = transition(r, tick()).record
    (resume,) = transition(r, tick()).actions
    assert resume.params["exclude"] == []


def test_dismiss_uncordons_then_finishes() -> None:
    """awaiting_approval -> dismissed -> (uncordon) -> uncordoned."""
    r = transition(to_awaiting(), Dismissed(by="carol", at=NOW)).record
    assert (r.state, r.dismissed_by) == (State.DISMISSED, "carol")
    step = transition(r, tick())
    assert [(a.kind, a.node) for a in step.actions] == [(ActionKind.UNCORDON, "n2")]
    r = done(step)
    assert transition(r, tick()).record.state is State.UNCORDONED


def test_dismiss_during_cordon_cancels_and_still_uncordons() -> None:
    """Dismissing while a cordon is in flight cancels it and treats the node as cordoned (safe undo)."""
    step = transition(initial_record(make_incident()), tick())
    d = transition(step.record, Dismissed(by="x", at=NOW))
    assert d.cancel == step.record.outstanding and d.record.cordoned == ("n2",)


def test_dismiss_after_replacement_started_is_refused() -> None:
    """A replacement under way cannot be dismissed."""
    r = transition(to_awaiting(), Approved(by="a", at=NOW)).record
    r = transition(r, tick()).record
    with pytest.raises(InvalidTransitionError):
        transition(r, Dismissed(by="x", at=NOW))


def test_permanent_failure_moves_to_failed_with_reason() -> None:
    """An outstanding action failing permanently moves the incident to failed with the reason."""
    step = transition(initial_record(make_incident(nodes=("n1", "n2"))), tick())
    a = step.actions[0]
    f = transition(step.record, ActionFailed(a.key, a.kind, a.node, "Invalid node name"))
    assert f.record.state is State.FAILED and "Invalid node name" in f.record.reason
    assert f.cancel == (step.actions[1].key,)


def test_failed_can_be_dismissed() -> None:
    """A failed incident can be dismissed, which undoes its cordons."""
    r = to_awaiting().evolve(state=State.FAILED)
    assert transition(r, Dismissed(by="x", at=NOW)).record.state is State.DISMISSED


def test_no_node_named_skips_cordon_and_replacement() -> None:
    """An incident with no node goes to approval without cordoning and resumes without replacing."""
    r = initial_record(make_incident(nodes=()))
    r = transition(r, tick()).record
    assert r.state is State.CORDONED and r.reason.startswith("no node named")
    r = transition(transition(r, tick()).record, Approved(by="a", at=NOW)).record
    assert transition(r, tick()).record.state is State.REPLACED


def test_transition_is_pure() -> None:
    """The same record and event give equal results, and the input record is unchanged."""
    r = initial_record(make_incident())
    before = r.to_json()
    assert transition(r, tick()) == transition(r, tick())
    assert r.to_json() == before


def test_record_round_trips_through_json() -> None:
    """A record with every field filled survives to_json/from_json unchanged."""
    r = transition(to_awaiting(), Approved(by="a", at=NOW)).record
    r = r.evolve(
        triage=(TriageResult("n2", False, "differs"),),
        returned=(("n2", False, "s1"),),
        cordon_skipped=(("n9", "why"),),
        resume={"detail": "d"},
    )
    assert Record.from_json(r.to_json()) == r


@pytest.mark.parametrize("classification", ["data", "divergence"])
def test_data_and_divergence_never_cordon_or_replace(classification: str) -> None:
    """A data-borne or divergence incident is recorded and waits for a person: no cordon, no
    self-test, no auto-approval, and an approval resumes the job without replacing any node,
    even when the record lists nodes."""
    r = initial_record(make_incident(classification=classification, nodes=("n2", "n3")))
    assert r.targets == ()
    step = transition(r, tick(auto_approve=True, triage=True, triage_persistent=True))
    assert step.actions == () and step.record.state is State.AWAITING_APPROVAL
    assert step.record.reason.startswith(classification) and "no node is cordoned" in step.record.reason
    waiting = transition(step.record, tick(auto_approve=True))
    assert waiting.record.state is State.AWAITING_APPROVAL and waiting.actions == ()
    approved = transition(waiting.record, Approved(by="alice", at=NOW)).record
    # Even a record that somehow kept targets is never replaced.
    step = transition(approved.evolve(targets=("n2",)), tick())
    assert step.record.state is State.REPLACED and step.actions == ()
    resume = transition(step.record, tick())
    assert [a.kind for a in resume.actions] == [ActionKind.RESUME]
    assert transition(waiting.record, Dismissed(by="bob", at=NOW)).record.state is State.DISMISSED
