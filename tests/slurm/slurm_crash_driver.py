"""Runs the controller with the slurm backend until its incident settles, optionally SIGKILLing
itself right before or right after one backend call. Every command that changes the cluster
is appended to LOG before it runs. Used by test_slurm_exactly_once.py as a subprocess:

    slurm_crash_driver.py DB SLURM_CONF LOG MODE JOB [before:METHOD | after:METHOD | cmd:TEXT]

MODE: default (scontrol state=fail), custom (replace_command), resubmit, dismiss, triage (a
transient incident self-tested through Slurm; stops awaiting approval), join (a no-restart
incident: one replacement replica group started with join_command). ``cmd:TEXT`` SIGKILLs
right before the first command whose argv contains TEXT (inside a backend call); ``cmd:TEXT#N``
before the Nth such command.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.backends.commands import CommandResult, CommandRunner
from replicheck.controller.backends.slurm import SlurmBackend, SlurmConfig
from replicheck.incident import Continuation, Incident, NodeIdentity, Suspect

NODE = "node3"


class LoggingRunner(CommandRunner):
    def __init__(self, conf: str, log: str, kill_before: str = "") -> None:
        super().__init__({"SLURM_CONF": conf}, 30.0)
        self.log = log
        self.kill_before, _, nth = kill_before.partition("#")
        self.kill_at, self.seen = int(nth or 1), 0

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout_s: float | None = None
    ) -> CommandResult:
        name = Path(argv[0]).name
        if self.kill_before and self.kill_before in " ".join(argv):
            self.seen += 1
            if self.seen == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
        changes = ("update", "requeue", "requeuehold", "release", "create", "delete")
        if (name == "scontrol" and argv[1] in changes) or name in ("sbatch", "replace.sh", "srun", "scancel"):
            fd = os.open(self.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.write(fd, (" ".join(argv) + "\n").encode())
            os.close(fd)
        return super().run(argv, check=check, timeout_s=timeout_s)


class KillAt:
    """Delegates to the backend; SIGKILLs this process right before or after ``method``."""

    def __init__(self, inner: SlurmBackend, point: str) -> None:
        self.inner, self.name = inner, inner.name
        self.when, _, self.method = point.partition(":")

    def __getattr__(self, method: str) -> Any:
        target = getattr(self.inner, method)

        def call(*args: Any, **kwargs: Any) -> Any:
            if method == self.method and self.when == "before":
                os.kill(os.getpid(), signal.SIGKILL)
            result = target(*args, **kwargs)
            if method == self.method and self.when == "after":
                os.kill(os.getpid(), signal.SIGKILL)
            return result

        return call


def main() -> int:
    db, conf, log, mode, job = sys.argv[1:6]
    point = sys.argv[6] if len(sys.argv) > 6 else ""
    here = Path(__file__).resolve().parent
    options: dict[str, Any] = {"resume_mode": "none"}
    if mode == "custom":
        options["replace_command"] = (os.environ["REPLACE_SCRIPT"], "{node}", "{marker}")
    if mode == "resubmit":
        options = {
            "resume_mode": "resubmit",
            "resubmit_command": (
                "sbatch",
                "--parsable",
                "-o",
                "/dev/null",
                "--exclude={exclude}",
                "--comment={marker}",
                "--job-name=resumed-{job_id}",
                "--wrap",
                "sleep 600",
            ),
        }
    if mode == "join":
        options["join_command"] = (
            "sbatch",
            "--parsable",
            "-o",
            "/dev/null",
            "--exclude={exclude}",
            "--comment={marker}",
            "--job-name=replica-{replica_group}",
            "--wrap",
            "sleep 600",
        )
    if mode == "triage":
        options["triage_command"] = (sys.executable, "-m", "replicheck", "selftest", "--json", "--steps", "1")
    kill_before = point.partition(":")[2] if point.startswith("cmd:") else ""
    runner = LoggingRunner(conf, log, kill_before)
    backend = SlurmBackend(SlurmConfig(slurm_conf=conf, **options), runner=runner)
    if kill_before:
        point = ""
    inc = Incident(
        id=f"{job}-s10-replay",
        job_id=job,
        step=10,
        check="replay",
        suspect_ranks=(1,),
        suspect_nodes=(NODE,),
        classification="transient" if mode == "triage" else "persistent",
        suspects=(Suspect(1, NodeIdentity(name=NODE, slurm_node=NODE)),),
        recommended_checkpoint={"step": 5, "path": str(here)},
        world_size=4,
        continuation=Continuation(mode="no_restart", replica_group="rg1") if mode == "join" else None,
    )
    config = ControllerConfig(
        apply=True,
        auto_approve=mode not in ("dismiss", "triage"),
        triage=mode == "triage",
        return_timeout_s=0,
        return_poll_s=0,
        retry_base_delay_s=0,
        checkpoint_roots=(str(here),),  # the incident's checkpoint path
    )
    with Controller(db, backend=KillAt(backend, point) if point else backend, config=config) as ctl:  # type: ignore[arg-type]
        # As if posted with the job's own scoped token: auto-approve acts only on such incidents.
        ctl.ingest(inc, vouched_by=f"job token {job} (jobs={job})")
        for _ in range(20):
            ctl.reconcile()
            record = ctl.store.get_record(inc.id)
            if mode == "dismiss" and record.state is State.AWAITING_APPROVAL:
                ctl.dismiss(inc.id, by="ops")
            if record.state in (State.RESUMED, State.JOINED, State.UNCORDONED, State.FAILED) or (
                mode == "triage" and record.state is State.AWAITING_APPROVAL
            ):
                break
        record = ctl.store.get_record(inc.id)
        triage = [{"node": t.node, "passed": t.passed, "detail": t.detail} for t in record.triage]
        print(json.dumps({"state": record.state.value, "reason": record.reason, "triage": triage}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
