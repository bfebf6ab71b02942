"""The SQLite store (migrations, append-only audit) and incident ingestion."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
from ctlkit import make_incident

from replicheck.controller import Controller, State, StoreError
from replicheck.controller.store import MIGRATIONS, SCHEMA_VERSION, Store
from replicheck.incident import write_incident

pytestmark = pytest.mark.timeout(60)


def test_fresh_database_is_wal_at_latest_version(tmp_path: Path) -> None:
    """A new store is in WAL mode at the newest schema version."""
    store = Store(tmp_path / "c.db")
    assert store.schema_version() == SCHEMA_VERSION
    assert store.connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    store.close()


def test_old_database_is_migrated_and_keeps_data(tmp_path: Path) -> None:
    """A database at schema version 1 is migrated forward without losing its incidents."""
    db = tmp_path / "c.db"
    con = sqlite3.connect(db, isolation_level=None)
    con.executescript(MIGRATIONS[0] + "PRAGMA user_version=1;")
    inc = make_incident()
    con.execute(
        "INSERT INTO incidents VALUES(?, ?, ?, 'old', 't', 't', 1)", (inc.id, inc.job_id, inc.to_json())
    )
    con.close()
    store = Store(db)
    assert store.schema_version() == SCHEMA_VERSION
    assert store.get_incident(inc.id).incident == inc
    store.close()


def test_newer_database_is_refused(tmp_path: Path) -> None:
    """A database from a newer build is refused with StoreError naming both versions."""
    db = tmp_path / "c.db"
    Store(db).close()
    sqlite3.connect(db).execute(f"PRAGMA user_version={SCHEMA_VERSION + 5}").connection.close()
    with pytest.raises(StoreError, match=f"version {SCHEMA_VERSION + 5}"):
        Store(db)


def test_not_a_database_is_a_clear_error(tmp_path: Path) -> None:
    """A file that is not SQLite gives StoreError, not a raw sqlite3 exception."""
    db = tmp_path / "c.db"
    db.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(StoreError, match="file is not a database"):
        Store(db)


def test_audit_log_is_append_only(tmp_path: Path) -> None:
    """Updating or deleting an audit row is refused by the database itself."""
    store = Store(tmp_path / "c.db")
    with store.transaction():
        store.audit("2025-01-01T00:00:00+00:00", "me", "did", "ok")
    for sql in ("UPDATE audit SET outcome='x'", "DELETE FROM audit"):
        with pytest.raises(sqlite3.IntegrityError, match="append-only"):
            store.connection.execute(sql)
    assert len(store.audit_rows()) == 1
    store.close()


def test_duplicates_from_every_rank_merge_into_one(tmp_path: Path) -> None:
    """The same incident delivered by 4 ranks is stored once with 4 deliveries and one record."""
    with Controller(tmp_path / "c.db") as ctl:
        inc = make_incident()
        results = [ctl.ingest(inc, source=f"rank{r}") for r in range(4)]
        assert [r.new for r in results] == [True, False, False, False]
        assert ctl.store.get_incident(inc.id).deliveries == 4
        assert len(ctl.records()) == 1


def test_differing_duplicate_keeps_first_and_is_audited(tmp_path: Path) -> None:
    """A duplicate id with different content keeps the first copy, is stored as a distinct
    incident (never merged: issue 12) and leaves an audit entry."""
    with Controller(tmp_path / "c.db") as ctl:
        first = make_incident(nodes=("n2",))
        ctl.ingest(first)
        other = ctl.ingest(make_incident(nodes=("n3",)))
        assert ctl.store.get_incident(first.id).incident == first
        assert any(a.what == "distinct incident" for a in ctl.store.audit_rows())
        assert other.new and other.incident_id != first.id and other.incident_id.startswith(first.id + "+")
        assert ctl.store.get_incident(first.id).deliveries == 1
        assert ctl.store.get_incident(other.incident_id).incident.suspect_nodes == ("n3",)
        assert len(ctl.records()) == 2
        assert (
            ctl.ingest(make_incident(nodes=("n3",))).incident_id == other.incident_id
        )  # its own copy merges


@pytest.mark.parametrize(
    "content,needle",
    [
        (b"{not json", "not valid JSON"),
        (
            json.dumps({**make_incident().to_dict(), "version": 99}).encode(),
            "unsupported incident version 99",
        ),
        (json.dumps({**make_incident().to_dict(), "step": -1}).encode(), "'step'"),
        (json.dumps({"schema": "something.else"}).encode(), "not a replicheck incident"),
    ],
)
def test_malformed_record_is_rejected_and_kept(tmp_path: Path, content: bytes, needle: str) -> None:
    """A malformed or unknown-version file is rejected with a clear reason; file and content are kept."""
    bad = tmp_path / "bad.json"
    bad.write_bytes(content)
    with Controller(tmp_path / "c.db") as ctl:
        result = ctl.ingest_file(bad)
        assert result.incident_id is None and needle in (result.rejected or "")
        ((source, reason, kept, _),) = ctl.store.rejected_rows()
        assert kept == content and needle in reason and source == str(bad.resolve())
        assert ctl.records() == []
    assert bad.read_bytes() == content


def test_watched_directory_ingests_new_files_once(tmp_path: Path) -> None:
    """A watched directory's incident files are ingested; re-scanning does not re-read unchanged files."""
    inbox = tmp_path / "incidents"
    for step in (10, 20):
        write_incident(make_incident(step=step), inbox)
    (inbox / ".incident-partial.tmp").write_text("{")
    with Controller(tmp_path / "c.db") as ctl:
        assert sorted(r.incident_id or "" for r in ctl.ingest_dir(inbox)) == [
            "job1-s10-replay",
            "job1-s20-replay",
        ]
        assert ctl.ingest_dir(inbox) == []
        assert ctl.store.rejected_rows() == []


def test_file_fixed_after_rejection_is_ingested(tmp_path: Path) -> None:
    """A file rejected while incomplete is ingested once its content becomes valid (nothing valid dropped)."""
    inbox = tmp_path / "incidents"
    inbox.mkdir()
    target = inbox / "x.json"
    target.write_text('{"schema": "replicheck.incident"')
    with Controller(tmp_path / "c.db") as ctl:
        assert ctl.ingest_dir(inbox)[0].rejected
        target.write_text(make_incident().to_json())
        os.utime(target, ns=(1, 2_000_000_000_000_000_000))
        (result,) = ctl.ingest_dir(inbox)
        assert result.incident_id == make_incident().id
        assert ctl.records()[0].state is State.DETECTED


def test_reconcile_reads_configured_dirs(tmp_path: Path) -> None:
    """reconcile() ingests from ControllerConfig.incident_dirs before acting."""
    from replicheck.controller import ControllerConfig, LocalBackend

    inbox = tmp_path / "in"
    write_incident(make_incident(), inbox)
    backend = LocalBackend(tmp_path / "c.db")
    for n in ("n1", "n2", "n3"):
        backend.add_node(n)
    backend.add_job("job1", ("n1", "n2", "n3"))  # the incident's job and its allocation
    with Controller(
        tmp_path / "c.db", backend=backend, config=ControllerConfig(apply=True, incident_dirs=(str(inbox),))
    ) as ctl:
        assert [t.to_state for t in ctl.reconcile()] == [State.CORDONED, State.AWAITING_APPROVAL]


def test_later_copy_does_not_add_the_checkpoint(tmp_path: Path) -> None:
    """A duplicate that only adds a recommended_checkpoint is counted and audited, but neither the
    stored incident nor the record takes it: the first copy's checkpoint is the one used (issue 27;
    the resume this protects is tested in test_job_authority.py)."""
    with Controller(tmp_path / "c.db") as ctl:
        ctl.ingest(make_incident(checkpoint_step=None))
        assert ctl.records()[0].checkpoint is None
        assert ctl.ingest(make_incident(checkpoint_step=30)).new is False
        assert ctl.records()[0].checkpoint is None
        assert ctl.store.get_incident(make_incident().id).incident.recommended_checkpoint is None
        assert any(a.what == "checkpoint not taken" for a in ctl.store.audit_rows(make_incident().id))
