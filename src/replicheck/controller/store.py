"""The controller's SQLite store (WAL): incidents, their records, keyed actions, the
append-only audit log and rejected inputs. Versioned with ``PRAGMA user_version`` and
forward-only migrations; a database newer than this build is refused, not guessed at."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import sqlite3
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from replicheck.controller.errors import QuarantinedError, StoreError, UnknownIncidentError
from replicheck.controller.model import Action, ActionKind, Record, State
from replicheck.incident import Incident, IncidentFormatError
from replicheck.timefmt import utc_iso_us

Migration = str | Callable[[sqlite3.Connection], None]

MIGRATIONS: tuple[Migration, ...] = (
    # 1: the core tables.
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    CREATE TABLE incidents (
        id TEXT PRIMARY KEY, job_id TEXT NOT NULL, body TEXT NOT NULL, source TEXT NOT NULL,
        first_seen TEXT NOT NULL, last_seen TEXT NOT NULL, deliveries INTEGER NOT NULL);
    CREATE TABLE records (
        incident_id TEXT PRIMARY KEY REFERENCES incidents(id), state TEXT NOT NULL,
        data TEXT NOT NULL, updated_at TEXT NOT NULL);
    CREATE INDEX records_state ON records(state);
    CREATE TABLE actions (
        key TEXT PRIMARY KEY, incident_id TEXT NOT NULL REFERENCES incidents(id),
        kind TEXT NOT NULL, node TEXT, params TEXT NOT NULL, status TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0, next_attempt_at TEXT NOT NULL, last_error TEXT,
        result TEXT, created_at TEXT NOT NULL, started_at TEXT, finished_at TEXT);
    CREATE TABLE audit (
        id INTEGER PRIMARY KEY AUTOINCREMENT, at TEXT NOT NULL, actor TEXT NOT NULL,
        incident_id TEXT, what TEXT NOT NULL, outcome TEXT NOT NULL);
    CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    CREATE TRIGGER audit_no_delete BEFORE DELETE ON audit
        BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END;
    CREATE TABLE rejected (
        id INTEGER PRIMARY KEY AUTOINCREMENT, source TEXT NOT NULL, digest TEXT NOT NULL,
        reason TEXT NOT NULL, content BLOB NOT NULL, at TEXT NOT NULL, UNIQUE (source, digest));
    """,
    # 2: remember which incident files were read, so a watched directory is not re-parsed.
    """
    CREATE TABLE seen_files (
        path TEXT PRIMARY KEY, mtime_ns INTEGER NOT NULL, size INTEGER NOT NULL);
    CREATE INDEX actions_due ON actions(status, next_attempt_at);
    """,
    # 3: the audit log becomes a hash chain (rows written before are chained in id order).
    lambda db: _chain_audit(db),
    # 4: rows that cannot be read are quarantined (kept, reported once, skipped by every read),
    # and the indexes that let /metrics and the quotas count without loading bodies.
    """
    CREATE TABLE quarantine (
        tbl TEXT NOT NULL, key TEXT NOT NULL, reason TEXT NOT NULL, at TEXT NOT NULL,
        PRIMARY KEY (tbl, key));
    CREATE INDEX incidents_source ON incidents(source, first_seen);
    CREATE INDEX actions_kind ON actions(kind, status);
    CREATE INDEX audit_incident ON audit(incident_id);
    """,
)
SCHEMA_VERSION = len(MIGRATIONS)
log = logging.getLogger(__name__)
GENESIS = "0" * 64
"""The ``prev`` hash of the first audit row."""

ACTIVE = ("pending", "in_flight")

MAX_AUDIT_TEXT = 2048
"""Longest ``what``/``outcome`` kept in an audit row (characters); longer text is cut, saying by
how much, so a flood of refused 15 KB paths cannot grow the audit log by gigabytes."""
BUSY_TIMEOUT_S = 30.0
"""How long a statement waits for another process's lock before SQLite says "locked"."""

ActionStatus = Literal["pending", "in_flight", "done", "failed", "cancelled"]
"""pending, in_flight (started, result not recorded), done, failed, cancelled."""


@dataclass(frozen=True)
class ActionRow:
    """An action as stored, with its execution bookkeeping."""

    key: str
    incident_id: str
    kind: ActionKind
    node: str | None
    params: Mapping[str, Any]
    status: ActionStatus
    """pending, in_flight (started, result not recorded), done, failed, cancelled."""
    attempts: int
    next_attempt_at: str
    last_error: str | None
    result: Mapping[str, Any] | None
    started_at: str | None = None
    """When the latest attempt started (with status in_flight: an attempt whose outcome is unknown)."""


@dataclass(frozen=True)
class AuditRow:
    """One audit log entry."""

    id: int
    at: str
    actor: str
    incident_id: str | None
    what: str
    outcome: str


@dataclass(frozen=True)
class AuditCheck:
    """The result of verifying the audit hash chain."""

    rows: int
    """Rows checked."""
    head: str
    """Hash of the last row (record it elsewhere to detect a rewrite of the whole chain)."""
    problems: tuple[str, ...]
    """Each break found (empty: the chain is intact)."""

    @property
    def ok(self) -> bool:
        return not self.problems


@dataclass(frozen=True)
class IncidentRow:
    """A stored incident with its delivery bookkeeping."""

    incident: Incident
    source: str
    first_seen: str
    deliveries: int


class Store:
    """One connection to the controller database. Not thread-safe; one per process."""

    def __init__(self, path: str | Path, *, busy_timeout_s: float = BUSY_TIMEOUT_S) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(str(self.path), timeout=busy_timeout_s, isolation_level=None)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.execute("PRAGMA foreign_keys=ON")
        except (sqlite3.Error, OSError) as exc:
            raise StoreError(f"{self.path}: cannot open the controller database: {exc}") from exc
        self._depth = 0
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise

    def close(self) -> None:
        self._db.close()

    @property
    def connection(self) -> sqlite3.Connection:
        """The raw connection (the local backend keeps its simulated cluster in the same file)."""
        return self._db

    # --- schema -----------------------------------------------------------------------------

    def _migrate(self) -> None:
        try:
            version = self._db.execute("PRAGMA user_version").fetchone()[0]
            if version > SCHEMA_VERSION:
                raise StoreError(
                    f"{self.path}: database schema version {version} is newer than this build "
                    f"understands ({SCHEMA_VERSION}); upgrade replicheck"
                )
            for number in range(version, SCHEMA_VERSION):
                with self.transaction():
                    if self.schema_version() != number:
                        continue  # another process migrated while this one waited
                    migration = MIGRATIONS[number]
                    if callable(migration):
                        migration(self._db)
                    else:
                        for statement in _statements(migration):
                            self._db.execute(statement)
                    self._db.execute(f"PRAGMA user_version={number + 1}")
        except sqlite3.DatabaseError as exc:
            raise StoreError(f"{self.path}: not a usable controller database: {exc}") from exc

    def schema_version(self) -> int:
        return int(self._db.execute("PRAGMA user_version").fetchone()[0])

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """BEGIN IMMEDIATE ... COMMIT; nested uses join the outer transaction."""
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        self._db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield
        except BaseException:
            self._depth = 0
            self._db.execute("ROLLBACK")
            raise
        self._depth = 0
        self._db.execute("COMMIT")

    # --- meta -------------------------------------------------------------------------------

    def get_meta(self, key: str) -> str | None:
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        self._db.execute(
            "INSERT INTO meta(key, value) VALUES(?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, value),
        )

    # --- incidents and records --------------------------------------------------------------

    def add_incident(self, incident: Incident, source: str, now: str) -> tuple[bool, str]:
        """Store ``incident`` or merge it into the stored one with the same id.

        Returns (new, merge): merge is "same" for an identical copy, "filled" when the copy only
        adds a recommended_checkpoint the first lacked (counted; the stored first copy is kept), and
        "differs" otherwise (nothing is stored or counted: the caller stores it as a distinct
        incident under a derived id).
        """
        body = incident.to_json()
        with self.transaction():
            row = self._db.execute("SELECT body FROM incidents WHERE id=?", (incident.id,)).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO incidents(id, job_id, body, source, first_seen, last_seen, deliveries)"
                    " VALUES(?, ?, ?, ?, ?, ?, 1)",
                    (incident.id, incident.job_id, body, source, now, now),
                )
                return True, "same"
            old, new = _comparable(row[0]), _comparable(body)
            filled = (
                old.get("recommended_checkpoint") is None
                and new.get("recommended_checkpoint") is not None
                and {**old, "recommended_checkpoint": None} == {**new, "recommended_checkpoint": None}
            )
            if old != new and not filled:
                return False, "differs"  # not a copy of this incident: nothing is merged
            self._db.execute(
                "UPDATE incidents SET deliveries=deliveries+1, last_seen=? WHERE id=?", (now, incident.id)
            )
            if filled:
                # Counted as a delivery; the first copy is kept: a later one never adds a checkpoint.
                return False, "filled"
            return False, "same"

    def get_incident(self, incident_id: str) -> IncidentRow:
        row = self._db.execute(
            "SELECT body, source, first_seen, deliveries FROM incidents WHERE id=?", (incident_id,)
        ).fetchone()
        if row is None:
            raise UnknownIncidentError(f"no incident {incident_id!r} in {self.path}")
        try:
            incident = Incident.from_json(row[0])
        except (IncidentFormatError, ValueError, TypeError, RecursionError) as exc:
            # Written by an older build or damaged on disk: kept aside, reported, never fatal.
            reason = f"stored incident is unreadable: {_reason(exc)}"
            self.quarantine("incidents", incident_id, reason)
            raise QuarantinedError(f"incident {incident_id!r} is quarantined: {reason}") from None
        return IncidentRow(incident, row[1], row[2], int(row[3]))

    def save_record(self, record: Record, now: str) -> None:
        self._db.execute(
            "INSERT INTO records(incident_id, state, data, updated_at) VALUES(?, ?, ?, ?) "
            "ON CONFLICT(incident_id) DO UPDATE SET state=excluded.state, data=excluded.data, "
            "updated_at=excluded.updated_at",
            (record.incident_id, record.state.value, record.to_json(), now),
        )

    def get_record(self, incident_id: str) -> Record:
        row = self._db.execute("SELECT data FROM records WHERE incident_id=?", (incident_id,)).fetchone()
        if row is None:
            raise UnknownIncidentError(f"no incident {incident_id!r} in {self.path}")
        record = self._record(incident_id, row[0])
        if record is None:
            raise QuarantinedError(f"incident {incident_id!r} is quarantined: its record is unreadable")
        return record

    def list_records(self, states: Sequence[State] | None = None) -> list[Record]:
        """Every readable record (optionally only some states); an unreadable one is quarantined
        and left out, so one damaged row never stops the others being listed or acted on."""
        sql = (
            "SELECT r.incident_id, r.data FROM records r JOIN incidents i ON i.id=r.incident_id"
            " WHERE r.incident_id NOT IN (SELECT key FROM quarantine WHERE tbl='records')"
        )
        args: tuple[str, ...] = ()
        if states is not None:
            wanted = tuple(s.value for s in states)
            sql += f" AND r.state IN ({', '.join('?' * len(wanted))})"
            args = wanted
        rows = self._db.execute(sql + " ORDER BY i.first_seen, r.incident_id", args).fetchall()
        return [r for r in (self._record(key, data) for key, data in rows) if r is not None]

    def _record(self, incident_id: str, data: Any) -> Record | None:
        try:
            record = Record.from_json(data)
            if record.incident_id != incident_id:
                raise ValueError(f"holds incident {record.incident_id!r}")
            return record
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            self.quarantine("records", incident_id, f"unreadable record: {_reason(exc)}")
            return None

    # --- actions ----------------------------------------------------------------------------

    def add_actions(self, actions: Sequence[Action], now: str) -> None:
        for a in actions:
            self._db.execute(
                "INSERT OR IGNORE INTO actions(key, incident_id, kind, node, params, status, "
                "next_attempt_at, created_at) VALUES(?, ?, ?, ?, ?, 'pending', ?, ?)",
                (
                    a.key,
                    a.incident_id,
                    a.kind.value,
                    a.node,
                    json.dumps(dict(a.params), sort_keys=True),
                    now,
                    now,
                ),
            )

    def cancel_actions(self, keys: Sequence[str], now: str) -> None:
        for key in keys:
            self._db.execute(
                "UPDATE actions SET status='cancelled', finished_at=? WHERE key=? "
                "AND status IN ('pending', 'in_flight')",
                (now, key),
            )

    def due_actions(self, now: str) -> list[ActionRow]:
        rows = self._db.execute(
            f"SELECT {_ACTION_COLS} FROM actions WHERE status IN ('pending', 'in_flight') "
            "AND next_attempt_at <= ? AND key NOT IN (SELECT key FROM quarantine WHERE tbl='actions') "
            "ORDER BY created_at, key",
            (now,),
        ).fetchall()
        return self._action_rows(rows)

    def actions(self, incident_id: str | None = None) -> list[ActionRow]:
        """Readable actions (of one incident); an unreadable one (unknown kind, damaged
        parameters) is quarantined and left out."""
        sql = f"SELECT {_ACTION_COLS} FROM actions"
        args: tuple[Any, ...] = ()
        if incident_id is not None:
            sql, args = sql + " WHERE incident_id=?", (incident_id,)
        return self._action_rows(self._db.execute(sql + " ORDER BY created_at, key", args).fetchall())

    def get_action(self, key: str) -> ActionRow | None:
        row = self._db.execute(f"SELECT {_ACTION_COLS} FROM actions WHERE key=?", (key,)).fetchone()
        if row is None:
            return None
        found = self._action_rows([row])
        return found[0] if found else None

    def _action_rows(self, rows: Sequence[Sequence[Any]]) -> list[ActionRow]:
        out = []
        for r in rows:
            try:
                out.append(_action_row(r))
            except (ValueError, TypeError, KeyError, RecursionError) as exc:
                self.quarantine("actions", str(r[0]), f"unreadable action: {_reason(exc)}")
        return out

    def start_attempt(self, key: str, now: str) -> bool:
        """Mark the action in flight before calling the backend (so a crash leaves it in doubt).

        False when the action is no longer pending or in flight (cancelled or finished since it
        was listed): the caller must not perform it."""
        cur = self._db.execute(
            "UPDATE actions SET status='in_flight', attempts=attempts+1, started_at=? "
            "WHERE key=? AND status IN ('pending', 'in_flight')",
            (now, key),
        )
        return cur.rowcount == 1

    def finish_action(self, key: str, result: Mapping[str, Any], now: str) -> None:
        self._db.execute(
            "UPDATE actions SET status='done', result=?, last_error=NULL, finished_at=? WHERE key=?",
            (json.dumps(dict(result), sort_keys=True), now, key),
        )

    def fail_action(self, key: str, error: str, now: str) -> None:
        self._db.execute(
            "UPDATE actions SET status='failed', last_error=?, finished_at=? WHERE key=?", (error, now, key)
        )

    def defer_action(self, key: str, note: str, next_at: str, *, uncount: bool = False) -> None:
        """Put the action back to pending until ``next_at``; ``uncount`` undoes the attempt count
        (polling and dry-run are not failures)."""
        self._db.execute(
            "UPDATE actions SET status='pending', last_error=?, next_attempt_at=?, "
            "attempts=attempts-? WHERE key=?",
            (note, next_at, 1 if uncount else 0, key),
        )

    def replacements_since(self, since: str) -> int:
        """Replacements done since ``since`` plus those committed to but not finished."""
        row = self._db.execute(
            "SELECT COUNT(*) FROM actions WHERE kind='replace' AND (status IN ('pending', 'in_flight') "
            "OR (status='done' AND finished_at >= ?))",
            (since,),
        ).fetchone()
        return int(row[0])

    def cordons_since(self, since: str, job_id: str | None = None) -> int:
        """Cordons done since ``since`` plus those committed to but not finished (of ``job_id``'s
        incidents only, when given). A dismissed incident's cordons are undone: they stop counting."""
        where = (
            "kind='cordon' AND (status IN ('pending', 'in_flight') "
            "OR (status='done' AND finished_at >= ? AND result NOT LIKE '%\"skipped\"%')) "
            "AND incident_id NOT IN (SELECT incident_id FROM records WHERE state IN ('dismissed', 'uncordoned'))"
        )
        args: tuple[str, ...] = (since,)
        if job_id is not None:
            where += " AND incident_id IN (SELECT id FROM incidents WHERE job_id=?)"
            args += (job_id,)
        row = self._db.execute(f"SELECT COUNT(*) FROM actions WHERE {where}", args).fetchone()
        return int(row[0])

    def clamp_future(self, now: str, latest: str, latest_deadline: str) -> int:
        """Bring timestamps the clock put in the future back: finish times, records' approval
        and dismissal times and their last update after ``now`` to ``now``; next attempts after
        ``latest`` (the longest wait the controller sets) to ``now``; a replaced node's return
        deadline after ``latest_deadline`` (now plus the return timeout) to that. Returns how
        many rows changed."""
        changed = 0
        for sql, args in (
            ("UPDATE actions SET finished_at=? WHERE finished_at > ?", (now, now)),
            (
                "UPDATE actions SET next_attempt_at=? WHERE status IN ('pending', 'in_flight') "
                "AND next_attempt_at > ?",
                (now, latest),
            ),
            (
                "UPDATE actions SET params=json_set(params, '$.deadline', ?) WHERE status IN "
                "('pending', 'in_flight') AND json_valid(params) "
                "AND json_extract(params, '$.deadline') > ?",
                (latest_deadline, latest_deadline),
            ),
            *(
                (
                    f"UPDATE records SET data=json_set(data, '$.{field}', ?) WHERE json_valid(data) "
                    f"AND json_extract(data, '$.{field}') > ?",
                    (now, now),
                )
                for field in ("approved_at", "dismissed_at")
            ),
            ("UPDATE records SET updated_at=? WHERE updated_at > ?", (now, now)),
        ):
            changed += self._db.execute(sql, args).rowcount
        return changed

    def nodes_held(self, exclude_incident: str) -> set[str]:
        """Nodes still cordoned by other incidents that are not finished."""
        held: set[str] = set()
        for record in self.list_records():
            if record.incident_id != exclude_incident and record.state not in (
                State.RESUMED,
                State.JOINED,
                State.UNCORDONED,
            ):
                held.update(record.cordoned)
        return held

    # --- quarantine -------------------------------------------------------------------------

    def quarantine(self, table: str, key: str, reason: str) -> bool:
        """Set a row that cannot be read aside: every later read skips it, the first time is
        audited (``quarantined``). Best effort: a database that cannot be written right now
        still serves the readable rows. True if newly quarantined."""
        try:
            with self.transaction():
                cur = self._db.execute(
                    "INSERT OR IGNORE INTO quarantine(tbl, key, reason, at) VALUES(?, ?, ?, ?)",
                    (table, key, reason, utc_iso_us()),
                )
                if cur.rowcount != 1:
                    return False
                incident = key if table in ("incidents", "records") else None
                if (
                    incident is not None
                    and self._db.execute("SELECT 1 FROM incidents WHERE id=?", (incident,)).fetchone() is None
                ):
                    incident = None
                _append_audit(
                    self._db, utc_iso_us(), "controller", incident, "quarantined", f"{table} {key}: {reason}"
                )
        except sqlite3.Error as exc:
            log.warning("could not record the quarantine of %s %s (%s): %s", table, key, reason, exc)
            return False
        log.error("quarantined %s row %s: %s", table, key, reason)
        return True

    def quarantined(self) -> list[tuple[str, str, str, str]]:
        """(table, key, reason, at) of every quarantined row."""
        return [
            (str(r[0]), str(r[1]), str(r[2]), str(r[3]))
            for r in self._db.execute("SELECT tbl, key, reason, at FROM quarantine ORDER BY at, tbl, key")
        ]

    def count(self, sql: str, args: Sequence[Any] = ()) -> int:
        """``SELECT COUNT(*) ...``: one integer, computed by SQLite without loading rows."""
        return int(self._db.execute(sql, tuple(args)).fetchone()[0])

    # --- audit, rejections, seen files ------------------------------------------------------

    def audit(self, at: str, actor: str, what: str, outcome: str, incident_id: str | None = None) -> None:
        """Append one row to the hash-chained audit log (and move the recorded head)."""
        with self.transaction():
            _append_audit(self._db, at, actor, incident_id, _cut(what), _cut(outcome))

    def verify_audit(self) -> AuditCheck:
        """Recompute the audit hash chain; every edited, removed or inserted row is reported."""
        return _verify_chain(self._db)

    def audit_rows(self, incident_id: str | None = None) -> list[AuditRow]:
        sql = "SELECT id, at, actor, incident_id, what, outcome FROM audit"
        args: tuple[Any, ...] = ()
        if incident_id is not None:
            sql, args = sql + " WHERE incident_id=?", (incident_id,)
        return [AuditRow(*r) for r in self._db.execute(sql + " ORDER BY id", args)]

    def reject(self, source: str, reason: str, content: bytes, now: str) -> bool:
        """Keep a rejected input for inspection; False if this exact content was already kept."""
        digest = hashlib.sha256(content).hexdigest()
        cur = self._db.execute(
            "INSERT OR IGNORE INTO rejected(source, digest, reason, content, at) VALUES(?, ?, ?, ?, ?)",
            (source, digest, reason, content, now),
        )
        return cur.rowcount == 1

    def clear_unreadable(self, source: str) -> None:
        """Forget the "cannot read" and "not yet valid" reports of ``source`` once it has been read."""
        self._db.execute(
            "DELETE FROM rejected WHERE source=? AND (reason LIKE 'cannot read:%' OR reason LIKE 'not yet valid:%')",
            (source,),
        )

    def rejected_rows(self) -> list[tuple[str, str, bytes, str]]:
        """(source, reason, content, at) of every rejected input."""
        return [
            (r[0], r[1], bytes(r[2]), r[3])
            for r in self._db.execute("SELECT source, reason, content, at FROM rejected ORDER BY id")
        ]

    def file_seen(self, path: str, mtime_ns: int, size: int) -> bool:
        row = self._db.execute("SELECT mtime_ns, size FROM seen_files WHERE path=?", (path,)).fetchone()
        return row is not None and (int(row[0]), int(row[1])) == (mtime_ns, size)

    def mark_file_seen(self, path: str, mtime_ns: int, size: int) -> None:
        self._db.execute(
            "INSERT INTO seen_files(path, mtime_ns, size) VALUES(?, ?, ?) ON CONFLICT(path) "
            "DO UPDATE SET mtime_ns=excluded.mtime_ns, size=excluded.size",
            (path, mtime_ns, size),
        )


_ACTION_COLS = (
    "key, incident_id, kind, node, params, status, attempts, next_attempt_at, last_error, result, started_at"
)


def _action_row(r: Sequence[Any]) -> ActionRow:
    return ActionRow(
        key=r[0],
        incident_id=r[1],
        kind=ActionKind(r[2]),
        node=r[3],
        params=json.loads(r[4]),
        status=cast(ActionStatus, r[5]),
        attempts=int(r[6]),
        next_attempt_at=r[7],
        last_error=r[8],
        result=None if r[9] is None else json.loads(r[9]),
        started_at=r[10],
    )


def _cut(text: str) -> str:
    if len(text) <= MAX_AUDIT_TEXT:
        return text
    return f"{text[:MAX_AUDIT_TEXT]}... ({len(text) - MAX_AUDIT_TEXT} more characters not kept)"


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:200]}"


def _statements(script: str) -> list[str]:
    # Split on ';' at the end of a line, keeping trigger bodies (which end in "END;") whole.
    out, buf = [], []
    for line in script.strip().splitlines():
        buf.append(line)
        text = "\n".join(buf).strip()
        if text.endswith(";") and sqlite3.complete_statement(text):
            out.append(text)
            buf = []
    return out


def _comparable(body: str) -> dict[str, Any]:
    # Ranks may write their copies at slightly different times; the time is not the content.
    data: dict[str, Any] = json.loads(body)
    data.pop("time", None)
    return data


def _row_hash(prev: str, row: Sequence[Any]) -> str:
    body = json.dumps([prev, *row], ensure_ascii=True, separators=(",", ":"))
    return hashlib.sha256(body.encode("ascii")).hexdigest()


def _append_audit(
    db: sqlite3.Connection, at: str, actor: str, incident_id: str | None, what: str, outcome: str
) -> None:
    last = db.execute("SELECT id, hash FROM audit ORDER BY id DESC LIMIT 1").fetchone()
    number, prev = (1, GENESIS) if last is None else (int(last[0]) + 1, str(last[1]))
    digest = _row_hash(prev, (number, at, actor, incident_id, what, outcome))
    db.execute(
        "INSERT INTO audit(id, at, actor, incident_id, what, outcome, prev, hash) "
        "VALUES(?, ?, ?, ?, ?, ?, ?, ?)",
        (number, at, actor, incident_id, what, outcome, prev, digest),
    )
    db.execute(
        "INSERT INTO meta(key, value) VALUES('audit_head', ?) ON CONFLICT(key) DO UPDATE "
        "SET value=excluded.value",
        (f"{number}:{digest}",),
    )


def _verify_chain(db: sqlite3.Connection) -> AuditCheck:
    problems: list[str] = []
    prev, count, last_id = GENESIS, 0, 0
    for row in db.execute(
        "SELECT id, at, actor, incident_id, what, outcome, prev, hash FROM audit ORDER BY id"
    ):
        number = int(row[0])
        count += 1
        if number != last_id + 1:
            problems.append(f"rows {last_id + 1}..{number - 1} are missing")
        if row[6] != prev:
            problems.append(f"row {number}: does not follow row {last_id} (chain broken)")
        if _row_hash(str(row[6]), row[:6]) != row[7]:
            problems.append(f"row {number}: content does not match its hash (edited)")
        prev, last_id = str(row[7]), number
    head = db.execute("SELECT value FROM meta WHERE key='audit_head'").fetchone()
    recorded = None if head is None else str(head[0])
    if count and recorded != f"{last_id}:{prev}":
        problems.append(
            f"the last row is {last_id} but the recorded head is {recorded} (rows removed or added)"
        )
    if not count and recorded is not None:
        problems.append(f"the audit log is empty but its recorded head is {recorded} (rows removed)")
    return AuditCheck(rows=count, head=prev, problems=tuple(problems))


def _chain_audit(db: sqlite3.Connection) -> None:
    db.execute("ALTER TABLE audit ADD COLUMN prev TEXT")
    db.execute("ALTER TABLE audit ADD COLUMN hash TEXT")
    db.execute("DROP TRIGGER audit_no_update")
    rows = db.execute("SELECT id, at, actor, incident_id, what, outcome FROM audit ORDER BY id").fetchall()
    prev, number = GENESIS, 0
    for row in rows:
        # Renumber densely so verification can tell a removed row from a gap left by AUTOINCREMENT.
        number += 1
        digest = _row_hash(prev, (number, *row[1:]))
        db.execute("UPDATE audit SET id=?, prev=?, hash=? WHERE id=?", (number, prev, digest, row[0]))
        prev = digest
    if rows:
        db.execute(
            "INSERT INTO meta(key, value) VALUES('audit_head', ?) ON CONFLICT(key) DO UPDATE "
            "SET value=excluded.value",
            (f"{number}:{prev}",),
        )
    db.execute(
        "CREATE TRIGGER audit_no_update BEFORE UPDATE ON audit "
        "BEGIN SELECT RAISE(ABORT, 'the audit log is append-only'); END"
    )
