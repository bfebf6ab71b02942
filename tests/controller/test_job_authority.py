"""A job speaks only for itself (issue 27): incidents are checked against the job's allocation
as the backend reports it, budgets are per job and returned on dismissal, auto-approve needs a
job-scoped credential, and the checkpoint a job resumes from is the first copy's, under a root.

Each test reproduces an attack that succeeded on 8fadf7f."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from ctlkit import make_incident

from replicheck.controller import Controller, ControllerConfig, LocalBackend, State
from replicheck.controller.backends.hyperpod import HyperPodBackend, HyperPodConfig
from replicheck.controller.backends.kubernetes import KubernetesBackend, KubernetesConfig
from replicheck.controller.errors import ConfigError
from replicheck.controller.http.auth import Principal, Role, read_token_file
from replicheck.simulation.kubernetes import FakeApiServer, make_node

NODES = tuple(f"n{i}" for i in range(1, 10))


def _cluster(db: Path) -> LocalBackend:
    local = LocalBackend(db)
    for n in NODES:
        local.add_node(n)
    local.add_node("s1", spare=True)
    local.add_job("evil", ("n1",))  # the attacker's own job holds one node
    local.add_job("train-9", ("n9",))  # a genuine job on n9
    return local


def _ctl(db: Path, local: LocalBackend, **config: object) -> Controller:
    defaults: dict[str, object] = {"apply": True, "checkpoint_roots": ("/ck/{job_id}",)}
    return Controller(db, backend=local, config=ControllerConfig(**{**defaults, **config}))  # type: ignore[arg-type]


def test_forged_incidents_outside_the_allocation_are_refused_and_the_genuine_one_acts(tmp_path: Path) -> None:
    """Two incidents for job "evil" naming n1-n4 and n5-n8 (outside its allocation) are refused
    with the reason and cordon nothing; a genuine incident for n9 is cordoned meanwhile."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    with _ctl(db, local, max_cordons=8, max_cordons_per_incident=4, auto_approve=True) as ctl:
        forged = [
            make_incident(job="evil", step=1, nodes=("n1", "n2", "n3", "n4")),
            make_incident(job="evil", step=2, nodes=("n5", "n6", "n7", "n8")),
        ]
        for inc in forged:
            ctl.ingest(inc, vouched_by="job token evil (jobs=evil)")
        genuine = make_incident(job="train-9", step=3, nodes=("n9",))
        ctl.ingest(genuine)
        ctl.reconcile()
        for inc in forged:
            record = ctl.store.get_record(inc.id)
            assert record.state is State.REFUSED, record
            assert "not in job evil's allocation" in record.reason and "nothing cordoned" in record.reason
            assert any("refused" in a.what or "refused" in a.outcome for a in ctl.store.audit_rows(inc.id))
        assert local.op_counts().get("cordon") == 1
        assert [n.name for n in local.list_nodes() if n.state == "drained"] == ["n9"]
        assert ctl.store.get_record(genuine.id).state is State.AWAITING_APPROVAL


def test_unknown_job_is_refused(tmp_path: Path) -> None:
    """An incident for a job the backend does not know cordons nothing."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    with _ctl(db, local) as ctl:
        inc = make_incident(job="victim-train-7", nodes=("n9",))
        ctl.ingest(inc)
        ctl.reconcile()
        record = ctl.store.get_record(inc.id)
        assert record.state is State.REFUSED and "not known to the backend" in record.reason
        assert local.op_counts() == {}


def test_dismissal_returns_the_cordon_budget(tmp_path: Path) -> None:
    """With max_cordons=1, a second incident waits while the first holds the budget, and is
    cordoned once the first is dismissed (on 8fadf7f it kept waiting for the whole window)."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    local.add_job("job1", ("n2", "n3"))
    with _ctl(db, local, max_cordons=1) as ctl:
        first, second = make_incident(step=1, nodes=("n2",)), make_incident(step=2, nodes=("n3",))
        ctl.ingest(first)
        ctl.ingest(second)
        ctl.reconcile()
        assert ctl.store.get_record(second.id).state is State.DETECTED
        assert "cordon(s) in the window" in ctl.store.get_record(second.id).reason
        ctl.dismiss(first.id, by="alice")
        ctl.reconcile()
        assert ctl.store.get_record(first.id).state is State.UNCORDONED
        assert ctl.store.get_record(second.id).state is State.AWAITING_APPROVAL


def test_cordon_budget_per_job(tmp_path: Path) -> None:
    """One job's incidents stop at max_cordons_per_job; another job's incident still acts."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    local.add_job("job1", ("n2", "n3", "n4"))
    with _ctl(db, local, max_cordons_per_job=2, max_cordons=8) as ctl:
        a, b = make_incident(step=1, nodes=("n2", "n3")), make_incident(step=2, nodes=("n4",))
        other = make_incident(job="train-9", step=3, nodes=("n9",))
        for inc in (a, b, other):
            ctl.ingest(inc)
        ctl.reconcile()
        assert ctl.store.get_record(a.id).state is State.AWAITING_APPROVAL
        waiting = ctl.store.get_record(b.id)
        assert waiting.state is State.DETECTED and "per-job limit of 2" in waiting.reason
        assert ctl.store.get_record(other.id).state is State.AWAITING_APPROVAL


def test_auto_approve_needs_a_job_scoped_credential(tmp_path: Path) -> None:
    """Auto-approve does not act on an incident no job-scoped credential vouched for (a watched
    directory, an unscoped token); it does for one that a scoped token delivered."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    local.add_job("job1", ("n2", "n3"))
    with _ctl(db, local, auto_approve=True, max_replacements=5) as ctl:
        unvouched, vouched = make_incident(step=1, nodes=("n2",)), make_incident(step=2, nodes=("n3",))
        ctl.ingest(unvouched)
        ctl.ingest(vouched, vouched_by="job token job1 (jobs=job1)")
        ctl.reconcile()
        record = ctl.store.get_record(unvouched.id)
        assert record.state is State.AWAITING_APPROVAL and "auto-approve does not act" in record.reason
        assert ctl.store.get_record(vouched.id).state is not State.AWAITING_APPROVAL
        assert local.op_counts().get("replace") == 1


def test_later_copy_cannot_fill_in_the_checkpoint(tmp_path: Path) -> None:
    """A later copy of an incident adding a recommended checkpoint changes nothing: the job is
    resumed without it (as the first copy said), and the stored incident is the first copy."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    local.add_job("job1", ("n2",))
    with _ctl(db, local, checkpoint_roots=("/",)) as ctl:
        first = make_incident(nodes=("n2",), checkpoint_step=None)
        ctl.ingest(first)
        later = dataclasses.replace(first, recommended_checkpoint={"step": 1, "path": "/attacker/ckpt"})
        assert ctl.ingest(later).new is False
        assert ctl.store.get_record(first.id).checkpoint is None
        assert ctl.store.get_incident(first.id).incident.recommended_checkpoint is None
        ctl.reconcile()
        ctl.approve(first.id, by="alice")
        ctl.reconcile()
        (req,) = local.resume_requests()
        assert req.job_id == "job1" and req.checkpoint is None


def test_checkpoint_outside_the_root_is_refused(tmp_path: Path) -> None:
    """A checkpoint path outside the job's configured root (or climbing out with ..) is not
    resumed from; the incident fails saying so and no resume is issued."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    local.add_job("job1", ("n2",))
    with _ctl(db, local) as ctl:
        inc = dataclasses.replace(
            make_incident(nodes=("n2",)), recommended_checkpoint={"step": 3, "path": "/ck/job1/../evil/3"}
        )
        ctl.ingest(inc)
        ctl.reconcile()
        ctl.approve(inc.id, by="alice")
        ctl.reconcile()
        record = ctl.store.get_record(inc.id)
        assert record.state is State.FAILED and "not under a configured checkpoint root" in record.reason
        assert local.resume_requests() == []


def test_checkpoint_under_the_jobs_root_is_used(tmp_path: Path) -> None:
    """A checkpoint under ``/ck/{job_id}`` resumes the incident's own job from it."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    local.add_job("job1", ("n2",))
    with _ctl(db, local) as ctl:
        inc = dataclasses.replace(
            make_incident(nodes=("n2",)), recommended_checkpoint={"step": 3, "path": "/ck/job1/step-3"}
        )
        ctl.ingest(inc)
        ctl.reconcile()
        ctl.approve(inc.id, by="alice")
        ctl.reconcile()
        (req,) = local.resume_requests()
        assert (req.job_id, req.checkpoint) == ("job1", {"step": 3, "path": "/ck/job1/step-3"})


def test_ended_job_still_verifies(tmp_path: Path) -> None:
    """A job that just ended (exit 87) is still known with its allocation."""
    db = tmp_path / "c.db"
    local = _cluster(db)
    local.end_job("train-9")
    with _ctl(db, local) as ctl:
        inc = make_incident(job="train-9", nodes=("n9",))
        ctl.ingest(inc)
        ctl.reconcile()
        assert ctl.store.get_record(inc.id).state is State.AWAITING_APPROVAL


# --- Kubernetes: against the request-checking fake API server (no real API server can run here)


def test_kubernetes_forged_nodes_refused_and_finished_pods_count(tmp_path: Path) -> None:
    """Kubernetes, against replicheck.simulation.kubernetes (a request-checking fake of the API
    server): a Job's allocation is its pods' nodes, finished pods included; an incident naming
    nodes outside it is refused and no node is patched."""
    with FakeApiServer() as server:
        for name in ("n1", "n2", "n3", "n4"):
            server.add_node(make_node(name, group="workers"))
        server.add_pod("ml", "evil-0", "n1", labels={"job-name": "evil"})
        server.add_pod("ml", "train-0", "n3", labels={"job-name": "train"}, phase="Failed")
        backend = KubernetesBackend(KubernetesConfig(host=server.url, request_timeout_s=5))
        assert backend.allocation("ml/evil") == {"n1", "evil-0"}
        assert backend.allocation("ml/train") == {"n3", "train-0"}
        assert backend.allocation("ml/nothing") is None
        db = tmp_path / "c.db"
        with Controller(db, backend=backend, config=ControllerConfig(apply=True)) as ctl:
            forged = make_incident(job="ml/evil", step=1, nodes=("n2", "n4"))
            genuine = make_incident(job="ml/train", step=2, nodes=("n3",))
            ctl.ingest(forged)
            ctl.ingest(genuine)
            ctl.reconcile()
            assert ctl.store.get_record(forged.id).state is State.REFUSED
            assert ctl.store.get_record(genuine.id).state is State.AWAITING_APPROVAL
        patched = {r.path for r in server.requests if r.method == "PATCH"}
        assert patched == {"/api/v1/nodes/n3"}


def test_hyperpod_without_orchestrator_cannot_verify() -> None:
    """HyperPod knows no jobs: without an orchestrator no job can be verified (None)."""
    backend = HyperPodBackend(HyperPodConfig(cluster_name="c"), client=object())
    assert backend.allocation("123") is None


# --- job-scoped tokens -----------------------------------------------------------------------


def test_job_token_scoped_to_a_job_speaks_only_for_it(tmp_path: Path) -> None:
    """A token line ``NAME TOKEN jobs=A`` speaks for job A only; ``ns/*`` for that namespace
    (not across '/'); an unscoped line speaks for every job but vouches for none."""
    path = tmp_path / "job.tokens"
    path.write_text(
        "a-job tok-aaaaaaaaaaaaaaaaaaaa jobs=1234\n"
        "team tok-bbbbbbbbbbbbbbbbbbbb jobs=ml/*,exp-*\n"
        "legacy tok-cccccccccccccccccccc\n"
    )
    path.chmod(0o600)
    a, team, legacy = (Principal(t.role, t.name, t.jobs) for t in read_token_file(path, Role.JOB))
    assert a.speaks_for("1234") and not a.speaks_for("1235") and not a.speaks_for("12345")
    assert team.speaks_for("ml/train") and team.speaks_for("exp-7") and not team.speaks_for("ml/a/b")
    assert not team.speaks_for("other/train")
    assert legacy.speaks_for("anything") and legacy.vouches() == ""
    assert a.vouches() == "job token a-job (jobs=1234)"
    bad = tmp_path / "bad.tokens"
    bad.write_text("x tok-dddddddddddddddddddd jobs=a;b\n")
    with pytest.raises(ConfigError, match="job pattern"):
        read_token_file(bad, Role.JOB)
    with pytest.raises(ConfigError, match="job tokens only"):
        bad.write_text("x tok-dddddddddddddddddddd jobs=a\n")
        read_token_file(bad, Role.OPERATOR)
