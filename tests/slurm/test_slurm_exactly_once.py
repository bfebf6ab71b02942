"""Exactly once on a real Slurm cluster: the controller is SIGKILLed right before or right
after a backend call (replace by scontrol, replace by a custom command, resubmit, uncordon on
dismissal), restarted, and each side effect is counted where it lands: commands issued, the
custom command's own tally, jobs in squeue, node states."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from slurmkit import SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]
DRIVER = Path(__file__).with_name("slurm_crash_driver.py")
SRC = Path(__file__).resolve().parents[2] / "src"


class Run:
    """One controller database driven through kills and restarts."""

    def __init__(self, slurm: SlurmCluster, tmp_path: Path, mode: str) -> None:
        # The incident's job: a real one that ran on node3 and exited 87, so the controller's
        # allocation check (squeue, or sacct once slurmctld forgets it) vouches for node3.
        self.slurm, self.mode, self.job = slurm, mode, slurm.ended_job("node3")
        self.db, self.log, self.tally = (
            tmp_path / "c.db",
            tmp_path / "commands.log",
            tmp_path / "replaced.txt",
        )
        script = tmp_path / "replace.sh"
        script.write_text(f'#!/bin/sh\necho "$1 $2" >> {self.tally}\n')
        script.chmod(0o755)
        self.env = {**slurm.env, "PYTHONPATH": str(SRC), "REPLACE_SCRIPT": str(script)}

    def drive(self, point: str = "") -> dict[str, str]:
        proc = subprocess.run(
            [
                sys.executable,
                str(DRIVER),
                str(self.db),
                str(self.slurm.conf),
                str(self.log),
                self.mode,
                self.job,
                *([point] if point else []),
            ],
            capture_output=True,
            text=True,
            env=self.env,
            timeout=180,
        )
        if point:
            assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
            return {}
        assert proc.returncode == 0, proc.stderr
        return dict(json.loads(proc.stdout.strip().splitlines()[-1]))

    def commands(self, needle: str) -> int:
        text = self.log.read_text() if self.log.exists() else ""
        return sum(1 for line in text.splitlines() if needle in line)

    def replaced_by_script(self) -> int:
        return len(self.tally.read_text().splitlines()) if self.tally.exists() else 0

    def joined(self) -> list[str]:
        """Jobs named as the replacement replica group, with the join action's marker."""
        out = self.slurm.run("squeue", "--noheader", "--all", "--states=all", "--format=%i|%j|%k").stdout
        marker = f"replicheck:{self.job}-s10-replay:join_replacement:"
        return [line.split("|")[0] for line in out.splitlines() if marker in line and "|replica-rg1|" in line]

    def resubmitted(self) -> list[str]:
        out = self.slurm.run("squeue", "--noheader", "--all", "--states=all", "--format=%i|%k").stdout
        marker = f"replicheck:{self.job}-s10-replay:"  # not job 1's marker in job 11's
        return [line.split("|")[0] for line in out.splitlines() if marker in line]


@pytest.mark.parametrize("point", ["before:replace", "after:replace"])
def test_default_replace_once_even_if_node_came_back(slurm: SlurmCluster, tmp_path: Path, point: str) -> None:
    """Killed around the scontrol state=fail, restarted after the node came back idle: the node is failed exactly once."""
    run = Run(slurm, tmp_path, "default")
    run.drive(point)
    if point.startswith("after"):
        assert slurm.node_states()["node3"] == ("fail", "Action:Replace")
        slurm.scontrol("update", "nodename=node3", "state=resume")  # replaced and back before the restart
        slurm.wait_states({"node3": "idle"})
    assert run.drive()["state"] == "resumed"
    assert run.commands("state=fail") == 1
    assert slurm.node_states()["node3"][0] == ("idle" if point.startswith("after") else "fail")


@pytest.mark.parametrize("point", ["before:replace", "after:replace"])
def test_custom_replace_command_runs_once(slurm: SlurmCluster, tmp_path: Path, point: str) -> None:
    """Killed around a custom replace command that leaves the node's state alone: the command runs exactly once."""
    run = Run(slurm, tmp_path, "custom")
    run.drive(point)
    assert run.drive()["state"] == "resumed"
    assert run.replaced_by_script() == 1
    assert run.commands("state=fail") == 0


@pytest.mark.parametrize("point", ["before:resume", "after:resume"])
def test_resubmit_once(slurm: SlurmCluster, tmp_path: Path, point: str) -> None:
    """Killed around the resubmission: exactly one job carrying the action's marker is in Slurm, from one sbatch."""
    run = Run(slurm, tmp_path, "resubmit")
    try:
        run.drive(point)
        assert run.drive()["state"] == "resumed"
        assert len(run.resubmitted()) == 1 and run.commands("sbatch") == 1
    finally:
        for job in run.resubmitted():
            slurm.run("scancel", job, check=False)


@pytest.mark.parametrize("point", ["before:join", "after:join", "cmd:sbatch"])
def test_join_starts_one_replacement_group(slurm: SlurmCluster, tmp_path: Path, point: str) -> None:
    """A no-restart incident (its job went on without replica group rg1): killed around the
    join, or right before its sbatch, and restarted, the controller ends in ``joined`` with
    exactly one Slurm job named replica-rg1 carrying the join action's marker, from one sbatch,
    excluding the replaced node; the incident's own job is never requeued or resubmitted."""
    run = Run(slurm, tmp_path, "join")
    try:
        run.drive(point)
        assert run.drive()["state"] == "joined"
        (job,) = run.joined()
        assert run.commands("sbatch") == 1
        assert "ExcNodeList=node3" in slurm.scontrol("show", "job", job).stdout
        assert run.commands("requeue") == 0 and run.commands("release") == 0
    finally:
        for job in run.joined():
            slurm.run("scancel", job, check=False)


@pytest.mark.parametrize("point", ["before:uncordon", "after:uncordon"])
def test_dismiss_uncordons_once(slurm: SlurmCluster, tmp_path: Path, point: str) -> None:
    """Killed around the uncordon of a dismissed incident: the node is drained once and resumed once."""
    run = Run(slurm, tmp_path, "dismiss")
    run.drive(point)
    assert run.drive()["state"] == "uncordoned"
    assert run.commands("state=drain") == 1 and run.commands("state=resume") == 1
    assert slurm.wait_states({"node3": "idle"})["node3"][0] == "idle"


def test_repeated_kills_each_side_effect_once(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Killed after the cordon, then before and after the custom replace, then after the resume: every effect once."""
    run = Run(slurm, tmp_path, "custom")
    for point in ("after:cordon", "before:replace", "after:replace", "after:resume"):
        run.drive(point)
    assert run.drive()["state"] == "resumed"
    assert run.commands("state=drain") == 1 and run.replaced_by_script() == 1


def test_interrupted_custom_replace_is_not_repeated(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A custom replace interrupted between its start and done markers fails the incident instead of running again."""
    run = Run(slurm, tmp_path, "custom")
    run.drive("after:cordon")
    # What a kill inside the call leaves behind: the start marker, the command's effect unknown.
    marker = f"replicheck:{run.job}-s10-replay:replace:node3"
    slurm.scontrol("update", "nodename=node3", f"extra={marker}/started")
    summary = run.drive()
    assert summary["state"] == "failed" and "not repeating it" in summary["reason"]
    assert run.replaced_by_script() == 0
    assert os.path.exists(run.db)


def test_resubmit_in_doubt_past_min_job_age_is_not_repeated(slurm: SlurmCluster, tmp_path: Path) -> None:
    """An unrecorded resubmission older than MinJobAge (or stamped in the future, so of unknown age), whose job Slurm no longer lists, is refused rather than repeated."""
    from test_slurm_backend import backend

    from replicheck.controller.backends.base import ResumeRequest
    from replicheck.controller.errors import PermanentBackendError

    tally = tmp_path / "sbatch.txt"
    script = tmp_path / "submit.sh"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tally}\necho 1\n')
    script.chmod(0o755)
    b, _ = backend(slurm, resume_mode="resubmit", resubmit_command=(str(script), "--comment={marker}"))
    job = slurm.ended_job("node1")
    key = f"{job}-s1-replay:resume:{job}"
    old = ResumeRequest(
        f"{job}-s1-replay",
        job,
        None,
        (),
        previous_attempt_at="2020-01-01T00:00:00+00:00",
        allocation=("node1",),
    )
    with pytest.raises(PermanentBackendError, match="MinJobAge=600s"):
        b.resume(old, key)
    # Stamped while the clock ran 30 days ahead: its real age is unknown, so not repeated either.
    ahead = dataclasses.replace(
        old, previous_attempt_at=(dt.datetime.now(dt.UTC) + dt.timedelta(days=30)).isoformat()
    )
    with pytest.raises(PermanentBackendError, match="MinJobAge=600s"):
        b.resume(ahead, key)
    assert not tally.exists()
    recent = dataclasses.replace(old, previous_attempt_at=dt.datetime.now(dt.UTC).isoformat())
    b.resume(recent, key)  # absence within MinJobAge proves nothing ran: submit
    assert len(tally.read_text().splitlines()) == 1
