"""The slurm backend against a real slurmctld/slurmd cluster started by the tests."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from slurmkit import SlurmCluster

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.backends.base import ResumeRequest
from replicheck.controller.backends.commands import CommandResult, CommandRunner
from replicheck.controller.backends.slurm import SlurmBackend, SlurmConfig
from replicheck.controller.errors import NotYet, PermanentBackendError
from replicheck.incident import Incident, NodeIdentity, Suspect

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]
REASON = "replicheck: suspected silent data corruption"


class CountingRunner(CommandRunner):
    """Counts the scontrol update/requeue/create/delete commands actually issued (what changes the cluster);
    the free-text reason and the Extra marker are left out of the count's key."""

    def __init__(self, conf: Path) -> None:
        super().__init__({"SLURM_CONF": str(conf)}, 30.0)
        self.changes: Counter[str] = Counter()

    def run(
        self, argv: Sequence[str], *, check: bool = True, timeout_s: float | None = None
    ) -> CommandResult:
        if Path(argv[0]).name == "scontrol" and argv[1] in (
            "update",
            "requeuehold",
            "release",
            "create",
            "delete",
        ):
            self.changes[" ".join(a for a in argv[1:] if not a.startswith(("reason=", "extra=")))] += 1
        return super().run(argv, check=check, timeout_s=timeout_s)


def backend(slurm: SlurmCluster, **kw: Any) -> tuple[SlurmBackend, CountingRunner]:
    runner = CountingRunner(slurm.conf)
    return SlurmBackend(SlurmConfig(slurm_conf=str(slurm.conf), **kw), runner=runner), runner


def incident(node: str, job: str = "42", classification: str = "persistent") -> Incident:
    return Incident(
        id=f"{job}-s10-replay",
        job_id=job,
        step=10,
        check="replay",
        suspect_ranks=(1,),
        suspect_nodes=(node,),
        classification=classification,  # type: ignore[arg-type]
        suspects=(Suspect(1, NodeIdentity(name=node, slurm_node=node)),),
        recommended_checkpoint={"step": 5, "path": "/ck/5"},
        world_size=2,
    )


def test_cordon_drains_with_reason_once(slurm: SlurmCluster) -> None:
    """cordon drains the node with our reason; a repeated call issues no second scontrol update."""
    b, runner = backend(slurm)
    b.cordon("node2", REASON, "k1")
    b.cordon("node2", REASON, "k1")
    assert slurm.node_states()["node2"] == ("drained", REASON)
    assert runner.changes == Counter({"update nodename=node2 state=drain": 1})


def test_uncordon_resumes_only_our_drain(slurm: SlurmCluster) -> None:
    """uncordon resumes a node we drained and leaves a node drained for another reason."""
    slurm.scontrol("update", "nodename=node3", "state=drain", "reason=bad DIMM (ops)")
    b, _ = backend(slurm)
    b.cordon("node2", REASON, "k1")
    b.uncordon("node2", "replicheck", "k2")
    b.uncordon("node3", "replicheck", "k3")
    states = slurm.wait_states({"node2": "idle"})
    assert states["node3"] == ("drained", "bad DIMM (ops)")


def test_replace_sets_fail_with_exact_reason_once(slurm: SlurmCluster) -> None:
    """replace sets state fail with reason exactly Action:Replace, and repeating it changes nothing."""
    b, runner = backend(slurm)
    b.replace("node4", "k")
    b.replace("node4", "k")
    assert slurm.node_states()["node4"] == ("fail", "Action:Replace")
    assert runner.changes == Counter({"update nodename=node4 state=fail": 1})


def test_await_return_polls_until_node_is_back(slurm: SlurmCluster) -> None:
    """await_return raises NotYet while the node is failed and reports it back once it is idle."""
    b, _ = backend(slurm)
    b.replace("node4", "k")
    with pytest.raises(NotYet):
        b.await_return("node4", "k")
    slurm.scontrol("update", "nodename=node4", "state=resume")
    deadline = time.monotonic() + 20
    while True:
        try:
            assert b.await_return("node4", "k")["back"] is True
            break
        except NotYet:
            assert time.monotonic() < deadline
            time.sleep(0.1)


def test_invalid_node_names_never_reach_scontrol(slurm: SlurmCluster) -> None:
    """Hostlist expressions and option-like names are refused before any command runs."""
    b, runner = backend(slurm)
    for bad in ("node[1-4]", "node1,node2", "-h", "node1 state=idle", ""):
        with pytest.raises(PermanentBackendError, match="invalid node name"):
            b.cordon(bad, REASON, "k")
    assert runner.changes == Counter()


def test_unknown_node_is_permanent(slurm: SlurmCluster) -> None:
    """A node Slurm does not know is a permanent error naming it."""
    b, _ = backend(slurm)
    with pytest.raises(PermanentBackendError, match="node9"):
        b.cordon("node9", REASON, "k")


def test_requeue_resume_excludes_node_and_is_idempotent(slurm: SlurmCluster, tmp_path: Path) -> None:
    """resume (requeue) puts a finished job back with the node excluded; a repeat does not requeue twice."""
    out = slurm.run("sbatch", "--parsable", "-N1", "-o", "/dev/null", "--wrap", "exit 87").stdout.strip()
    job = out.split(";")[0]
    deadline = time.monotonic() + 30
    while "JobState=FAILED" not in slurm.scontrol("show", "job", job).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.2)
    b, runner = backend(slurm)
    allocation = b.allocation(job)  # what the controller's verify action records
    assert allocation  # the ended job's node, from slurmctld (MinJobAge) or accounting
    req = ResumeRequest("inc", job, {"step": 5, "path": "/ck"}, ("node2",), allocation=tuple(allocation))
    b.resume(req, "inc:resume:" + job)
    b.resume(req, "inc:resume:" + job)
    info = slurm.scontrol("--oneliner", "show", "job", job).stdout
    assert "ExcNodeList=node2" in info and "Restarts=1" in info
    assert runner.changes[f"requeuehold {job}"] == 1
    slurm.scontrol("cancel", job, check=False)


def test_controller_drives_slurm_to_awaiting_approval(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The controller with the slurm backend drains the suspect and waits for approval."""
    job = slurm.ended_job("node3")  # the guarded job on node3 exited 87
    b, _ = backend(slurm)
    with Controller(tmp_path / "c.db", backend=b, config=ControllerConfig(apply=True)) as ctl:
        ctl.ingest(incident("node3", job=job))
        assert [t.to_state for t in ctl.reconcile()] == [State.CORDONED, State.AWAITING_APPROVAL]
    assert slurm.node_states()["node3"] == ("drained", REASON)


def test_last_schedulable_node_is_not_drained(slurm: SlurmCluster, tmp_path: Path) -> None:
    """With the other nodes of the partition drained, the suspect stays schedulable and the record says why."""
    job = slurm.ended_job("node3")
    for n in ("node1", "node2", "node4"):
        slurm.scontrol("update", f"nodename={n}", "state=drain", "reason=maintenance")
    b, runner = backend(slurm)
    with Controller(tmp_path / "c.db", backend=b, config=ControllerConfig(apply=True)) as ctl:
        ctl.ingest(incident("node3", job=job))
        ctl.reconcile()
        record = ctl.store.get_record(incident("node3", job=job).id)
    assert record.cordon_skipped == (("node3", "last schedulable node of partition debug"),)
    assert slurm.node_states()["node3"][0] == "idle"
    assert runner.changes == Counter()


def test_triage_compares_selftest_with_reference_node(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Triage runs the configured self-test command for the suspect and a healthy node and records the comparison."""
    fake = tmp_path / "selftest.sh"
    fake.write_text(
        '#!/bin/sh\nif [ "$1" = node2 ]; then f=bad0; else f=600d; fi\n'
        'echo "{\\"fingerprint\\": \\"$f\\", \\"node\\": \\"$1\\"}"\n'
    )
    fake.chmod(0o755)
    job = slurm.ended_job("node2")
    b, _ = backend(slurm, triage="command", selftest_command=(str(fake), "{node}"))
    with Controller(tmp_path / "c.db", backend=b, config=ControllerConfig(apply=True)) as ctl:
        ctl.ingest(incident("node2", job=job, classification="transient"))
        ctl.reconcile()
        record = ctl.store.get_record(incident("node2", job=job).id)
    assert record.state is State.AWAITING_APPROVAL
    (result,) = record.triage
    assert result.node == "node2" and not result.passed and "bad0 differs from node1's 600d" in result.detail


def test_unreachable_scheduler_retried_then_failed(private_slurm: SlurmCluster, tmp_path: Path) -> None:
    """With slurmctld down, a verified incident's cordon is retried with backoff, then the incident
    fails with the scontrol error; a new incident, whose allocation cannot be read, is retried and
    then refused (nothing cordoned, never acted on unverified)."""
    job = private_slurm.ended_job("node1")
    b = SlurmBackend(SlurmConfig(slurm_conf=str(private_slurm.conf), command_timeout_s=20))
    config = ControllerConfig(apply=True, retry_max_attempts=2, retry_base_delay_s=60)
    now = [dt.datetime.now(dt.UTC)]
    # Dry-run first: the read-only allocation check runs while slurmctld is up, the cordon waits.
    with Controller(
        tmp_path / "c.db", backend=b, config=config.with_overrides(apply=False), clock=lambda: now[0]
    ) as ctl:
        ctl.ingest(incident("node1", job=job))
        ctl.reconcile()
        assert ctl.store.get_record(incident("node1", job=job).id).allocation == ("node1",)
    private_slurm.stop_controller()
    now[0] += dt.timedelta(seconds=config.poll_interval_s + 1)
    with Controller(tmp_path / "c.db", backend=b, config=config, clock=lambda: now[0]) as ctl:
        ctl.ingest(incident("node1", job="7"))
        ctl.reconcile()
        assert ctl.store.get_record(incident("node1", job=job).id).state is State.DETECTED
        assert ctl.store.get_record(incident("node1", job="7").id).state is State.DETECTED
        now[0] += dt.timedelta(seconds=61)
        ctl.reconcile()
        record = ctl.store.get_record(incident("node1", job=job).id)
        refused = ctl.store.get_record(incident("node1", job="7").id)
    assert record.state is State.FAILED
    assert "gave up after 2 attempts" in record.reason and "sinfo" in record.reason
    assert refused.state is State.REFUSED and refused.cordoned == ()
    assert "could not be read" in refused.reason and "squeue" in refused.reason
