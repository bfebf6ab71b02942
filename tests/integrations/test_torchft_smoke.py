"""torchft under this project's torch (issue 28, first step): a gloo smoke test of the path a
no-restart recovery would take, with nothing of replicheck's in it yet.

Three replica groups of one rank each, in separate processes, each with its own torchft
``Manager``, against the real Rust lighthouse (in this process, on a free port):

* ``stay`` and ``leave`` train a small MLP together with torchft's per-step quorum,
  ``torchft.DistributedDataParallel`` and ``torchft.Optimizer`` (whose ``step`` asks
  ``Manager.should_commit``);
* at step ``LEAVE_AT`` both groups vote the step down (``Manager.report_error``, the stand-in for
  a guard verdict naming ``leave``), then ``leave`` exits with 87 without shutting anything down;
* ``stay`` goes on in the same process and commits ``LEAVE_AT`` alone once the lighthouse has
  stopped hearing ``leave`` (``heartbeat_timeout_ms``);
* ``join`` starts from other weights, and torchft's live recovery (the quorum's ``heal``, the
  HTTP checkpoint transport) gives it ``stay``'s model and optimizer state; both then commit the
  same steps and end with bitwise-equal weights.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torchft_ranks as tr
from torch import nn

from replicheck.harness.launch import _context

LEAVE_AT = 3
"""The step both groups vote down, after which ``leave`` exits."""
EXTRA = 3
"""Steps ``stay`` and ``join`` commit together before both stop."""
ALONE_CAP = 400
"""Steps ``stay`` may take alone waiting for ``join``: past it the scenario has failed."""
HEARTBEAT_MS = 1000
"""The lighthouse's ``heartbeat_timeout_ms``: how long a silent group still counts as alive."""
EXIT_SUSPECT = 87
"""The exit status of a group named by a verdict (``replicheck.elastic.exit_on_corruption``)."""
ROLE_SEED = {"stay": 0, "leave": 0, "join": 1}
"""Initial weights: ``join`` starts elsewhere, so equal weights later can only come from recovery."""


class _SuspectVerdict(RuntimeError):
    """Stands in for a guard verdict that names a replica group."""


def _digest(module: nn.Module) -> str:
    """A digest of the weights, bit for bit."""
    h = hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _batch(role: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's own shard of step ``step``."""
    g = torch.Generator().manual_seed(1000 * step + sorted(ROLE_SEED).index(role))
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def _replica_group(role: str, lighthouse: str, out_dir: str, start: Any) -> None:
    """One replica group (one rank): train under torchft; write what happened to ``out_dir``
    (or the traceback, for the parent to raise)."""
    try:
        _train(role, lighthouse, Path(out_dir), start)
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out_dir) / f"{role}.pt")
        raise


def _train(role: str, lighthouse: str, out: Path, start: Any) -> None:
    import torch.distributed as dist
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo

    torch.set_num_threads(1)
    record: dict[str, Any] = {"role": role, "pid": os.getpid(), "attempts": [], "t_start": time.time()}
    # Each group is its own torchft world: its own store, its own manager server.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(ROLE_SEED[role])
    net = tr.Net()
    inner = torch.optim.AdamW(net.parameters(), lr=1e-2)
    record["initial_digest"] = _digest(net)

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "optim": inner.state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        net.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    ttl = timedelta(seconds=20)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=ttl),
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=1,
        # Heal inside start_quorum, before the forward pass: the joiner then takes part in the
        # step it recovered at, and its recovered weights can be read before its first update.
        use_async_quorum=False,
        replica_id=f"replicheck_{role}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=ttl,
        quorum_timeout=ttl,
        connect_timeout=ttl,
    )
    ddp = DistributedDataParallel(manager, net)
    opt = Optimizer(manager, inner)
    if start is not None:
        # Both first groups heartbeat before either asks for a quorum: the lighthouse then
        # holds the first quorum for both (at most half the live groups is no quorum).
        start.wait(timeout=30)

    voted_down = False
    together_from: int | None = None
    while True:
        t0 = time.perf_counter()
        opt.zero_grad()  # Manager.start_quorum: the lighthouse's quorum, and healing if behind
        quorum_s = time.perf_counter() - t0
        step = manager.current_step()
        n = manager.num_participants()
        attempt: dict[str, Any] = {"step": step, "participants": n, "quorum_s": quorum_s}
        attempt["digest_before"] = _digest(net)
        x, y = _batch(role, step)
        F.mse_loss(ddp(x), y).backward()
        verdict = role in ("stay", "leave") and step == LEAVE_AT and not voted_down
        if verdict:
            # Every group has reached the same verdict (the guard's comparisons are collective),
            # so each one votes its own should_commit down: torchft's vote is per group.
            manager.report_error(_SuspectVerdict("replica group 'leave' computed wrong"))
            voted_down = True
        opt.step()  # Manager.should_commit, then the inner step only if it says yes
        attempt.update(committed=manager.current_step() == step + 1, t=time.time(), pid=os.getpid())
        record["attempts"].append(attempt)
        if verdict and role == "leave":
            record["left_at"] = time.time()
            torch.save(record, out / f"{role}.pt")
            # A dead group: nothing shut down, its manager server just stops heartbeating.
            os._exit(EXIT_SUSPECT)
        if role == "stay" and voted_down and n == 1 and attempt["committed"]:
            (out / "alone").touch()
        if together_from is None and n == 2 and (role == "join" or (voted_down and not verdict)):
            together_from = step
        if together_from is not None and manager.current_step() >= together_from + EXTRA:
            break
        if n == 1:
            if manager.current_step() > LEAVE_AT + ALONE_CAP:
                break
            time.sleep(0.05)  # alone, waiting for the joiner: leave it the CPU
    record["final"] = {k: v.clone() for k, v in state_dict()["model"].items()}
    record["final_optim"] = state_dict()["optim"]
    record["final_step"] = manager.current_step()
    manager.shutdown(wait=False)
    torch.save(record, out / f"{role}.pt")


def _wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f} s for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the leave-and-join scenario once; the tests below read its records."""
    from torchft._torchft import LighthouseServer

    out = tmp_path_factory.mktemp("torchft")
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=HEARTBEAT_MS
    )
    # The harness's forkserver (torch preloaded): a spawned group would spend seconds importing.
    ctx = _context()
    start = ctx.Barrier(2)
    procs: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        for role in ("stay", "leave"):
            procs[role] = ctx.Process(
                target=_replica_group, args=(role, lighthouse.address(), str(out), start)
            )
            procs[role].start()
        procs["leave"].join(timeout=40)
        # The joiner starts once 'stay' has committed alone, so the leave is measured on its own.
        _wait_for(lambda: (out / "alone").exists(), 20, "'stay' to commit a step alone")
        procs["join"] = ctx.Process(
            target=_replica_group, args=("join", lighthouse.address(), str(out), None)
        )
        procs["join"].start()
        for role in ("stay", "join"):
            procs[role].join(timeout=40)
    finally:
        tr.stop(procs.values(), lighthouse)
    records = {role: torch.load(out / f"{role}.pt", weights_only=False) for role in procs}
    for role, record in records.items():
        if "error" in record:
            raise AssertionError(f"replica group {role!r} failed:\n{record['error']}")
    return {
        "records": records,
        "pids": {role: p.pid for role, p in procs.items()},
        "exitcodes": {role: p.exitcode for role, p in procs.items()},
        "wall_s": time.monotonic() - t0,
    }


def _committed(record: dict[str, Any]) -> list[int]:
    return [a["step"] for a in record["attempts"] if a["committed"]]


@pytest.mark.timeout(120)
def test_groups_commit_every_step_once_and_the_voted_down_step_is_redone_alone(
    scenario: dict[str, Any],
) -> None:
    """The two groups commit steps 0..LEAVE_AT-1 together; at LEAVE_AT both vote no (no group
    applies it); 'stay' then commits LEAVE_AT itself alone, and every later step once, no gap."""
    stay, leave = scenario["records"]["stay"], scenario["records"]["leave"]
    assert _committed(leave) == list(range(LEAVE_AT))
    assert [a["participants"] for a in leave["attempts"]] == [2] * (LEAVE_AT + 1)
    assert (leave["attempts"][-1]["step"], leave["attempts"][-1]["committed"]) == (LEAVE_AT, False)
    steps = _committed(stay)
    assert steps == list(range(stay["final_step"]))
    voted = [a for a in stay["attempts"] if a["step"] == LEAVE_AT]
    assert [(a["participants"], a["committed"]) for a in voted] == [(2, False), (1, True)]


@pytest.mark.timeout(120)
def test_the_suspect_group_exits_and_the_other_goes_on_in_the_same_process(
    scenario: dict[str, Any],
) -> None:
    """'leave' exits with 87; 'stay' commits every step in the process it started in and ends
    cleanly; the first step after the leave comes within the lighthouse's heartbeat timeout."""
    stay = scenario["records"]["stay"]
    assert scenario["exitcodes"] == {"stay": 0, "leave": EXIT_SUSPECT, "join": 0}
    assert {a["pid"] for a in stay["attempts"]} == {scenario["pids"]["stay"]} == {stay["pid"]}
    redo = next(a for a in stay["attempts"] if a["step"] == LEAVE_AT and a["committed"])
    gap = redo["t"] - scenario["records"]["leave"]["left_at"]
    assert gap < HEARTBEAT_MS / 1000 + 5.0, f"{gap:.2f} s from the leave to the next commit"


@pytest.mark.timeout(120)
def test_the_joiner_recovers_live_and_ends_bitwise_equal(scenario: dict[str, Any]) -> None:
    """'join' starts from other weights, is healed at 'stay''s current step with its model (digest
    equal before either updates), commits the same steps, and ends with equal weights and Adam state."""
    stay, join = scenario["records"]["stay"], scenario["records"]["join"]
    assert join["initial_digest"] != stay["initial_digest"]
    first = join["attempts"][0]
    assert first["step"] > LEAVE_AT and first["participants"] == 2
    same_step = next(a for a in stay["attempts"] if a["step"] == first["step"] and a["participants"] == 2)
    assert first["digest_before"] == same_step["digest_before"]
    assert _committed(join) == list(range(first["step"], stay["final_step"]))
    assert join["final_step"] == stay["final_step"]
    assert stay["final"].keys() == join["final"].keys()
    for name, tensor in stay["final"].items():
        assert torch.equal(tensor, join["final"][name]), name
    for sa, sb in zip(
        stay["final_optim"]["state"].values(), join["final_optim"]["state"].values(), strict=True
    ):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])
        assert torch.equal(torch.as_tensor(sa["step"]), torch.as_tensor(sb["step"]))
