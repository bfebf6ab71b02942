"""``replicheck demo --no-restart``: the faulty replica group leaves, training goes on, a spare
joins live (issue 28; ``docs/no-restart.md``, "The demo").

On one machine, with the real torchft lighthouse and gloo:

1. three torchft replica groups (one rank each, each its own process) train a small MLP under
   :class:`~replicheck.integrations.torchft.TorchftGuard`; a persistent fault hits group 1 from
   step ``onset``; the guard verifies every ``verify_every`` steps and names group 1 at the first
   verification after the onset. Group 1 votes down and exits 87; group 0 writes the incident
   (``continuation`` no_restart); groups 0 and 2 take the same step again in their own processes;
2. the controller (SQLite, ``local`` backend, the job registered with a ``join_command`` that
   starts the spare replica group) ingests the incident, cordons, triages, asks for approval and
   starts the spare, whose first quorum recovers the model and optimizer state live from a
   healthy group (torchft's recovery); training ends at the planned step on three groups;
3. today's path on the same model and schedule, measured in the same run: the job stops at the
   detection (every group exits 87) and restarts, the spare in group 1's place, from the newest
   verified checkpoint;
4. the final weights against a plain recomputation with the same membership schedule.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import nn

from replicheck.demo import DemoError, _claim_out_dir, _Printer, _seal_out_dir, _settle

JOB_ID = "demo-job"
"""The job the groups belong to (the incident's ``job_id``, registered with the backend)."""
FAULTY = 1
"""The faulty replica group's index."""
LR = 1e-2
HEARTBEAT_MS = 1000
"""Lighthouse heartbeat timeout: short, so a silent group is dropped quickly."""
JOIN_MS = 500
"""Lighthouse join timeout: how long a quorum waits for a straggler."""
EXIT_SUSPECT = 87


@dataclass(frozen=True, kw_only=True)
class NoRestartConfig:
    """What ``replicheck demo --no-restart`` runs."""

    out_dir: str = "demo-out-no-restart"
    """Output directory (new, empty, or an earlier demo's): facts JSON, incidents, controller DB."""
    steps: int = 60
    """Planned training length: steps 0..steps-1 are committed."""
    onset: int = 23
    """First step the persistent fault on group 1 acts."""
    verify_every: int = 10
    """The guard's replay and weight-check period (the fault is caught at the first multiple of it
    at or after ``onset``)."""
    join_by: int | None = None
    """The step from which the two remaining groups wait for the spare (so it joins before the
    end however long approval takes); ``None``: ``steps - 15``."""
    approve: Callable[[str], bool] | None = None
    """Asks a person to approve the replacement (given the prompt); ``None``: approve automatically."""
    approver: str = "demo --yes"
    """Name recorded for the approval."""
    timeout_s: float = 300.0
    """Longest wait for any one phase (processes, the spare, approval: the two remaining groups go
    on alone after it)."""

    @property
    def detect_step(self) -> int:
        """The first verification step at or after the onset."""
        return -(-self.onset // self.verify_every) * self.verify_every

    @property
    def hold_step(self) -> int:
        """Where the remaining groups wait for the spare."""
        return self.join_by if self.join_by is not None else self.steps - 15

    @property
    def checkpoint_step(self) -> int:
        """The newest verified step before the detection (today's path saves after it)."""
        return self.detect_step - self.verify_every


def _validate(cfg: NoRestartConfig) -> None:
    if cfg.verify_every < 1 or cfg.onset < 1:
        raise DemoError("--verify-every and --onset must be >= 1")
    if cfg.checkpoint_step < 0 or cfg.onset <= cfg.checkpoint_step:
        raise DemoError("the onset must fall after a verified step (onset > verify_every)")
    if not cfg.detect_step < cfg.hold_step < cfg.steps - 1:
        raise DemoError(
            f"need detection step ({cfg.detect_step}) < join-by step ({cfg.hold_step}) < steps - 1 ({cfg.steps - 1})"
        )


# --- one replica group ---------------------------------------------------------------------------


class _Net(nn.Module):
    """A small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def _batch(shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica group ``shard``'s data for ``step`` (the spare takes the departed group's shard)."""
    g = torch.Generator().manual_seed(1000 * step + shard)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _loss(module: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(module(x), y)


def _fault(group: int = FAULTY) -> Any:
    from replicheck.faults import Fault

    return Fault.at_forward("inp").scale(3.0, index=5).on_rank(group)


def _digest(net: nn.Module, opt: torch.optim.Optimizer) -> str:
    """sha256 of the weights and the optimizer's tensors (the state torchft recovers)."""
    h = hashlib.sha256()
    for t in net.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor):
                h.update(v.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True, kw_only=True)
class _Member:
    """One replica group's orders."""

    shard: int
    """Its data shard (and the fault's rank index)."""
    name: str
    """Its node name (the replica group's name in incidents)."""
    lighthouse: str
    """The lighthouse's address."""
    records: str
    """Where its record goes (``<name>.pt``)."""
    incidents: str
    """The guard's incident directory."""
    steps: int
    """Stop once this many steps are committed."""
    verify_every: int
    """The guard's replay and weight-check period."""
    min_size: int
    """The manager's ``min_replica_size``: 2 lets a group leave; 3 makes a departure today's stop."""
    seed: int = 0
    """Seed of the initial weights (the spare's differ: what it trains with must come from the recovery)."""
    fault_onset: int | None = None
    """The persistent fault's first step on this group (``None``: no fault)."""
    fault_transient: bool = False
    """The fault acts on ``fault_onset`` only (a one-step fault) instead of from it on."""
    fault_until: int | None = None
    """Remove the fault before this step (the reference run: the window the demo applied)."""
    leave_at: int | None = None
    """Shut down cleanly before this step (the reference run: group 1 leaving without a verdict)."""
    holding: str | None = None
    """Create this file when the hold begins (the reference run starts its spare then)."""
    hold_step: int | None = None
    """Wait before this step until ``ready`` or ``no_join`` exists (the spare is coming, or not)."""
    ready: str | None = None
    """File the spare creates once it is about to ask for its first quorum."""
    no_join: str | None = None
    """File the demo creates when no spare will come (approval declined)."""
    announce: bool = False
    """Create ``ready`` just before the first quorum (the spare)."""
    await_hold: str | None = None
    """The spare: wait until this file exists (the remaining groups hold at the join-by step)
    before it starts its manager, so it joins at that step in the demo and the reference alike,
    however early the controller starts it."""
    checkpoint_step: int | None = None
    """Save a checkpoint once this step is committed (today's path, shard 0)."""
    checkpoint: str | None = None
    """Where that checkpoint goes."""
    resume_from: str | None = None
    """Load this checkpoint first (today's path after the stop)."""
    timeout_s: float = 300.0
    """Longest wait at the start barrier or the hold."""


def _member(m: _Member, start: Any | None) -> None:
    """A replica group's process: its record (or traceback) goes to ``records/<name>.pt``."""
    record: dict[str, Any] = {"name": m.name, "pid": os.getpid(), "t_start": time.time(), "attempts": []}
    out = Path(m.records) / f"{m.name}.pt"
    # torchft's logs, the guard's summary on exit: next to the record, not over the demo's story.
    log = os.open(str(Path(m.records) / f"{m.name}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        _train(m, start, record)
    except SystemExit as exc:
        record.update(exit=exc.code, t_exit=time.time())
        torch.save(record, out)
        raise
    except BaseException:
        record["error"] = traceback.format_exc()
        torch.save(record, out)
        raise
    record["exit"] = 0
    torch.save(record, out)


def _train(m: _Member, start: Any | None, record: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from replicheck.elastic import exit_on_corruption
    from replicheck.guard import CorruptionDetected, GuardConfig
    from replicheck.integrations.torchft import TorchftGuard

    torch.set_num_threads(1)
    if m.await_hold is not None:
        deadline = time.monotonic() + m.timeout_s
        while not Path(m.await_hold).exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the remaining groups never reached the join-by step ({m.await_hold})")
            time.sleep(0.02)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    torch.manual_seed(m.seed)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    ttl = timedelta(seconds=30)
    pg = ProcessGroupGloo(timeout=ttl)
    manager = Manager(
        pg=pg,
        # What a joining group receives (model, optimizer, guard state) TorchftGuard registers.
        load_state_dict=None,
        state_dict=None,
        min_replica_size=m.min_size,
        use_async_quorum=False,
        replica_id=f"replicheck_{m.name}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=m.lighthouse,
        timeout=ttl,
        quorum_timeout=ttl,
        connect_timeout=ttl,
    )
    if m.resume_from is not None:
        ckpt = torch.load(m.resume_from, weights_only=False)
        net.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optim"])
        manager.load_state_dict(ckpt["torchft"])
        record["checkpoint_read"] = {"path": m.resume_from, "step": ckpt["torchft"]["step"], "t": time.time()}
    config = GuardConfig(
        verify_every=m.verify_every, weights_every=m.verify_every, incident_dir=m.incidents, job_id=JOB_ID
    )
    tg = TorchftGuard(manager, pg, net, opt, _loss, config, node=m.name)
    fault = None
    if m.fault_onset is not None:
        at = _fault(m.shard)
        at = at.transient(step=m.fault_onset) if m.fault_transient else at.persistent(from_step=m.fault_onset)
        fault = at.install(net, optimizer=opt, rank=m.shard, world_size=3)
    if start is not None:
        start.wait(timeout=m.timeout_s)  # every group heartbeats before any asks for the first quorum
    if m.announce and m.ready is not None:
        Path(m.ready).write_text(str(os.getpid()))
    held = False
    while manager.current_step() < m.steps:
        if fault is not None and m.fault_until is not None and manager.current_step() >= m.fault_until:
            fault.remove()
            fault = None
        if m.leave_at is not None and manager.current_step() >= m.leave_at:
            record["left_at"] = manager.current_step()
            break
        if m.hold_step is not None and not held and manager.current_step() >= m.hold_step:
            if m.holding is not None:
                Path(m.holding).write_text(str(manager.current_step()))
            record["hold"] = _hold(m, record)
            held = True
        s = tg.begin()
        t_begin = time.time()
        # After the quorum (and any recovery it brought): what this group steps from.
        at_begin = _digest(net, opt)
        try:
            got = tg.step(_batch(m.shard, s))
        except CorruptionDetected as exc:
            record["stopped"] = {"step": s, "classification": exc.incident.classification, "t": time.time()}
            exit_on_corruption(exc.incident)
        record["attempts"].append(
            {
                "step": got.step,
                "committed": got.committed,
                "participants": got.participants,
                "pid": os.getpid(),
                "t_begin": t_begin,
                "t": got.t_committed if got.t_committed is not None else time.time(),
                "digest_at_begin": at_begin,
                "verified": got.result.verified if got.result is not None else None,
                "incident": got.incident.id if got.incident is not None else None,
                "suspects": list(got.incident.suspect_nodes) if got.incident is not None else None,
                "classification": got.incident.classification if got.incident is not None else None,
            }
        )
        if got.committed and got.step == m.checkpoint_step and m.checkpoint is not None and m.shard == 0:
            # Today's verified checkpoint: the state after a step the guard verified.
            torch.save(
                {
                    "model": net.state_dict(),
                    "optim": opt.state_dict(),
                    "torchft": {"step": got.step + 1, "batches_committed": got.step + 1},
                },
                m.checkpoint,
            )
    record["final"] = {k: v.clone() for k, v in net.state_dict().items()}
    record["final_digest"] = _digest(net, opt)
    record["final_step"] = manager.current_step()
    manager.shutdown(wait=False)


def _hold(m: _Member, record: dict[str, Any]) -> dict[str, Any]:
    """Wait for the spare (or word that none comes), so it joins before the planned end."""
    t0 = time.time()
    deadline = time.monotonic() + m.timeout_s
    while time.monotonic() < deadline:
        if m.ready is not None and Path(m.ready).exists():
            time.sleep(0.3)  # its first quorum request reaches the lighthouse
            return {"waited_s": time.time() - t0, "spare": True}
        if m.no_join is not None and Path(m.no_join).exists():
            return {"waited_s": time.time() - t0, "spare": False}
        time.sleep(0.02)
    return {"waited_s": time.time() - t0, "spare": False, "timed_out": True}


# --- the spare, started by the controller's join action -----------------------------------------


def _spare_main(argv: list[str]) -> int:
    """``python -m replicheck.demo_no_restart spare ORDERS REPLICA_GROUP NODE``: the join command."""
    p = argparse.ArgumentParser(prog="replicheck.demo_no_restart spare")
    p.add_argument("orders")
    p.add_argument("replica_group")
    p.add_argument("node")
    args = p.parse_args(argv)
    orders = json.loads(Path(args.orders).read_text())
    m = _Member(**{**orders, "name": args.node})
    try:
        _member(m, None)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


# --- running groups ------------------------------------------------------------------------------


def _lighthouse(min_replicas: int) -> Any:
    # The lighthouse logs every quorum at INFO; its logger reads this when torchft is first imported.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    return LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=JOIN_MS, heartbeat_timeout_ms=HEARTBEAT_MS
    )


class _Procs(list[Any]):
    """The started processes, holding their start barrier (its semaphore must outlive their start)."""

    barrier: Any = None


def _start(members: list[_Member]) -> _Procs:
    from replicheck.harness.launch import _context

    ctx = _context()
    procs = _Procs()
    procs.barrier = ctx.Barrier(len(members))
    procs.extend(ctx.Process(target=_member, args=(m, procs.barrier), name=m.name) for m in members)
    for p in procs:
        p.start()
    return procs


def _wait(procs: list[Any], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    late = [p.name for p in procs if p.exitcode is not None and p.exitcode < 0]
    if late:
        raise DemoError(f"replica group(s) {late} did not finish within {timeout:.0f} s")


def _record(records: Path, name: str) -> dict[str, Any]:
    path = records / f"{name}.pt"
    if not path.exists():
        raise DemoError(f"replica group {name} left no record ({path})")
    r: dict[str, Any] = torch.load(path, weights_only=False)
    if "error" in r:
        raise DemoError(f"replica group {name} failed:\n{r['error']}")
    return r


def _committed(r: dict[str, Any]) -> list[dict[str, Any]]:
    return [a for a in r["attempts"] if a["committed"]]


# --- the demo ------------------------------------------------------------------------------------


def run_no_restart_demo(cfg: NoRestartConfig, out: TextIO = sys.stdout) -> dict[str, Any]:
    """Play the demo (module docstring); return the facts (also written to ``out_dir/demo.json``)."""
    _validate(cfg)
    import importlib.util

    # Looked up, not imported: the lighthouse's logger reads RUST_LOG at torchft's first import.
    if importlib.util.find_spec("torchft") is None:
        raise DemoError("--no-restart needs torchft: pip install 'replicheck[torchft]'")
    say = _Printer(out)
    root = Path(cfg.out_dir)
    _claim_out_dir(root)
    root = root.resolve()
    for d in ("incidents", "records", "resume-path"):
        (root / d).mkdir()
    say(
        "cluster",
        f"3 torchft replica groups x 1 rank (group0, group1, group2) + spare0; real lighthouse "
        f"(heartbeat {HEARTBEAT_MS} ms, join {JOIN_MS} ms); guard exact mode, replay and weights every "
        f"{cfg.verify_every}; {cfg.steps} steps",
    )
    say("fault", f"persistent, group1, from step {cfg.onset} ({_fault().persistent(cfg.onset).describe()})")
    facts: dict[str, Any] = {
        "steps": cfg.steps,
        "onset": cfg.onset,
        "verify_every": cfg.verify_every,
        "heartbeat_timeout_ms": HEARTBEAT_MS,
        "join_timeout_ms": JOIN_MS,
    }
    t0 = time.monotonic()
    facts["no_restart"] = _no_restart(cfg, root, say)
    facts["no_restart"]["wall_s"] = round(time.monotonic() - t0, 2)
    t1 = time.monotonic()
    facts["resume_path"] = _resume_path(cfg, root, say)
    facts["resume_path"]["wall_s"] = round(time.monotonic() - t1, 2)
    facts["final_weights"] = _final_check(cfg, facts["no_restart"], root, say)
    return _finish(cfg, root, say, facts)


def _no_restart(cfg: NoRestartConfig, root: Path, say: _Printer) -> dict[str, Any]:
    from replicheck.controller import LocalBackend
    from replicheck.incident import read_incident

    records, incidents = root / "records", root / "incidents"
    ready, no_join = root / "records" / "spare.ready", root / "records" / "spare.no-join"
    holding = root / "records" / "holding"
    lighthouse = _lighthouse(min_replicas=2)
    common = dict(
        lighthouse=lighthouse.address(),
        records=str(records),
        incidents=str(incidents),
        steps=cfg.steps,
        verify_every=cfg.verify_every,
        min_size=2,
        timeout_s=cfg.timeout_s,
    )
    # The join command's orders: the spare takes group 1's data shard, starts from other weights
    # (another seed: what it trains with comes from the recovery) and has no fault.
    orders = root / "spare-orders.json"
    orders.write_text(
        json.dumps(
            {
                **common,
                "shard": FAULTY,
                "seed": 1,
                "ready": str(ready),
                "announce": True,
                "await_hold": str(holding),
            }
        )
    )
    backend = LocalBackend(root / "controller.db")
    names = [f"group{i}" for i in range(3)]
    for n in names:
        backend.add_node(n)
    backend.add_node("spare0", spare=True)
    backend.add_job(
        JOB_ID,
        names,
        join_command=[
            sys.executable,
            "-m",
            "replicheck.demo_no_restart",
            "spare",
            str(orders),
            "{replica_group}",
            "{node}",
        ],
    )
    members = [
        _Member(
            shard=i,
            name=names[i],
            fault_onset=cfg.onset if i == FAULTY else None,
            hold_step=cfg.hold_step,
            holding=str(holding) if i == 0 else None,
            ready=str(ready),
            no_join=str(no_join),
            **common,
        )
        for i in range(3)
    ]
    say("train", "replica groups group0, group1, group2 start (one process each)")
    procs = _start(members)
    try:
        incident_path = _await_incident(incidents, procs, cfg.timeout_s)
        incident = read_incident(incident_path)
        say(
            "incident",
            f"step {incident.step}: check {incident.check!r} names {list(incident.suspect_nodes)} "
            f"({incident.classification}); no group applied step {incident.step}; continuation "
            f"{incident.continuation.mode if incident.continuation else None} (replica group "
            f"{incident.continuation.replica_group if incident.continuation else None}); group1 exits "
            f"{EXIT_SUSPECT}, group0 and group2 go on",
            incident=incident.to_dict(),
        )
        transitions, joined = _control(cfg, root, say, backend, incident)
        if not joined:
            no_join.write_text("dismissed")
        _wait(procs, cfg.timeout_s)
        spare = _await_spare(records, backend, cfg.timeout_s) if joined else None
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
        backend.close()
    recs = [_record(records, n) for n in names]
    return _no_restart_facts(cfg, say, incident, transitions, recs, spare, [p.exitcode for p in procs])


def _await_incident(incidents: Path, procs: list[Any], timeout: float) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = sorted(incidents.glob("*.json"))
        if found:
            return found[0]
        if all(not p.is_alive() for p in procs):
            break
        time.sleep(0.05)
    raise DemoError("no incident was written: the fault was not detected")


def _control(
    cfg: NoRestartConfig, root: Path, say: _Printer, backend: Any, incident: Any
) -> tuple[list[dict[str, Any]], bool]:
    """Cordon, triage, approval, replace, join: ``(transitions, whether the spare was started)``."""
    from replicheck.controller import Controller, ControllerConfig

    for n in incident.suspect_nodes:
        backend.set_healthy(n, False)  # the simulated bad hardware also fails its self-test
    ctl_cfg = ControllerConfig(
        apply=True,
        auto_approve=False,
        triage_persistent=True,
        incident_dirs=(str(root / "incidents"),),
        retry_base_delay_s=0.0,
    )
    transitions: list[dict[str, Any]] = []

    def on_transition(t: Any) -> None:
        transitions.append({"from": t.from_state.value, "to": t.to_state.value, "reason": t.reason})
        say("controller", f"{t.from_state.value} -> {t.to_state.value}: {t.reason}")

    with Controller(
        root / "controller.db", backend=backend, config=ctl_cfg, on_transition=on_transition
    ) as ctl:
        ctl.ingest_dir(root / "incidents")
        _settle(ctl)
        record = next(r for r in ctl.records() if r.incident_id == incident.id)
        if record.state.value == "awaiting_approval":
            group = incident.continuation.replica_group if incident.continuation else "?"
            prompt = (
                f"Replace node(s) {', '.join(incident.suspect_nodes)} and start a replacement for replica "
                f"group {group} that joins live (incident {incident.id})? [y/N] "
            )
            if cfg.approve is None:
                say("approval", f"approved automatically as {cfg.approver!r} (run at a terminal to be asked)")
                ctl.approve(incident.id, by=cfg.approver)
            elif cfg.approve(prompt):
                ctl.approve(incident.id, by=cfg.approver)
            else:
                ctl.dismiss(incident.id, by=cfg.approver)
                say("approval", "dismissed: no replacement; the two groups finish alone")
            _settle(ctl)
    joins = [j for j in backend.join_requests() if j.status == "started"]
    for j in joins:
        say("join", f"controller started the replacement for {j.replica_group} on {j.node} (pid {j.pid})")
    return transitions, bool(joins)


def _await_spare(records: Path, backend: Any, timeout: float) -> dict[str, Any]:
    join = next(j for j in backend.join_requests() if j.status == "started")
    path = records / f"{join.node}.pt"
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if not path.exists():
        if join.pid is not None and Path(f"/proc/{join.pid}").exists():
            os.kill(join.pid, 9)  # our own child: the controller started it for this demo
        log = records / f"{join.node}.log"
        tail = log.read_text()[-3000:] if log.exists() else ""
        raise DemoError(f"the spare {join.node} did not finish within {timeout:.0f} s\n{tail}")
    time.sleep(0.1)  # the record is written whole before the process exits; let it exit
    r = _record(records, join.node)
    r["join_pid"] = join.pid
    return r


def _no_restart_facts(
    cfg: NoRestartConfig,
    say: _Printer,
    incident: Any,
    transitions: list[dict[str, Any]],
    recs: list[dict[str, Any]],
    spare: dict[str, Any] | None,
    exitcodes: list[int | None],
) -> dict[str, Any]:
    survivors = [recs[0], recs[2]]
    detect = incident.step
    t_detect = min(a["t"] for r in survivors for a in r["attempts"] if a["incident"] is not None)
    t_next = min(a["t"] for r in survivors for a in _committed(r) if a["step"] == detect)
    committed = [[a["step"] for a in _committed(r)] for r in survivors]
    pids_same = all({a["pid"] for a in r["attempts"]} == {r["pid"]} for r in survivors)
    join_step = None
    recovered_equal = None
    if spare is not None and _committed(spare):
        first = _committed(spare)[0]
        join_step = first["step"]
        at_join = [a for r in survivors for a in r["attempts"] if a["step"] == join_step and a["committed"]]
        recovered_equal = all(a["digest_at_begin"] == first["digest_at_begin"] for a in at_join)
    finals = [r["final_digest"] for r in survivors] + ([spare["final_digest"]] if spare else [])
    # Lost: planned steps no group committed; a step is never committed twice without a restart.
    planned = set(range(cfg.steps))
    lost = len(planned - set(committed[0]))
    facts = {
        "incident": incident.to_dict(),
        "detected_at": detect,
        "transitions": transitions,
        "exitcodes": {f"group{i}": c for i, c in enumerate(exitcodes)},
        "steps_lost": lost,
        "steps_recomputed": len(committed[0]) - len(set(committed[0])),
        "checkpoints_read": sum(1 for r in [*recs, *([spare] if spare else [])] if "checkpoint_read" in r),
        "detection_to_next_commit_s": round(t_next - t_detect, 3),
        "next_committed_step": detect,
        "survivors_same_pids": pids_same,
        "survivors_committed_every_step_once": all(c == list(range(cfg.steps)) for c in committed),
        "approved": spare is not None,
        "join_step": join_step,
        "spare_pid": spare["pid"] if spare else None,
        "spare_recovered_state_equal": recovered_equal,
        "spare_committed": [a["step"] for a in _committed(spare)] if spare else [],
        "final_step": recs[0]["final_step"],
        "final_digests_equal": len(set(finals)) == 1,
        "hold": recs[0].get("hold"),
        "membership": {
            "3 groups": [0, detect - 1],
            "2 groups": [detect, (join_step or cfg.steps) - 1],
            "3 groups again": [join_step, cfg.steps - 1] if join_step is not None else None,
        },
        "corrupted_steps_applied": [cfg.onset, detect - 1],
        "_finals": recs[0]["final"],
        "_final_digest": recs[0]["final_digest"],
    }
    say(
        "continued",
        f"group0 and group2 committed step {detect} {facts['detection_to_next_commit_s']:.2f} s after the "
        f"detection, in their original processes (same pids: {pids_same})",
    )
    if spare is not None:
        say(
            "joined",
            f"spare0 joined live at step {join_step}: its recovered weights and optimizer state "
            f"{'equal' if recovered_equal else 'DIFFER from'} the healthy groups' (the guard's recovered-state digest check passed; sha256 checked again from outside the guard); training "
            f"ended at step {facts['final_step']} on 3 groups (final digests equal: {facts['final_digests_equal']})",
        )
    return facts


def _resume_path(cfg: NoRestartConfig, root: Path, say: _Printer) -> dict[str, Any]:
    """Today's path on the same model and schedule: stop at the detection, restart from the
    newest verified checkpoint with the spare in group 1's place."""
    base = root / "resume-path"
    (base / "incidents").mkdir()
    (base / "records").mkdir()
    ckpt = base / f"checkpoint-step{cfg.checkpoint_step}.pt"
    say(
        "today",
        f"today's path, same model and schedule: stop at the detection, resume from step {cfg.checkpoint_step}'s checkpoint",
    )
    lighthouse = _lighthouse(min_replicas=3)
    try:
        common = dict(
            lighthouse=lighthouse.address(),
            records=str(base / "records"),
            incidents=str(base / "incidents"),
            verify_every=cfg.verify_every,
            # 3: a departure would leave too few groups, so the verdict is today's stop.
            min_size=3,
            timeout_s=cfg.timeout_s,
        )
        first = [
            _Member(
                shard=i,
                name=f"group{i}",
                steps=cfg.steps,
                fault_onset=cfg.onset if i == FAULTY else None,
                checkpoint_step=cfg.checkpoint_step,
                checkpoint=str(ckpt),
                **common,
            )
            for i in range(3)
        ]
        procs = _start(first)
        _wait(procs, cfg.timeout_s)
        stopped = [_record(base / "records", f"group{i}") for i in range(3)]
        exits = [p.exitcode for p in procs]
        t_detect = min(r["stopped"]["t"] for r in stopped if "stopped" in r)
        detect = min(r["stopped"]["step"] for r in stopped if "stopped" in r)
        say(
            "stopped",
            f"every group stopped at step {detect} (exit codes {exits}); the job restarts from {ckpt.name}",
        )
        names = ["group0", "spare0", "group2"]
        again = [
            _Member(
                shard=i,
                name=f"{names[i]}-resumed",
                steps=detect + 1,
                resume_from=str(ckpt),
                **common,
            )
            for i in range(3)
        ]
        procs = _start(again)
        _wait(procs, cfg.timeout_s)
        resumed = [_record(base / "records", m.name) for m in again]
    finally:
        lighthouse.shutdown()
    firsts = [_committed(r)[0] for r in resumed]
    t_next = min(a["t"] for a in firsts)
    t_regained = min(a["t"] for r in resumed for a in _committed(r) if a["step"] == detect)
    first_step = firsts[0]["step"]
    facts = {
        "detected_at": detect,
        "exitcodes": exits,
        "checkpoint_step": cfg.checkpoint_step,
        "resumed_at_step": first_step,
        "steps_lost": detect - first_step,
        "checkpoints_read": 1,
        "checkpoint_loads": sum(1 for r in resumed if "checkpoint_read" in r),
        "detection_to_next_commit_s": round(t_next - t_detect, 3),
        "detection_to_step_regained_s": round(t_regained - t_detect, 3),
        "incident_continuation": json.loads(next((base / "incidents").glob("*.json")).read_text()).get(
            "continuation"
        ),
    }
    say(
        "resumed",
        f"first committed step after the restart: {first_step}, {facts['detection_to_next_commit_s']:.2f} s after "
        f"the detection; step {detect} committed again {facts['detection_to_step_regained_s']:.2f} s after it "
        f"({facts['steps_lost']} steps recomputed, 1 checkpoint read by {facts['checkpoint_loads']} groups)",
    )
    return facts


def _reference(
    cfg: NoRestartConfig, detect: int, join_step: int | None, faulty_window: bool
) -> dict[str, torch.Tensor]:
    """Plain torch in one process with the run's membership: 3 groups before the detection, groups
    0 and 2 from it until the join, 3 again after; each group's gradient on its own shard,
    averaged, then AdamW. ``faulty_window``: group 1's forward in steps onset..detect-1 runs with
    the same fault (what the run applied before the detection)."""
    from replicheck.guard.context import running

    torch.manual_seed(0)
    net = _Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    handle = None
    if faulty_window:
        handle = (
            _fault().persistent(from_step=cfg.onset).install(net, optimizer=opt, rank=FAULTY, world_size=3)
        )
    joined = join_step if join_step is not None else cfg.steps
    params = list(net.parameters())
    for step in range(cfg.steps):
        groups = [0, 1, 2] if step < detect or step >= joined else [0, 2]
        grads: list[torch.Tensor] | None = None
        for g in groups:
            if g == FAULTY and step < detect and faulty_window:
                with running(step, "train"):
                    loss = _loss(net, _batch(g, step))
            else:
                loss = _loss(net, _batch(g, step))
            d = torch.autograd.grad(loss, params)
            grads = list(d) if grads is None else [a + b for a, b in zip(grads, d)]
        assert grads is not None
        for p, t in zip(params, grads):
            p.grad = t / len(groups)
        opt.step()
    if handle is not None:
        handle.remove()
    return {k: v.clone() for k, v in net.state_dict().items()}


def _reference_run(cfg: NoRestartConfig, root: Path, nr: dict[str, Any]) -> dict[str, Any]:
    """The same torchft machinery with the demo's membership schedule and no detection: group 1
    carries the fault on the steps the demo applied (onset..detection-1), then shuts down cleanly
    before the detection step; the spare is started when the other two reach the demo's join step."""
    from replicheck.harness.launch import _context

    base = root / "reference"
    (base / "incidents").mkdir(parents=True)
    (base / "records").mkdir()
    detect, join = nr["detected_at"], nr["join_step"]
    ready, holding = base / "spare.ready", base / "holding"
    lighthouse = _lighthouse(min_replicas=2)
    try:
        common = dict(
            lighthouse=lighthouse.address(),
            records=str(base / "records"),
            incidents=str(base / "incidents"),
            steps=cfg.steps,
            verify_every=cfg.verify_every,
            min_size=2,
            timeout_s=cfg.timeout_s,
        )
        members = [
            _Member(
                shard=i,
                name=f"group{i}",
                fault_onset=cfg.onset if i == FAULTY else None,
                fault_until=detect if i == FAULTY else None,
                leave_at=detect if i == FAULTY else None,
                hold_step=join if i != FAULTY else None,
                holding=str(holding) if i == 0 else None,
                ready=str(ready),
                **common,
            )
            for i in range(3)
        ]
        procs = _start(members)
        names = ["group0", "group2"]
        if join is not None:
            deadline = time.monotonic() + cfg.timeout_s
            while not holding.exists() and time.monotonic() < deadline and any(p.is_alive() for p in procs):
                time.sleep(0.02)
            spare = _Member(shard=FAULTY, name="spare0", seed=1, ready=str(ready), announce=True, **common)
            sp = _context().Process(target=_member, args=(spare, None), name="spare0")
            sp.start()
            procs.append(sp)
            names.append("spare0")
        _wait(procs, cfg.timeout_s)
        recs = [_record(base / "records", n) for n in names]
    finally:
        lighthouse.shutdown()
    ref_join = _committed(recs[2])[0]["step"] if len(recs) > 2 and _committed(recs[2]) else None
    return {"join_step": ref_join, "final_digests": [r["final_digest"] for r in recs]}


def _final_check(cfg: NoRestartConfig, nr: dict[str, Any], root: Path, say: _Printer) -> dict[str, Any]:
    finals: dict[str, torch.Tensor] = nr.pop("_finals")
    digest: str = nr.pop("_final_digest")
    say(
        "reference",
        "a torchft run with the same membership schedule and no detection, for the bit-for-bit check",
    )
    ref = _reference_run(cfg, root, nr)
    same_schedule = ref["join_step"] == nr["join_step"]
    torchft_ref = {
        "join_step": ref["join_step"],
        "same_membership": same_schedule,
        "bitwise": (same_schedule and all(d == digest for d in ref["final_digests"]))
        if same_schedule
        else None,
    }
    same_window = _reference(cfg, nr["detected_at"], nr["join_step"], faulty_window=True)
    clean = _reference(cfg, nr["detected_at"], nr["join_step"], faulty_window=False)

    def compare(ref: dict[str, torch.Tensor]) -> dict[str, Any]:
        bitwise = all(torch.equal(finals[k], ref[k]) for k in finals)
        diff = max(float((finals[k] - ref[k]).abs().max()) for k in finals)
        close = all(torch.allclose(finals[k], ref[k], rtol=1e-5, atol=1e-6) for k in finals)
        return {"bitwise": bitwise, "max_abs_diff": diff, "close_rtol_1e-5": close}

    facts = {
        "torchft_same_schedule": torchft_ref,
        "with_the_undetected_window": compare(same_window),
        "fault_free": compare(clean),
    }
    if torchft_ref["bitwise"] is None:
        say(
            "proof",
            f"the reference's spare joined at {ref['join_step']}, not {nr['join_step']}: not compared",
        )
    else:
        join = nr["join_step"]
        after = f"2 to {join - 1}, 3 after" if join is not None else "2 after"
        say(
            "proof",
            "final weights and AdamW state (sha256) "
            + ("are bit-for-bit equal to" if torchft_ref["bitwise"] else "DIFFER from")
            + f" the torchft reference run (3 groups to {nr['detected_at'] - 1}, {after}; "
            f"group1's steps {cfg.onset}-{nr['detected_at'] - 1} as applied)",
        )
    w = facts["with_the_undetected_window"]
    verdict = (
        "bit for bit" if w["bitwise"] else ("to rounding (rtol 1e-5)" if w["close_rtol_1e-5"] else "NOT")
    )
    say(
        "proof",
        f"final weights equal {verdict} a plain recomputation with the same membership schedule and group1's "
        f"steps {cfg.onset}-{nr['detected_at'] - 1} as the run applied them (max |diff| {w['max_abs_diff']:.3g}); "
        f"against a fault-free recomputation they differ by {facts['fault_free']['max_abs_diff']:.3g}: the "
        "undetected window is kept on this path (today's path rolls it back)",
    )
    return facts


def _finish(cfg: NoRestartConfig, root: Path, say: _Printer, facts: dict[str, Any]) -> dict[str, Any]:
    nr, rp = facts["no_restart"], facts["resume_path"]
    facts["faster_than_resume"] = nr["detection_to_next_commit_s"] < rp["detection_to_next_commit_s"]
    facts["ok"] = bool(
        nr["steps_lost"] == 0
        and nr["checkpoints_read"] == 0
        and nr["survivors_committed_every_step_once"]
        # A replacement a person declined is not a failure of the demo; one that never joined is.
        and (nr["join_step"] is not None or not nr["approved"])
        and nr["spare_recovered_state_equal"] is not False
        and nr["final_digests_equal"]
        and facts["final_weights"]["with_the_undetected_window"]["close_rtol_1e-5"]
        and facts["final_weights"]["torchft_same_schedule"]["bitwise"] is not False
    )
    lines = [
        "no restart (group1 leaves, "
        + ("spare0 joins live):" if nr["join_step"] is not None else "no replacement joined):"),
        f"  steps lost: {nr['steps_lost']}",
        f"  checkpoints read: {nr['checkpoints_read']}",
        f"  detection to next committed step: {nr['detection_to_next_commit_s']:.2f} s (step {nr['next_committed_step']})",
        "today's path (stop, resume from the newest verified checkpoint), same run:",
        f"  steps lost: {rp['steps_lost']}",
        f"  checkpoints read: {rp['checkpoints_read']}",
        f"  detection to next committed step: {rp['detection_to_next_commit_s']:.2f} s (step {rp['resumed_at_step']}); "
        f"to step {rp['detected_at']} again: {rp['detection_to_step_regained_s']:.2f} s",
    ]
    for line in lines:
        say.out.write(line + "\n")
    say.out.flush()
    facts["timeline"] = say.timeline
    path = root / "demo.json"
    path.write_text(json.dumps(facts, indent=2, default=str))
    _seal_out_dir(root)
    say("files", f"{path}, {root / 'incidents'}, {root / 'controller.db'}")
    return facts


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "spare":
        sys.exit(_spare_main(sys.argv[2:]))
    sys.exit("usage: python -m replicheck.demo_no_restart spare ORDERS REPLICA_GROUP NODE")
