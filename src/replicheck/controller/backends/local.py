"""``local``: a simulated cluster kept in SQLite (by default the controller's own file).

Nodes are active or spare; ``replace`` retires a node and swaps a spare into its partition;
``resume`` records the request so a demo can restart training itself. Every effective
operation is logged in ``sim_ops`` under its action key, which is what makes repeated calls
no-ops and what tests count.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from replicheck.controller.backends.base import (
    NodeInfo,
    ResumeRequest,
    validate_node_name,
)
from replicheck.controller.errors import PermanentBackendError
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
"""


@dataclass(frozen=True, kw_only=True)
class ResumeRecord(ResumeRequest):
    """A resume request the local backend received (what a demo restarts training from), with
    where and when it resumed. ``previous_attempt_at`` is not kept: the backend's keyed log, not
    the caller, tells it whether a call was already made."""

    nodes: tuple[str, ...]
    """Active, schedulable nodes of the simulated cluster after the replacement."""
    at: str
    """When the request was received (ISO time)."""


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

    def add_job(self, job_id: str, nodes: Sequence[str]) -> None:
        """Register a running job on ``nodes`` (its allocation); registering again replaces it."""
        names = [validate_node_name(n) for n in nodes]
        self._db.execute(
            "INSERT OR REPLACE INTO sim_jobs(job_id, nodes, state) VALUES(?, ?, 'running')",
            (job_id, json.dumps(names)),
        )

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
