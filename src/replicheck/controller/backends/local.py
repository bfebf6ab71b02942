"""``local``: a simulated cluster kept in SQLite (by default the controller's own file).

Nodes are active or spare; ``replace`` retires a node and swaps a spare into its partition;
``resume`` records the request so a demo can restart training itself; ``join`` starts the job's
registered replacement command (one replica group, as a real process) or, with none registered,
records the request for a demo to start. Every effective operation is logged in ``sim_ops``
under its action key, which is what makes repeated calls no-ops and what tests count.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicheck.controller.backends.base import (
    JoinRequest,
    NodeInfo,
    ResumeRequest,
    validate_node_name,
)
from replicheck.controller.errors import PermanentBackendError
from replicheck.incident import INCIDENT_ID, JOB_ID, REPLICA_GROUP
from replicheck.timefmt import utc_iso_us

_SCHEMA = """
CREATE TABLE IF NOT EXISTS sim_nodes (
    name TEXT PRIMARY KEY, partition TEXT NOT NULL, role TEXT NOT NULL, state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '', healthy INTEGER NOT NULL DEFAULT 1);
CREATE TABLE IF NOT EXISTS sim_ops (
    key TEXT PRIMARY KEY, kind TEXT NOT NULL, node TEXT, result TEXT NOT NULL, at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sim_resumes (
    key TEXT PRIMARY KEY, incident_id TEXT NOT NULL, job_id TEXT NOT NULL, checkpoint TEXT,
    exclude TEXT NOT NULL, nodes TEXT NOT NULL, at TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sim_jobs (
    job_id TEXT PRIMARY KEY, nodes TEXT NOT NULL, state TEXT NOT NULL DEFAULT 'running');
CREATE TABLE IF NOT EXISTS sim_join_commands (job_id TEXT PRIMARY KEY, argv TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS sim_joins (
    key TEXT PRIMARY KEY, incident_id TEXT NOT NULL, job_id TEXT NOT NULL, replica_group TEXT NOT NULL,
    node TEXT NOT NULL, argv TEXT, pid INTEGER, status TEXT NOT NULL, at TEXT NOT NULL);
"""

JOIN_MARKER = "REPLICHECK_JOIN_KEY"
"""Environment variable a replacement group started by :meth:`LocalBackend.join` carries (the
action key): a controller that stopped between starting it and recording it finds it by this."""
JOIN_PLACEHOLDERS = ("{job_id}", "{replica_group}", "{node}", "{incident}")
"""What a registered join command may name; each value is checked against its grammar first."""


@dataclass(frozen=True, kw_only=True)
class ResumeRecord(ResumeRequest):
    """A resume request the local backend received (what a demo restarts training from), with
    where and when it resumed. ``previous_attempt_at`` is not kept: the backend's keyed log, not
    the caller, tells it whether a call was already made."""

    nodes: tuple[str, ...]
    """Active, schedulable nodes of the simulated cluster after the replacement."""
    at: str
    """When the request was received (ISO time)."""


@dataclass(frozen=True, kw_only=True)
class JoinRecord:
    """A replacement group the local backend started (or, with no command registered, was asked
    to start)."""

    incident_id: str
    job_id: str
    replica_group: str
    node: str
    """Where it runs: the node that took the replaced one's place."""
    argv: tuple[str, ...] | None
    """The command started (None: no join command registered; the request is only recorded)."""
    pid: int | None
    """Its process id (None while in doubt or when nothing was started)."""
    status: str
    """``started``, ``requested`` (recorded only) or ``starting`` (a start in doubt)."""
    at: str


class LocalBackend:
    """The simulated cluster. ``db_path`` may be the controller database (the default)."""

    name = "local"

    def __init__(self, db_path: str | Path) -> None:
        self._db = sqlite3.connect(str(db_path), timeout=30.0, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    # --- setting up and inspecting the simulation --------------------------------------------

    def add_node(
        self, name: str, *, partition: str = "main", spare: bool = False, healthy: bool = True
    ) -> None:
        """Add a node (idempotent): active and idle, or a spare waiting to be swapped in."""
        validate_node_name(name)
        self._db.execute(
            "INSERT OR IGNORE INTO sim_nodes(name, partition, role, state, healthy) "
            "VALUES(?, ?, ?, 'idle', ?)",
            (name, partition, "spare" if spare else "active", int(healthy)),
        )

    def add_job(
        self, job_id: str, nodes: Sequence[str], *, join_command: Sequence[str] | None = None
    ) -> None:
        """Register a running job on ``nodes`` (its allocation); registering again replaces it.

        ``join_command``: the argv that starts one replica group of this job, run by
        :meth:`join` (no shell) with ``{job_id}``, ``{replica_group}``, ``{node}`` and
        ``{incident}`` replaced; it is the operator's, never the incident's."""
        names = [validate_node_name(n) for n in nodes]
        argv = None if join_command is None else [str(a) for a in join_command]
        if argv is not None and not argv:
            raise ValueError("join_command must name a program")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(
                "INSERT OR REPLACE INTO sim_jobs(job_id, nodes, state) VALUES(?, ?, 'running')",
                (job_id, json.dumps(names)),
            )
            if argv is not None:
                self._db.execute(
                    "INSERT OR REPLACE INTO sim_join_commands(job_id, argv) VALUES(?, ?)",
                    (job_id, json.dumps(argv)),
                )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise

    def end_job(self, job_id: str) -> None:
        """The job ended; its allocation is still reported, as Slurm's accounting would."""
        self._db.execute("UPDATE sim_jobs SET state='ended' WHERE job_id=?", (job_id,))

    def set_healthy(self, name: str, healthy: bool) -> None:
        """Make the simulated self-test on ``name`` pass or fail."""
        self._db.execute("UPDATE sim_nodes SET healthy=? WHERE name=?", (int(healthy), name))

    def op_counts(self) -> dict[str, int]:
        """Effective operations performed, by kind (repeated keyed calls are not counted)."""
        rows = self._db.execute("SELECT kind, COUNT(*) FROM sim_ops GROUP BY kind")
        return {kind: int(n) for kind, n in rows}

    def resume_requests(self) -> list[ResumeRecord]:
        rows = self._db.execute(
            "SELECT incident_id, job_id, checkpoint, exclude, nodes, at FROM sim_resumes ORDER BY at, key"
        )
        return [
            ResumeRecord(
                incident_id=i,
                job_id=j,
                checkpoint=None if c is None else json.loads(c),
                exclude=tuple(json.loads(e)),
                nodes=tuple(json.loads(n)),
                at=at,
            )
            for i, j, c, e, n, at in rows
        ]

    def join_requests(self) -> list[JoinRecord]:
        rows = self._db.execute(
            "SELECT incident_id, job_id, replica_group, node, argv, pid, status, at FROM sim_joins "
            "ORDER BY at, key"
        )
        return [
            JoinRecord(
                incident_id=i,
                job_id=j,
                replica_group=g,
                node=n,
                argv=None if a is None else tuple(json.loads(a)),
                pid=pid,
                status=st,
                at=at,
            )
            for i, j, g, n, a, pid, st, at in rows
        ]

    def list_nodes(self) -> list[NodeInfo]:
        rows = self._db.execute(
            "SELECT name, partition, role, state, reason, healthy FROM sim_nodes ORDER BY name"
        )
        return [
            NodeInfo(
                name=n,
                state=s if role != "spare" else "spare",
                reason=r,
                partitions=(p,),
                schedulable=(role == "active" and s == "idle"),
                extra={"role": role, "healthy": bool(h)},
            )
            for n, p, role, s, r, h in rows
        ]

    # --- the Backend protocol ---------------------------------------------------------------

    def cordon(self, node: str, reason: str, key: str) -> Mapping[str, Any]:
        row = self._node(node)
        if row["state"] == "drained":
            return {"detail": f"{node} already drained", "reason": row["reason"]}
        self._db.execute("UPDATE sim_nodes SET state='drained', reason=? WHERE name=?", (reason, node))
        return self._log(key, "cordon", node, {"detail": f"drained {node}"})

    def uncordon(self, node: str, reason_prefix: str, key: str) -> Mapping[str, Any]:
        row = self._node(node)
        if row["state"] != "drained" or not row["reason"].startswith(reason_prefix):
            return {"detail": f"{node} left as is ({row['state']}: {row['reason'] or 'no reason'})"}
        self._db.execute("UPDATE sim_nodes SET state='idle', reason='' WHERE name=?", (node,))
        return self._log(key, "uncordon", node, {"detail": f"resumed {node}"})

    def selftest(self, node: str, key: str) -> Mapping[str, Any]:
        row = self._node(node)
        passed = bool(row["healthy"])
        detail = "simulated known-answer self-test " + ("matched" if passed else "did not match")
        return self._log(key, "selftest", node, {"passed": passed, "detail": detail}, replace_ok=True)

    def replace(self, node: str, key: str) -> Mapping[str, Any]:
        done = self._op(key)
        if done is not None:
            return done
        row = self._node(node)
        spare = self._db.execute(
            "SELECT name FROM sim_nodes WHERE role='spare' ORDER BY (partition = ?) DESC, name LIMIT 1",
            (row["partition"],),
        ).fetchone()
        if spare is None:
            raise PermanentBackendError(f"no spare node left to replace {node}")
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(
                "UPDATE sim_nodes SET role='retired', state='fail', reason='Action:Replace' WHERE name=?",
                (node,),
            )
            self._db.execute(
                "UPDATE sim_nodes SET role='active', state='idle', reason='', partition=? WHERE name=?",
                (row["partition"], spare[0]),
            )
            result = self._log(
                key, "replace", node, {"replacement": spare[0], "detail": f"{spare[0]} swapped in for {node}"}
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return result

    def await_return(self, node: str, key: str) -> Mapping[str, Any]:
        # A simulated replacement is immediate: a spare took the node's place, the node stays out.
        row = self._db.execute(
            "SELECT result FROM sim_ops WHERE kind='replace' AND node=? ORDER BY at DESC LIMIT 1", (node,)
        ).fetchone()
        replacement = json.loads(row[0]).get("replacement") if row else None
        back = self._node(node)["role"] == "active"
        return {"back": back, "replacement": None if back else replacement}

    def resume(self, request: ResumeRequest, key: str) -> Mapping[str, Any]:
        done = self._op(key)
        if done is not None:
            return done
        nodes = [n.name for n in self.list_nodes() if n.schedulable and n.name not in request.exclude]
        now = utc_iso_us()
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute(
                "INSERT INTO sim_resumes(key, incident_id, job_id, checkpoint, exclude, nodes, at) "
                "VALUES(?, ?, ?, ?, ?, ?, ?)",
                (
                    key,
                    request.incident_id,
                    request.job_id,
                    None if request.checkpoint is None else json.dumps(dict(request.checkpoint)),
                    json.dumps(list(request.exclude)),
                    json.dumps(nodes),
                    now,
                ),
            )
            step = (request.checkpoint or {}).get("step")
            detail = f"resume requested from step {step} on {', '.join(nodes)}"
            result = self._log(
                key, "resume", None, {"detail": detail, "nodes": nodes, "exclude": list(request.exclude)}
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return result

    def join(self, request: JoinRequest, key: str) -> Mapping[str, Any]:
        done = self._op(key)
        if done is not None:
            return done
        group, job_id = request.replica_group, request.job_id
        for value, pattern, what in (
            (group, REPLICA_GROUP, "replica group"),
            (job_id, JOB_ID, "job id"),
            (request.incident_id, INCIDENT_ID, "incident id"),
        ):
            if pattern.fullmatch(value) is None:
                raise PermanentBackendError(f"refusing to start a replacement: invalid {what} {value!r}")
        job = self._db.execute("SELECT state FROM sim_jobs WHERE job_id=?", (job_id,)).fetchone()
        if job is None or job[0] != "running":
            why = "is not known" if job is None else f"is {job[0]}"
            raise PermanentBackendError(
                f"job {job_id} {why}: a replacement for replica group {group} cannot join it live; "
                "nothing started and the job was not resumed"
            )
        previous = self._db.execute("SELECT node, argv, status FROM sim_joins WHERE key=?", (key,)).fetchone()
        if previous is not None:
            # An earlier call began starting the group and its outcome was never recorded.
            return self._settle_in_doubt(request, key, previous[0], previous[1])
        node = self._join_node(request)
        row = self._db.execute("SELECT argv FROM sim_join_commands WHERE job_id=?", (job_id,)).fetchone()
        now = utc_iso_us()
        if row is None:
            # Like resume: the request is recorded for whoever drives the simulation (a demo).
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._insert_join(key, request, node, None, None, "requested", now)
                detail = (
                    f"replacement for replica group {group} requested on {node} (no join command registered)"
                )
                result = self._log(
                    key, "join", None, {"detail": detail, "node": node, "replica_group": group}
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            return result
        values = dict(zip(JOIN_PLACEHOLDERS, (job_id, group, node, request.incident_id), strict=True))
        argv = [_fill(str(a), values) for a in json.loads(row[0])]
        # Committed before the process starts: a crash after the start leaves this row, and the
        # next call looks for the process instead of starting a second group.
        self._insert_join(key, request, node, argv, None, "starting", now)
        env = {**os.environ, JOIN_MARKER: key, "REPLICHECK_REPLICA_GROUP": group, "REPLICHECK_NODE": node}
        try:
            pid = self._spawn(argv, env)
        except OSError as exc:
            # Nothing started: the next attempt may try again.
            self._db.execute("DELETE FROM sim_joins WHERE key=? AND status='starting'", (key,))
            raise PermanentBackendError(f"cannot start the replacement group ({argv[0]}): {exc}") from exc
        return self._record_started(key, request, node, argv, pid)

    def _spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> int:
        """Start the replacement group's command, detached (its own session), and return its pid."""
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        return proc.pid

    def _settle_in_doubt(
        self, request: JoinRequest, key: str, node: str, argv_json: str | None
    ) -> Mapping[str, Any]:
        argv = None if argv_json is None else [str(a) for a in json.loads(argv_json)]
        pid = _find_marked_process(key)
        if pid is not None and argv is not None:
            return self._record_started(key, request, node, argv, pid)
        raise PermanentBackendError(
            f"the start of a replacement for replica group {request.replica_group} of job "
            f"{request.job_id} on {node} was begun and never recorded, and no process carrying its "
            f"marker ({JOIN_MARKER}) runs: it may have started and exited. Not started again (at most "
            "once): check the job and start the group by hand if it is missing"
        )

    def _record_started(
        self, key: str, request: JoinRequest, node: str, argv: Sequence[str], pid: int
    ) -> Mapping[str, Any]:
        group = request.replica_group
        detail = f"replacement for replica group {group} started on {node} (pid {pid})"
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.execute("UPDATE sim_joins SET pid=?, status='started' WHERE key=?", (pid, key))
            # The replacement node now belongs to the job: a later incident naming it verifies.
            row = self._db.execute("SELECT nodes FROM sim_jobs WHERE job_id=?", (request.job_id,)).fetchone()
            if row is not None and node not in json.loads(row[0]):
                nodes = [*json.loads(row[0]), node]
                self._db.execute(
                    "UPDATE sim_jobs SET nodes=? WHERE job_id=?", (json.dumps(nodes), request.job_id)
                )
            result = self._log(
                key,
                "join",
                None,
                {"detail": detail, "node": node, "pid": pid, "replica_group": group, "argv": list(argv)},
            )
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return result

    def _insert_join(
        self,
        key: str,
        request: JoinRequest,
        node: str,
        argv: Sequence[str] | None,
        pid: int | None,
        status: str,
        at: str,
    ) -> None:
        self._db.execute(
            "INSERT INTO sim_joins(key, incident_id, job_id, replica_group, node, argv, pid, status, at) "
            "VALUES(?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                key,
                request.incident_id,
                request.job_id,
                request.replica_group,
                node,
                None if argv is None else json.dumps(list(argv)),
                pid,
                status,
                at,
            ),
        )

    def _join_node(self, request: JoinRequest) -> str:
        """The node the replacement group runs on: the first that took a replaced one's place
        (it must be active), else any schedulable node the request does not exclude."""
        for name in request.nodes:
            if self._node(name)["role"] == "active":
                return name
        for node in self.list_nodes():
            if node.schedulable and node.name not in request.exclude:
                return node.name
        raise PermanentBackendError(
            f"no active node to start the replacement for replica group {request.replica_group} on"
        )

    def allocation(self, job_id: str) -> frozenset[str] | None:
        row = self._db.execute("SELECT nodes FROM sim_jobs WHERE job_id=?", (job_id,)).fetchone()
        return None if row is None else frozenset(json.loads(row[0]))

    def schedulable_by_partition(self, node: str) -> Mapping[str, Sequence[str]]:
        partition = self._node(node)["partition"]
        rows = self._db.execute(
            "SELECT name FROM sim_nodes WHERE partition=? AND role='active' AND state='idle' ORDER BY name",
            (partition,),
        )
        return {partition: [r[0] for r in rows]}

    # --- helpers ----------------------------------------------------------------------------

    def _node(self, node: str) -> dict[str, Any]:
        validate_node_name(node)
        row = self._db.execute(
            "SELECT name, partition, role, state, reason, healthy FROM sim_nodes WHERE name=?", (node,)
        ).fetchone()
        if row is None:
            raise PermanentBackendError(f"unknown node {node!r} in the local cluster")
        return dict(zip(("name", "partition", "role", "state", "reason", "healthy"), row))

    def _op(self, key: str) -> Mapping[str, Any] | None:
        row = self._db.execute("SELECT result FROM sim_ops WHERE key=?", (key,)).fetchone()
        return None if row is None else dict(json.loads(row[0]))

    def _log(
        self, key: str, kind: str, node: str | None, result: Mapping[str, Any], replace_ok: bool = False
    ) -> Mapping[str, Any]:
        verb = "INSERT OR REPLACE" if replace_ok else "INSERT OR IGNORE"
        self._db.execute(
            f"{verb} INTO sim_ops(key, kind, node, result, at) VALUES(?, ?, ?, ?, ?)",
            (key, kind, node, json.dumps(dict(result), sort_keys=True), utc_iso_us()),
        )
        return result


def _fill(arg: str, values: Mapping[str, str]) -> str:
    # Plain replacement of the known placeholders (never str.format: an argument is data).
    for token, value in values.items():
        arg = arg.replace(token, value)
    return arg


def _find_marked_process(key: str) -> int | None:
    """The pid of a live process whose environment carries ``JOIN_MARKER=key`` (Linux /proc)."""
    wanted = f"{JOIN_MARKER}={key}".encode()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:
            continue  # gone, or another user's
        if wanted in environ:
            return int(entry)
    return None
