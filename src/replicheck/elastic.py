"""Making a detection survive the launcher (torchrun, Slurm, a Kubernetes Job).

* :func:`summary`: the short human account of an incident (what, where, what happens next).
* :func:`write_error_file`: the incident in torchrun's error file (``TORCHELASTIC_ERROR_FILE``),
  in the JSON layout ``torch.distributed.elastic``'s ``ErrorHandler.record_exception`` writes, so
  the agent's failure summary names the incident instead of a bare exit code.
* :func:`exit_on_corruption`: log, print the summary, write the error file, exit 87.
* :func:`open_incidents` / :func:`refuse_if_suspect`: the start-up check that refuses to run on
  a node an unresolved incident names (what keeps ``torchrun --max-restarts`` or a requeue from
  training again on the bad node).
* :func:`guarded_main`: a decorator doing both around a training ``main``.

Torch-free: the launcher wrapper (``replicheck launch``) and the controller host can use it.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TextIO, TypeVar

from replicheck.codes import EXIT_CORRUPTION, EXIT_SUSPECT_NODE
from replicheck.incident import Incident, IncidentFormatError, read_incident

log = logging.getLogger(__name__)

RESOLVED_STATES = frozenset({"resumed", "joined", "uncordoned"})
"""Controller states after which an incident no longer holds its node (the node was replaced,
or a person dismissed the incident and the node was uncordoned)."""

_F = TypeVar("_F", bound=Callable[..., Any])


class SuspectNodeError(RuntimeError):
    """This node is named by an unresolved incident: training must not start here."""

    def __init__(self, node: str, incidents: list[Incident]) -> None:
        self.node = node
        self.incidents = incidents
        ids = ", ".join(i.id for i in incidents)
        super().__init__(
            f"refusing to run on {node}: named by unresolved incident(s) {ids}; "
            "the controller must replace the node or a person dismiss the incident first"
        )


def summary(incident: Incident, *, incident_path: str | os.PathLike[str] | None = None) -> str:
    """A few lines a person reads: what was detected, where, and what happens next."""
    who = ", ".join(f"rank {s.rank} on {s.node.name}" for s in incident.suspects)
    if not who:
        cands = ", ".join(f"rank {s.rank} on {s.node.name}" for s in incident.candidates)
        who = f"undetermined (candidates: {cands or 'none'})"
    ckpt = incident.recommended_checkpoint or {}
    lines = [
        f"replicheck: SILENT DATA CORRUPTION detected at step {incident.step} "
        f"(check {incident.check}, {incident.classification}); the step's update was not applied.",
        f"  suspect:  {who}",
        f"  job:      {incident.job_id}    incident: {incident.id}",
    ]
    if incident_path is not None:
        lines.append(f"  file:     {incident_path}")
    if incident.continuation is not None and incident.continuation.mode == "no_restart":
        lines.append(
            f"  next:     replica group {incident.continuation.replica_group} exits with code 87 and "
            "the other groups go on without it (no restart, no checkpoint read); the controller "
            "cordons the suspect node(s), triages, and after approval starts a replacement group "
            "that joins live; a restart on a suspect node is refused."
        )
        return "\n".join(lines)
    lines.append(
        "  next:     the job exits with code 87; the controller cordons the suspect node(s), "
        "triages, and after approval replaces them and resumes"
        + (f" from checkpoint step {ckpt.get('step')}" if ckpt.get("step") is not None else "")
        + "; a restart on a suspect node is refused."
    )
    return "\n".join(lines)


def write_error_file(incident: Incident, path: str | os.PathLike[str] | None = None) -> Path | None:
    """Write the incident into torchrun's per-rank error file (``path``, else
    ``$TORCHELASTIC_ERROR_FILE``); ``None`` when there is no such file to write.

    The layout is the one ``ErrorHandler.record_exception`` writes (``message.message`` and
    ``message.extraInfo``), which the elastic agent copies into its failure summary; the
    incident itself rides along under ``extraInfo.replicheck_incident``."""
    target = path if path is not None else os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not target:
        return None
    data = {
        "message": {
            "message": f"CorruptionDetected: {summary(incident)}",
            "extraInfo": {
                # The agent's summary prints this field: the account a person reads comes last.
                "py_callstack": (traceback.format_exc() if sys.exc_info()[0] is not None else "")
                + summary(incident)
                + "\n",
                "timestamp": str(int(time.time())),
                "replicheck_incident": incident.to_dict(),
            },
        }
    }
    Path(target).write_text(json.dumps(data), encoding="utf-8")
    return Path(target)


def exit_on_corruption(
    incident: Incident, *, error_file: str | os.PathLike[str] | None = None, out: TextIO | None = None
) -> NoReturn:
    """Log the incident at ERROR, print its summary, record it for torchrun, exit 87."""
    text = summary(incident)
    log.error("incident %s: %s", incident.id, text.splitlines()[0])
    print(text, file=out or sys.stderr, flush=True)
    write_error_file(incident, error_file)
    raise SystemExit(EXIT_CORRUPTION)


def open_incidents(
    incident_dir: str | os.PathLike[str], node: str, *, controller_db: str | os.PathLike[str] | None = None
) -> list[Incident]:
    """Incidents in ``incident_dir`` whose suspects include ``node`` and that are not resolved.

    Resolved means the controller database (read-only; optional) has the incident in a state
    of :data:`RESOLVED_STATES`. Without a database every such incident is open. Ambiguous
    incidents (no suspect, only candidates) never hold a node: no node is blamed without
    evidence. An unreadable file is skipped with a warning (it names nobody we can trust)."""
    directory = Path(incident_dir)
    if not directory.is_dir():
        return []
    states = _controller_states(controller_db) if controller_db is not None else {}
    found: list[Incident] = []
    for path in sorted(directory.glob("*.json")):
        try:
            incident = read_incident(path)
        except IncidentFormatError as exc:
            log.warning("skipping unreadable incident file: %s", exc)
            continue
        if (
            node in {s.node.name for s in incident.suspects}
            and states.get(incident.id) not in RESOLVED_STATES
        ):
            found.append(incident)
    return found


def _controller_states(db: str | os.PathLike[str]) -> dict[str, str]:
    if not Path(db).is_file():
        raise FileNotFoundError(f"no controller database at {db}")
    conn = sqlite3.connect(f"file:{Path(db).resolve()}?mode=ro", uri=True)
    try:
        return {str(i): str(s) for i, s in conn.execute("SELECT incident_id, state FROM records")}
    finally:
        conn.close()


def refuse_if_suspect(
    incident_dir: str | os.PathLike[str], node: str, *, controller_db: str | os.PathLike[str] | None = None
) -> None:
    """Raise :class:`SuspectNodeError` when an unresolved incident names ``node``."""
    found = open_incidents(incident_dir, node, controller_db=controller_db)
    if found:
        raise SuspectNodeError(node, found)
    log.info("start-up check: no unresolved incident names %s", node)


def guarded_main(
    *, incident_dir: str | os.PathLike[str], node: str | None = None, controller_db: str | None = None
) -> Callable[[_F], _F]:
    """Decorate a training ``main``: refuse to start on a suspect node (exit 86, recorded in
    torchrun's error file), and turn ``CorruptionDetected`` into the summary, the error-file
    record and exit 87. ``node`` defaults to the guard's node name from the environment."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            from replicheck.guard.errors import CorruptionDetected
            from replicheck.guard.runtime import RuntimeInfo

            name = node or RuntimeInfo.from_env().node.name
            try:
                refuse_if_suspect(incident_dir, name, controller_db=controller_db)
            except SuspectNodeError as exc:
                _refused(exc)
            try:
                return fn(*args, **kwargs)
            except CorruptionDetected as exc:
                exit_on_corruption(exc.incident)

        return run  # type: ignore[return-value]

    return wrap


def _refused(exc: SuspectNodeError) -> NoReturn:
    log.error("%s", exc)
    print(f"replicheck: {exc}", file=sys.stderr, flush=True)
    target = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if target:
        data = {
            "message": {
                "message": f"SuspectNodeError: {exc}",
                "extraInfo": {"py_callstack": f"{exc}\n", "timestamp": str(int(time.time()))},
            }
        }
        Path(target).write_text(json.dumps(data), encoding="utf-8")
    raise SystemExit(EXIT_SUSPECT_NODE)
