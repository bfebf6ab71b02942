"""The controller's "replacement joins live" path (issue 28): an incident whose job went on
without the suspect's replica group (``continuation``) ends with one replacement group started
on the replacement node, never with the job resumed. Pure transitions, the incident contract,
and the executor with the local backend starting a real process, counted where it lands."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from ctlkit import Clock, Counting, TransientBackendError, make_incident

from replicheck.controller import Controller, ControllerConfig, LocalBackend
from replicheck.controller.backends.base import JoinRequest
from replicheck.controller.errors import JoinNotBuiltError, PermanentBackendError
from replicheck.controller.executor import DRY_RUN_NOTE
from replicheck.controller.machine import initial_record, transition
from replicheck.controller.model import ActionDone, ActionKind, Approved, Record, State, Step, Tick
from replicheck.incident import (
    Continuation,
    Incident,
    IncidentFormatError,
    read_incident,
    validate_incident,
    write_incident,
)

pytestmark = pytest.mark.timeout(60)
NOW = "2025-01-01T00:00:00+00:00"
TOKEN = "job token test (jobs=*)"
NO_RESTART = Continuation(mode="no_restart", replica_group="rg1")

# The replacement group's command: appends "<group> <node> <pid>" to a tally file (each start is
# counted where it lands), then lives for a while, as a replica group would.
GROUP_SCRIPT = (
    "import os, sys, time\n"
    "with open(sys.argv[1], 'a') as fh:\n"
    "    fh.write(f'{sys.argv[2]} {sys.argv[3]} {os.getpid()}\\n')\n"
    "time.sleep(float(sys.argv[4]))\n"
)


def join_incident(classification: str = "persistent", **kw: Any) -> Incident:
    return dataclasses.replace(make_incident(classification=classification, **kw), continuation=NO_RESTART)


def tick() -> Tick:
    return Tick(now=NOW, return_deadline="2025-01-01T01:00:00+00:00")


def done(step: Step, **outcome: object) -> Record:
    r = step.record
    for a in step.actions:
        r = transition(r, ActionDone(a.key, a.kind, a.node, dict(outcome))).record
    return r


# --- the incident contract ---------------------------------------------------------------------


def test_continuation_round_trips_as_version_3(tmp_path: Path) -> None:
    """An incident with ``continuation`` is written as version 3 and reads back equal; one
    without it is written exactly as before (version 2, no such key), so older readers read it."""
    with_it = join_incident()
    data = json.loads(with_it.to_json())
    assert data["version"] == 3 and data["continuation"] == {"mode": "no_restart", "replica_group": "rg1"}
    assert read_incident(write_incident(with_it, tmp_path)) == with_it
    without = json.loads(make_incident().to_json())
    assert without["version"] == 2 and "continuation" not in without
    assert Incident.from_dict(without).continuation is None


@pytest.mark.parametrize(
    ("value", "version", "message"),
    [
        ({"mode": "no_restart", "replica_group": "rg1"}, 2, "needs incident version 3"),
        ("no_restart", 3, "must be an object"),
        ({"mode": "restart", "replica_group": "rg1"}, 3, "'mode' must be one of no_restart"),
        ({"mode": "no_restart"}, 3, "'replica_group' must be a non-empty string"),
        ({"mode": "no_restart", "replica_group": 7}, 3, "'replica_group' must be a non-empty string"),
        ({"mode": "no_restart", "replica_group": "rg1", "x": 1}, 3, "unknown key"),
        ({"mode": "no_restart", "replica_group": "--rg"}, 3, "continuation replica_group"),
        ({"mode": "no_restart", "replica_group": "rg 1;rm"}, 3, "continuation replica_group"),
    ],
)
def test_malformed_continuation_is_refused_clearly(value: object, version: int, message: str) -> None:
    """A bad ``continuation`` (wrong type, unknown mode or key, missing or option-like group id,
    or in a version-2 record that an older reader would act on as a resume) is an
    IncidentFormatError naming the field."""
    data = {**json.loads(make_incident().to_json()), "continuation": value, "version": version}
    with pytest.raises(IncidentFormatError, match=message):
        Incident.from_json(json.dumps(data))


def test_malformed_continuation_file_is_kept_as_rejected(env: Callable[..., Any], tmp_path: Path) -> None:
    """A file with a malformed ``continuation`` is stored as rejected with the reason (nothing
    lost), starts nothing, and a valid incident beside it is ingested."""
    ctl, counting, local = env()
    bad = tmp_path / "bad.json"
    data = {
        **json.loads(join_incident().to_json()),
        "continuation": {"mode": "rejoin", "replica_group": "rg1"},
    }
    bad.write_text(json.dumps(data))
    result = ctl.ingest_file(bad)
    assert result.incident_id is None and "continuation 'mode'" in (result.rejected or "")
    ((_, reason, content, _),) = ctl.store.rejected_rows()
    assert "continuation" in reason and b"rejoin" in content
    assert ctl.ingest(join_incident()).new
    ctl.reconcile()
    assert counting.calls["join"] == 0 and local.join_requests() == []


# --- pure transitions ---------------------------------------------------------------------------


@pytest.mark.parametrize("classification", ["persistent", "transient"])
def test_transition_table_joins_instead_of_resuming(classification: str) -> None:
    """replaced -> (join_replacement) -> joined for a no-restart incident: one JOIN action keyed
    on the job, with the group id and the node that took the suspect's place; never a RESUME."""
    r = initial_record(join_incident(classification), TOKEN).evolve(allocation=("n1", "n2", "n3"))
    assert r.continuation == {"mode": "no_restart", "replica_group": "rg1"}
    r = r.evolve(state=State.AWAITING_APPROVAL)
    r = transition(r, Approved(by="alice", at=NOW)).record
    step = transition(r, tick())
    assert step.record.state is State.REPLACING
    r = done(transition(done(step), tick()), back=False, replacement="s1")
    step = transition(r, tick())
    assert step.record.state is State.REPLACED
    step = transition(step.record, tick())
    (join,) = step.actions
    assert join.kind is ActionKind.JOIN and join.node is None
    assert join.key == f"{r.incident_id}:join_replacement:job1"
    assert join.params == {
        "job_id": "job1",
        "replica_group": "rg1",
        "nodes": ["s1"],
        "exclude": ["n2"],
        "allocation": ["n1", "n2", "n3"],
    }
    assert transition(step.record, tick()).actions == ()  # waiting: emitted once
    end = transition(done(step, detail="started"), tick()).record
    assert end.state is State.JOINED and end.resume is None and "not resumed" in end.reason
    assert transition(end, tick()).record == end


@pytest.mark.parametrize("classification", ["ambiguous", "data"])
def test_continuation_ignored_where_no_group_is_named(classification: str) -> None:
    """An ambiguous (or data) incident carrying ``continuation`` keeps today's path: the record
    holds no continuation and says so, and recovery ends in RESUME."""
    r = initial_record(join_incident(classification), TOKEN)
    assert r.continuation is None and "continuation ignored" in r.reason
    step = transition(r.evolve(state=State.REPLACED), tick())
    assert [a.kind for a in step.actions] == [ActionKind.RESUME]


# --- end to end through the controller and the local backend ------------------------------------


class Groups:
    """Registers a job whose join command starts a real process, and ends what it started."""

    def __init__(self, tmp_path: Path) -> None:
        self.tally = tmp_path / "groups.txt"
        self.backends: list[LocalBackend] = []

    def command(self, lifetime_s: float) -> list[str]:
        return [
            sys.executable,
            "-c",
            GROUP_SCRIPT,
            str(self.tally),
            "{replica_group}",
            "{node}",
            str(lifetime_s),
        ]

    def started(self, expect: int = 1, wait_s: float = 15.0) -> list[list[str]]:
        """The starts the processes themselves recorded, once ``expect`` of them have (or after
        ``wait_s``), and after a pause long enough for an unexpected extra one to show."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and len(self._lines()) < expect:
            time.sleep(0.05)
        time.sleep(0.3)
        return self._lines()

    def _lines(self) -> list[list[str]]:
        return [ln.split() for ln in self.tally.read_text().splitlines()] if self.tally.exists() else []

    def stop(self) -> None:
        for backend in self.backends:
            for rec in backend.join_requests():
                if rec.pid is not None:
                    try:
                        os.killpg(rec.pid, signal.SIGTERM)
                    except ProcessLookupError:
                        pass


@pytest.fixture
def groups(tmp_path: Path) -> Iterator[Groups]:
    g = Groups(tmp_path)
    yield g
    g.stop()


def live_env(env: Callable[..., Any], groups: Groups, lifetime_s: float = 30.0, **config: Any) -> Any:
    ctl, counting, local = env(**config)
    local.add_job("job1", ("n1", "n2", "n3"), join_command=groups.command(lifetime_s))
    groups.backends.append(local)
    return ctl, counting, local


def approve_and_run(ctl: Controller, incident_id: str) -> None:
    ctl.reconcile()
    ctl.approve(incident_id, by="alice")
    ctl.reconcile()


def test_approved_join_starts_one_group_and_never_resumes(env: Callable[..., Any], groups: Groups) -> None:
    """Through cordon and approval, the replacement group's process starts once, on the spare
    that took n2's place, with the group's id; the job is not resumed, and further passes (and a
    repeated join call) start nothing more."""
    ctl, counting, local = live_env(env, groups)
    inc = join_incident()
    ctl.ingest(inc)
    approve_and_run(ctl, inc.id)
    record = ctl.store.get_record(inc.id)
    assert record.state is State.JOINED, record.reason
    assert groups.started() == [["rg1", "s1", str(record.joined and record.joined["pid"])]]
    (req,) = local.join_requests()
    assert (req.replica_group, req.node, req.status) == ("rg1", "s1", "started")
    assert "s1" in (local.allocation("job1") or ())
    assert local.resume_requests() == [] and counting.calls["resume"] == 0
    assert counting.calls["join"] == 1 and local.op_counts()["join"] == 1
    for _ in range(2):
        ctl.reconcile()
    key = f"{inc.id}:join_replacement:job1"
    again = local.join(JoinRequest(inc.id, "job1", "rg1", ("s1",), ("n2",)), key)
    assert again["pid"] == record.joined["pid"]  # type: ignore[index]
    assert len(groups.started()) == 1 and counting.calls["join"] == 1 and local.op_counts()["join"] == 1


def test_dry_run_holds_the_join_back(
    env: Callable[..., Any], groups: Groups, tmp_path: Path, clock: Clock
) -> None:
    """A controller in dry-run holds the join back (pending, with the dry-run note; no group
    starts); a controller with apply on then starts the group once."""
    ctl, counting, local = live_env(env, groups)
    inc = join_incident()
    ctl.ingest(inc)
    # The first join attempt fails (a temporary error), so the action is still pending when the
    # controller is swapped for one in dry-run.
    counting.fail("join", TransientBackendError("scheduler busy"))
    approve_and_run(ctl, inc.id)
    assert ctl.store.get_record(inc.id).state is State.REPLACED
    ctl.close()

    def run(apply: bool) -> Controller:
        clock.advance(120)  # past any retry or deferral
        config = ControllerConfig(apply=apply, checkpoint_roots=("/ck",))
        c = Controller(tmp_path / "ctl.db", backend=counting, config=config, clock=clock)
        for _ in range(2):
            c.reconcile()
        return c

    dry = run(apply=False)
    (join,) = [a for a in dry.store.actions(inc.id) if a.kind is ActionKind.JOIN]
    assert join.status == "pending" and join.last_error == DRY_RUN_NOTE
    assert dry.store.get_record(inc.id).state is State.REPLACED
    dry.close()
    assert counting.calls["join"] == 1 and "join" not in local.op_counts()
    assert groups.started(expect=0, wait_s=0) == []
    applying = run(apply=True)
    try:
        assert applying.store.get_record(inc.id).state is State.JOINED
    finally:
        applying.close()
    assert len(groups.started()) == 1 and local.op_counts()["join"] == 1 and counting.calls["resume"] == 0


class CrashAfterStart(LocalBackend):
    """Starts the group, then the controller "dies" before the start is recorded."""

    def _spawn(self, argv: Sequence[str], env: Mapping[str, str]) -> int:
        super()._spawn(argv, env)
        raise KeyboardInterrupt("controller killed between starting the group and recording it")


def crash_mid_join(
    env: Callable[..., Any], groups: Groups, tmp_path: Path, lifetime_s: float
) -> tuple[Incident, Path]:
    ctl, _, local = live_env(env, groups, lifetime_s=lifetime_s)
    inc = join_incident()
    ctl.ingest(inc)
    ctl.reconcile()
    ctl.approve(inc.id, by="alice")
    ctl._backend = crashing = CrashAfterStart(tmp_path / "ctl.db")  # type: ignore[attr-defined]
    groups.backends.append(crashing)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            ctl.reconcile()
    (action,) = [a for a in ctl.store.actions(inc.id) if a.kind is ActionKind.JOIN]
    assert action.status == "in_flight"
    ctl.close()
    return inc, tmp_path / "ctl.db"


def restarted(db: Path) -> tuple[Controller, Counting]:
    counting = Counting(LocalBackend(db))
    return Controller(
        db, backend=counting, config=ControllerConfig(apply=True, checkpoint_roots=("/ck",))
    ), counting


def test_restart_mid_join_does_not_start_a_second_group(
    env: Callable[..., Any], groups: Groups, tmp_path: Path
) -> None:
    """A controller killed after starting the group and before recording it: the restarted one
    finds the group by its marker, records it and starts no second one."""
    inc, db = crash_mid_join(env, groups, tmp_path, lifetime_s=30.0)
    (first,) = groups.started()
    ctl, counting = restarted(db)
    try:
        for _ in range(3):
            ctl.reconcile()
        record = ctl.store.get_record(inc.id)
        assert record.state is State.JOINED, record.reason
        assert record.joined is not None and str(record.joined["pid"]) == first[2]
        assert counting.calls["join"] == 1 and counting.calls["resume"] == 0
    finally:
        ctl.close()
    assert len(groups.started()) == 1


def test_restart_after_group_exited_fails_instead_of_starting_again(
    env: Callable[..., Any], groups: Groups, tmp_path: Path
) -> None:
    """When the group started in doubt is gone by the restart (it may have run and exited), the
    join is not repeated: the incident fails for a person (at most once), the job not resumed."""
    inc, db = crash_mid_join(env, groups, tmp_path, lifetime_s=0.0)
    assert len(groups.started()) == 1
    time.sleep(0.5)
    ctl, counting = restarted(db)
    try:
        for _ in range(3):
            ctl.reconcile()
        record = ctl.store.get_record(inc.id)
        assert record.state is State.FAILED and "Not started again" in record.reason
        assert counting.calls["resume"] == 0
    finally:
        ctl.close()
    assert len(groups.started()) == 1


def test_old_incident_without_continuation_resumes(env: Callable[..., Any], groups: Groups) -> None:
    """An incident without ``continuation`` takes today's path: the job is resumed from its
    checkpoint and no replacement group is started."""
    ctl, counting, local = live_env(env, groups)
    inc = make_incident()
    ctl.ingest(inc)
    approve_and_run(ctl, inc.id)
    assert ctl.store.get_record(inc.id).state is State.RESUMED
    assert len(local.resume_requests()) == 1 and local.join_requests() == []
    assert counting.calls["join"] == 0 and groups.started(expect=0, wait_s=0) == []


def test_join_acts_only_for_the_senders_job(env: Callable[..., Any], groups: Groups) -> None:
    """A no-restart incident naming a node outside its job's allocation is refused like any
    other: nothing cordoned, no group started."""
    ctl, counting, local = live_env(env, groups)
    local.add_job("job2", ("n1",))
    inc = join_incident(job="job2", nodes=("n3",))
    ctl.ingest(inc)
    ctl.reconcile()
    assert ctl.store.get_record(inc.id).state is State.REFUSED
    assert counting.calls["cordon"] == 0 and counting.calls["join"] == 0


def test_join_into_an_ended_job_fails_and_does_not_resume(env: Callable[..., Any], groups: Groups) -> None:
    """A replacement cannot join a job that is no longer running: the incident fails saying so,
    and the job is not resumed instead."""
    ctl, counting, local = live_env(env, groups)
    inc = join_incident()
    ctl.ingest(inc)
    ctl.reconcile()
    local.end_job("job1")
    ctl.approve(inc.id, by="alice")
    ctl.reconcile()
    record = ctl.store.get_record(inc.id)
    assert record.state is State.FAILED and "cannot join it live" in record.reason
    assert counting.calls["resume"] == 0 and groups.started(expect=0, wait_s=0) == []


def test_other_backends_say_the_join_is_designed_not_built() -> None:
    """The Kubernetes and HyperPod (no orchestrator) backends refuse a join with a typed error
    pointing at the design; HyperPod with an orchestrator hands the join to it (Slurm without a
    join_command: refused before any command, saying to start the group by hand)."""
    from replicheck.controller.backends.hyperpod import HyperPodBackend, HyperPodConfig
    from replicheck.controller.backends.kube_config import KubernetesConfig
    from replicheck.controller.backends.kubernetes import KubernetesBackend
    from replicheck.controller.backends.slurm import SlurmBackend

    request = JoinRequest("job1-s40-replay", "job1", "rg1", ("s1",), ("n2",))
    backends = (
        KubernetesBackend(KubernetesConfig(host="http://127.0.0.1:9")),
        HyperPodBackend(HyperPodConfig(cluster_name="c", orchestrator="none"), client=object()),
    )
    for backend in backends:
        with pytest.raises(JoinNotBuiltError, match="The controller's join action") as info:
            backend.join(request, "k")
        assert info.value.replica_group == "rg1" and "by hand" in str(info.value)
    orchestrated = HyperPodBackend(
        HyperPodConfig(cluster_name="c"), client=object(), orchestrator=SlurmBackend()
    )
    with pytest.raises(PermanentBackendError, match=r"no \[slurm\] join_command .* by hand"):
        orchestrated.join(request, "k")
    with pytest.raises(PermanentBackendError, match="join_command"):
        SlurmBackend().join(request, "k")


def test_continuation_validated_on_the_api_path() -> None:
    """``validate_incident`` (every path in, including ``Controller.ingest``) refuses an
    option-like replica group id built in Python."""
    bad = dataclasses.replace(
        make_incident(), continuation=Continuation(mode="no_restart", replica_group="-x")
    )
    with pytest.raises(IncidentFormatError, match="replica_group"):
        validate_incident(bad)


def test_approval_page_says_the_group_joins_and_the_job_is_not_resumed(env: Callable[..., Any]) -> None:
    """What approving will do, as the page and the API show it: a no-restart incident names the
    replacement group joining live and says the job is not resumed; today's incident still says
    the job is resumed."""
    from replicheck.controller.http.views import consequences

    ctl, _, _ = env()
    live, old = join_incident(), make_incident(job="job2")
    for inc in (live, old):
        ctl.ingest(inc)
    ctl.reconcile()
    said = consequences(ctl.show(live.id), ctl.config, True)["approve"]
    assert (
        "replica group rg1" in said and "joins job job1 live" in said and "not restarted or resumed" in said
    )
    assert "resumed from checkpoint step 30" in consequences(ctl.show(old.id), ctl.config, True)["approve"]
