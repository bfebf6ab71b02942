"""Triage through Slurm on the real test cluster: the self-test runs as a Slurm job on the drained
suspect (a maintenance reservation, the node resumed inside it), the node ends drained with its
reason, the reservation is gone, and every step happens once even when the controller is killed
in the middle."""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
from slurmkit import SlurmCluster
from test_slurm_backend import REASON, backend, incident
from test_slurm_exactly_once import Run

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.backends.commands import CommandResult
from replicheck.controller.backends.slurm import SlurmBackend, SlurmConfig
from replicheck.controller.backends.slurm_triage import reservation_name
from replicheck.controller.errors import ConfigError, PermanentBackendError, TransientBackendError

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(180)]
SELFTEST = (sys.executable, "-m", "replicheck", "selftest", "--json", "--steps", "1")
KEY = "t1-s10-replay:selftest:node2"


def node_wrapper(tmp_path: Path, on_node2: str) -> tuple[str, ...]:
    """A triage command that runs the real self-test, with ``on_node2`` added on node2 only."""
    script = tmp_path / "selftest.sh"
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$SLURMD_NODENAME" = node2 ]; then set -- {on_node2} "$@"; fi\n'
        f'exec {" ".join(SELFTEST)} "$@"\n'
    )
    script.chmod(0o755)
    return (str(script),)


def reservations(slurm: SlurmCluster) -> str:
    return slurm.scontrol("show", "reservation").stdout.strip()


def accounted_jobs(slurm: SlurmCluster, name: str) -> list[list[str]]:
    """sacct rows (NodeList, Reservation, ExitCode) of the jobs called ``name``, once recorded."""
    rows: list[list[str]] = []
    for _ in range(100):
        out = slurm.run(
            "sacct",
            "-X",
            "--noheader",
            "--parsable2",
            f"--name={name}",
            "-o",
            "NodeList,Reservation,ExitCode,State",
        ).stdout
        rows = [line.split("|") for line in out.splitlines()]
        if rows and all(r[3] not in ("PENDING", "RUNNING") for r in rows):
            return rows
        time.sleep(0.2)
    return rows


def test_healthy_node_passes_through_a_slurm_job_and_ends_drained(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    """A transient incident's triage runs the self-test as a Slurm job on the drained node and leaves it drained with its reason."""
    b, runner = backend(slurm, triage_command=SELFTEST)
    job = slurm.ended_job("node2")  # the incident's job ran on node2 (its allocation)
    inc = incident("node2", job=job, classification="transient")
    key = f"{job}-s10-replay:selftest:node2"
    with Controller(tmp_path / "c.db", backend=b, config=ControllerConfig(apply=True)) as ctl:
        ctl.ingest(inc)
        ctl.reconcile()
        record = ctl.store.get_record(inc.id)
    assert record.state is State.AWAITING_APPROVAL, record.reason
    (result,) = record.triage
    assert result.node == "node2" and result.passed and "exit 0" in result.detail, result.detail
    assert slurm.node_states()["node2"] == ("drained", REASON)
    assert reservations(slurm) == "No reservations in the system"
    resv = reservation_name("replicheck:" + key)
    create = (
        f"create reservation ReservationName={resv} Nodes=node2 StartTime=now Duration=infinite "
        "Users=root Flags=MAINT,IGNORE_JOBS"
    )
    assert runner.changes == Counter(
        {
            "update nodename=node2 state=drain": 2,  # the cordon, then the drain after the test
            "update nodename=node2 state=resume": 1,
            "update nodename=node2": 2,  # the triage notes in Extra: started, finished
            create: 1,
            f"delete reservation={resv}": 1,
        }
    ), runner.changes
    # Slurm's own record: the test ran on node2 inside the reservation; the reference elsewhere.
    assert accounted_jobs(slurm, f"{resv}-test") == [["node2", resv, "0:0", "COMPLETED"]]
    ((ref_node, ref_resv, ref_exit, _),) = accounted_jobs(slurm, f"{resv}-ref")
    assert ref_node != "node2" and ref_resv == "" and ref_exit == "0:0"


def test_repeated_call_answers_from_the_record_without_side_effects(slurm: SlurmCluster) -> None:
    """A second selftest call with the same key (its result was lost) returns the recorded result and changes nothing."""
    slurm.scontrol("update", "nodename=node2", "state=drain", f"reason={REASON}")
    b, runner = backend(slurm, triage_command=SELFTEST)
    first = b.selftest("node2", KEY)
    changes = Counter(runner.changes)
    second = b.selftest("node2", KEY)
    assert first == second and first["passed"] is True
    assert runner.changes == changes
    assert slurm.node_states()["node2"] == ("drained", REASON)


def test_mismatch_on_the_node_is_a_failed_selftest(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A node whose self-test computes a different fingerprint (exit 1) fails triage; it ends drained."""
    b, _ = backend(slurm, triage_command=node_wrapper(tmp_path, "--steps 2"))
    slurm.scontrol("update", "nodename=node2", "state=drain", f"reason={REASON}")
    result = b.selftest("node2", KEY)
    assert result["passed"] is False and result["exit_code"] == 1
    assert result["fingerprint"] != result["reference_fingerprint"]
    assert slurm.node_states()["node2"] == ("drained", REASON)
    assert reservations(slurm) == "No reservations in the system"


def test_selftest_that_cannot_run_is_no_verdict(slurm: SlurmCluster, tmp_path: Path) -> None:
    """A self-test that could not run on the node (exit 3) is an error, not a failed node; the node ends drained."""
    b, _ = backend(slurm, triage_command=node_wrapper(tmp_path, "--device cuda:99"))
    slurm.scontrol("update", "nodename=node2", "state=drain", f"reason={REASON}")
    with pytest.raises(PermanentBackendError, match=r"could not run \(exit 3\).*cuda:99"):
        b.selftest("node2", KEY)
    assert slurm.node_states()["node2"] == ("drained", REASON)
    assert reservations(slurm) == "No reservations in the system"
    with pytest.raises(PermanentBackendError, match="could not run"):
        b.selftest("node2", KEY)  # answered from the record, nothing run again


@pytest.mark.parametrize("needle", ["--reservation=", "state=drain#2"])
def test_killed_between_resume_and_redrain_converges(
    slurm: SlurmCluster, tmp_path: Path, needle: str
) -> None:
    """Killed after the node was resumed into the reservation (before the test, or before the re-drain): no
    ordinary job starts there meanwhile, and the restarted controller finishes with each change made once."""
    run = Run(slurm, tmp_path, "triage")
    run.drive(f"cmd:{needle}")
    assert run.commands("state=resume") == 1
    assert "No reservations" not in reservations(slurm)
    assert "drain" not in slurm.node_states()["node3"][0]
    blocked = slurm.run(
        "sbatch", "--parsable", "-w", "node3", "-o", "/dev/null", "--wrap", "true"
    ).stdout.strip()
    try:
        time.sleep(2)
        state = slurm.run("squeue", "--noheader", "-j", blocked, "--format=%T").stdout.strip()
        assert state == "PENDING", state
        summary = run.drive()
    finally:
        slurm.run("scancel", blocked, check=False)
    assert summary["state"] == "awaiting_approval", summary
    assert [t["passed"] for t in summary["triage"]] == [True]
    assert slurm.node_states()["node3"] == ("drained", REASON)
    assert reservations(slurm) == "No reservations in the system"
    assert run.commands("create reservation") == 1 and run.commands("delete reservation") == 1
    assert run.commands("state=resume") == 1
    assert run.commands("state=drain") == 2  # the cordon and the one drain after the test


class _Killed(BaseException):
    """Stands for a SIGKILL inside the call: nothing after it runs, no clean-up either."""


def _interrupted_triage(slurm: SlurmCluster) -> tuple[SlurmBackend, Callable[[], None]]:
    """node2 drained, then a triage of it cut off (as by SIGKILL) right before its srun; the
    backend, and what makes its srun work again."""
    slurm.scontrol("update", "nodename=node2", "state=drain", f"reason={REASON}")
    b, runner = backend(slurm, triage_command=SELFTEST)
    real_run = runner.run

    def run(argv: Sequence[str], **kw: Any) -> CommandResult:
        if any(a.startswith("--reservation=") for a in argv):
            raise _Killed
        return real_run(argv, **kw)

    runner.run = run  # type: ignore[method-assign]
    with pytest.raises(_Killed):
        b.selftest("node2", KEY)

    def restore() -> None:
        runner.run = real_run  # type: ignore[method-assign]

    return b, restore


def test_dismissal_after_an_interrupted_triage_releases_the_node(slurm: SlurmCluster) -> None:
    """Uncordoning a node whose triage was cut off after the resume deletes its reservation and clears the note."""
    b, restore = _interrupted_triage(slurm)
    assert "No reservations" not in reservations(slurm) and "drain" not in slurm.node_states()["node2"][0]
    b.uncordon("node2", "replicheck", "t1-s10-replay:uncordon:node2")
    assert reservations(slurm) == "No reservations in the system"
    assert slurm.wait_states({"node2": "idle"})["node2"][0] == "idle"
    assert b.node_extra("node2") == ""


def test_second_triage_waits_for_an_interrupted_one_on_the_same_node(slurm: SlurmCluster) -> None:
    """Another incident's triage of a node still in an interrupted triage's reservation is a temporary error, not an overwrite."""
    b, restore = _interrupted_triage(slurm)
    note = b.node_extra("node2")
    other, _ = backend(slurm, triage_command=SELFTEST)
    with pytest.raises(TransientBackendError, match="another self-test"):
        other.selftest("node2", "t2-s10-replay:selftest:node2")
    assert b.node_extra("node2") == note
    restore()
    assert b.selftest("node2", KEY)["passed"] is True  # the first one finishes on its next call
    assert slurm.node_states()["node2"] == ("drained", REASON)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"triage": "ssh"}, "triage must be slurm or command"),
        ({"triage_command": ()}, "needs a triage_command"),
        ({"triage_timeout_s": 0}, "triage_timeout_s must be > 0"),
        ({"triage_user": "alice,bob"}, "triage_user must be one user name"),
    ],
)
def test_bad_triage_settings_are_refused(options: dict[str, Any], message: str) -> None:
    """Invalid triage settings are a ConfigError naming the setting."""
    with pytest.raises(ConfigError, match=message):
        SlurmConfig(**options)


def test_leftover_selftest_job_is_cancelled_before_the_test_runs_again(slurm: SlurmCluster) -> None:
    """A self-test job of the same action still queued (its srun died with a killed controller) is cancelled, not left to run."""
    slurm.scontrol("update", "nodename=node2", "state=drain", f"reason={REASON}")
    name = reservation_name("replicheck:" + KEY) + "-test"
    left = slurm.run(
        "sbatch", "--parsable", f"--job-name={name}", "-w", "node2", "-o", "/dev/null", "--wrap", "sleep 600"
    ).stdout.strip()
    b, _ = backend(slurm, triage_command=SELFTEST)
    try:
        assert b.selftest("node2", KEY)["passed"] is True
        state = slurm.run("squeue", "--noheader", "--states=all", "-j", left, "--format=%T").stdout.strip()
        assert state == "CANCELLED", state
    finally:
        slurm.run("scancel", left, check=False)
    assert slurm.node_states()["node2"] == ("drained", REASON)
