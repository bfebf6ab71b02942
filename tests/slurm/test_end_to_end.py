"""End to end on the test Slurm cluster: a 2-node job (4 ranks) runs guarded DDP training with a
persistent fault on one rank, the guard detects it and the job exits with EXIT_CORRUPTION (as
Slurm's accounting records it: sacct, backed by slurmdbd and MariaDB), the controller drains the suspect node, a person approves through the CLI, the node is failed with
Action:Replace, the test plays the cloud and brings it back, the job is resubmitted from the
recommended checkpoint (without the fault) and completes."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurmkit import SlurmCluster, free_ports

from replicheck.codes import EXIT_CORRUPTION
from replicheck.incident import read_incident

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]
SRC = Path(__file__).resolve().parents[2] / "src"
JOB = Path(__file__).with_name("guarded_job.py")
FAULT_RANK, FAULT_ONSET, STOP = 3, 23, 40  # detected by the replay of step 30; clean resume point: step 20


def cli(slurm: SlurmCluster, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**slurm.env, "PYTHONPATH": str(SRC)}
    return subprocess.run(
        [sys.executable, "-m", "replicheck", *args], capture_output=True, text=True, env=env, timeout=120
    )


def wait_job(slurm: SlurmCluster, job: str, timeout: float = 120) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = slurm.scontrol("--oneliner", "show", "job", job).stdout
        fields = dict(t.split("=", 1) for t in out.split() if "=" in t)
        if fields.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            return fields
        time.sleep(0.2)
    raise TimeoutError(f"job {job} did not finish: {out}")


def wait_accounted(slurm: SlurmCluster, job: str, timeout: float = 60) -> dict[str, str]:
    """The job's finished record in the accounting database (slurmctld reports it asynchronously)."""
    record: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        record = slurm.sacct(job)
        if record.get("State", "PENDING") not in ("PENDING", "RUNNING", "REQUEUED"):
            return record
        time.sleep(0.2)
    raise TimeoutError(f"sacct has no finished record of job {job}: {record}")


def test_detect_drain_approve_replace_resubmit(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The whole procedure on real Slurm, driven by the CLI; the replacement happens once and the resubmitted job completes."""
    incidents, out, ckpts = tmp_path / "incidents", tmp_path / "out", tmp_path / "ckpt"
    incidents.mkdir()
    out.mkdir()
    first_port, resume_port = free_ports(2)
    task = (
        f"{sys.executable} {JOB} --incident-dir {incidents} --checkpoint-dir {ckpts} --out {out} "
        f"--stop-step {STOP}"
    )
    env_export = f"--export=ALL,PYTHONPATH={SRC}"
    job = (
        slurm.run(
            "sbatch",
            "--parsable",
            "-N2",
            "--ntasks-per-node=2",
            env_export,
            "-o",
            str(out / "first.log"),
            "--wrap",
            f"srun {task} --port {first_port} --fault-rank {FAULT_RANK} --fault-onset {FAULT_ONSET}",
        )
        .stdout.strip()
        .split(";")[0]
    )
    fields = wait_job(slurm, job)
    assert fields["ExitCode"] == f"{EXIT_CORRUPTION}:0", (fields, (out / "first.log").read_text())
    accounted = wait_accounted(slurm, job)
    assert (accounted["State"], accounted["ExitCode"]) == ("FAILED", f"{EXIT_CORRUPTION}:0"), accounted
    where = {int(r): n for n, r in (p.read_text().split() for p in out.glob("rank-*"))}  # rank -> its node
    assert sorted(where) == [0, 1, 2, 3] and len(set(where.values())) == 2, where
    (incident_file,) = incidents.glob("*.json")
    found = read_incident(incident_file)
    assert found.job_id == job and found.classification == "persistent" and found.step == 30
    assert found.suspect_ranks == (FAULT_RANK,) and found.suspect_nodes == (where[FAULT_RANK],)
    assert found.recommended_checkpoint == {"step": 20, "path": str(ckpts / "step-000000020")}
    config = tmp_path / "controller.toml"
    resume_wrap = f"srun {task} --port {resume_port} --resume-checkpoint {{checkpoint}}"
    config.write_text(
        "[controller]\nbackend = 'slurm'\napply = true\nretry_base_delay_s = 0.2\nreturn_poll_s = 0.2\n"
        f"incident_dirs = ['{incidents}']\ncheckpoint_roots = ['{ckpts}']\n"
        "[slurm]\nresume_mode = 'resubmit'\n"
        "resubmit_command = ['sbatch', '--parsable', '-N2', '--ntasks-per-node=2', '--exclude={exclude}', "
        f"'--comment={{marker}}', '{env_export}', '-o', '{out}/resumed.log', '--wrap', \"{resume_wrap}\"]\n"
    )
    db = str(tmp_path / "ctl.db")
    run = cli(slurm, "controller", "run", "--db", db, "--config", str(config), "--once")
    assert run.returncode == 0, run.stderr
    incident_id = incident_file.stem
    suspect = cli(slurm, "incidents", "show", incident_id, "--db", db).stdout
    node = next(line.split()[-1] for line in suspect.splitlines() if line.strip().startswith("nodes:"))
    assert node == where[FAULT_RANK]
    assert slurm.node_states()[node] == ("drained", "replicheck: suspected silent data corruption")
    assert "awaiting_approval" in suspect

    approve = cli(slurm, "incidents", "approve", incident_id, "--by", "alice", "--db", db)
    assert approve.returncode == 0, approve.stderr
    run = cli(slurm, "controller", "run", "--db", db, "--config", str(config), "--once")
    assert "approved -> replacing" in run.stdout, run.stdout + run.stderr
    assert slurm.node_states()[node] == ("fail", "Action:Replace")

    slurm.scontrol("update", f"nodename={node}", "state=resume")  # the cloud brings the node back
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "replicheck",
            "controller",
            "run",
            "--db",
            db,
            "--config",
            str(config),
            "--interval",
            "0.2",
            "--passes",
            "30",
        ],
        env={**slurm.env, "PYTHONPATH": str(SRC)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "replaced -> resumed" in stdout, stdout
    shown = json.loads(cli(slurm, "incidents", "show", incident_id, "--json", "--db", db).stdout)
    new_job = shown["record"]["resume"]["job_id"]
    resubmitted = wait_job(slurm, new_job)
    assert resubmitted["JobState"] == "COMPLETED" and resubmitted["Comment"].startswith("replicheck:"), (
        resubmitted,
        (out / "resumed.log").read_text(),
    )
    assert wait_accounted(slurm, new_job)["ExitCode"] == "0:0"
    resumed = [p.read_text().split() for p in out.glob("resumed-*")]
    finished = [p.read_text().split() for p in out.glob("done-*")]
    assert len(resumed) == 4 and {step for _, step in resumed} == {"20"}, resumed
    assert len(finished) == 4 and {step for _, step in finished} == {str(STOP - 1)}, finished
    assert "Action:Replace" not in slurm.node_states()[node][1]
    assert [a["kind"] for a in shown["actions"]].count("replace") == 1
    assert shown["record"]["approved_by"] == "alice"
