"""Values reaching Slurm commands: template values are checked against their grammar before
argv is built, and a job name cannot fake the requeue marker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from slurmkit import SlurmCluster
from test_slurm_backend import backend

from replicheck.controller.backends.base import ResumeRequest
from replicheck.controller.errors import PermanentBackendError

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


@pytest.mark.parametrize(
    ("job", "checkpoint", "message"),
    [
        ("--wrap=reboot", {"step": 5, "path": "/ck"}, "job id"),
        ("42", {"step": 5, "path": "/ck\n--wrap=id"}, "checkpoint path"),
        ("42", {"step": 5, "path": "-o/etc/passwd"}, "checkpoint path"),
        ("42", {"step": 5, "path": "/ck\x00x"}, "checkpoint path"),
        ("42", {"step": "5; id", "path": "/ck"}, "checkpoint step"),
        ("\u0664\u0662", {"step": 5, "path": "/ck"}, "job id"),
    ],
)
def test_resubmit_template_values_are_checked(
    slurm: SlurmCluster, tmp_path: Path, job: str, checkpoint: dict[str, object], message: str
) -> None:
    """An option-like job id, a newline/NUL/option in the checkpoint path or a non-integer step never reaches sbatch."""
    tally = tmp_path / "argv.txt"
    script = tmp_path / "submit.sh"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tally}\necho 1\n')
    script.chmod(0o755)
    b, _ = backend(
        slurm,
        resume_mode="resubmit",
        resubmit_command=(str(script), "--comment={marker}", "{job_id}", "{checkpoint}", "{step}"),
    )
    # Verified on every node of the cluster, so the value checks, not the allocation, refuse it.
    verified = ResumeRequest(
        "inc-s1-replay", job, checkpoint, (), allocation=("node1", "node2", "node3", "node4")
    )
    with pytest.raises(PermanentBackendError, match=message):
        b.resume(verified, "inc-s1-replay:resume:42")
    assert not tally.exists()


def test_job_name_cannot_fake_the_requeue_marker(slurm: SlurmCluster) -> None:
    """A finished job whose name contains Comment=<marker> is still requeued (once)."""
    key = "inc:resume:job"
    name = f"evil Comment=replicheck:{key}"
    job = slurm.run(
        "sbatch", "--parsable", "-N1", "-o", "/dev/null", "-J", name, "--wrap", "exit 3"
    ).stdout.strip()
    deadline = time.monotonic() + 30
    while "JobState=FAILED" not in slurm.scontrol("show", "job", job).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    b, runner = backend(slurm)
    verified = ResumeRequest("inc", job, None, (), allocation=tuple(b.allocation(job) or ()))
    b.resume(verified, key)
    b.resume(verified, key)
    assert runner.changes[f"requeuehold {job}"] == 1
    slurm.run("scancel", job, check=False)


@pytest.mark.parametrize(
    ("group", "exclude", "message"),
    [
        ("-x", ("node3",), "replica group"),
        ("rg1\n--wrap=id", ("node3",), "replica group"),
        ("rg1", ("node3,--wrap=id",), "node"),
    ],
)
def test_join_template_values_are_checked(
    slurm: SlurmCluster, tmp_path: Path, group: str, exclude: tuple[str, ...], message: str
) -> None:
    """An option-like or multi-line replica group id, or a node list smuggling an option, never
    reaches the join command."""
    from replicheck.controller.backends.base import JoinRequest

    tally = tmp_path / "argv.txt"
    script = tmp_path / "submit.sh"
    script.write_text(f'#!/bin/sh\necho "$@" >> {tally}\necho 1\n')
    script.chmod(0o755)
    b, _ = backend(
        slurm, join_command=(str(script), "--comment={marker}", "{replica_group}", "--exclude={exclude}")
    )
    request = JoinRequest(
        "inc-s1-replay", "42", group, (), exclude, allocation=("node1", "node2", "node3", "node4")
    )
    with pytest.raises(PermanentBackendError, match=message):
        b.join(request, "inc-s1-replay:join_replacement:42")
    assert not tally.exists()


def test_a_join_command_without_its_marker_is_refused() -> None:
    """join_command without {marker} is a configuration error: a restarted controller could not
    tell that it already started the replacement group."""
    from replicheck.controller.backends.slurm import SlurmConfig
    from replicheck.controller.errors import ConfigError

    with pytest.raises(ConfigError, match=r"join_command must pass \{marker\}"):
        SlurmConfig(join_command=("sbatch", "group.sbatch"))
