"""`replicheck demo --no-restart` end to end (issue 28), non-interactive, on a shortened schedule:
3 torchft replica groups with the real lighthouse, a persistent fault on group 1, the group
leaving, the controller's join starting the spare, today's resume path measured in the same run.
One demo run is shared by the tests below (module fixture)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torchft")

STEPS, ONSET, VERIFY_EVERY = 34, 8, 5
"""A shortened schedule: the fault from step 8 is caught at step 10, today's path resumes from
step 5's checkpoint; the two remaining groups wait for the spare from step 19 (STEPS - 15)."""
DETECT = 10


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("nr") / "demo"
    t0 = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replicheck",
            "demo",
            "--no-restart",
            "--yes",
            "--out",
            str(out),
            "--steps",
            str(STEPS),
            "--onset",
            str(ONSET),
            "--verify-every",
            str(VERIFY_EVERY),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"},
    )
    facts = json.loads((out / "demo.json").read_text()) if (out / "demo.json").exists() else {}
    return {"proc": proc, "out": out, "facts": facts, "wall_s": time.monotonic() - t0}


def _ok(demo: dict[str, Any]) -> dict[str, Any]:
    proc = demo["proc"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    facts: dict[str, Any] = demo["facts"]
    return facts


@pytest.mark.timeout(200)
def test_the_demo_exits_0_and_prints_nothing_lost(demo: dict[str, Any]) -> None:
    """Exit 0; the no-restart figures printed are `steps lost: 0` and `checkpoints read: 0`, then
    today's path's (steps 6..9 recomputed, one checkpoint read); group 1 exited 87 and the
    survivors committed every planned step once, in the processes they started in."""
    facts = _ok(demo)
    stdout = demo["proc"].stdout
    no_restart, today = stdout.split("today's path (stop, resume")
    assert "steps lost: 0" in no_restart and "checkpoints read: 0" in no_restart
    assert f"steps lost: {DETECT - 6}" in today
    assert "checkpoints read: 1" in today
    nr = facts["no_restart"]
    assert (nr["steps_lost"], nr["checkpoints_read"], nr["steps_recomputed"]) == (0, 0, 0)
    assert nr["exitcodes"] == {"group0": 0, "group1": 87, "group2": 0}
    assert nr["survivors_same_pids"] and nr["survivors_committed_every_step_once"]
    assert nr["detected_at"] == DETECT and nr["next_committed_step"] == DETECT
    assert nr["final_step"] == STEPS
    print(f"\ndemo wall {demo['wall_s']:.1f} s; no-restart {nr['detection_to_next_commit_s']} s")


@pytest.mark.timeout(200)
def test_the_continuation_beats_todays_checkpoint_resume(demo: dict[str, Any]) -> None:
    """From the detection, the remaining groups commit the detected step sooner than today's path
    (every group stopped with 87, restarted from the newest verified checkpoint) commits its
    first step; today's path recomputes the steps after the checkpoint and its incident has no
    continuation (a stop, not a leave)."""
    facts = _ok(demo)
    nr, rp = facts["no_restart"], facts["resume_path"]
    assert facts["faster_than_resume"] is True
    assert 0 < nr["detection_to_next_commit_s"] < rp["detection_to_next_commit_s"]
    assert rp["exitcodes"] == [87, 87, 87]
    assert (rp["detected_at"], rp["checkpoint_step"], rp["resumed_at_step"]) == (DETECT, 5, 6)
    assert rp["steps_lost"] == DETECT - 6 and rp["checkpoints_read"] == 1 and rp["checkpoint_loads"] == 3
    assert rp["incident_continuation"] is None
    assert rp["detection_to_step_regained_s"] >= rp["detection_to_next_commit_s"]


@pytest.mark.timeout(200)
def test_the_controller_starts_the_spare_which_joins_live(demo: dict[str, Any]) -> None:
    """The incident written to --out names group1 with continuation no_restart; the controller
    (its database in --out) goes cordon → triage → approval → replaced → joined, starting the spare
    with the registered join command; the spare's state after its first quorum equals the healthy
    groups' (sha256 of weights and AdamW state), it commits every step from its join to the end,
    and all three groups end with equal digests."""
    facts = _ok(demo)
    out: Path = demo["out"]
    nr = facts["no_restart"]
    [incident] = list((out / "incidents").glob("*.json"))
    written = json.loads(incident.read_text())
    assert written["continuation"] == {"mode": "no_restart", "replica_group": "group1"}
    assert (written["step"], written["suspect_nodes"], written["classification"]) == (
        DETECT,
        ["group1"],
        "persistent",
    )
    assert [t["to"] for t in nr["transitions"]] == [
        "cordoned",
        "triaging",
        "awaiting_approval",
        "approved",
        "replacing",
        "replaced",
        "joined",
    ]
    with sqlite3.connect(out / "controller.db") as db:
        joins = db.execute("SELECT replica_group, node, status, pid FROM sim_joins").fetchall()
    assert joins == [("group1", "spare0", "started", nr["spare_pid"])]
    hold = STEPS - 15
    assert nr["join_step"] in (hold, hold + 1)
    assert nr["spare_recovered_state_equal"] is True
    assert nr["spare_committed"] == list(range(nr["join_step"], STEPS))
    assert nr["final_digests_equal"] is True
    assert nr["membership"] == {
        "3 groups": [0, DETECT - 1],
        "2 groups": [DETECT, nr["join_step"] - 1],
        "3 groups again": [nr["join_step"], STEPS - 1],
    }


@pytest.mark.timeout(200)
def test_the_final_weights_match_the_membership_schedule(demo: dict[str, Any]) -> None:
    """The final weights and AdamW state are bit-for-bit equal (sha256) to a torchft run with the
    same membership schedule and no detection (group 1 leaving cleanly at the detection step, the
    spare joining at the same step); the weights equal (rtol 1e-5) a one-process recomputation
    with that schedule and group 1's corrupted steps before the detection, and differ from a
    fault-free one: the check can fail, and the undetected window is reported, not hidden."""
    fw = _ok(demo)["final_weights"]
    assert fw["torchft_same_schedule"]["same_membership"] is True
    assert fw["torchft_same_schedule"]["bitwise"] is True
    assert fw["with_the_undetected_window"]["close_rtol_1e-5"] is True
    assert fw["with_the_undetected_window"]["max_abs_diff"] < 1e-5
    assert fw["fault_free"]["close_rtol_1e-5"] is False
    assert _ok(demo)["no_restart"]["corrupted_steps_applied"] == [ONSET, DETECT - 1]


@pytest.mark.timeout(60)
def test_a_schedule_the_demo_cannot_play_is_refused(tmp_path: Path) -> None:
    """A spare that could not join before the end (the join-by step after the last step) is
    refused with exit 2 before anything starts."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "replicheck",
            "demo",
            "--no-restart",
            "--yes",
            "--out",
            str(tmp_path / "x"),
            "--steps",
            "20",
        ],
        capture_output=True,
        text=True,
        timeout=50,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "join-by step" in proc.stderr
    assert not (tmp_path / "x").exists()


def _incident_and_backend(root: Path, join_argv: list[str]) -> tuple[Any, Any]:
    """An incident naming group1 with continuation no_restart, written where the controller reads,
    and the local backend with the demo's job, nodes and spare."""
    from replicheck.controller import LocalBackend
    from replicheck.demo_no_restart import JOB_ID
    from replicheck.incident import (
        Continuation,
        Incident,
        NodeIdentity,
        Suspect,
        make_incident_id,
        write_incident,
    )

    incident = Incident(
        id=make_incident_id(JOB_ID, 30, "replay"),
        job_id=JOB_ID,
        step=30,
        check="replay",
        suspect_ranks=(1,),
        suspect_nodes=("group1",),
        classification="persistent",
        suspects=(Suspect(rank=1, node=NodeIdentity(name="group1", hostname="group1", slurm_node="group1")),),
        world_size=3,
        last_verified_step=20,
        continuation=Continuation(mode="no_restart", replica_group="group1"),
    )
    (root / "incidents").mkdir(parents=True)
    write_incident(incident, root / "incidents")
    backend = LocalBackend(root / "controller.db")
    for n in ("group0", "group1", "group2"):
        backend.add_node(n)
    backend.add_node("spare0", spare=True)
    backend.add_job(JOB_ID, ["group0", "group1", "group2"], join_command=join_argv)
    return incident, backend


@pytest.mark.timeout(60)
@pytest.mark.parametrize("answer", [True, False])
def test_the_prompt_decides_whether_the_spare_is_started(tmp_path: Path, answer: bool) -> None:
    """The demo's controller step asks the approval prompt once (naming the node and the replica
    group); "yes" starts the registered join command for group1 on spare0 and ends `joined`; "no"
    dismisses the incident (uncordoned) and starts nothing."""
    import io

    from replicheck.demo import _Printer
    from replicheck.demo_no_restart import NoRestartConfig, _control

    tally = tmp_path / "tally"
    argv = [sys.executable, "-c", f"open({str(tally)!r}, 'a').write('{{replica_group}} {{node}}\\n')"]
    incident, backend = _incident_and_backend(tmp_path / "out", argv)
    prompts: list[str] = []

    def ask(prompt: str) -> bool:
        prompts.append(prompt)
        return answer

    cfg = NoRestartConfig(out_dir=str(tmp_path / "out"), approve=ask, approver="tester")
    try:
        transitions, joined = _control(cfg, tmp_path / "out", _Printer(io.StringIO()), backend, incident)
        joins = backend.join_requests()
    finally:
        backend.close()
    assert len(prompts) == 1 and "group1" in prompts[0] and "joins live" in prompts[0]
    assert joined is answer
    if answer:
        assert transitions[-1]["to"] == "joined"
        assert [(j.replica_group, j.node, j.status) for j in joins] == [("group1", "spare0", "started")]
        deadline = time.monotonic() + 30
        while not tally.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert tally.read_text() == "group1 spare0\n"
    else:
        assert [t["to"] for t in transitions][-2:] == ["dismissed", "uncordoned"]
        assert joins == [] and not tally.exists()
