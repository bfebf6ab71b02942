"""``slurm``: drain, resume, fail with ``Action:Replace``, triage (a self-test job on the drained
node: slurm_triage) and requeue/resubmit through the Slurm client commands. Each call observes
the node or job first so that repeating it after a crash is a no-op; node names are validated
before they reach a command line."""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from replicheck.controller.backends.base import (
    JoinRequest,
    NodeInfo,
    ResumeRequest,
    validate_node_name,
)
from replicheck.controller.backends.commands import CommandRunner, classify
from replicheck.controller.backends.slurm_triage import SlurmTriage, SlurmTriageConfig
from replicheck.controller.errors import ConfigError, NotYet, PermanentBackendError
from replicheck.incident import CHECKPOINT_PATH, INCIDENT_ID, JOB_ID, REPLICA_GROUP

_SEP = "|#|"
_SLURM_JOB_ID = re.compile(r"[0-9]{1,20}")
"""A numeric Slurm job id (ASCII digits only: ``str.isdigit`` accepts other scripts' digits)."""
_USER = re.compile(r"[A-Za-z_][A-Za-z0-9._-]{0,63}")
_STARTED, _DONE = "/started", "/done"
"""Suffixes of the node ``Extra`` marker around a custom replace command."""
_UNSCHEDULABLE = ("drain", "fail", "down", "maint", "reboot", "power", "future", "unknown")
_FINISHED_JOB = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


@dataclass(frozen=True, kw_only=True)
class SlurmConfig:
    """How to talk to Slurm."""

    slurm_conf: str | None = None
    """Path given to the client commands as SLURM_CONF (None: their default)."""
    bin_dir: str | None = None
    """Directory holding scontrol/sinfo/squeue (None: found on PATH)."""
    command_timeout_s: float = 30.0
    """Timeout of one client command; a timeout is a temporary error."""
    replace_reason: str = "Action:Replace"
    """Reason set with state=fail; HyperPod matches this string exactly."""
    replace_command: tuple[str, ...] = ()
    """Run this instead of ``scontrol update ... state=fail`` to replace (``{node}`` and
    ``{marker}`` substituted). The node's ``Extra`` field records it as started, then done, so
    a restarted controller never runs it twice (a run interrupted in between is reported, not
    repeated)."""
    resume_mode: str = "requeue"
    """``requeue`` (scontrol requeuehold, exclude, release), ``resubmit`` (resubmit_command) or ``none``."""
    resubmit_command: tuple[str, ...] = ()
    """For resume_mode=resubmit: argv template with {job_id} {step} {checkpoint} {exclude} {marker};
    must contain {marker} (e.g. ``--comment={marker}``); an argument with {exclude} is dropped when
    nothing is excluded."""
    join_command: tuple[str, ...] = ()
    """For a job that goes on without a replica group (torchft, ``docs/no-restart.md``): argv
    template that starts one replacement replica group, e.g. ``("sbatch", "--parsable",
    "--comment={marker}", "--exclude={exclude}", "--export=ALL,REPLICA_GROUP_ID={replica_group}",
    "group.sbatch")``, with {job_id} (the departed group's job) {replica_group} {exclude} {node}
    (the first node that took the replaced one's place) {incident} {marker}; must contain
    {marker}; an argument with {exclude} or {node} is dropped when there is none. Empty: a join
    fails the incident for a person to start the group by hand."""
    triage: str = "slurm"
    """How triage runs the self-test: ``slurm`` (a Slurm job on the drained node, through a
    maintenance reservation; see slurm_triage) or ``command`` (``selftest_command``, out of band)."""
    triage_command: tuple[str, ...] = ("replicheck", "selftest", "--json")
    """For triage=slurm: the self-test argv ``srun`` runs on the node (``--node`` and, on the
    suspect, ``--expect`` are appended)."""
    triage_timeout_s: float = 600.0
    """For triage=slurm: time limit of each self-test job, and how long it may wait to start."""
    triage_user: str | None = None
    """For triage=slurm: the user the maintenance reservation admits (None: the controller's)."""
    triage_srun_options: tuple[str, ...] = ()
    """For triage=slurm: extra ``srun`` arguments (e.g. ``--gres=gpu:8``, ``--partition=gpu``)."""
    selftest_command: tuple[str, ...] = (
        "ssh",
        "-o",
        "BatchMode=yes",
        "{node}",
        "replicheck",
        "selftest",
        "--json",
    )
    """For triage=command: argv template running the self-test on ``{node}`` out of band; it
    must print the self-test JSON."""
    reference_node: str | None = None
    """Healthy node to compare self-test fingerprints with (None: a schedulable node of the
    suspect's partition)."""

    def __post_init__(self) -> None:
        if self.resume_mode not in ("requeue", "resubmit", "none"):
            raise ConfigError(f"resume_mode must be requeue, resubmit or none, got {self.resume_mode!r}")
        if self.resume_mode == "resubmit":
            if not self.resubmit_command:
                raise ConfigError("resume_mode=resubmit needs resubmit_command")
            if not any("{marker}" in a for a in self.resubmit_command):
                raise ConfigError(
                    "resubmit_command must pass {marker} (e.g. --comment={marker}) so a "
                    "restarted controller can tell it already resubmitted"
                )
        if self.join_command and not any("{marker}" in a for a in self.join_command):
            raise ConfigError(
                "join_command must pass {marker} (e.g. --comment={marker}) so a restarted "
                "controller can tell it already started the replacement group"
            )
        if not self.replace_reason:
            raise ConfigError("replace_reason must not be empty")
        if self.triage not in ("slurm", "command"):
            raise ConfigError(f"triage must be slurm or command, got {self.triage!r}")
        if self.triage == "slurm" and not self.triage_command:
            raise ConfigError("triage=slurm needs a triage_command")
        if not self.triage_timeout_s > 0:
            raise ConfigError(f"triage_timeout_s must be > 0, got {self.triage_timeout_s!r}")
        if self.reference_node is not None:
            validate_node_name(self.reference_node)
        if self.triage_user is not None and _USER.fullmatch(self.triage_user) is None:
            raise ConfigError(f"triage_user must be one user name, got {self.triage_user!r}")


class SlurmBackend:
    """The Backend protocol on a Slurm cluster."""

    name = "slurm"

    def __init__(self, config: SlurmConfig | None = None, runner: CommandRunner | None = None) -> None:
        self.config = config or SlurmConfig()
        env = {"SLURM_CONF": self.config.slurm_conf} if self.config.slurm_conf else {}
        self._run = runner or CommandRunner(env, self.config.command_timeout_s)

    def _bin(self, name: str) -> str:
        return os.path.join(self.config.bin_dir, name) if self.config.bin_dir else name

    # --- observation ------------------------------------------------------------------------

    def list_nodes(self) -> list[NodeInfo]:
        out = self._run.run(
            [self._bin("sinfo"), "--noheader", "--Node", "--format", _SEP.join(("%N", "%T", "%P", "%E"))]
        ).stdout
        merged: dict[str, NodeInfo] = {}
        for line in out.splitlines():
            parts = line.split(_SEP)
            if len(parts) != 4:
                continue
            name, state, partition, reason = (p.strip() for p in parts)
            partition = partition.rstrip("*")
            reason = "" if reason == "none" else reason
            prev = merged.get(name)
            partitions = (prev.partitions if prev else ()) + (partition,)
            merged[name] = NodeInfo(
                name=name, state=state, reason=reason, partitions=partitions, schedulable=_schedulable(state)
            )
        return [merged[n] for n in sorted(merged)]

    def node(self, node: str) -> NodeInfo:
        validate_node_name(node)
        for info in self.list_nodes():
            if info.name == node:
                return info
        raise PermanentBackendError(f"Slurm knows no node {node!r}")

    def allocation(self, job_id: str) -> frozenset[str] | None:
        """The job's nodes: from slurmctld while it lists the job (running, pending: none, or
        ended less than ``MinJobAge`` ago), else from the accounting database (``sacct``), so a
        job that just ended still answers. None when neither knows the job."""
        if _SLURM_JOB_ID.fullmatch(job_id) is None:
            return None  # not a Slurm job id: Slurm cannot vouch for it
        live = self._run.run(
            [
                self._bin("squeue"),
                "--noheader",
                f"--jobs={job_id}",
                "--states=all",
                "--format",
                _SEP.join(("%i", "%T", "%N")),
            ],
            check=False,
        )
        listed: frozenset[str] | None = None
        if live.returncode == 0:
            for line in live.stdout.splitlines():
                parts = line.split(_SEP)
                if len(parts) == 3 and parts[0].strip() == job_id:
                    listed = self._hostnames(parts[2].strip())
                    if listed or parts[1].strip() == "PENDING":
                        return listed
        elif "invalid job id" not in (live.stderr + live.stdout).lower():
            raise classify(live)
        # Ended (a completing job's list shrinks as nodes are released) or forgotten: accounting.
        acct = self._run.run(
            [
                self._bin("sacct"),
                "--noheader",
                "--parsable2",
                "--allocations",
                f"--jobs={job_id}",
                "--format=JobID,NodeList",
            ],
            check=False,
        )
        if acct.returncode != 0:
            text = (acct.stderr + acct.stdout).lower()
            if "accounting storage is disabled" in text or "invalid" in text:
                return listed  # no accounting: a job slurmctld forgot cannot be verified
            raise classify(acct)
        for line in acct.stdout.splitlines():
            jid, sep, nodes = line.partition("|")
            if sep and jid.strip() == job_id:
                return self._hostnames(nodes.strip())
        return listed

    def _hostnames(self, hostlist: str) -> frozenset[str]:
        """A Slurm host list (``node[1-3,7]``) as node names; none for a job not yet placed."""
        if not hostlist or hostlist in ("(null)", "None assigned", "None"):
            return frozenset()
        out = self._run.run([self._bin("scontrol"), "show", "hostnames", hostlist]).stdout
        return frozenset(n.strip() for n in out.splitlines() if n.strip())

    def schedulable_by_partition(self, node: str) -> Mapping[str, Sequence[str]]:
        nodes = self.list_nodes()
        mine = next((n for n in nodes if n.name == node), None)
        if mine is None:
            raise PermanentBackendError(f"Slurm knows no node {node!r}")
        return {p: [n.name for n in nodes if p in n.partitions and n.schedulable] for p in mine.partitions}

    # --- node actions -----------------------------------------------------------------------

    def cordon(self, node: str, reason: str, key: str) -> Mapping[str, Any]:
        info = self.node(node)
        if "drain" in info.state:
            return {"detail": f"{node} already {info.state}", "reason": info.reason}
        self._update_node(node, "drain", reason)
        return {"detail": f"drained {node}"}

    def uncordon(self, node: str, reason_prefix: str, key: str) -> Mapping[str, Any]:
        if self.config.triage == "slurm":
            self._triage().abandon(node)  # a triage cut off by a dismissal: its reservation goes
        info = self.node(node)
        if "drain" not in info.state or not info.reason.startswith(reason_prefix):
            # Not ours (or already resumed): leave a node drained by someone else alone.
            return {"detail": f"{node} left as is ({info.state}: {info.reason or 'no reason'})"}
        self._update_node(node, "resume", None)
        return {"detail": f"resumed {node}"}

    def replace(self, node: str, key: str) -> Mapping[str, Any]:
        # The node's Extra field carries this action's marker: it survives the node coming back
        # idle, so a repeat after a crash sees the replacement happened and does not fail it again.
        marker = _marker(key)
        extra = self.node_extra(node)
        if extra in (marker, marker + _DONE):
            return {"detail": f"{node} already replaced by this action ({extra})"}
        if self.config.replace_command:
            if extra == marker + _STARTED:
                raise PermanentBackendError(
                    f"the replace command for {node} was started before the controller stopped and may "
                    f"have run (Extra={extra}); not repeating it: check the node, then replace it by hand "
                    "or dismiss the incident"
                )
            self._set_extra(node, marker + _STARTED)
            argv = [
                a.replace("{node}", node).replace("{marker}", marker) for a in self.config.replace_command
            ]
            self._run.run(argv)
            self._set_extra(node, marker + _DONE)
            return {"detail": f"replace command run for {node}"}
        info = self.node(node)
        if "fail" in info.state and info.reason.startswith(self.config.replace_reason):
            return {"detail": f"{node} already {info.state} ({info.reason})"}
        self._update_node(node, "fail", self.config.replace_reason, extra=marker)
        return {"detail": f"{node} set to fail with reason {self.config.replace_reason}"}

    def node_extra(self, node: str) -> str:
        """The node's ``Extra`` field ("" when unset)."""
        validate_node_name(node)
        out = self._run.run(
            [
                self._bin("sinfo"),
                "--noheader",
                "--Node",
                "--nodes",
                node,
                "--Format",
                f"NodeList:{_SEP},Extra:",
            ]
        ).stdout
        for line in out.splitlines():
            name, sep, extra = line.partition(_SEP)
            if sep and name.strip() == node:
                extra = extra.strip()
                return "" if extra == "(null)" else extra
        raise PermanentBackendError(f"Slurm knows no node {node!r}")

    def _set_extra(self, node: str, value: str) -> None:
        self._run.run(
            [self._bin("scontrol"), "update", f"nodename={validate_node_name(node)}", f"extra={value}"]
        )

    def await_return(self, node: str, key: str) -> Mapping[str, Any]:
        info = self.node(node)
        # A resumed node shows e.g. "idle*" until its slurmd registers: not back yet.
        if info.schedulable:
            return {"back": True, "replacement": None, "detail": f"{node} is {info.state}"}
        raise NotYet(f"{node} is {info.state}")

    def _update_node(self, node: str, state: str, reason: str | None, extra: str | None = None) -> None:
        argv = [self._bin("scontrol"), "update", f"nodename={validate_node_name(node)}", f"state={state}"]
        if reason is not None:
            argv.append(f"reason={reason}")
        if extra is not None:
            argv.append(f"extra={extra}")
        self._run.run(argv)

    # --- triage -----------------------------------------------------------------------------

    def selftest(self, node: str, key: str) -> Mapping[str, Any]:
        validate_node_name(node)
        if self.config.triage == "slurm":
            return self._triage().run(
                node, _marker(key), lambda: self.config.reference_node or self._pick_reference(node)
            )
        reference = self.config.reference_node or self._pick_reference(node)
        mine = self._selftest_on(node)
        theirs = self._selftest_on(reference)
        passed = mine["fingerprint"] == theirs["fingerprint"]
        verdict = "matches" if passed else "differs from"
        return {
            "passed": passed,
            "fingerprint": mine["fingerprint"],
            "reference": reference,
            "reference_fingerprint": theirs["fingerprint"],
            "detail": f"fingerprint {mine['fingerprint']} {verdict} {reference}'s {theirs['fingerprint']}",
        }

    def _triage(self) -> SlurmTriage:
        c = self.config
        config = SlurmTriageConfig(
            command=c.triage_command,
            timeout_s=c.triage_timeout_s,
            user=c.triage_user,
            srun_options=c.triage_srun_options,
        )
        return SlurmTriage(config, self._run, self._bin, self.node, self.node_extra, self._set_extra)

    def _pick_reference(self, node: str) -> str:
        for _partition, names in sorted(self.schedulable_by_partition(node).items()):
            for name in names:
                if name != node:
                    return name
        raise PermanentBackendError(f"no healthy node to compare {node}'s self-test with")

    def _selftest_on(self, node: str) -> Mapping[str, Any]:
        argv = [a.replace("{node}", node) for a in self.config.selftest_command]
        out = self._run.run(argv, check=False)
        try:
            data = json.loads(out.stdout.strip().splitlines()[-1])
            str(data["fingerprint"])  # a result without a fingerprint is no result
        except (ValueError, IndexError, KeyError, TypeError) as exc:
            raise PermanentBackendError(
                f"self-test on {node} gave no result (exit {out.returncode}): "
                f"{(out.stderr or out.stdout).strip()[-300:] or 'no output'}"
            ) from exc
        if not isinstance(data, dict):
            raise PermanentBackendError(f"self-test on {node} printed JSON that is not an object")
        if not isinstance(data.get("fingerprint"), str):  # could not run: no evidence either way
            raise PermanentBackendError(
                f"self-test on {node} could not run (exit {out.returncode}): {json.dumps(data.get('devices'))[:300]}"
            )
        return data

    def join(self, request: JoinRequest, key: str) -> Mapping[str, Any]:
        """Start one replacement replica group with ``join_command`` (docs/no-restart.md, "The
        controller's join action"): the job itself is never touched. Idempotent as
        ``resubmit``: a job carrying the action's marker is the replacement already started."""
        if not self.config.join_command:
            raise PermanentBackendError(
                "slurm: no [slurm] join_command is configured, so the controller cannot start a "
                f"replacement for replica group {request.replica_group} of job {request.job_id}; "
                "start it by hand (the job was not resumed)"
            )
        marker = _marker(key)
        values = _join_values(request, marker)  # every value checked before any command
        for node in (*request.exclude, *request.nodes):
            validate_node_name(node)
        self._check_same_job(request)
        found = self._marked(marker)
        if found is not None:
            return {
                "detail": f"replica group {request.replica_group} already started as job {found}",
                "job_id": found,
            }
        if request.previous_attempt_at is not None:
            self._check_absence_conclusive(request.previous_attempt_at, marker)
        argv = _expand(
            self.config.join_command, values, {"{exclude}": request.exclude, "{node}": request.nodes}
        )
        result = self._run.run(argv)
        new_id = result.stdout.strip().split(";")[0].split()[-1] if result.stdout.strip() else "?"
        return {
            "detail": f"started a replacement for replica group {request.replica_group} of job "
            f"{request.job_id} as job {new_id}",
            "job_id": new_id,
            "replica_group": request.replica_group,
        }

    def _marked(self, marker: str) -> str | None:
        """The job whose comment is ``marker`` (one the controller submitted), if Slurm lists one."""
        out = self._run.run(
            [self._bin("squeue"), "--noheader", "--all", "--states=all", "--format", f"%i{_SEP}%k"]
        ).stdout
        for line in out.splitlines():
            job_id, _, comment = line.partition(_SEP)
            if comment.strip() == marker:
                return job_id.strip()
        return None

    # --- resuming the job -------------------------------------------------------------------

    def resume(self, request: ResumeRequest, key: str) -> Mapping[str, Any]:
        for node in request.exclude:
            validate_node_name(node)
        if self.config.resume_mode == "none":
            return {"detail": "resume_mode=none: the job is not restarted by the controller"}
        self._check_same_job(request)
        if self.config.resume_mode == "resubmit":
            return self._resubmit(request, key)
        return self._requeue(request, key)

    def _check_same_job(self, request: ResumeRequest | JoinRequest) -> None:
        """Requeue, resubmit or join only for the job the incident was verified against: never a
        job id no allocation check vouched for, nor one now placed only on other nodes (a reused
        id)."""
        if request.allocation is None:
            raise PermanentBackendError(
                f"job {request.job_id} was never verified against Slurm's allocation; not restarting it"
            )
        now = self.allocation(request.job_id) if _SLURM_JOB_ID.fullmatch(request.job_id) else None
        if now and request.allocation and not now & set(request.allocation):
            raise PermanentBackendError(
                f"job {request.job_id} now runs on {', '.join(sorted(now))}, none of the nodes it was "
                f"verified on ({', '.join(request.allocation)}): not the incident's job; not restarting it"
            )

    def _job(self, job_id: str) -> dict[str, str]:
        # Fixed columns with the free-text comment last: a job name cannot inject a field.
        out = self._run.run(
            [
                self._bin("squeue"),
                "--noheader",
                f"--jobs={job_id}",
                "--states=all",
                "--format",
                _SEP.join(("%i", "%T", "%Q", "%r", "%k")),
            ]
        ).stdout
        for line in out.splitlines():
            parts = line.split(_SEP, 4)
            if len(parts) == 5 and parts[0].strip() == job_id:
                comment = parts[4].strip()
                return {
                    "JobState": parts[1].strip(),
                    "Priority": parts[2].strip(),
                    "Reason": parts[3].strip(),
                    "Comment": "" if comment == "(null)" else comment,
                }
        raise PermanentBackendError(f"Slurm no longer lists job {job_id}; cannot requeue it")

    def _requeue(self, request: ResumeRequest, key: str) -> Mapping[str, Any]:
        job, marker = request.job_id, _marker(key)
        if _SLURM_JOB_ID.fullmatch(job) is None:
            raise PermanentBackendError(f"job id {job!r} is not a Slurm job id; use resume_mode=resubmit")
        scontrol = self._bin("scontrol")
        info = self._job(job)
        held = info.get("Priority") == "0" or "Held" in info.get("Reason", "")
        if info.get("Comment") != marker:
            if info.get("JobState") in _FINISHED_JOB:
                self._run.run([scontrol, "requeuehold", job])
                held = True
            update = [scontrol, "update", f"jobid={job}", f"comment={marker}"]
            if request.exclude:
                update.append(f"excnodelist={','.join(request.exclude)}")
            self._run.run(update)
        if held:
            self._run.run([scontrol, "release", job])
            # Slurm holds a requeued batch job back for the credential lifetime; start it now.
            self._run.run([scontrol, "update", f"jobid={job}", "starttime=now"], check=False)
        excluded = ", ".join(request.exclude) or "nothing"
        return {"detail": f"requeued job {job} (excluding {excluded})", "job_id": job}

    def _resubmit(self, request: ResumeRequest, key: str) -> Mapping[str, Any]:
        marker = _marker(key)
        found = self._marked(marker)
        if found is not None:
            return {"detail": f"already resubmitted as job {found}", "job_id": found}
        if request.previous_attempt_at is not None:
            self._check_absence_conclusive(request.previous_attempt_at, marker)
        ckpt = request.checkpoint or {}
        values = _template_values(request, marker)
        argv = []
        for arg in self.config.resubmit_command:
            if "{exclude}" in arg and not request.exclude:
                continue
            for placeholder, value in values.items():
                arg = arg.replace(placeholder, value)
            argv.append(arg)
        if any("\x00" in a or "\n" in a for a in argv):
            raise PermanentBackendError("resubmit_command expands to an argument with a NUL or newline")
        result = self._run.run(argv)
        new_id = result.stdout.strip().split(";")[0].split()[-1] if result.stdout.strip() else "?"
        return {
            "detail": f"resubmitted job {request.job_id} as {new_id} from step {ckpt.get('step')}",
            "job_id": new_id,
        }

    def _check_absence_conclusive(self, attempt_at: str, marker: str) -> None:
        """An earlier resubmission may have run. Slurm lists a job until ``MinJobAge`` after it
        ends, so if that attempt started less than ``MinJobAge`` ago, the marker's absence proves
        nothing was submitted; otherwise the job may have come and gone: refuse to repeat it."""
        out = self._run.run([self._bin("scontrol"), "show", "config"]).stdout
        match = re.search(r"^MinJobAge\s*=\s*([0-9]+)", out, re.MULTILINE)
        min_age = int(match.group(1)) if match else 0
        started = _dt.datetime.fromisoformat(attempt_at)
        age = (_dt.datetime.now(_dt.UTC) - started).total_seconds()
        # A start stamped in the future (the clock ran ahead then) says nothing of how long ago
        # it really was: not conclusive either.
        if age >= min_age or age < 0:
            raise PermanentBackendError(
                f"a resubmission started at {attempt_at} may have run (no job with comment {marker} is "
                f"listed, but Slurm forgets finished jobs after MinJobAge={min_age}s); not repeating it: "
                "check the job, then resubmit it by hand or dismiss the incident"
            )


def _template_values(request: ResumeRequest, marker: str) -> dict[str, str]:
    """Placeholder values, each checked against its grammar before it can reach argv."""
    ckpt = request.checkpoint or {}
    step, path = ckpt.get("step", ""), ckpt.get("path", "")
    checks = ((JOB_ID, request.job_id, "job id"), (INCIDENT_ID, request.incident_id, "incident id"))
    for pattern, value, what in checks:
        if not isinstance(value, str) or pattern.fullmatch(value) is None:
            raise PermanentBackendError(f"refusing {what} {value!r} in resubmit_command")
    if step != "" and (not isinstance(step, int) or isinstance(step, bool) or step < 0):
        raise PermanentBackendError(f"refusing checkpoint step {step!r} in resubmit_command")
    if path != "" and (not isinstance(path, str) or CHECKPOINT_PATH.fullmatch(path) is None):
        raise PermanentBackendError(f"refusing checkpoint path {path!r} in resubmit_command")
    return {
        "{job_id}": request.job_id,
        "{step}": str(step),
        "{checkpoint}": str(path),
        "{exclude}": ",".join(validate_node_name(n) for n in request.exclude),
        "{marker}": marker,
        "{incident}": request.incident_id,
    }


def _join_values(request: JoinRequest, marker: str) -> dict[str, str]:
    """The join template's values, each checked against its grammar before it can reach argv."""
    checks = (
        (JOB_ID, request.job_id, "job id"),
        (INCIDENT_ID, request.incident_id, "incident id"),
        (REPLICA_GROUP, request.replica_group, "replica group"),
    )
    for pattern, value, what in checks:
        if not isinstance(value, str) or pattern.fullmatch(value) is None:
            raise PermanentBackendError(f"refusing {what} {value!r} in join_command")
    return {
        "{job_id}": request.job_id,
        "{replica_group}": request.replica_group,
        "{exclude}": ",".join(validate_node_name(n) for n in request.exclude),
        "{node}": validate_node_name(request.nodes[0]) if request.nodes else "",
        "{marker}": marker,
        "{incident}": request.incident_id,
    }


def _expand(
    template: Sequence[str], values: Mapping[str, str], optional: Mapping[str, Sequence[str]]
) -> list[str]:
    """``template`` with ``values`` in place; an argument naming an ``optional`` placeholder that
    has nothing is dropped."""
    argv = []
    for arg in template:
        if any(p in arg and not optional[p] for p in optional):
            continue
        for placeholder, value in values.items():
            arg = arg.replace(placeholder, value)
        argv.append(arg)
    if any("\x00" in a or "\n" in a for a in argv):
        raise PermanentBackendError("the command template expands to an argument with a NUL or newline")
    return argv


def _marker(key: str) -> str:
    # Slurm comments are free text; keep it one token so scontrol's key=value output parses.
    return "replicheck:" + "".join(c if c.isalnum() or c in "-_.:" else "_" for c in key)


def _schedulable(state: str) -> bool:
    s = state.lower()
    return not s.endswith("*") and not any(word in s for word in _UNSCHEDULABLE)
