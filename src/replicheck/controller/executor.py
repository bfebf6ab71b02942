"""The thin executor: performs one stored action through the backend and says what happened.

Before the call the action is committed as ``in_flight``; a controller killed during the call
finds it still in flight on restart and calls again, which is safe because backends observe
before they act. Temporary errors are retried with exponential backoff; permanent ones (or
running out of attempts) become ``ActionFailed``.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from replicheck.controller.backends.base import Backend, JoinRequest, ResumeRequest
from replicheck.controller.config import ControllerConfig
from replicheck.controller.errors import (
    NotYet,
    PermanentBackendError,
    TransientBackendError,
)
from replicheck.controller.model import (
    DESTRUCTIVE,
    ActionDone,
    ActionFailed,
    ActionKind,
)
from replicheck.controller.policy import checkpoint_refusal, cordon_refusal, retry_delay
from replicheck.controller.store import ActionRow, Store
from replicheck.timefmt import utc_iso_us

DRY_RUN_NOTE = "dry-run: not performed (pass --apply or set apply = true)"


@dataclass(frozen=True)
class Deferred:
    """The action goes back to pending; ``note`` says why (retry, polling, dry-run)."""

    note: str
    next_at: str
    uncount: bool
    """Undo this attempt's count: polling is not a failure towards retry_max_attempts."""


@dataclass(frozen=True)
class Skipped:
    """The action was cancelled or finished after it was listed; nothing was performed."""

    status: str | None
    """Its status when the executor re-checked it (None: it no longer exists)."""


ExecResult = ActionDone | ActionFailed | Deferred | Skipped
"""What performing one stored action came to."""


class Executor:
    """Performs actions; owns no state beyond its collaborators."""

    def __init__(
        self, store: Store, backend: Backend, config: ControllerConfig, clock: Callable[[], _dt.datetime]
    ) -> None:
        self._store = store
        self._backend = backend
        self._config = config
        self._clock = clock

    def perform(self, row: ActionRow) -> ExecResult:
        now = self._clock()
        if row.kind in DESTRUCTIVE and not self._config.apply:
            return Deferred(
                DRY_RUN_NOTE, utc_iso_us(now + _seconds(self._config.poll_interval_s)), uncount=False
            )
        with self._store.transaction():
            # Re-checked in the transaction that starts it: an action cancelled earlier in this
            # pass (its incident failed or was dismissed) must not run.
            if not self._store.start_attempt(row.key, utc_iso_us(now)):
                current = self._store.get_action(row.key)
                return Skipped(None if current is None else current.status)
        attempts = row.attempts + 1
        try:
            result = self._call(row)
        except NotYet as exc:
            deadline = row.params.get("deadline")
            if deadline and utc_iso_us(self._clock()) >= str(deadline):
                return ActionDone(
                    row.key,
                    row.kind,
                    row.node,
                    {"back": False, "replacement": None, "detail": f"not back by {deadline}"},
                )
            return Deferred(
                f"waiting: {exc}", utc_iso_us(now + _seconds(self._config.return_poll_s)), uncount=True
            )
        except PermanentBackendError as exc:
            return ActionFailed(row.key, row.kind, row.node, str(exc))
        except (TransientBackendError, OSError) as exc:
            if attempts >= self._config.retry_max_attempts:
                return ActionFailed(row.key, row.kind, row.node, f"gave up after {attempts} attempts: {exc}")
            delay = retry_delay(attempts, self._config.retry_base_delay_s, self._config.retry_max_delay_s)
            note = f"attempt {attempts} failed ({exc}); retrying in {delay:g}s"
            return Deferred(note, utc_iso_us(now + _seconds(delay)), uncount=False)
        return ActionDone(row.key, row.kind, row.node, result)

    def _call(self, row: ActionRow) -> Mapping[str, Any]:
        b, node, key = self._backend, row.node, row.key
        if row.kind is ActionKind.VERIFY:
            nodes = b.allocation(str(row.params["job_id"]))
            if nodes is None:
                return {"allocation": None, "detail": f"job {row.params['job_id']} unknown to the backend"}
            return {
                "allocation": sorted(nodes),
                "detail": f"allocation: {', '.join(sorted(nodes)) or 'none'}",
            }
        if row.kind is ActionKind.RESUME:
            checkpoint = row.params.get("checkpoint")
            job_id = str(row.params["job_id"])
            refusal = checkpoint_refusal(checkpoint, job_id, self._config.checkpoint_roots)
            if refusal is not None:
                raise PermanentBackendError(f"not resumed: {refusal}; resume job {job_id} by hand")
            in_doubt = row.started_at if row.status == "in_flight" else None
            allocation = row.params.get("allocation")
            request = ResumeRequest(
                row.incident_id,
                job_id,
                checkpoint,
                tuple(row.params.get("exclude", ())),
                previous_attempt_at=in_doubt,
                allocation=None if allocation is None else tuple(str(n) for n in allocation),
            )
            return b.resume(request, key)
        if row.kind is ActionKind.JOIN:
            allocation = row.params.get("allocation")
            join = JoinRequest(
                row.incident_id,
                str(row.params["job_id"]),
                str(row.params["replica_group"]),
                tuple(str(n) for n in row.params.get("nodes", ())),
                tuple(str(n) for n in row.params.get("exclude", ())),
                previous_attempt_at=row.started_at if row.status == "in_flight" else None,
                allocation=None if allocation is None else tuple(str(n) for n in allocation),
            )
            return b.join(join, key)
        if node is None:
            raise PermanentBackendError(f"action {key} names no node")
        if row.kind is ActionKind.CORDON:
            refusal = cordon_refusal(node, b.schedulable_by_partition(node))
            if refusal is not None:
                return {"skipped": refusal}
            return b.cordon(node, self._config.drain_reason, key)
        if row.kind is ActionKind.UNCORDON:
            held = self._store.nodes_held(row.incident_id)
            if node in held:
                return {"detail": f"{node} stays cordoned: another open incident holds it"}
            return b.uncordon(node, self._config.drain_reason, key)
        if row.kind is ActionKind.SELFTEST:
            return b.selftest(node, key)
        if row.kind is ActionKind.REPLACE:
            return b.replace(node, key)
        return b.await_return(node, key)


def _seconds(s: float) -> _dt.timedelta:
    return _dt.timedelta(seconds=s)
