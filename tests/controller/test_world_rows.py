"""One bad row never stops everything, and time is not trusted blindly (issue 27): a damaged
record or an action of an unknown kind is quarantined and reported while the rest is served and
acted on; evidence too deep or too large is refused on the Python path too; a replacement stamped
while the clock ran 30 days ahead blocks one window, not a month; a file rejected for its
timestamp is read again once it is valid."""

from __future__ import annotations

import dataclasses
import datetime as dt
import sqlite3
from pathlib import Path

import pytest
from ctlkit import Clock, Counting, cluster, make_incident
from test_cli import cli

import replicheck.incident as incident_module
from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.controller import derived_id
from replicheck.controller.errors import NotYet
from replicheck.incident import INCIDENT_ID, write_incident


def _three(db: Path) -> tuple[Controller, list[str]]:
    cluster(db)
    ctl = Controller(db, config=ControllerConfig(apply=True))
    ids = []
    for step, node in ((1, "n1"), (2, "n2"), (3, "n3")):
        inc = make_incident(step=step, nodes=(node,))
        ctl.ingest(inc)
        ids.append(inc.id)
    return ctl, ids


def test_damaged_record_and_unknown_action_kind_are_quarantined(tmp_path: Path) -> None:
    """A record that is not JSON and an action of a kind this build does not know are set aside
    (audited once, listed), while every reconcile pass and `incidents list` go on with the others;
    on the old code both made every pass and the listing fail."""
    db = tmp_path / "c.db"
    ctl, (good1, bad, good2) = _three(db)
    with sqlite3.connect(db) as raw:
        raw.execute("UPDATE records SET data='{not json' WHERE incident_id=?", (bad,))
        raw.execute(
            "INSERT INTO actions(key, incident_id, kind, node, params, status, next_attempt_at, created_at)"
            " VALUES('x:reboot:n1', ?, 'reboot', 'n1', '{}', 'pending', '', '')",
            (good1,),
        )
    for _ in range(3):
        ctl.reconcile()
    states = {r.incident_id: r.state for r in ctl.records()}
    assert set(states) == {good1, good2}
    assert all(s is State.AWAITING_APPROVAL for s in states.values())
    quarantined = {(t, k) for t, k, _, _ in ctl.store.quarantined()}
    assert quarantined == {("records", bad), ("actions", "x:reboot:n1")}
    audited = [a for a in ctl.store.audit_rows() if a.what == "quarantined"]
    assert len(audited) == 2  # once each, not once per pass
    ctl.close()
    listing = cli("incidents", "list", "--db", str(db))
    assert listing.returncode == 0, listing.stderr
    assert good1 in listing.stdout and good2 in listing.stdout
    assert "quarantined (records)" in listing.stderr


@pytest.mark.parametrize("evidence", [{"big": 2**70}, "deep"])
def test_python_path_refuses_deep_or_huge_evidence(tmp_path: Path, evidence: object) -> None:
    """Controller.ingest applies the same checks as files and HTTP: evidence nested 40 deep or
    holding 2**70 is rejected (kept with the reason), and every read still answers."""
    if evidence == "deep":
        value: object = 1
        for _ in range(40):
            value = [value]
        evidence = {"deep": value}
    db = tmp_path / "c.db"
    cluster(db)
    with Controller(db) as ctl:
        result = ctl.ingest(dataclasses.replace(make_incident(), evidence=evidence))  # type: ignore[arg-type]
        assert result.incident_id is None and result.rejected
        ctl.reconcile()
        assert ctl.records() == []
    assert cli("incidents", "list", "--db", str(db)).returncode == 0


def test_replacement_stamped_in_the_future_blocks_one_window(tmp_path: Path) -> None:
    """A replacement finished while the clock ran 30 days ahead counts for one window from when the
    clock is right again, not until the wrong date (on the old code: a month)."""
    db = tmp_path / "c.db"
    cluster(db)
    clock = Clock()
    with Controller(db, config=ControllerConfig(apply=True), clock=clock) as ctl:
        ctl.ingest(make_incident())
        ctl.reconcile()
        ahead = clock.now + dt.timedelta(days=30)
        with ctl.store.transaction():
            ctl.store.connection.execute(
                "INSERT INTO actions(key, incident_id, kind, node, params, status, next_attempt_at,"
                " created_at, finished_at, result) VALUES('r', ?, 'replace', 'n9', '{}', 'done', ?, ?, ?, '{}')",
                (make_incident().id, ahead.isoformat(), ahead.isoformat(), ahead.isoformat()),
            )
        ctl.reconcile()  # the clock is right again: the stamp is brought back to now
        window = ControllerConfig().replacement_window_s
        clock.advance(window + 1)
        ctl.reconcile()
        since = (clock.now - dt.timedelta(seconds=window)).isoformat()
        assert ctl.store.replacements_since(since) == 0


def test_replacement_and_decisions_stamped_ahead_do_not_wait_a_month(tmp_path: Path) -> None:
    """A replacement made and an approval recorded while the clock ran 30 days ahead: once the
    clock is right, the replaced node is awaited for return_timeout_s from then (not until the
    wrong date plus the timeout) and the job resumes; the stored approval and dismissal times
    are brought back to now (on the old code the incident waited a month)."""
    db = tmp_path / "c.db"
    backend = Counting(cluster(db))
    backend.fail("await_return", *(NotYet("not back yet") for _ in range(100)))
    clock = Clock()
    right = clock.now
    config = ControllerConfig(
        apply=True, auto_approve=True, checkpoint_roots=("/ck",), return_poll_s=5, return_timeout_s=60
    )
    with Controller(db, backend=backend, config=config, clock=clock) as ctl:
        inc, other = make_incident(), make_incident(step=41, nodes=("n3",), check="sketch")
        ctl.ingest(inc, vouched_by="job token job1 (jobs=job1)")
        ctl.ingest(other)
        clock.now = right + dt.timedelta(days=30)
        ctl.reconcile()
        assert ctl.store.get_record(inc.id).state is State.REPLACING
        ctl.dismiss(other.id, by="alice")
        clock.now = right  # the clock is right again
        ctl.reconcile()
        for record in (ctl.store.get_record(inc.id), ctl.store.get_record(other.id)):
            for stamp in (record.approved_at, record.dismissed_at):
                assert stamp is None or stamp <= right.isoformat(timespec="microseconds"), record
        clock.advance(61)
        for _ in range(3):
            ctl.reconcile()
            clock.advance(5)
        record = ctl.store.get_record(inc.id)
        assert record.state is State.RESUMED, record.reason
        assert record.returned == (("n2", False, None),)


def test_file_rejected_for_its_time_is_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An incident file rejected because this controller's clock was 400 days behind is read
    again on later passes and ingested once the clock is right (the old code never re-read it)."""
    db, inbox = tmp_path / "c.db", tmp_path / "inbox"
    cluster(db)
    inc = make_incident()
    write_incident(inc, inbox)
    real = incident_module._reader_clock
    monkeypatch.setattr(incident_module, "_reader_clock", lambda: real() - dt.timedelta(days=400))
    with Controller(db, config=ControllerConfig(incident_dirs=(str(inbox),))) as ctl:
        ctl.reconcile()
        ctl.reconcile()
        assert ctl.records() == []
        assert [r[1][:13] for r in ctl.store.rejected_rows()] == ["not yet valid"]
        monkeypatch.setattr(incident_module, "_reader_clock", real)
        ctl.reconcile()
        assert [r.incident_id for r in ctl.records()] == [inc.id]
        assert ctl.store.rejected_rows() == []


def test_derived_id_fits_the_grammar() -> None:
    """The id of a differing copy keeps its digest and fits the id grammar at any length."""
    for base in ("a" * 320, "ns/" + "b" * 317, "ns/j", "x" * 318 + "/y"):
        made = derived_id(base, "0123456789ab")
        assert INCIDENT_ID.fullmatch(made), made
        assert made.endswith("+0123456789ab")
