"""An approval racing a dismissal ends in exactly one recorded decision."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from httpkit import ALICE_TOKEN, JOB_TOKEN, SHARED_TOKEN, Live, call, cluster, make_incident

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.errors import DecisionConflictError

pytestmark = pytest.mark.timeout(180)

ROUNDS = 8


def _decisions(ctl: Controller, iid: str) -> list[str]:
    """Audit entries that record a person's decision leaving awaiting_approval."""
    return [a.what for a in ctl.store.audit_rows(iid) if a.what.startswith("awaiting_approval -> ")]


def test_http_approve_racing_dismiss(live: Live) -> None:
    """Approve and dismiss sent at the same moment by two threads: one gets 200, the other 409,
    and the incident carries exactly one decision, audited once."""
    ids = []
    for n in range(ROUNDS):
        inc = make_incident(job=f"race{n}")
        assert call(live.url, "POST", "/api/v1/incidents", inc.to_json(), token=JOB_TOKEN).status == 201
        ids.append(inc.id)
    with live.controller() as ctl:
        ctl.reconcile()
    for iid in ids:
        barrier = threading.Barrier(2)
        statuses: dict[str, int] = {}

        def send(decision: str, token: str, body: dict[str, str]) -> None:
            barrier.wait(timeout=30)
            statuses[decision] = call(
                live.url, "POST", f"/api/v1/incidents/{iid}/{decision}", body, token=token
            ).status

        threads = [
            threading.Thread(target=send, args=("approve", ALICE_TOKEN, {})),
            threading.Thread(target=send, args=("dismiss", SHARED_TOKEN, {"by": "bob"})),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(statuses.values()) == [200, 409], statuses
        with live.controller() as ctl:
            record = ctl.store.get_record(iid)
            winner = "approve" if statuses["approve"] == 200 else "dismiss"
            assert record.state is (State.APPROVED if winner == "approve" else State.DISMISSED)
            assert (record.approved_by is None) != (record.dismissed_by is None)
            assert len(_decisions(ctl, iid)) == 1
            assert [a.what for a in ctl.store.audit_rows(iid) if a.what.endswith("requested")] == [
                f"{winner} requested"
            ]


def test_store_level_race_between_two_controllers(tmp_path: Path) -> None:
    """Two controllers (two SQLite connections) deciding the same incident concurrently: exactly
    one decision is written, the other raises DecisionConflictError."""
    db = tmp_path / "c.db"
    cluster(db)
    ids = []
    with Controller(db, config=ControllerConfig(apply=True)) as ctl:
        for n in range(ROUNDS):
            inc = make_incident(job=f"r{n}")
            ctl.ingest(inc)
            ids.append(inc.id)
        ctl.reconcile()
    for iid in ids:
        barrier = threading.Barrier(2)
        outcome: dict[str, str] = {}

        def decide(decision: str) -> None:
            with Controller(db) as ctl:
                barrier.wait(timeout=30)
                try:
                    ctl.decide(iid, decision, by=decision + "-person")
                    outcome[decision] = "ok"
                except DecisionConflictError:
                    outcome[decision] = "conflict"

        threads = [threading.Thread(target=decide, args=(d,)) for d in ("approve", "dismiss")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert sorted(outcome.values()) == ["conflict", "ok"], outcome
        with Controller(db) as ctl:
            assert len(_decisions(ctl, iid)) == 1
