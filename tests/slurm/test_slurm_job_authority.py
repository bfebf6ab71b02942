"""A job speaks only for itself, on the real test cluster (issue 27): the nodes an incident names
are checked against the job's allocation as slurmctld (or its accounting) reports it, and the
backend restarts only a job that was verified. Each test failed on 8fadf7f, which drained any
named node and requeued any job id."""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest
from slurmkit import SlurmCluster
from test_slurm_backend import REASON, backend, incident

from replicheck.controller import Controller, ControllerConfig, State
from replicheck.controller.backends.base import ResumeRequest
from replicheck.controller.errors import PermanentBackendError
from replicheck.incident import Incident, NodeIdentity, Suspect

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(120)]


def _naming(job: str, *nodes: str, step: int = 10) -> Incident:
    """An incident of ``job`` naming ``nodes`` (its own or, when forged, others'), one rank each."""
    ranks = tuple(range(1, len(nodes) + 1))
    return dataclasses.replace(
        incident(nodes[0], job=job),
        id=f"{job}-s{step}-replay",
        step=step,
        suspect_ranks=ranks,
        suspect_nodes=nodes,
        suspects=tuple(Suspect(r, NodeIdentity(name=n, slurm_node=n)) for r, n in zip(ranks, nodes)),
        world_size=8,
    )


def test_forged_nodes_refused_own_node_accepted(slurm: SlurmCluster, tmp_path: Path) -> None:
    """Incidents for a job that just exited 87 on node1 and for a job running on node2, naming
    nodes outside their allocations, are refused with the reason and drain nothing; one for a job
    id Slurm cannot know is refused too; the ended job's incident naming node1 drains node1 only,
    and the running job's incident naming node2 drains node2."""
    ended = slurm.ended_job("node1")
    running = slurm.running_job("node2")
    try:
        b, runner = backend(slurm)
        forged = [
            _naming(ended, "node2", "node3", step=1),
            _naming(running, "node3", "node4", step=2),
            _naming("train-7", "node1", step=3),  # not a Slurm job id: Slurm cannot vouch for it
        ]
        genuine = [_naming(ended, "node1", step=4), _naming(running, "node2", step=5)]
        config = ControllerConfig(apply=True, max_cordons=8)
        with Controller(tmp_path / "c.db", backend=b, config=config) as ctl:
            for inc in forged + genuine:
                ctl.ingest(inc)
            ctl.reconcile()
            records = {inc.id: ctl.store.get_record(inc.id) for inc in forged + genuine}
            audit = {inc.id: [a.what for a in ctl.store.audit_rows(inc.id)] for inc in forged}
        for inc in forged:
            record = records[inc.id]
            assert record.state is State.REFUSED and record.cordoned == (), record
            assert "nothing cordoned" in record.reason
            assert any("refused" in what for what in audit[inc.id]), audit[inc.id]
        assert f"node(s) node2, node3 not in job {ended}'s allocation" in records[forged[0].id].reason
        assert "(node1)" in records[forged[0].id].reason
        assert f"node(s) node3, node4 not in job {running}'s allocation" in records[forged[1].id].reason
        assert "job train-7 is not known" in records[forged[2].id].reason
        assert records[genuine[0].id].state is State.AWAITING_APPROVAL
        assert records[genuine[0].id].allocation == ("node1",)
        assert records[genuine[1].id].cordoned == ("node2",)
        assert runner.changes == Counter(
            {"update nodename=node1 state=drain": 1, "update nodename=node2 state=drain": 1}
        ), runner.changes
        states = slurm.node_states()
        assert states["node1"] == ("drained", REASON)
        assert states["node2"][0] in ("draining", "drained")  # its job still runs
        assert states["node3"][0] == "idle" and states["node4"][0] == "idle"
    finally:
        slurm.run("scancel", running, check=False)


def test_resume_only_a_verified_job(slurm: SlurmCluster) -> None:
    """The backend requeues no job that no allocation check vouched for, nor one whose id now
    names a job on none of the verified nodes; the verified job is requeued once."""
    job = slurm.ended_job("node1")
    b, runner = backend(slurm)
    never = ResumeRequest("inc", job, None, ())
    with pytest.raises(PermanentBackendError, match="never verified"):
        b.resume(never, "inc:resume:" + job)
    elsewhere = ResumeRequest("inc", job, None, (), allocation=("node4",))
    with pytest.raises(PermanentBackendError, match="not the incident's job"):
        b.resume(elsewhere, "inc:resume:" + job)
    assert runner.changes == Counter()
    verified = ResumeRequest("inc", job, None, (), allocation=tuple(sorted(b.allocation(job) or ())))
    assert verified.allocation == ("node1",)
    b.resume(verified, "inc:resume:" + job)
    assert runner.changes[f"requeuehold {job}"] == 1
    slurm.run("scancel", job, check=False)


def test_allocation_of_a_multi_node_job_and_an_unknown_id(slurm: SlurmCluster) -> None:
    """A two-node job's allocation is both node names (Slurm's host list expanded); an id Slurm
    never issued, and a non-numeric id, have none."""
    job = slurm.ended_job("node3", "node4")
    b, _ = backend(slurm)
    assert b.allocation(job) == frozenset({"node3", "node4"})
    assert b.allocation("999999") is None
    assert b.allocation("train-7") is None
