"""Replica groups of 2 ranks (DDP inside each group, or FSDP2 sharding the model over the group's
ranks; torchft across the groups) under ``TorchftGuard``, with the real Rust lighthouse and gloo
(``torchft_ranks.py`` is each rank).

One run per kind, 3 groups of 2 ranks: a persistent forward fault on rank 1 of group 1 from ``ONSET`` (a
verification step). Only the guard of rank 1 (its column: rank 1 of each group) sees it; the
groups combine their columns' verdicts, so both ranks of group 1 exit 87, and groups 0 and 2 take
``ONSET`` again without it in the processes they started in. At ``JOIN_AT`` a replacement group
of 2 fresh processes with other weights joins live, heals through torchft's recovery, passes the
recovered-state digest check in both columns, and every surviving rank ends bitwise equal, at
the weights of a plain recomputation of that membership.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torchft_ranks as tr

from replicheck.harness.launch import _context
from replicheck.incident import Continuation, read_incident

STEPS = 8
ONSET = 4
"""The fault's first step, a verification step: caught at once."""
JOIN_AT = 6
"""The step before which groups 0 and 2 hold for the replacement."""
FAULTY = 1
"""The faulty group; its rank 1 (global rank 3) computes wrong."""
HEARTBEAT_MS = 1000


def _run(tmp: Path, fsdp: bool = False) -> dict[str, Any]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=HEARTBEAT_MS
    )
    ctx = _context()
    names = ["g0", "g1", "g2", "joiner"]
    events: dict[str, Any] = {
        "start": ctx.Barrier(3 * tr.RANKS),
        "ready": ctx.Event(),
        "holding": ctx.Event(),
        "go": ctx.Event(),
        **{f"port-{n}": ctx.Queue() for n in names},
    }
    common = {
        "lighthouse": lighthouse.address(),
        "out": str(tmp),
        "steps": STEPS,
        "join_at": JOIN_AT,
        "fsdp": fsdp,
    }
    plans = [
        tr.Plan(name=f"g{g}", group=g, rank=r, fault=(tr.RANKS * FAULTY + 1, ONSET), **common)
        for g in range(3)
        for r in range(tr.RANKS)
    ]
    plans += [tr.Plan(name="joiner", group=FAULTY, rank=r, joiner=True, **common) for r in range(tr.RANKS)]
    procs = {(p.name, p.rank): ctx.Process(target=tr.main, args=(p, events)) for p in plans}
    t0 = time.monotonic()
    try:
        for p in procs.values():
            p.start()
        for r in range(tr.RANKS):
            procs[(f"g{FAULTY}", r)].join(timeout=90)
        events["holding"].wait(timeout=90)
        events["go"].set()
        for p in procs.values():
            p.join(timeout=90)
    finally:
        tr.stop(procs.values(), lighthouse)
    records = {key: torch.load(tmp / f"{key[0]}-r{key[1]}.pt", weights_only=False) for key in procs}
    for key, r in records.items():
        if "error" in r:
            raise AssertionError(f"{key} failed:\n{r['error']}")
    return {
        "records": records,
        "pids": {key: p.pid for key, p in procs.items()},
        "exitcodes": {key: p.exitcode for key, p in procs.items()},
        "wall_s": time.monotonic() - t0,
        "incidents": sorted(tmp.glob("*.json")),
    }


@pytest.fixture(scope="module", params=["ddp", "fsdp2"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scenario with DDP inside each group, and with FSDP2 (each rank holds a shard)."""
    return _run(tmp_path_factory.mktemp(f"groups-{request.param}"), fsdp=request.param == "fsdp2")


def _committed(record: dict[str, Any]) -> list[int]:
    return [a["step"] for a in record["attempts"] if a["committed"]]


@pytest.mark.timeout(200)
def test_both_ranks_of_the_named_group_leave_and_the_others_retake_the_step(run: dict[str, Any]) -> None:
    """The fault on rank 1 of group 1 is caught at ONSET by rank 1's column; one incident names
    group 1 with continuation no_restart; both ranks of group 1 exit 87 (rank 0 on the combined
    verdict, its own column clean); no group commits ONSET then; both ranks of groups 0 and 2
    commit ONSET next with 2 participants, then every planned step once, in the same PIDs."""
    recs, exits = run["records"], run["exitcodes"]
    for r in range(tr.RANKS):
        assert exits[(f"g{FAULTY}", r)] == tr.EXIT_SUSPECT
        assert recs[(f"g{FAULTY}", r)]["exit"] == tr.EXIT_SUSPECT
        assert _committed(recs[(f"g{FAULTY}", r)]) == list(range(ONSET))
    assert len(run["incidents"]) == 1
    incident = read_incident(run["incidents"][0])
    assert incident.continuation == Continuation(mode="no_restart", replica_group=f"group{FAULTY}")
    assert (incident.step, incident.suspect_nodes) == (ONSET, (f"group{FAULTY}",))
    for g in (0, 2):
        for r in range(tr.RANKS):
            rec = recs[(f"g{g}", r)]
            assert exits[(f"g{g}", r)] == 0
            at_onset = [a for a in rec["attempts"] if a["step"] == ONSET]
            assert [(a["committed"], a["participants"]) for a in at_onset] == [(False, 3), (True, 2)]
            assert at_onset[0]["suspects"] == (f"group{FAULTY}",)
            assert at_onset[0]["classification"] == "persistent"
            assert _committed(rec) == list(range(STEPS)) and rec["final_step"] == STEPS
            assert {a["pid"] for a in rec["attempts"]} == {run["pids"][(f"g{g}", r)]}
    detected = min(a["t"] for g in (0, 2) for a in recs[(f"g{g}", 0)]["attempts"] if a["incident"])
    retaken = min(
        a["t"]
        for g in (0, 2)
        for a in recs[(f"g{g}", 0)]["attempts"]
        if a["step"] == ONSET and a["committed"]
    )
    print(f"\n2 ranks per group: detection to the next committed step {retaken - detected:.2f} s")
    assert 0 < retaken - detected < HEARTBEAT_MS / 1000 + 5.0


@pytest.mark.timeout(200)
def test_the_replacement_group_heals_in_both_columns_and_all_end_equal(run: dict[str, Any]) -> None:
    """The replacement's 2 ranks join at JOIN_AT from other weights: in each column the recovered
    state check passes (healed, nothing refused, every group's digests equal), each joiner rank
    starts its first step with the weights and AdamW state of the same rank in group 0, commits
    every later step with 3 participants, and all 6 surviving ranks end bitwise equal, at the
    weights of a plain recomputation of the membership (3 groups, then 2 from ONSET, then 3 from
    the join)."""
    recs = run["records"]
    for r in range(tr.RANKS):
        joiner = recs[("joiner", r)]
        assert run["exitcodes"][("joiner", r)] == 0
        j = joiner["first"]["step"]
        assert j == JOIN_AT
        (attempt,) = [a for a in recs[("g0", r)]["attempts"] if a["step"] == j]
        assert attempt["committed"] and attempt["participants"] == 3
        assert attempt["before"] == joiner["first"]["sha"]
        check = attempt["recovery"]
        assert check["healed"] == (FAULTY,) and check["refused"] == ()
        assert len(set(check["states"])) == 1
        assert _committed(joiner) == list(range(j, STEPS))
        assert all(a["participants"] == 3 for a in joiner["attempts"])
    final = recs[("g0", 0)]["final"]
    for key in [(n, r) for n in ("g0", "g2", "joiner") for r in range(tr.RANKS)]:
        for name, t in final.items():
            assert torch.equal(t, recs[key]["final"][name]), (key, name)
    schedule = [[0, 1, 2]] * ONSET + [[0, 2]] * (JOIN_AT - ONSET) + [[0, 1, 2]] * (STEPS - JOIN_AT)
    ref = tr.reference(schedule)
    for name in final:
        torch.testing.assert_close(final[name], ref[name], rtol=1e-5, atol=1e-6)
    # A membership in which group 1's corrupted ONSET was applied ends elsewhere.
    wrong = tr.reference([[0, 1, 2]] * (ONSET + 1) + [[0, 2]] * (JOIN_AT - ONSET - 1) + [[0, 1, 2]] * 2)
    assert any(not torch.allclose(final[n], wrong[n], rtol=1e-5, atol=1e-6) for n in final)
    print(f"wall {run['wall_s']:.1f} s")


def _run_failing(tmp: Path, ranks: int, fail: tuple[int, int], fsdp: bool = False) -> dict[str, Any]:
    """3 groups of ``ranks`` ranks, 5 planned steps; the loss function raises on ``fail``."""
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=500, heartbeat_timeout_ms=1000
    )
    ctx = _context()
    events: dict[str, Any] = {
        "start": ctx.Barrier(3 * ranks),
        "ready": ctx.Event(),
        "holding": ctx.Event(),
        **{f"port-g{g}": ctx.Queue() for g in range(3)},
    }
    plans = [
        tr.Plan(
            name=f"g{g}",
            group=g,
            rank=r,
            ranks=ranks,
            lighthouse=lighthouse.address(),
            out=str(tmp),
            steps=5,
            fail=fail,
            fsdp=fsdp,
        )
        for g in range(3)
        for r in range(ranks)
    ]
    procs = {(p.name, p.rank): ctx.Process(target=tr.main, args=(p, events)) for p in plans}
    try:
        for p in procs.values():
            p.start()
        for p in procs.values():
            p.join(timeout=60)
    finally:
        tr.stop(procs.values(), lighthouse)
    return {
        "records": {key: torch.load(tmp / f"{key[0]}-r{key[1]}.pt", weights_only=False) for key in procs},
        "exitcodes": {key: p.exitcode for key, p in procs.items()},
    }


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("ranks", "fail", "fsdp"),
    [(1, (1, 2), False), (2, (3, 3), False), (2, (2, 2), False), (2, (3, 2), True), (2, (0, 3), True)],
    ids=["1x3-verify", "2x3", "2x3-verify", "fsdp2-2x3-verify", "fsdp2-2x3"],
)
def test_a_users_error_on_one_rank_ends_every_rank_of_every_group_promptly(
    tmp_path: Path, ranks: int, fail: tuple[int, int], fsdp: bool
) -> None:
    """A loss function that raises on one rank (a user's error: no incident, nobody named) ends
    every rank of every group at that step within seconds, not at torchft's 20 s timeout: the
    failing rank with its own error, the others of its column with the guard's PeerFailed, the
    other ranks of each group with a GuardError naming the group's failed rank (under FSDP2,
    whose failure flags span the job, with PeerFailed too); no rank commits the step, and no
    incident is written."""
    run = _run_failing(tmp_path, ranks, fail, fsdp)
    target, at = fail
    raised = {}
    for (name, r), rec in run["records"].items():
        me = ranks * int(name[1:]) + r
        assert run["exitcodes"][(name, r)] == 1, (name, r)
        assert rec["raised"]["step"] == at
        assert _committed(rec) == list(range(at))
        raised[me] = rec["raised"]
    assert raised[target]["type"] == "ValueError"
    column = {me for me in raised if me % ranks == target % ranks}
    for me, got in raised.items():
        if me == target:
            continue
        if me in column or fsdp:
            # FSDP2's failure flags span the job (its passes are collectives of the group).
            assert got["type"] == "PeerFailed", (me, got)
        else:
            assert got["type"] == "GuardError" and "of this replica group failed" in got["message"], (me, got)
    times = [got["t"] for got in raised.values()]
    assert max(times) - min(times) < 5.0
    assert list(tmp_path.glob("*.json")) == []
