"""A second controller on the same database refuses to act (the lease); the audit log is a
hash chain that `replicheck audit verify` checks, and tampering is detected."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from ctlkit import cluster, make_incident
from test_cli import cli

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.errors import LeaseHeldError
from replicheck.controller.lease import Lease
from replicheck.controller.store import MIGRATIONS, Store

DRIVER = Path(__file__).with_name("lease_driver.py")
SRC = Path(__file__).resolve().parents[2] / "src"


def test_second_controller_refuses_to_act(tmp_path: Path) -> None:
    """While one controller holds the lease a second one raises LeaseHeldError naming the holder and calls nothing."""
    db = tmp_path / "c.db"
    cluster(db).close()
    first = Controller(db, config=ControllerConfig(apply=True))
    first.ingest(make_incident())
    first.reconcile()
    second = Controller(db, config=ControllerConfig(apply=True))
    with pytest.raises(LeaseHeldError, match=f"pid {os.getpid()}"):
        second.reconcile()
    second.close()
    first.close()
    third = Controller(db, config=ControllerConfig(apply=True))  # released on close: the next one acts
    third.reconcile()
    third.close()


def _snapshot(db: Path) -> dict[str, tuple[int, int, bytes]]:
    """(size, mtime, bytes) of the database file and its WAL/shared-memory companions."""
    files = [db, Path(f"{db}-wal"), Path(f"{db}-shm")]
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes()) for p in files if p.exists()}


def test_second_controller_on_python_api_writes_nothing(tmp_path: Path) -> None:
    """A second Controller built on a leased database (an older schema, so it would migrate) is refused with LeaseHeldError before it writes anything: the file's bytes and mtime, schema version and audit are unchanged."""
    db = tmp_path / "c.db"
    con = sqlite3.connect(db, isolation_level=None)
    con.executescript(str(MIGRATIONS[0]) + "PRAGMA user_version=1;")
    con.close()
    holder = Lease(db)
    holder.acquire()
    before = _snapshot(db)
    second = Controller(db, config=ControllerConfig(apply=True))
    with pytest.raises(LeaseHeldError):
        second.reconcile()
    with pytest.raises(LeaseHeldError):
        second.run(max_passes=1)
    second.close()
    assert _snapshot(db) == before
    con = sqlite3.connect(db, isolation_level=None)
    assert con.execute("PRAGMA user_version").fetchone()[0] == 1
    assert con.execute("SELECT COUNT(*) FROM audit").fetchone()[0] == 0
    con.close()
    holder.release()


def test_operator_commands_need_no_lease(tmp_path: Path) -> None:
    """While another controller holds the lease, the Python API still ingests, approves, dismisses and shows (operator commands take no lease)."""
    db = tmp_path / "c.db"
    cluster(db).close()
    with Controller(db, config=ControllerConfig(apply=True, checkpoint_roots=("/ck",))) as acting:
        acting.reconcile()
        with Controller(db) as operator:
            inc = make_incident()
            assert operator.ingest(inc).new
        acting.reconcile()
        with Controller(db) as operator:
            assert operator.show(inc.id).record.state is State.AWAITING_APPROVAL
            operator.approve(inc.id, by="alice")
            assert operator.show(inc.id).record.approved_by == "alice"
        other = make_incident(step=9, nodes=("n3",))
        with Controller(db) as operator:
            operator.ingest(other)
        acting.reconcile()
        with Controller(db) as operator:
            operator.dismiss(other.id, by="alice")
            assert operator.show(other.id).record.dismissed_by == "alice"


@pytest.mark.timeout(300)
def test_two_controllers_twenty_trials_no_duplicate_side_effect(tmp_path: Path) -> None:
    """20 trials of two controller processes started together on one database: one acts, the other refuses; no change is made twice."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    refusals = 0
    for trial in range(20):
        db, log = tmp_path / f"c{trial}.db", tmp_path / f"calls{trial}.log"
        cluster(db, active=("n1", "n2", "n3"), spares=("s1",)).close()
        Store(db).close()  # migrate once, so both start from the same schema
        gate = tmp_path / f"gate{trial}"
        procs = [
            subprocess.Popen(
                [sys.executable, str(DRIVER), str(db), str(log), str(gate)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(2)
        ]
        # Both processes imported and set up before either opens its controller: on a slow,
        # loaded machine one start could otherwise finish before the other begins.
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob(f"gate{trial}.*"))) < 2 and time.monotonic() < deadline:
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.01)
        gate.touch()
        outs = [p.communicate(timeout=120) for p in procs]
        assert all(p.returncode == 0 for p in procs), outs
        said = sorted(out.split(":")[0].strip() for out, _ in outs)
        assert "acted" in said, outs
        refusals += said.count("refused")
        calls = Counter(" ".join(line.split()[1:]) for line in log.read_text().splitlines())
        assert calls == Counter({"cordon n2": 1, "replace n2": 1, "resume job": 1}), (trial, calls, outs)
    assert refusals >= 1  # the two really overlapped at least once


def _audited_db(tmp_path: Path) -> Path:
    db = tmp_path / "c.db"
    cluster(db).close()
    with Controller(
        db, config=ControllerConfig(apply=True, auto_approve=True, checkpoint_roots=("/ck",))
    ) as ctl:
        ctl.ingest(make_incident(), vouched_by="job token job1 (jobs=job1)")
        for _ in range(3):
            ctl.reconcile()
        assert ctl.store.get_record(make_incident().id).state is State.RESUMED
    return db


def test_audit_chain_verifies(tmp_path: Path) -> None:
    """A controller's audit log verifies intact, through the API and `replicheck audit verify`."""
    db = _audited_db(tmp_path)
    with _Open(db) as store:
        check = store.verify_audit()
    assert check.ok and check.rows >= 8, check
    run = cli("audit", "verify", "--db", str(db))
    assert run.returncode == 0 and f"{check.rows} rows" in run.stdout and check.head in run.stdout, run.stderr


@pytest.mark.parametrize("tamper", ["edit", "delete_middle", "delete_last", "insert"])
def test_tampered_audit_is_detected(tmp_path: Path, tamper: str) -> None:
    """Editing, removing or inserting an audit row (after dropping the triggers) makes `audit verify` exit 1 naming the row."""
    db = _audited_db(tmp_path)
    con = sqlite3.connect(db, isolation_level=None)
    con.execute("DROP TRIGGER audit_no_update")
    con.execute("DROP TRIGGER audit_no_delete")
    last = con.execute("SELECT max(id) FROM audit").fetchone()[0]
    if tamper == "edit":
        con.execute("UPDATE audit SET actor='mallory' WHERE id=3")
    elif tamper == "delete_middle":
        con.execute("DELETE FROM audit WHERE id=4")
    elif tamper == "delete_last":
        con.execute("DELETE FROM audit WHERE id=?", (last,))
    else:
        row = con.execute(
            "SELECT at, actor, incident_id, what, outcome, prev, hash FROM audit WHERE id=2"
        ).fetchone()
        con.execute(
            "INSERT INTO audit(id, at, actor, incident_id, what, outcome, prev, hash) "
            "VALUES(?, ?, 'mallory', ?, 'approved', 'forged', ?, ?)",
            (last + 1, row[0], row[2], row[5], row[6]),
        )
    con.close()
    run = cli("audit", "verify", "--db", str(db))
    assert run.returncode == 1 and "TAMPERED" in run.stdout, run.stdout + run.stderr


def test_version_two_database_gets_a_verified_chain(tmp_path: Path) -> None:
    """A schema-2 database with audit rows migrates to the hash chain, and its old rows verify."""
    db = tmp_path / "c.db"
    con = sqlite3.connect(db, isolation_level=None)
    con.executescript(str(MIGRATIONS[0]) + str(MIGRATIONS[1]) + "PRAGMA user_version=2;")
    for i in (1, 2, 5):  # AUTOINCREMENT gaps are normal in an old log
        con.execute(
            "INSERT INTO audit(id, at, actor, what, outcome) VALUES(?, 't', 'controller', 'w', ?)",
            (i, f"o{i}"),
        )
    con.close()
    store = Store(db)
    check = store.verify_audit()
    assert check.ok and check.rows == 3, check
    assert [r.outcome for r in store.audit_rows()] == ["o1", "o2", "o5"]
    store.close()


class _Open:
    def __init__(self, db: Path) -> None:
        self.store = Store(db)

    def __enter__(self) -> Store:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def test_controller_run_says_the_lease_is_held(tmp_path: Path) -> None:
    """`controller run` against a database whose lease another controller holds exits 2 with one line saying so."""
    db = tmp_path / "c.db"
    cluster(db).close()
    with Controller(db, config=ControllerConfig()) as holder:
        holder.reconcile()
        run = cli("controller", "run", "--db", str(db), "--once")
    assert run.returncode == 2 and "another controller holds the lease" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


def test_api_source_with_lone_surrogate_is_stored(tmp_path: Path) -> None:
    """An API caller's source label with a lone surrogate is stored escaped, not a crash."""
    with Controller(tmp_path / "c.db") as ctl:
        result = ctl.ingest(make_incident(), source="api:\ud800")
        assert result.incident_id is not None
        assert ctl.show(make_incident().id).incident.source == "api:\\ud800"
