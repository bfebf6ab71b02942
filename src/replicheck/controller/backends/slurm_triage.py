"""Triage through Slurm itself: the self-test runs as a Slurm job on the drained suspect node.

A drained node accepts no job, not even in a maintenance reservation; but a node resumed while a
``MAINT`` reservation covers it takes jobs of that reservation only. So triage is:

1. note in the node's ``Extra`` field that triage started and how the node was (drained, reason);
2. self-test a healthy reference node of the partition (an ordinary job) for the fingerprint;
3. create the reservation (deterministic name per action key; reused if it exists);
4. resume the node (it is now usable by the reservation only);
5. run the self-test there with ``srun --reservation -w NODE`` and ``--expect`` the reference;
6. record the result in ``Extra``;
7. drain the node again with the reason it had, delete the reservation.

Every step observes before it acts, and the ``Extra`` notes make a repeated call (the controller
was killed at any point) continue where the last one stopped: a finished triage is answered
from its record without touching the cluster, an interrupted one reuses the reservation and the
resumed node, cancels the self-test job it may have left and runs the test again (a read-only
job), then drains the node. While the reservation exists no ordinary job can start on the node.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pwd
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from replicheck.controller.backends.base import NodeInfo, validate_node_name
from replicheck.controller.backends.commands import (
    TRANSIENT_MARKERS,
    CommandResult,
    CommandRunner,
)
from replicheck.controller.errors import PermanentBackendError, TransientBackendError

STARTED, FINISHED = "/triage|", "/triaged|"
"""What follows an action's marker in the node's ``Extra`` field while triage runs / once done."""
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_EXIT_OK, _EXIT_MISMATCH, _EXIT_COULD_NOT_RUN = 0, 1, 3
"""``replicheck selftest`` exit statuses (see replicheck.cli.selftest)."""
_STATUS_EXIT = {"ok": _EXIT_OK, "mismatch": _EXIT_MISMATCH, "could not run": _EXIT_COULD_NOT_RUN}


@dataclass(frozen=True, kw_only=True)
class SlurmTriageConfig:
    """How the self-test runs as a Slurm job."""

    command: tuple[str, ...] = ("replicheck", "selftest", "--json")
    """The self-test argv run by ``srun`` on the node; ``--node NODE`` is appended, and on the
    suspect ``--expect`` with the reference node's fingerprint."""
    timeout_s: float = 600.0
    """Time limit of each self-test job (``srun --time``, rounded up to minutes); the controller
    also waits this long for it to start (``--immediate``)."""
    user: str | None = None
    """User the maintenance reservation admits (None: the user the controller runs as)."""
    srun_options: tuple[str, ...] = ()
    """Extra ``srun`` arguments for both self-test jobs (e.g. ``--gres=gpu:8``, ``--partition``)."""


@dataclass(frozen=True)
class _Memo:
    drained: bool
    reason: str


class SlurmTriage:
    """Runs the steps above for one (node, action key). ``node_info``, ``node_extra`` and
    ``set_extra`` are the backend's own observation and marker helpers."""

    def __init__(
        self,
        config: SlurmTriageConfig,
        runner: CommandRunner,
        binary: Callable[[str], str],
        node_info: Callable[[str], NodeInfo],
        node_extra: Callable[[str], str],
        set_extra: Callable[[str, str], None],
    ) -> None:
        self._config = config
        self._run = runner
        self._bin = binary
        self._node = node_info
        self._extra = node_extra
        self._set_extra = set_extra

    def run(self, node: str, marker: str, reference: Callable[[], str]) -> Mapping[str, Any]:
        """Triage ``node`` for the action whose marker is ``marker``; ``reference`` picks the
        healthy node to compare with (asked only when a test is still to run)."""
        validate_node_name(node)
        extra = self._extra(node)
        resv = reservation_name(marker)
        if extra.startswith(marker + FINISHED):
            record = extra[len(marker + FINISHED) :]
            result = _Record.parse(node, record)
            self._restore(node, resv, result.memo)  # the last call may have stopped before this
            return result.outcome(node)
        owner = _note_owner(extra)
        if owner not in (None, marker) and self._reservation_exists(reservation_name(owner or "")):
            # Another incident's triage of this node was interrupted; its notes must survive until
            # it finishes (they say how to restore the node), so wait rather than overwrite them.
            raise TransientBackendError(
                f"{node} is in the maintenance reservation of another self-test "
                f"({reservation_name(owner or '')}); waiting for it to finish"
            )
        if extra.startswith(marker + STARTED):
            memo = _parse_memo(extra[len(marker + STARTED) :])
        else:
            info = self._node(node)
            memo = _Memo("drain" in info.state, info.reason if "drain" in info.state else "")
            self._set_extra(node, marker + STARTED + _format_memo(memo))
        try:
            ref_node = reference()
            ref_fp = self._reference_fingerprint(ref_node, f"{resv}-ref")
            if not self._reservation_exists(resv):
                self._create_reservation(resv, node)
            if memo.drained and "drain" in self._node(node).state:
                self._run.run([self._bin("scontrol"), "update", f"nodename={node}", "state=resume"])
            outcome = self._suspect_test(node, resv, ref_fp)
        except (PermanentBackendError, TransientBackendError, OSError):
            self._restore(node, resv, memo)
            raise
        code, fingerprint, detail = outcome
        result = _Record(code, fingerprint, ref_node, ref_fp, detail, memo)
        # Recorded before the node is drained again: a repeat after a crash here only restores.
        self._set_extra(node, marker + FINISHED + result.format())
        self._restore(node, resv, memo)
        return result.outcome(node)

    def abandon(self, node: str) -> None:
        """The node is being released (its incident was dismissed): delete the reservation of a
        triage that was cut off and clear its note."""
        extra = self._extra(node)
        owner = _note_owner(extra)
        if owner is None:
            return
        resv = reservation_name(owner)
        if self._reservation_exists(resv):
            self._run.run([self._bin("scontrol"), "delete", f"reservation={resv}"])
        if extra.startswith(owner + STARTED):
            self._set_extra(node, "")

    # --- the steps --------------------------------------------------------------------------

    def _reference_fingerprint(self, ref_node: str, job_name: str) -> str:
        self._cancel_leftovers(job_name)
        out = self._srun(ref_node, job_name, None, [])
        data = _last_json(out.stdout)
        fp = data.get("fingerprint") if data else None
        if out.returncode != 0 or not isinstance(fp, str) or not _FINGERPRINT.fullmatch(fp):
            raise PermanentBackendError(
                f"reference self-test on {ref_node} gave no fingerprint (exit {out.returncode}): {_tail(out)}"
            )
        return fp

    def _suspect_test(self, node: str, resv: str, ref_fp: str) -> tuple[int, str, str]:
        job_name = f"{resv}-test"
        self._cancel_leftovers(job_name)
        out = self._srun(node, job_name, resv, ["--expect", ref_fp])
        data = _last_json(out.stdout)
        status = data.get("status") if data else None
        if data is None or status not in _STATUS_EXIT or _STATUS_EXIT[str(status)] != out.returncode:
            raise PermanentBackendError(
                f"self-test job on {node} gave no result (exit {out.returncode}): {_tail(out)}"
            )
        fp = data.get("fingerprint")
        detail = ""
        if status == "could not run":
            listed = data.get("devices")
            devices: list[Any] = listed if isinstance(listed, list) else []
            errors = [f"{d.get('device')}: {d.get('error')}" for d in devices if isinstance(d, dict)]
            detail = _plain("; ".join(e for e in errors if not e.endswith(": None")))
        return out.returncode, _plain(fp) if isinstance(fp, str) else "none", detail

    def _srun(self, node: str, job_name: str, resv: str | None, extra_args: list[str]) -> CommandResult:
        minutes = max(1, math.ceil(self._config.timeout_s / 60))
        argv = [
            self._bin("srun"),
            f"--job-name={job_name}",
            f"--nodelist={node}",
            "--nodes=1",
            "--ntasks=1",
            f"--time={minutes}",
            f"--immediate={max(1, int(self._config.timeout_s))}",
            *([f"--reservation={resv}"] if resv else []),
            *self._config.srun_options,
            *self._config.command,
            "--node",
            node,
            *extra_args,
        ]
        # Waiting to start plus running, plus slack for srun's own start-up and teardown.
        out = self._run.run(argv, check=False, timeout_s=2 * self._config.timeout_s + 60)
        if out.returncode != 0 and _last_json(out.stdout) is None:
            text = (out.stderr or out.stdout).lower()
            if any(m in text for m in TRANSIENT_MARKERS):
                raise TransientBackendError(f"srun on {node} failed: {_tail(out)}")
        return out

    def _cancel_leftovers(self, job_name: str) -> None:
        """A self-test job a killed controller left behind (srun died with it)."""
        out = self._run.run(
            [
                self._bin("squeue"),
                "--noheader",
                f"--name={job_name}",
                "--states=PENDING,RUNNING,SUSPENDED,CONFIGURING",
                "--format=%i",
            ]
        ).stdout
        for job in out.split():
            self._run.run([self._bin("scancel"), job], check=False)

    def _reservation_exists(self, name: str) -> bool:
        out = self._run.run([self._bin("scontrol"), "show", "reservation", name], check=False)
        if out.returncode == 0 and f"ReservationName={name} " in out.stdout:
            return True
        if "not found" in (out.stderr + out.stdout).lower():
            return False
        raise TransientBackendError(f"scontrol show reservation {name}: {_tail(out)}")

    def _create_reservation(self, name: str, node: str) -> None:
        user = self._config.user or pwd.getpwuid(os.getuid()).pw_name
        self._run.run(
            [
                self._bin("scontrol"),
                "create",
                "reservation",
                f"ReservationName={name}",
                f"Nodes={node}",
                "StartTime=now",
                # No end: a reservation that expired under a resumed node would free it for any job.
                "Duration=infinite",
                f"Users={user}",
                "Flags=MAINT,IGNORE_JOBS",
            ]
        )

    def _restore(self, node: str, resv: str, memo: _Memo) -> None:
        """Drain the node again as it was (before the reservation goes), then delete it."""
        if memo.drained and "drain" not in self._node(node).state:
            argv = [self._bin("scontrol"), "update", f"nodename={node}", "state=drain"]
            self._run.run([*argv, f"reason={memo.reason or 'replicheck triage'}"])
        if self._reservation_exists(resv):
            self._run.run([self._bin("scontrol"), "delete", f"reservation={resv}"])


def reservation_name(marker: str) -> str:
    """The reservation (and job name prefix) of one triage action: stable across restarts."""
    return "replicheck-triage-" + hashlib.sha256(marker.encode()).hexdigest()[:12]


def _note_owner(extra: str) -> str | None:
    """The marker of the triage action whose note ``extra`` is, or None."""
    for sep in (STARTED, FINISHED):
        owner, found, _ = extra.partition(sep)
        if found and owner.startswith("replicheck:"):
            return owner
    return None


def _format_memo(memo: _Memo) -> str:
    return ("d|" if memo.drained else "u|") + memo.reason


def _parse_memo(text: str) -> _Memo:
    kind, _, reason = text.partition("|")
    return _Memo(kind == "d", reason)


def _plain(text: str) -> str:
    """Free text made safe for the ``Extra`` record: no field separator, quotes or newlines."""
    return re.sub(r"[^A-Za-z0-9 .,:;_()/+=-]", "_", text)[:200]


@dataclass(frozen=True)
class _Record:
    """A finished triage as kept in ``Extra``: ``code|fp|ref|ref_fp|detail|d-or-u|reason``."""

    code: int
    fingerprint: str
    reference: str
    reference_fingerprint: str
    detail: str
    memo: _Memo

    def format(self) -> str:
        fields = (str(self.code), self.fingerprint, self.reference, self.reference_fingerprint, self.detail)
        return "|".join(fields) + "|" + _format_memo(self.memo)

    @classmethod
    def parse(cls, node: str, text: str) -> _Record:
        parts = text.split("|", 5)
        if len(parts) != 6 or not parts[0].isascii() or not parts[0].isdigit():
            raise PermanentBackendError(f"{node}: unreadable triage record in Extra: {text!r}")
        code, fp, ref_node, ref_fp, detail, memo = parts
        return cls(int(code), fp, ref_node, ref_fp, detail, _parse_memo(memo))

    def outcome(self, node: str) -> Mapping[str, Any]:
        if self.code == _EXIT_COULD_NOT_RUN:
            # No evidence either way: a node that could not be tested did not fail the test.
            raise PermanentBackendError(f"self-test on {node} could not run (exit 3): {self.detail}")
        passed = self.code == _EXIT_OK
        verdict = "matches" if passed else "differs from"
        fp, ref, ref_fp = self.fingerprint, self.reference, self.reference_fingerprint
        return {
            "passed": passed,
            "fingerprint": fp,
            "reference": ref,
            "reference_fingerprint": ref_fp,
            "exit_code": self.code,
            "detail": f"fingerprint {fp} {verdict} {ref}'s {ref_fp} (Slurm job, exit {self.code})",
        }


def _last_json(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict):
            return data
    return None


def _tail(out: CommandResult) -> str:
    return (out.stderr or out.stdout).strip()[-300:] or "no output"
