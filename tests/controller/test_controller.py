"""The controller over the local backend: executor, idempotency, retries, policy."""

from __future__ import annotations

import pytest
from ctlkit import PermanentBackendError, TransientBackendError, make_incident

from replicheck.controller import State
from replicheck.controller.executor import DRY_RUN_NOTE

pytestmark = pytest.mark.timeout(60)


def test_full_procedure_with_approval(env) -> None:
    """A persistent incident goes detected..resumed after approval, with one call of each kind."""
    ctl, backend, local = env()
    inc = make_incident()
    ctl.ingest(inc)
    states = [t.to_state for t in ctl.reconcile()]
    assert states == [State.CORDONED, State.AWAITING_APPROVAL]
    ctl.approve(inc.id, by="alice")
    states = [t.to_state for t in ctl.reconcile()]
    assert states == [State.REPLACING, State.REPLACED, State.RESUMED]
    assert local.op_counts() == {"cordon": 1, "replace": 1, "resume": 1}
    (req,) = local.resume_requests()
    assert (req.job_id, req.checkpoint, req.exclude) == ("job1", {"step": 30, "path": "/ck/30"}, ("n2",))
    assert "s1" in req.nodes and "n2" not in req.nodes
    record = ctl.store.get_record(inc.id)
    assert (record.approved_by, record.approved_at) == ("alice", "2025-01-01T00:00:00.000000+00:00")


def test_reconcile_twice_makes_no_second_backend_call(env) -> None:
    """A second (and third) reconcile after convergence calls the backend zero more times."""
    ctl, backend, _ = env(auto_approve=True)
    ctl.ingest(make_incident())
    ctl.reconcile()
    assert ctl.store.get_record(make_incident().id).state is State.RESUMED
    calls = dict(backend.calls)
    assert ctl.reconcile() == [] and ctl.reconcile() == []
    assert dict(backend.calls) == calls


def test_waiting_for_approval_makes_no_backend_calls(env) -> None:
    """Reconciling an incident that waits for approval calls nothing on the backend."""
    ctl, backend, _ = env()
    ctl.ingest(make_incident())
    ctl.reconcile()
    calls = dict(backend.calls)
    ctl.reconcile()
    assert dict(backend.calls) == calls


def test_transient_error_is_retried_with_backoff(env, clock) -> None:
    """A temporary cordon error is retried only after the backoff delay, then succeeds."""
    ctl, backend, local = env()
    backend.fail("cordon", TransientBackendError("slurmctld unreachable"))
    ctl.ingest(make_incident())
    ctl.reconcile()
    assert backend.calls["cordon"] == 1
    assert ctl.store.get_record(make_incident().id).state is State.DETECTED
    ctl.reconcile()
    assert backend.calls["cordon"] == 1  # not yet due
    clock.advance(1.0)
    ctl.reconcile()
    assert backend.calls["cordon"] == 2
    assert ctl.store.get_record(make_incident().id).state is State.AWAITING_APPROVAL
    (action,) = [a for a in ctl.store.actions() if a.kind.value == "cordon"]
    assert action.attempts == 2


def test_retries_exhausted_fail_the_incident_with_reason(env, clock) -> None:
    """After retry_max_attempts temporary errors the incident is failed with the last error."""
    ctl, backend, _ = env(retry_max_attempts=3)
    backend.fail("cordon", *[TransientBackendError("Unable to contact slurm controller")] * 3)
    ctl.ingest(make_incident())
    for _ in range(4):
        ctl.reconcile()
        clock.advance(10)
    record = ctl.store.get_record(make_incident().id)
    assert record.state is State.FAILED
    assert "gave up after 3 attempts" in record.reason and "Unable to contact" in record.reason
    assert backend.calls["cordon"] == 3


def test_permanent_error_fails_at_once(env) -> None:
    """A permanent backend error fails the incident on the first attempt."""
    ctl, backend, _ = env(auto_approve=True)
    backend.fail("replace", PermanentBackendError("no spare node left"))
    ctl.ingest(make_incident())
    ctl.reconcile()
    record = ctl.store.get_record(make_incident().id)
    assert record.state is State.FAILED and "no spare node left" in record.reason
    assert backend.calls["replace"] == 1


def test_unknown_node_fails_with_reason(env) -> None:
    """An incident naming a node outside its job's allocation (here one the cluster does not
    know) is refused, saying which node, and nothing is cordoned."""
    ctl, backend, _ = env()
    ctl.ingest(make_incident(nodes=("ghost",)))
    ctl.reconcile()
    record = ctl.store.get_record(make_incident().id)
    assert record.state is State.REFUSED and "ghost" in record.reason
    assert backend.calls["cordon"] == 0


def test_dry_run_performs_nothing_destructive(env) -> None:
    """Without apply the cordon stays pending with a dry-run note and the cluster is untouched."""
    ctl, backend, local = env(apply=False)
    ctl.ingest(make_incident())
    ctl.reconcile()
    ctl.reconcile()
    assert backend.calls["cordon"] == 0 and local.op_counts() == {}
    (action,) = [a for a in ctl.store.actions() if a.kind.value == "cordon"]
    assert action.status == "pending" and action.last_error == DRY_RUN_NOTE and action.attempts == 0
    notes = [a for a in ctl.store.audit_rows() if a.outcome == DRY_RUN_NOTE]
    assert len(notes) == 1


def test_blast_radius_limits_replacements_per_window(env, clock) -> None:
    """With max_replacements=1 a second approved incident waits until the window has passed."""
    ctl, backend, local = env(
        auto_approve=True,
        max_replacements=1,
        replacement_window_s=3600,
        cluster={"active": ("n1", "n2", "n3", "n4"), "spares": ("s1", "s2")},
    )
    a, b = make_incident(step=10, nodes=("n2",)), make_incident(step=20, nodes=("n3",))
    ctl.ingest(a)
    ctl.ingest(b)
    ctl.reconcile()
    assert ctl.store.get_record(a.id).state is State.RESUMED
    blocked = ctl.store.get_record(b.id)
    assert blocked.state is State.APPROVED and "blast radius" in blocked.reason
    assert backend.calls["replace"] == 1
    clock.advance(3601)
    ctl.reconcile()
    assert ctl.store.get_record(b.id).state is State.RESUMED
    assert local.op_counts()["replace"] == 2


def test_never_cordon_last_schedulable_node_of_partition(env) -> None:
    """In a partition whose other nodes are all drained the suspect is not cordoned, and the record says why."""
    ctl, backend, local = env(cluster={"active": ("n1", "n2"), "spares": ()})
    local.cordon("n1", "maintenance", "manual-key")
    ctl.ingest(make_incident(nodes=("n2",)))
    ctl.reconcile()
    record = ctl.store.get_record(make_incident().id)
    assert record.state is State.AWAITING_APPROVAL
    assert record.cordoned == () and record.cordon_skipped == (
        ("n2", "last schedulable node of partition main"),
    )
    assert backend.calls["cordon"] == 0
    assert {n.name: n.state for n in local.list_nodes()}["n2"] == "idle"


def test_two_suspects_in_two_node_partition_keep_one(env) -> None:
    """Of two suspects filling their partition, the first is cordoned and the last is kept schedulable."""
    ctl, _, local = env(cluster={"active": ("n1", "n2"), "spares": ()})
    ctl.ingest(make_incident(nodes=("n1", "n2")))
    ctl.reconcile()
    record = ctl.store.get_record(make_incident().id)
    assert record.cordoned == ("n1",) and [n for n, _ in record.cordon_skipped] == ["n2"]


def test_triage_result_is_recorded_for_approval(env) -> None:
    """An ambiguous incident is self-tested on each candidate; the failing one is kept, the other freed."""
    ctl, backend, local = env()
    local.set_healthy("n3", False)
    inc = make_incident(classification="ambiguous", nodes=("n2", "n3"))
    ctl.ingest(inc)
    states = [t.to_state for t in ctl.reconcile()]
    assert states == [State.CORDONED, State.TRIAGING, State.AWAITING_APPROVAL]
    record = ctl.store.get_record(inc.id)
    assert [(t.node, t.passed) for t in record.triage] == [("n2", True), ("n3", False)]
    assert record.targets == ("n3",) and record.cordoned == ("n3",)
    assert {n.name: n.state for n in local.list_nodes()}["n2"] == "idle"
    assert backend.calls["selftest"] == 2


def test_dismiss_uncordons_only_our_drain(env) -> None:
    """Dismissal resumes the node this incident drained and leaves a node drained by someone else."""
    ctl, _, local = env(cluster={"active": ("n1", "n2", "n3", "n4"), "spares": ()})
    local.cordon("n3", "disk replacement (ops)", "ops-key")
    inc = make_incident(nodes=("n2", "n3"))
    ctl.ingest(inc)
    ctl.reconcile()
    ctl.dismiss(inc.id, by="dave")
    states = [t.to_state for t in ctl.reconcile()]
    assert states == [State.UNCORDONED]
    nodes = {n.name: (n.state, n.reason) for n in local.list_nodes()}
    assert nodes["n2"] == ("idle", "") and nodes["n3"] == ("drained", "disk replacement (ops)")


def test_node_held_by_another_open_incident_stays_cordoned(env) -> None:
    """Dismissing one of two incidents on the same node does not uncordon it under the other."""
    ctl, backend, local = env()
    a, b = make_incident(step=10), make_incident(step=20)
    ctl.ingest(a)
    ctl.ingest(b)
    ctl.reconcile()
    ctl.dismiss(a.id, by="erin")
    ctl.reconcile()
    assert ctl.store.get_record(a.id).state is State.UNCORDONED
    assert {n.name: n.state for n in local.list_nodes()}["n2"] == "drained"
    assert backend.calls["uncordon"] == 0


def test_transitions_reach_callback_and_audit(env, tmp_path) -> None:
    """Every state change is passed to on_transition and written to the audit log with a UTC offset."""
    from replicheck.controller import Controller, ControllerConfig

    seen = []
    ctl, backend, _ = env()
    other = Controller(
        ctl.db_path, backend=backend, config=ControllerConfig(apply=True), on_transition=seen.append
    )
    other.ingest(make_incident())
    made = other.reconcile()
    other.close()
    assert seen == made and len(made) == 2
    moves = [a for a in ctl.store.audit_rows() if "->" in a.what]
    assert [a.what for a in moves] == ["detected -> cordoned", "cordoned -> awaiting_approval"]
    assert all(a.at.endswith("+00:00") for a in moves)


def test_approve_needs_a_name(env) -> None:
    """Approval without a person's name is refused with ConfigError and changes nothing."""
    from replicheck.controller import ConfigError

    ctl, _, _ = env()
    ctl.ingest(make_incident())
    ctl.reconcile()
    with pytest.raises(ConfigError):
        ctl.approve(make_incident().id, by="  ")
    assert ctl.store.get_record(make_incident().id).state is State.AWAITING_APPROVAL
