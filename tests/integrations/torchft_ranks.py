"""One rank of a torchft replica group of several ranks (DDP inside the group, torchft across),
guarded by ``TorchftGuard``: the body of ``test_torchft_groups.py``'s processes.

Each group has its own TCPStore (on its rank 0), its own gloo process group (torch.distributed's
default group in this process, as under a ``torchrun`` per group) and a ``Manager`` per rank;
rank ``l`` of every group meets rank ``l`` of the others in torchft's ``ProcessGroupGloo``.
A rank's record (or traceback) is saved to ``out/<name>-r<l>.pt``, also when it exits.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
import traceback
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

RANKS = 2
"""Ranks per replica group (unless a plan says otherwise)."""
LR = 1e-2
EXIT_SUSPECT = 87


class Net(nn.Module):
    """A small MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.inp(x)))


def stop(procs: Iterable[Any], lighthouse: Any) -> None:
    """Kill what is still running (a scenario that failed), then stop the lighthouse."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5)
    lighthouse.shutdown()


def batch(shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shard ``shard``'s batch of step ``step`` (a shard per rank: ``RANKS * group + rank``)."""
    g = torch.Generator().manual_seed(1000 * step + shard)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def loss(module: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = b
    return F.mse_loss(module(x), y)


def _local(t: Any) -> torch.Tensor:
    """This rank's part of ``t`` (its shard of a DTensor), on the host."""
    t = t.to_local() if hasattr(t, "to_local") else torch.as_tensor(t)
    return t.detach().contiguous()


def sha(module: nn.Module, opt: torch.optim.Optimizer) -> tuple[str, str]:
    """This rank's weights and AdamW state (its shards under FSDP2), bit for bit (independent of
    the guard's own digests)."""
    w, o = hashlib.sha256(), hashlib.sha256()
    for name, t in sorted(module.state_dict().items()):
        w.update(name.encode())
        w.update(_local(t).numpy().tobytes())
    for p in (p for g in opt.param_groups for p in g["params"]):
        for key, t in sorted(opt.state.get(p, {}).items()):
            o.update(key.encode())
            o.update(_local(t).numpy().tobytes())
    return w.hexdigest(), o.hexdigest()


def reference(schedule: list[list[int]]) -> dict[str, torch.Tensor]:
    """Plain torch, one process: step ``s`` averages the gradients of every rank of the groups in
    ``schedule[s]`` (each rank on its own shard), then AdamW."""
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    for step, groups in enumerate(schedule):
        shards = [RANKS * g + r for g in groups for r in range(RANKS)]
        total = [torch.zeros_like(p) for p in net.parameters()]
        for shard in shards:
            grads = torch.autograd.grad(loss(net, batch(shard, step)), list(net.parameters()))
            total = [t + d for t, d in zip(total, grads)]
        for p, t in zip(net.parameters(), total):
            p.grad = t / len(shards)
        opt.step()
    return {k: v.clone() for k, v in net.state_dict().items()}


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one rank does."""

    name: str
    """The group's record name (``g0``, ``joiner``...)."""
    group: int
    """The replica group's index (its replica id ``replicheck_g<group>``, node ``group<group>``)."""
    rank: int
    """This rank within the group."""
    lighthouse: str
    out: str
    steps: int
    """The planned steps."""
    fault: tuple[int, int] | None = None
    """``(global rank, onset)``: a persistent forward fault on that rank (``ranks * group + rank``)."""
    fail: tuple[int, int] | None = None
    """``(global rank, step)``: the loss function raises there (a user's error, not a device's)."""
    verify_every: int = 2
    join_at: int | None = None
    """The step before which the first groups hold until the replacement heartbeats."""
    joiner: bool = False
    """A replacement, started from other weights once told (``events["go"]``)."""
    ranks: int = RANKS
    """Ranks in each replica group."""
    fsdp: bool = False
    """FSDP2 inside each group (``fully_shard`` per layer over the group's ranks) instead of DDP."""


def main(plan: Plan, events: dict[str, Any]) -> None:
    """One rank: its record (or traceback) to ``out``."""
    record: dict[str, Any] = {"name": plan.name, "rank": plan.rank, "pid": os.getpid(), "attempts": []}
    out = Path(plan.out) / f"{plan.name}-r{plan.rank}.pt"
    try:
        _train(plan, events, record)
    except SystemExit as exc:
        record["exit"], record["t_exit"] = exc.code, time.time()
        torch.save(record, out)
        raise
    except BaseException:
        record["error"] = traceback.format_exc()
        torch.save(record, out)
        raise
    torch.save(record, out)


def _train(plan: Plan, events: dict[str, Any], record: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    from replicheck.faults import Fault
    from replicheck.guard import GuardConfig
    from replicheck.integrations.torchft import TorchftGuard

    torch.set_num_threads(1)
    if plan.joiner:
        events["go"].wait(timeout=60)
    ports = events[f"port-{plan.name}"]
    if plan.rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for _ in range(plan.ranks - 1):
            ports.put(store.port)
    else:
        store = dist.TCPStore("127.0.0.1", ports.get(timeout=60), is_master=False)
    # The group's own process group: torch.distributed's default, as under a torchrun per group.
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("group", store), rank=plan.rank, world_size=plan.ranks
    )
    torch.manual_seed(1 if plan.joiner else 0)  # a joiner's own weights differ from the quorum's
    net = Net()
    if plan.fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in (net.inp, net.out):
            fully_shard(layer)
        fully_shard(net)
    opt = torch.optim.AdamW(net.parameters(), lr=LR)
    ttl = timedelta(seconds=20)
    pg = ProcessGroupGloo(timeout=ttl)
    manager = Manager(
        pg=pg,
        load_state_dict=None,
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=False,
        replica_id=f"replicheck_g{plan.group}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=plan.rank,
        world_size=plan.ranks,
        lighthouse_addr=plan.lighthouse,
        timeout=ttl,
        quorum_timeout=ttl,
        connect_timeout=ttl,
    )
    config = GuardConfig(
        verify_every=plan.verify_every, weights_every=plan.verify_every, incident_dir=plan.out
    )
    me = plan.ranks * plan.group + plan.rank
    failing = [False]

    def loss_fn(module: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        if failing[0]:
            raise ValueError(f"the user's loss failed on rank {me}")
        return loss(module, b)

    tg = TorchftGuard(
        manager, pg, net, opt, loss_fn, config, node=f"group{plan.group}", group=dist.group.WORLD
    )
    if plan.fault is not None:
        target, onset = plan.fault
        fault = Fault.at_forward("inp").scale(3.0, index=5).on_rank(target).persistent(from_step=onset)
        fault.install(net, optimizer=opt, rank=me, world_size=plan.ranks * 3)
    if plan.joiner:
        dist.barrier()  # both ranks' managers are up before the others are told
        if plan.rank == 0:
            events["ready"].set()
    else:
        events["start"].wait(timeout=60)
    while manager.current_step() < plan.steps:
        if not plan.joiner and manager.current_step() == plan.join_at and not events["ready"].is_set():
            events["holding"].set()
            events["ready"].wait(timeout=60)
            time.sleep(0.3)
        s = tg.begin()
        before = sha(net, opt)
        if "first" not in record:
            record["first"] = {
                "step": s,
                "sha": before,
                "guard": (tg.guard.next_step, tg.guard.last_verified_step),
            }
        failing[0] = plan.fail == (me, s)
        try:
            got = tg.step(batch(me, s))
        except Exception as exc:
            record["raised"] = {"step": s, "type": type(exc).__name__, "message": str(exc), "t": time.time()}
            raise
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
            }
        )
    # The whole weights (a collective of the group under FSDP2: every rank of it gets here).
    record["final"] = {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in net.state_dict().items()
    }
    record["final_step"] = manager.current_step()
    manager.shutdown(wait=False)
