"""The Controller: ingestion, one reconcile pass, operator commands. It wires the pure state
machine (machine.py) to the store and the executor; it decides nothing itself."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import logging
import os
import pwd
import re
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from replicheck.controller import ingest as _ingest
from replicheck.controller import model
from replicheck.controller.backends.base import Backend, NodeInfo
from replicheck.controller.config import ControllerConfig
from replicheck.controller.errors import (
    ConfigError,
    DecisionConflictError,
    LeaseHeldError,
    QuarantinedError,
    StoreError,
)
from replicheck.controller.executor import Deferred, Executor, Skipped
from replicheck.controller.lease import Lease
from replicheck.controller.machine import initial_record, transition
from replicheck.controller.store import ActionRow, AuditRow, IncidentRow, Store
from replicheck.incident import INCIDENT_ID_MAX, Incident, IncidentFormatError, json_safe, validate_incident
from replicheck.timefmt import utc_iso_us

MAX_ROUNDS = 50
"""Bound on tick/execute rounds in one pass (each round advances at least one record)."""

PERSON_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9 ._@+-]{0,63}")
"""What ``--by`` accepts: a plain ASCII name (account, e-mail, or words separated by spaces);
no newline, tab, control or non-ASCII character that could forge or hide a line."""
RESERVED_NAMES = frozenset({"auto-approve", "controller", "replicheck", "system"})
"""Approver names the controller uses itself (with its configured ``actor``): refused for people."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IngestResult:
    """What happened to one delivered incident."""

    source: str
    incident_id: str | None
    """The incident's id, or None when rejected."""
    new: bool = False
    """False for a duplicate merged into an incident already stored."""
    rejected: str | None = None
    """Why the input was rejected (it is kept in the store's ``rejected`` table)."""


@dataclass(frozen=True)
class IncidentView:
    """Everything known about one incident, for ``incidents show``."""

    incident: IncidentRow
    record: model.Record
    actions: list[ActionRow]
    audit: list[AuditRow]


class Controller:
    """One controller over one database. ``backend=None`` uses the local simulated cluster
    kept in the same file (created on first use)."""

    def __init__(
        self,
        db_path: str | Path,
        backend: Backend | None = None,
        config: ControllerConfig | None = None,
        *,
        on_transition: Callable[[model.Transition], None] | None = None,
        clock: Callable[[], _dt.datetime] | None = None,
        lease: Lease | None = None,
    ) -> None:
        self.db_path = Path(db_path)
        self.config = config or ControllerConfig()
        # A lease taken by the caller before anything is written (``controller run``) is used as is.
        self.lease = lease or Lease(self.db_path)
        # Opened (and migrated: a write) on first use, not here: a controller that acts takes
        # the lease first (reconcile), so a second one is refused before it writes anything,
        # while operator commands (ingest, approve, dismiss, show) open it without the lease.
        self._store: Store | None = None
        self._backend = backend
        self._on_transition = on_transition
        self._clock = clock or (lambda: _dt.datetime.now(_dt.UTC))
        self.last_pass_at: str | None = None
        """Wall-clock time of the last completed reconcile pass of this process."""
        self.last_pass_monotonic: float | None = None
        """The same on the monotonic clock (what liveness is judged by: clock jumps do not fool it)."""
        self.last_error: str | None = None
        """Why the latest pass failed, while passes keep failing (None after a completed one)."""
        self.failed_passes = 0
        """Passes failed in a row (the back-off doubles with each)."""
        self._started = time.monotonic()

    @property
    def backend(self) -> Backend:
        if self._backend is None:
            from replicheck.controller.backends.local import LocalBackend

            self._backend = LocalBackend(self.db_path)
        return self._backend

    @property
    def store(self) -> Store:
        """The database, opened (and migrated) on first use."""
        if self._store is None:
            self._store = Store(self.db_path, busy_timeout_s=self.config.db_busy_timeout_s)
        return self._store

    def close(self) -> None:
        self.lease.release()
        if self._store is not None:
            self._store.close()
            self._store = None

    def __enter__(self) -> Controller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- ingestion --------------------------------------------------------------------------

    def ingest(self, incident: Incident, source: str = "api", *, vouched_by: str = "") -> IngestResult:
        """Store an incident (or merge a duplicate); the next reconcile pass acts on it. One
        that breaks the ingest grammar is rejected (kept with the reason), never acted on.

        ``vouched_by`` names the job-scoped credential that delivered it, already checked to
        speak for ``incident.job_id`` ("" for none: auto-approve will not act on it)."""
        source = _storable(source)
        try:
            validate_incident(incident)
        except IncidentFormatError as exc:
            try:
                content = incident.to_json().encode("utf-8", "backslashreplace")
            except (ValueError, TypeError, RecursionError):
                content = b""
            return self._ingest_parsed(_ingest.Parsed(source, content, error=str(exc)))
        # Non-finite numbers are kept as strings on every path in (replicheck.incident.NON_FINITE).
        incident = dataclasses.replace(
            incident,
            evidence=json_safe(incident.evidence),
            recommended_checkpoint=None
            if incident.recommended_checkpoint is None
            else json_safe(incident.recommended_checkpoint),
        )
        now = self._now()
        with self.store.transaction():
            new, merge = self.store.add_incident(incident, source, now)
            if new:
                self.store.save_record(initial_record(incident, vouched_by), now)
                self.store.audit(now, self.config.actor, "ingested", f"from {source}", incident.id)
                log.info("ingested incident %s (job %s) from %s", incident.id, incident.job_id, source)
            elif merge == "filled":
                # The checkpoint a job is resumed from comes from the first copy only: a later
                # copy (from anyone holding a credential for the job) cannot fill it in.
                checkpoint = dict(incident.recommended_checkpoint or {})
                self.store.audit(
                    now,
                    self.config.actor,
                    "checkpoint not taken",
                    f"a later copy from {source} names checkpoint step {checkpoint.get('step')}; "
                    "only the first copy's checkpoint is used",
                    incident.id,
                )
            if not new and merge != "differs" and vouched_by:
                record = self.store.get_record(incident.id)
                if not record.vouched_by and record.job_id == incident.job_id:
                    # The same content, now from a credential scoped to its job.
                    self.store.save_record(record.evolve(vouched_by=vouched_by), now)
                    self.store.audit(
                        now, self.config.actor, "vouched", f"{vouched_by} ({source})", incident.id
                    )
            elif merge == "differs":
                # Same id, other content (e.g. two jobs without a job id): a distinct incident,
                # stored under an id derived from its content; never merged into the first.
                digest = hashlib.sha256(incident.to_json().encode()).hexdigest()[:12]
                distinct = dataclasses.replace(incident, id=derived_id(incident.id, digest))
                self.store.audit(
                    now,
                    self.config.actor,
                    "distinct incident",
                    f"copy from {source} differs from the stored one; kept as {distinct.id}",
                    incident.id,
                )
        if merge == "differs":
            log.warning(
                "incident %s from %s differs from the stored copy; stored as %s",
                incident.id,
                source,
                distinct.id,
            )
            return self.ingest(distinct, source, vouched_by=vouched_by)
        return IngestResult(source, incident.id, new=new)

    def ingest_file(self, path: str | Path) -> IngestResult:
        """Ingest one file; a malformed or unknown-version record is rejected and kept."""
        return self._ingest_parsed(_ingest.parse_file(path))

    def ingest_dir(self, directory: str | Path) -> list[IngestResult]:
        """Ingest the new or changed ``*.json`` files of ``directory``. Every file is either
        ingested or rejected with a reason; an unreadable one is retried on every pass."""
        results = []
        for cand in _ingest.scan(directory):
            key = _ingest.display_path(os.path.abspath(cand.path))
            if self.store.file_seen(key, cand.mtime_ns, cand.size):
                continue
            if cand.symlink:
                parsed = _ingest.Parsed(key, b"", error="symbolic link: not followed")
            else:
                parsed = _ingest.parse_file(cand.path)
            result = self._ingest_parsed(parsed)
            results.append(result)
            if not parsed.retry:
                with self.store.transaction():
                    self.store.mark_file_seen(key, cand.mtime_ns, cand.size)
        return results

    def _ingest_parsed(self, parsed: _ingest.Parsed) -> IngestResult:
        parsed = dataclasses.replace(parsed, source=_storable(parsed.source))
        if parsed.incident is not None:
            result = self.ingest(parsed.incident, parsed.source)
            if result.incident_id is not None:
                with self.store.transaction():
                    self.store.clear_unreadable(parsed.source)
            return result
        now = self._now()
        error = parsed.error or "invalid"
        with self.store.transaction():
            log.warning("rejected input %s: %s", parsed.source, error)
            if self.store.reject(parsed.source, error, parsed.content, now):
                self.store.audit(now, self.config.actor, "rejected input", f"{parsed.source}: {error}")
        return IngestResult(parsed.source, None, rejected=error)

    # --- reconciling ------------------------------------------------------------------------

    def reconcile(self) -> list[model.Transition]:
        """One pass: read watched directories, advance every open incident as far as it goes
        without waiting, perform due actions. Returns the state changes made.

        Takes the database's lease first (held until :meth:`close`): while another controller
        holds it this raises LeaseHeldError having written nothing (a controller used only for
        reconciling opens its database after the lease is taken)."""
        self.lease.acquire()
        self._clamp_future()
        for directory in self.config.incident_dirs:
            self.ingest_dir(directory)
        made: list[model.Transition] = []
        for _ in range(MAX_ROUNDS):
            progressed = False
            for record in self.store.list_records():
                if record.state in model.TERMINAL:
                    continue
                before = record
                try:
                    after = self._apply(
                        record.incident_id, self._tick(record.job_id), self.config.actor, made
                    )
                except Exception as exc:
                    if is_world_error(exc):
                        raise
                    # This record cannot be advanced (damaged, or a state this build cannot
                    # handle): set it aside; the others go on.
                    self.store.quarantine("records", record.incident_id, f"cannot advance: {_brief(exc)}")
                    continue
                progressed |= after != before
            for row in self.store.due_actions(self._now()):
                try:
                    progressed |= self._execute(row, made)
                except Exception as exc:
                    if is_world_error(exc):
                        raise
                    self._defer_unexpected(row, exc)
            if not progressed:
                break
        now = self._now()
        with self.store.transaction():
            self.store.set_meta("last_pass_at", now)
        self.last_pass_at, self.last_pass_monotonic = now, time.monotonic()
        self.last_error, self.failed_passes = None, 0
        return made

    def run(
        self,
        stop: threading.Event | None = None,
        max_passes: int | None = None,
        *,
        wake: threading.Event | None = None,
    ) -> None:
        """Reconcile every ``poll_interval_s`` until ``stop`` is set (or ``max_passes`` ran);
        ``wake`` set by another thread starts the next pass at once.

        A pass that fails for a reason outside the controller (database locked, disk full, no
        file descriptor left, a backend library's bug) is logged and retried after a back-off
        that doubles up to ``error_backoff_max_s``; the loop itself never ends on it. Only
        another controller's lease ends it (LeaseHeldError), and with ``max_passes`` the last
        pass's error is raised."""
        stop = stop or threading.Event()
        passes = 0
        while not stop.is_set():
            if wake is not None:
                wake.clear()
            pause = self.config.poll_interval_s
            try:
                self.reconcile()
            except LeaseHeldError:
                raise
            except Exception as exc:
                pause = self._pass_failed(exc)
                if max_passes is not None and passes + 1 >= max_passes:
                    raise
            passes += 1
            if max_passes is not None and passes >= max_passes:
                return
            (wake or stop).wait(pause)

    def liveness(self) -> dict[str, object]:
        """Whether this process's acting loop completed a pass recently (for ``/healthz``)."""
        window = max(self.config.liveness_window_s, 3 * self.config.poll_interval_s)
        since = self._started if self.last_pass_monotonic is None else self.last_pass_monotonic
        age = time.monotonic() - since
        return {
            "acting": True,
            "last_pass_at": self.last_pass_at,
            "seconds_since_last_pass": None if self.last_pass_monotonic is None else round(age, 3),
            "recent": age <= window,  # (a process just started has a window for its first pass)
            "window_s": window,
            "failed_passes": self.failed_passes,
            "last_error": self.last_error,
        }

    def _pass_failed(self, exc: Exception) -> float:
        self.failed_passes += 1
        self.last_error = _brief(exc)
        base = max(self.config.poll_interval_s, 0.05)
        pause = float(min(self.config.error_backoff_max_s, base * 2 ** min(self.failed_passes - 1, 20)))
        if is_world_error(exc):
            log.warning(
                "reconcile pass failed (%d in a row), retrying in %.3g s: %s",
                self.failed_passes,
                pause,
                self.last_error,
            )
        else:
            log.error(
                "reconcile pass failed (%d in a row), retrying in %.3g s",
                self.failed_passes,
                pause,
                exc_info=exc,
            )
        return pause

    def _defer_unexpected(self, row: ActionRow, exc: Exception) -> None:
        # A backend raised something it should not have: treated as temporary, backed off.
        log.error("action %s raised unexpectedly; deferred", row.key, exc_info=exc)
        delay = min(self.config.retry_max_delay_s, max(self.config.retry_base_delay_s, 1.0))
        now = self._clock()
        note = f"unexpected error ({_brief(exc)}); retrying in {delay:g}s"
        with self.store.transaction():
            self.store.defer_action(row.key, note, utc_iso_us(now + _dt.timedelta(seconds=delay)))
            if note != row.last_error:
                self.store.audit(utc_iso_us(now), self.config.actor, row.kind.value, note, row.incident_id)

    def _clamp_future(self) -> None:
        """Timestamps stored while the clock ran ahead are brought back to now, so a replacement
        done then counts for one window from now (not until the wrong date), a retry set then
        is not put off for as long as the clock was wrong, a replaced node's return is awaited
        for at most ``return_timeout_s`` from now (not a month), and approval and dismissal
        times read as no later than now."""
        now = self._clock()
        latest = utc_iso_us(now + _dt.timedelta(seconds=self._longest_wait()))
        deadline = utc_iso_us(now + _dt.timedelta(seconds=self.config.return_timeout_s))
        with self.store.transaction():
            changed = self.store.clamp_future(utc_iso_us(now), latest, deadline)
        if changed:
            log.warning("%d stored time(s) were in the future (the clock ran ahead); brought back", changed)

    def _longest_wait(self) -> float:
        c = self.config
        return max(c.retry_max_delay_s, c.return_poll_s, c.poll_interval_s) + 1.0

    def _tick(self, job_id: str | None = None) -> model.Tick:
        now = self._clock()
        since = now - _dt.timedelta(seconds=self.config.replacement_window_s)
        job_cordons = 0 if job_id is None else self.store.cordons_since(utc_iso_us(since), job_id=job_id)
        return model.Tick(
            now=utc_iso_us(now),
            auto_approve=self.config.auto_approve,
            triage=self.config.triage,
            triage_persistent=self.config.triage_persistent,
            replacements_in_window=self.store.replacements_since(utc_iso_us(since)),
            max_replacements=self.config.max_replacements,
            cordons_in_window=self.store.cordons_since(utc_iso_us(since)),
            max_cordons=self.config.max_cordons,
            max_cordons_per_incident=self.config.max_cordons_per_incident,
            job_cordons_in_window=job_cordons,
            max_cordons_per_job=self.config.max_cordons_per_job,
            return_deadline=utc_iso_us(now + _dt.timedelta(seconds=self.config.return_timeout_s)),
        )

    def _execute(self, row: ActionRow, made: list[model.Transition]) -> bool:
        outcome = Executor(self.store, self.backend, self.config, self._clock).perform(row)
        now = self._now()
        if isinstance(outcome, Skipped):
            return False
        if isinstance(outcome, Deferred):
            with self.store.transaction():
                self.store.defer_action(row.key, outcome.note, outcome.next_at, uncount=outcome.uncount)
                if outcome.note != row.last_error:
                    self.store.audit(
                        now,
                        self.config.actor,
                        f"{row.kind.value} {row.node or ''}".strip(),
                        outcome.note,
                        row.incident_id,
                    )
            return False
        with self.store.transaction():
            if isinstance(outcome, model.ActionDone):
                self.store.finish_action(row.key, outcome.outcome, now)
                detail = str(outcome.outcome.get("skipped") or outcome.outcome.get("detail") or "done")
            else:
                self.store.fail_action(row.key, outcome.reason, now)
                detail = f"failed: {outcome.reason}"
            self.store.audit(
                now, self.config.actor, f"{row.kind.value} {row.node or ''}".strip(), detail, row.incident_id
            )
            if self.store.get_record(row.incident_id).state not in model.TERMINAL:
                self._apply(row.incident_id, outcome, self.config.actor, made)
        return True

    def _apply(
        self, incident_id: str, event: model.Event, actor: str, made: list[model.Transition]
    ) -> model.Record:
        now = self._now()
        with self.store.transaction():
            record = self.store.get_record(incident_id)
            step = transition(record, event)
            if step.record == record and not step.actions:
                return record
            self.store.save_record(step.record, now)
            self.store.add_actions(step.actions, now)
            self.store.cancel_actions(step.cancel, now)
            t = model.Transition(incident_id, record.state, step.record.state, step.record.reason, now)
            changed = t.from_state is not t.to_state
            if changed:
                self.store.audit(
                    now, actor, f"{t.from_state.value} -> {t.to_state.value}", t.reason, incident_id
                )
            elif step.record.reason != record.reason:
                self.store.audit(now, actor, record.state.value, step.record.reason, incident_id)
        if changed:
            level = logging.ERROR if t.to_state.value == "failed" else logging.INFO
            log.log(
                level,
                "incident %s: %s -> %s (%s)",
                incident_id,
                t.from_state.value,
                t.to_state.value,
                t.reason,
            )
            made.append(t)
            if self._on_transition is not None:
                self._on_transition(t)
        return step.record

    # --- operator commands ------------------------------------------------------------------

    def approve(self, incident_id: str, by: str) -> model.Record:
        """Record a person's approval of the replacement: the name given, the operating-system
        account that ran this process, and when."""
        return self._operator(
            incident_id, model.Approved(by=self._who(by), at=self._now(), os_user=os_account())
        )

    def dismiss(self, incident_id: str, by: str) -> model.Record:
        """Record that a person judged the incident a false alarm; the cordon is undone."""
        return self._operator(
            incident_id, model.Dismissed(by=self._who(by), at=self._now(), os_user=os_account())
        )

    def decide(
        self,
        incident_id: str,
        decision: str,
        by: str,
        *,
        expect_state: model.State | None = None,
        via: str | None = None,
    ) -> model.Record:
        """Approve or dismiss at most once: the check and the decision are one write transaction,
        so of two decisions racing on one incident exactly one is recorded.

        ``decision`` is "approve" or "dismiss". With ``expect_state`` the decision applies only
        while the incident is still in that state (the state the person saw); without it, only
        while no person or policy has decided yet. The loser gets DecisionConflictError.
        ``via`` (how the request arrived) is audited with the decision.
        """
        if decision not in ("approve", "dismiss"):
            raise ConfigError(f"unknown decision {decision!r}; use approve or dismiss")
        who = self._who(by)
        # Over HTTP the person is the token's holder; this process's OS account says nothing of them.
        os_user = "" if via else os_account()
        with self.store.transaction():  # BEGIN IMMEDIATE: no other writer between check and write
            record = self.store.get_record(incident_id)
            if expect_state is not None and record.state is not expect_state:
                raise DecisionConflictError(
                    f"incident {incident_id} is {record.state.value}, not {expect_state.value}: "
                    f"{_decided(record) or record.reason}; reload and decide again"
                )
            if expect_state is None and _decided(record):
                raise DecisionConflictError(
                    f"incident {incident_id} was already {_decided(record)}; to overrule, send "
                    f"expect_state={record.state.value}"
                )
            now = self._now()
            if via:
                self.store.audit(now, who, f"{decision} requested", via, incident_id)
            event: model.Approved | model.Dismissed = (
                model.Approved(by=who, at=now, os_user=os_user)
                if decision == "approve"
                else model.Dismissed(by=who, at=now, os_user=os_user)
            )
            return self._operator(incident_id, event)

    def _operator(self, incident_id: str, event: model.Approved | model.Dismissed) -> model.Record:
        made: list[model.Transition] = []
        return self._apply(incident_id, event, event.by, made)

    def _who(self, by: str) -> str:
        if not isinstance(by, str) or not by.strip():
            raise ConfigError("an approval or dismissal needs the name of the person (--by NAME)")
        name = by.strip()
        if PERSON_NAME.fullmatch(name) is None:
            raise ConfigError(f"--by must be a plain name matching {PERSON_NAME.pattern}, got {name[:64]!r}")
        if name.lower() in RESERVED_NAMES | {self.config.actor.lower()}:
            raise ConfigError(f"--by {name!r} is a name the controller uses itself; give a person's name")
        return name

    # --- queries ----------------------------------------------------------------------------

    def records(self, states: Sequence[model.State] | None = None) -> list[model.Record]:
        return self.store.list_records(states)

    def show(self, incident_id: str) -> IncidentView:
        return IncidentView(
            self.store.get_incident(incident_id),
            self.store.get_record(incident_id),
            self.store.actions(incident_id),
            self.store.audit_rows(incident_id),
        )

    def nodes(self) -> list[NodeInfo]:
        return self.backend.list_nodes()

    def _now(self) -> str:
        return utc_iso_us(self._clock())


WORLD_SQLITE_ERRORS = (sqlite3.OperationalError,)
"""SQLite errors that come from the world (locked, disk full, cannot open, I/O), not from a row."""


def is_world_error(exc: BaseException) -> bool:
    """A failure outside the controller's data: retried after a back-off, never fatal."""
    if isinstance(exc, QuarantinedError):
        return False
    return (
        isinstance(exc, (OSError, MemoryError, StoreError, *WORLD_SQLITE_ERRORS))
        or type(exc) is sqlite3.DatabaseError
    )


def derived_id(incident_id: str, digest: str) -> str:
    """``ID+DIGEST`` for a copy that differs from the stored incident, shortened so it still
    fits the id grammar (a long id loses its tail, never the digest that tells copies apart)."""
    suffix = f"+{digest}"
    return incident_id[: INCIDENT_ID_MAX - len(suffix)].rstrip("/") + suffix


def _brief(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return f"{type(exc).__name__}: {text[:300]}"


def _storable(text: str) -> str:
    # A caller-supplied source may hold lone surrogates, which SQLite cannot store.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def os_account() -> str:
    """``name uid N`` of the account running this process (from the uid, not the environment)."""
    uid = os.getuid()
    try:
        name = pwd.getpwuid(uid).pw_name
    except KeyError:
        name = "?"
    return f"{name} uid {uid}"


def _decided(record: model.Record) -> str:
    if record.dismissed_by:
        return f"dismissed by {record.dismissed_by} at {record.dismissed_at}"
    if record.approved_by:
        return f"approved by {record.approved_by} at {record.approved_at}"
    return ""
