"""The guard inside torchft's step (issue 28, first slice): ``TorchftGuard`` with the real Rust
lighthouse and gloo, one rank per replica group, each group its own process and ``Manager``.

* ``leave``: 3 groups, a persistent forward fault on group 1 from step ``ONSET`` (a verification
  step): the guard names group 1 at ``ONSET``, no group applies it, group 1 exits with 87, groups
  0 and 2 take step ``ONSET`` again in the same processes, and finish the planned steps;
* a transient fault sends its group out the same way; a second fault once 2 groups are left is
  ``ambiguous`` and stops both (today's path);
* ``ambiguous``: 2 groups, the same fault: no group can be named alone, so every group stops as
  today (``CorruptionDetected`` → ``exit_on_corruption`` → 87, an ambiguous incident);
* ``clean``: 3 groups, no fault: every step committed by every group, weights bitwise equal;
* the replacement joins live: after group 1 has left, a fresh process with other weights heals
  from groups 0 and 2 through torchft's recovery (model, optimizer and guard state), passes the
  recovered-state digest check at its first step, and all three end bitwise equal; a joiner whose
  copy is damaged is refused by that check, no group applies the step, and the others go on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torchft_ranks as tr
from torch import nn

from replicheck.harness.launch import _context
from replicheck.incident import Continuation, read_incident

os.environ.setdefault("HF_HUB_OFFLINE", "1")

STEPS = 8
"""Steps every scenario plans (committed steps 0..STEPS-1)."""
ONSET = 4
"""The fault's first step on group 1: a verification step (``VERIFY_EVERY``), so nothing corrupted
is ever committed and the survivors' weights can be checked against a clean recomputation."""
VERIFY_EVERY = 2
"""The guard verifies steps 0, 2, 4, ..."""
FAULTY = 1
"""The faulty replica group's index."""
SECOND_GROUP = 2
"""The group a second fault hits (``second`` scenario)."""
SECOND_ONSET = 6
"""Its first step, a verification step after group FAULTY has left."""
EXIT_SUSPECT = 87
LR = 1e-2
HEARTBEAT_MS = 1000
JOIN_MS = 500


def _group(
    index: int,
    lighthouse: str,
    out_dir: str,
    start: Any,
    fault: str | None,
    min_size: int,
    join: dict[str, Any] | None = None,
) -> None:
    """One replica group (one rank): guarded training under torchft; its record (or traceback)
    goes to ``out_dir`` (the suspect's too, as it exits). ``join``: the join scenarios' settings
    (see :func:`_train`)."""
    from replicheck.integrations.torchft import RecoveryRefused

    join = join or {}
    record: dict[str, Any] = {"index": index, "pid": os.getpid(), "attempts": []}
    out = Path(out_dir) / f"{join.get('name', f'g{index}')}.pt"
    try:
        _train(index, lighthouse, Path(out_dir), start, fault, min_size, record, join)
    except RecoveryRefused as exc:
        record["refused"] = {"step": exc.check.step, "states": exc.check.states, "t": time.time()}
        torch.save(record, out)
        raise
    except SystemExit as exc:
        record["exit"] = exc.code
        record["t_exit"] = time.time()
        torch.save(record, out)
        raise
    except BaseException:
        record["error"] = traceback.format_exc()
        torch.save(record, out)
        raise
    torch.save(record, out)


def _train(
    index: int,
    lighthouse: str,
    out: Path,
    start: Any,
    fault: str | None,
    min_size: int,
    record: dict[str, Any],
    join: dict[str, Any],
) -> None:
    """``join`` keys: ``name`` (the record's file), ``joiner`` (a replacement started late from other
    weights), ``damage`` (its recovered state is perturbed by a load function registered after the
    guard's), ``ready`` (an event the joiner sets once its manager heartbeats), ``join_at`` (the step
    before which the first groups wait for it), ``steps`` (the planned steps)."""
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from replicheck.elastic import exit_on_corruption
    from replicheck.faults import Fault
    from replicheck.guard import CorruptionDetected, GuardConfig
    from replicheck.integrations.torchft import TorchftGuard

    torch.set_num_threads(1)
    joiner = bool(join.get("joiner"))
    if joiner:
        # Started early (imports done), it builds its manager only when told: from then on it is a
        # replacement that was never part of the job.
        join["go"].wait(timeout=60)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    steps = int(join.get("steps", STEPS))
    torch.manual_seed(1 if joiner else 0)  # a joiner's own weights differ from the quorum's
    net = tr.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    record["initial_digest"] = _sha(net)
    ttl = timedelta(seconds=20)
    pg = ProcessGroupGloo(timeout=ttl)
    # The model's and the optimizer's state travel with TorchftGuard's registration.
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=min_size,
        use_async_quorum=False,
        replica_id=f"replicheck_g{index}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=ttl,
        quorum_timeout=ttl,
        connect_timeout=ttl,
    )
    config = GuardConfig(verify_every=VERIFY_EVERY, weights_every=VERIFY_EVERY, incident_dir=str(out))
    tg = TorchftGuard(manager, pg, net, opt, tr.loss, config, node=f"group{index}")
    if "damage" in join:
        # Test-only, on the joiner: after the guard's own load (torchft loads keys in registration
        # order) one weight of the recovered copy moves by one ulp. torchft sends every key the
        # receiver registered, so every group registers it (a no-op load on the others).
        def damage(_: object) -> None:
            if join["damage"]:
                with torch.no_grad():
                    net.out.bias[0] = torch.nextafter(net.out.bias[0], torch.tensor(1.0))

        manager.register_state_dict_fn("test_damage", damage, dict)
    if fault is not None:
        # On group FAULTY only (rank = the group's index among the 3 groups started).
        at = Fault.at_forward("inp").scale(3.0, index=5).on_rank(FAULTY)
        at = at.transient(step=ONSET) if fault == "transient" else at.persistent(from_step=ONSET)
        at.install(net, optimizer=opt, rank=index, world_size=3)
        if fault == "second":
            # A second faulty group, once group FAULTY has left: 2 groups, no third party.
            second = Fault.at_forward("inp").scale(3.0, index=5).on_rank(SECOND_GROUP)
            second.persistent(from_step=SECOND_ONSET).install(net, optimizer=opt, rank=index, world_size=3)
    if joiner:
        join["ready"].set()
    else:
        start.wait(timeout=30)  # every group heartbeats before any asks for the first quorum
    while manager.current_step() < steps:
        if not joiner and manager.current_step() == join.get("join_at") and not join["ready"].is_set():
            # Hold the step until the replacement's manager heartbeats and asks for a quorum.
            join["holding"].set()
            join["ready"].wait(timeout=30)
            time.sleep(0.3)
        t0 = time.time()
        s = tg.begin()
        t_begun = time.time()
        # The state this step starts from (after any recovery in its quorum).
        before = {
            "sha": _sha(net),
            "optim": _optim_sha(opt),
            "guard": (tg.guard.next_step, tg.guard.last_verified_step),
        }
        if "first" not in record:
            record["first"] = {"step": s, "t_quorum": t0, **before}
        try:
            got = tg.step(tr.batch(index, s))
        except CorruptionDetected as exc:
            record["stopped"] = {"step": s, "classification": exc.incident.classification, "t": time.time()}
            record["incident"] = exc.incident.id
            exit_on_corruption(exc.incident)
        record["attempts"].append(
            {
                "step": got.step,
                "committed": got.committed,
                "participants": got.participants,
                "pid": os.getpid(),
                "t": time.time(),
                "verified": got.result.verified if got.result is not None else None,
                "incident": got.incident.id if got.incident is not None else None,
                "suspects": got.incident.suspect_nodes if got.incident is not None else None,
                "classification": got.incident.classification if got.incident is not None else None,
                "recovery": dataclasses.asdict(got.recovery) if got.recovery is not None else None,
                "before": before,
                "t_start": t0,
                "t_begun": t_begun,
            }
        )
    record["final"] = {k: v.clone() for k, v in net.state_dict().items()}
    record["final_step"] = manager.current_step()
    record["reforms"] = tg.reforms
    manager.shutdown(wait=False)


def _sha(module: nn.Module) -> str:
    """The weights, bit for bit (independent of the guard's own digests)."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _optim_sha(opt: torch.optim.Optimizer) -> str:
    """AdamW's state (``step``, ``exp_avg``, ``exp_avg_sq`` of every parameter), bit for bit."""
    h = hashlib.sha256()
    for p in (p for g in opt.param_groups for p in g["params"]):
        for key, t in sorted(opt.state.get(p, {}).items()):
            h.update(key.encode())
            h.update(torch.as_tensor(t).detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _run(tmp: Path, groups: int, fault: str | None, min_size: int, min_replicas: int) -> dict[str, Any]:
    """Start ``groups`` replica groups against a fresh lighthouse; wait for all; their records."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=JOIN_MS, heartbeat_timeout_ms=HEARTBEAT_MS
    )
    ctx = _context()
    start = ctx.Barrier(groups)
    procs = [
        ctx.Process(target=_group, args=(i, lighthouse.address(), str(tmp), start, fault, min_size))
        for i in range(groups)
    ]
    t0 = time.monotonic()
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=60)
    finally:
        tr.stop(procs, lighthouse)
    records = [torch.load(tmp / f"g{i}.pt", weights_only=False) for i in range(groups)]
    for r in records:
        if "error" in r:
            raise AssertionError(f"replica group {r['index']} failed:\n{r['error']}")
    return {
        "records": records,
        "pids": [p.pid for p in procs],
        "exitcodes": [p.exitcode for p in procs],
        "wall_s": time.monotonic() - t0,
        "incidents": sorted(tmp.glob("*.json")),
    }


@pytest.fixture(scope="module")
def leave(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """3 groups, a persistent fault on group 1 from ONSET."""
    return _run(tmp_path_factory.mktemp("leave"), 3, fault="persistent", min_size=2, min_replicas=2)


def _committed(record: dict[str, Any]) -> list[int]:
    return [a["step"] for a in record["attempts"] if a["committed"]]


def _clean_reference(schedule: list[list[int]]) -> dict[str, torch.Tensor]:
    """Plain torch, one process: step ``s`` averages the gradients of the groups in
    ``schedule[s]`` (each on its own shard), then AdamW."""
    torch.manual_seed(0)
    net = tr.Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    for step, groups in enumerate(schedule):
        total = [torch.zeros_like(p) for p in net.parameters()]
        for g in groups:
            grads = torch.autograd.grad(tr.loss(net, tr.batch(g, step)), list(net.parameters()))
            total = [t + d for t, d in zip(total, grads)]
        for p, t in zip(net.parameters(), total):
            p.grad = t / len(groups)
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


@pytest.mark.timeout(120)
def test_the_named_group_leaves_with_87_and_the_others_retake_the_step(leave: dict[str, Any]) -> None:
    """Detection at ONSET (the first verification after the fault's onset) names group 1 in an
    incident that says the job goes on without it (continuation no_restart, replica group
    group1, incident version 3); no group commits ONSET then; group 1 exits 87; groups 0 and 2
    commit ONSET next, with 2 participants, in the processes they started in, and every planned
    step once."""
    recs = leave["records"]
    assert leave["exitcodes"] == [0, EXIT_SUSPECT, 0]
    assert len(leave["incidents"]) == 1
    written = read_incident(leave["incidents"][0])
    assert written.continuation == Continuation(mode="no_restart", replica_group=f"group{FAULTY}")
    assert json.loads(leave["incidents"][0].read_text())["version"] == 3
    suspect = recs[FAULTY]
    assert suspect["exit"] == EXIT_SUSPECT
    assert _committed(suspect) == list(range(ONSET))
    for i in (0, 2):
        r = recs[i]
        at_onset = [a for a in r["attempts"] if a["step"] == ONSET]
        assert [(a["committed"], a["participants"]) for a in at_onset] == [(False, 3), (True, 2)]
        assert at_onset[0]["suspects"] == (f"group{FAULTY}",)
        assert at_onset[0]["classification"] in ("persistent", "transient")
        assert at_onset[0]["incident"] in leave["incidents"][0].name
        assert _committed(r) == list(range(STEPS)) and r["final_step"] == STEPS
        assert {a["pid"] for a in r["attempts"]} == {leave["pids"][i]} == {r["pid"]}
        assert all(a["participants"] == 3 for a in r["attempts"] if a["step"] < ONSET)
        assert all(a["participants"] == 2 for a in r["attempts"] if a["step"] > ONSET)
        assert r["reforms"] == 2  # the first quorum, then the one without group 1
    # The verdict at ONSET was reached before any commit of ONSET: the suspect exited on it.
    first_commit = min(
        a["t"] for i in (0, 2) for a in recs[i]["attempts"] if a["step"] == ONSET and a["committed"]
    )
    gap = first_commit - suspect["t_exit"]
    detected = min(a["t"] for i in (0, 2) for a in recs[i]["attempts"] if a["incident"] is not None)
    print(
        f"\nfrom detection to the next committed step: {first_commit - detected:.2f} s; from the "
        f"suspect's exit: {gap:.2f} s (wall {leave['wall_s']:.1f} s)"
    )
    assert 0 < gap < HEARTBEAT_MS / 1000 + 5.0
    assert 0 < first_commit - detected < HEARTBEAT_MS / 1000 + 5.0


@pytest.mark.timeout(120)
def test_the_remaining_groups_hold_the_clean_weights(leave: dict[str, Any]) -> None:
    """Groups 0 and 2 end bitwise equal, and equal (to rounding) to a plain recomputation in which
    steps before ONSET average 3 groups and ONSET on average groups 0 and 2: nothing of group 1's
    corrupted step was applied anywhere."""
    a, b = leave["records"][0]["final"], leave["records"][2]["final"]
    for name in a:
        assert torch.equal(a[name], b[name]), name
    schedule = [[0, 1, 2]] * ONSET + [[0, 2]] * (STEPS - ONSET)
    ref = _clean_reference(schedule)
    for name in a:
        torch.testing.assert_close(a[name], ref[name], rtol=1e-5, atol=1e-6)
    # A schedule in which 3 groups committed ONSET ends elsewhere (so the check can fail).
    wrong = _clean_reference([[0, 1, 2]] * (ONSET + 1) + [[0, 2]] * (STEPS - ONSET - 1))
    assert any(not torch.allclose(a[n], wrong[n], rtol=1e-5, atol=1e-6) for n in a)


@pytest.mark.timeout(120)
def test_a_transient_fault_also_sends_its_group_out(tmp_path: Path) -> None:
    """A one-off fault on group 1 at ONSET is classified transient and names group 1: it exits
    87, and groups 0 and 2 commit ONSET without it and finish the planned steps."""
    run = _run(tmp_path, 3, fault="transient", min_size=2, min_replicas=2)
    assert run["exitcodes"] == [0, EXIT_SUSPECT, 0]
    for i in (0, 2):
        r = run["records"][i]
        at_onset = [a for a in r["attempts"] if a["step"] == ONSET]
        assert [(a["committed"], a["participants"]) for a in at_onset] == [(False, 3), (True, 2)]
        assert (at_onset[0]["classification"], at_onset[0]["suspects"]) == ("transient", (f"group{FAULTY}",))
        assert _committed(r) == list(range(STEPS))
    assert _committed(run["records"][FAULTY]) == list(range(ONSET))


@pytest.mark.timeout(120)
def test_two_groups_are_ambiguous_and_both_stop(tmp_path: Path) -> None:
    """With 2 groups no group can be named alone: the verdict is ambiguous, neither group commits
    ONSET, and both stop as today (CorruptionDetected, then exit 87), neither left running."""
    run = _run(tmp_path, 2, fault="persistent", min_size=1, min_replicas=2)
    assert run["exitcodes"] == [EXIT_SUSPECT, EXIT_SUSPECT]
    for r in run["records"]:
        assert r["stopped"]["step"] == ONSET
        assert r["stopped"]["classification"] == "ambiguous"
        assert _committed(r) == list(range(ONSET))
    assert len(run["incidents"]) == 1
    # Today's stop: the controller resumes the job from a checkpoint, so no continuation.
    assert read_incident(run["incidents"][0]).continuation is None


@pytest.mark.timeout(120)
def test_a_second_fault_with_two_groups_left_is_ambiguous(tmp_path: Path) -> None:
    """Group 1 leaves at ONSET; when group 2 goes wrong too at SECOND_ONSET, only 2 groups are in
    the quorum: the verdict is ambiguous, neither commits SECOND_ONSET, both stop with 87."""
    run = _run(tmp_path, 3, fault="second", min_size=2, min_replicas=2)
    assert run["exitcodes"] == [EXIT_SUSPECT, EXIT_SUSPECT, EXIT_SUSPECT]
    assert "stopped" not in run["records"][FAULTY]
    for i in (0, 2):
        r = run["records"][i]
        assert (r["stopped"]["step"], r["stopped"]["classification"]) == (SECOND_ONSET, "ambiguous")
        assert _committed(r) == list(range(SECOND_ONSET))
        assert {a["pid"] for a in r["attempts"]} == {run["pids"][i]}
    assert len(run["incidents"]) == 2


@pytest.mark.timeout(120)
def test_a_clean_three_group_run_commits_every_step_everywhere(tmp_path: Path) -> None:
    """No fault: no incident, every group commits every planned step with 3 participants, the
    guard verified every other step, and the weights end bitwise equal across groups."""
    run = _run(tmp_path, 3, fault=None, min_size=3, min_replicas=3)
    assert run["exitcodes"] == [0, 0, 0]
    assert run["incidents"] == []
    for r in run["records"]:
        assert [(a["step"], a["committed"], a["participants"]) for a in r["attempts"]] == [
            (s, True, 3) for s in range(STEPS)
        ]
        assert [a["verified"] for a in r["attempts"]] == [s % VERIFY_EVERY == 0 for s in range(STEPS)]
        assert r["reforms"] == 1
    first = run["records"][0]["final"]
    for r in run["records"][1:]:
        for name, t in first.items():
            assert torch.equal(t, r["final"][name]), name


JOIN_AT = 7
"""``join``: the step before which groups 0 and 2 wait for the replacement to heartbeat (it
joins at the first quorum it asks for, so at ``JOIN_AT`` or soon after)."""
JOIN_STEPS = 10
"""``join``: the planned steps (the replacement takes part in the last ones)."""
DAMAGE_AT = 2
"""``damaged``: the step before which the two groups wait for the damaged joiner."""
DAMAGE_STEPS = 5
"""``damaged``: the planned steps."""


def _run_join(
    tmp: Path, first: list[int], fault: str | None, joiner: dict[str, Any], join_at: int, steps: int
) -> dict[str, Any]:
    """Groups ``first`` start together (group FAULTY faulty when ``fault``); once the faulty one
    has exited (without a fault: once they hold ``join_at``), a replacement group ``FAULTY`` starts
    from other weights
    (``joiner`` adds to its settings); the first groups hold step ``join_at`` until it heartbeats."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=JOIN_MS, heartbeat_timeout_ms=HEARTBEAT_MS
    )
    ctx = _context()
    start, ready, holding = ctx.Barrier(len(first)), ctx.Event(), ctx.Event()
    common = {"ready": ready, "holding": holding, "join_at": join_at, "steps": steps}
    if "damage" in joiner:
        common["damage"] = False
    procs = {
        f"g{i}": ctx.Process(target=_group, args=(i, lighthouse.address(), str(tmp), start, fault, 2, common))
        for i in first
    }
    go = ctx.Event()
    joining = {"name": "joiner", "joiner": True, "ready": ready, "go": go, "steps": steps, **joiner}
    procs["joiner"] = ctx.Process(
        target=_group, args=(FAULTY, lighthouse.address(), str(tmp), None, None, 2, joining)
    )
    t0 = time.monotonic()
    try:
        for p in procs.values():
            p.start()
        if fault is not None:
            procs[f"g{FAULTY}"].join(timeout=60)
        # The replacement starts once the others hold ``join_at``: a live join after the first
        # steps (not torchft's step-0 weight sync), at a step that does not depend on timing.
        holding.wait(timeout=60)
        go.set()
        for p in procs.values():
            p.join(timeout=60)
    finally:
        tr.stop(procs.values(), lighthouse)
    records = {name: torch.load(tmp / f"{name}.pt", weights_only=False) for name in procs}
    for name, r in records.items():
        if "error" in r:
            raise AssertionError(f"replica group {name} failed:\n{r['error']}")
    return {
        "records": records,
        "pids": {name: p.pid for name, p in procs.items()},
        "exitcodes": {name: p.exitcode for name, p in procs.items()},
        "wall_s": time.monotonic() - t0,
        "incidents": sorted(tmp.glob("*.json")),
    }


@pytest.mark.timeout(120)
def test_a_replacement_group_joins_live_with_the_quorums_state(tmp_path: Path) -> None:
    """Group 1 is caught at ONSET and leaves with 87; a replacement (a fresh process, other initial
    weights) joins groups 0 and 2 later and heals live: at its first step its weights, AdamW state
    and guard state (next step, last verified step) equal the quorum's (the guard's digest check
    passes: it healed, nothing refused), its first update counts, all three commit every later
    step and end bitwise equal, at the weights of a plain recomputation of that membership; groups
    0 and 2 ran in their original processes throughout."""
    run = _run_join(tmp_path, [0, 1, 2], "persistent", {}, JOIN_AT, JOIN_STEPS)
    recs = run["records"]
    assert run["exitcodes"] == {"g0": 0, "g1": EXIT_SUSPECT, "g2": 0, "joiner": 0}
    joiner = recs["joiner"]
    assert joiner["initial_digest"] != recs["g0"]["initial_digest"]
    j = joiner["first"]["step"]
    assert ONSET < j < JOIN_STEPS
    for name in ("g0", "g2"):
        r = recs[name]
        assert {a["pid"] for a in r["attempts"]} == {run["pids"][name]} == {r["pid"]}
        assert _committed(r) == list(range(JOIN_STEPS))
        (attempt,) = [a for a in r["attempts"] if a["step"] == j]
        assert (attempt["committed"], attempt["participants"]) == (True, 3)
        first = joiner["first"]
        assert attempt["before"] == {k: first[k] for k in ("sha", "optim", "guard")}
        check = attempt["recovery"]
        assert check["healed"] == (FAULTY,) and check["refused"] == ()
        assert len(set(check["states"])) == 1
    assert joiner["first"]["guard"][0] == j and joiner["first"]["guard"][1] is not None
    assert _committed(joiner) == list(range(j, JOIN_STEPS))
    assert all(a["participants"] == 3 for a in joiner["attempts"])
    final = recs["g0"]["final"]
    for other in (recs["g2"], joiner):
        for name, t in final.items():
            assert torch.equal(t, other["final"][name]), name
    schedule = [[0, 1, 2]] * ONSET + [[0, 2]] * (j - ONSET) + [[0, 1, 2]] * (JOIN_STEPS - j)
    ref = _clean_reference(schedule)
    for name in final:
        torch.testing.assert_close(final[name], ref[name], rtol=1e-5, atol=1e-6)
    # Timing: the quorum that admitted the joiner opens when the last of groups 0 and 2 asks.
    first = joiner["attempts"][0]
    opened = max(a["t_start"] for n in ("g0", "g2") for a in recs[n]["attempts"] if a["step"] == j)
    usual = sorted(a["t"] - a["t_start"] for a in recs["g0"]["attempts"] if a["step"] > j)
    print(
        f"\nreplacement joined at step {j}: from the quorum's request to its first committed step "
        f"{first['t'] - opened:.2f} s (quorum, recovery and digest check {first['t_begun'] - opened:.2f} s,"
        f" the step {first['t'] - first['t_begun']:.2f} s; a 3-group step after it "
        f"{usual[len(usual) // 2]:.3f} s); wall {run['wall_s']:.1f} s"
    )


@pytest.mark.timeout(120)
def test_a_joiner_with_a_damaged_copy_is_refused_and_the_others_go_on(tmp_path: Path) -> None:
    """A joiner whose recovered weights differ from the quorum's by one value (a load function
    that perturbs a bias after the guard's load) is refused by the digest check at its first
    step: no group applies that step, the joiner leaves (RecoveryRefused, no incident, no group
    named), and groups 0 and 2 take the step again without it, ending at the weights of a plain
    two-group recomputation."""
    run = _run_join(tmp_path, [0, 2], None, {"damage": True}, DAMAGE_AT, DAMAGE_STEPS)
    recs = run["records"]
    assert run["exitcodes"] == {"g0": 0, "g2": 0, "joiner": 1}
    assert run["incidents"] == []
    refused = recs["joiner"]["refused"]
    j = refused["step"]
    assert DAMAGE_AT <= j < DAMAGE_STEPS and _committed(recs["joiner"]) == []
    mine, *others = (refused["states"][r] for r in (FAULTY, 0, 2))
    assert all(o == others[0] for o in others)
    # Everything equal but the weights digest (torchft step, guard steps, optimizer state).
    assert [m == o for m, o in zip(mine, others[0])] == [True, True, True, False, True]
    for name in ("g0", "g2"):
        r = recs[name]
        at = [a for a in r["attempts"] if a["step"] == j]
        assert [(a["committed"], a["participants"]) for a in at] == [(False, 3), (True, 2)]
        assert at[0]["recovery"]["refused"] == (FAULTY,) and at[0]["incident"] is None
        assert _committed(r) == list(range(DAMAGE_STEPS))
        assert {a["pid"] for a in r["attempts"]} == {run["pids"][name]}
    retaken = min(
        a["t"] for n in ("g0", "g2") for a in recs[n]["attempts"] if a["step"] == j and a["committed"]
    )
    print(
        f"\njoiner refused at step {j}; from the refusal to the others' retaken step: "
        f"{retaken - refused['t']:.2f} s (wall {run['wall_s']:.1f} s)"
    )
    ref = _clean_reference([[0, 2]] * DAMAGE_STEPS)
    for name, t in recs["g0"]["final"].items():
        assert torch.equal(t, recs["g2"]["final"][name]), name
        torch.testing.assert_close(t, ref[name], rtol=1e-5, atol=1e-6)
