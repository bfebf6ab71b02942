"""Guarded training under torchft: a ``torchrun`` per replica group, DDP inside each group.

A replica group named by ``--fault`` that computes wrong is voted out by every group at the
guard's next verification step; its ranks exit with 87 (the incident in ``--incident-dir``, with
``continuation: no_restart``) and the other groups take the same step again without it, in the
same processes. On one machine (``pip install 'replicheck[torchft]'``)::

    torchft_lighthouse --min_replicas 2 --join_timeout_ms 500 --heartbeat_timeout_ms 1000 &
    for g in 0 1 2; do
      torchrun --nproc-per-node 2 --master-port $((29600 + g)) examples/torchft_ddp.py \\
          --group $g --lighthouse http://localhost:29510 --steps 16 \\
          --incident-dir /tmp/incidents --fault 1:1:6 &
    done; wait

Each group's rank 0 prints one line per step. See ``docs/no-restart.md``.
"""

from __future__ import annotations

import argparse
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    """A small residual MLP."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.inp = nn.Linear(16, width)
        self.hidden = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + torch.relu(self.hidden(h)))


def batch(shard: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step`` (a synthetic regression task, a shard per rank)."""
    g = torch.Generator().manual_seed(10_000 * step + shard)
    x = torch.randn(32, 16, generator=g)
    return x, x[:, :4].sin() + 0.1 * torch.randn(32, 4, generator=g)


def loss_fn(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = b
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return F.mse_loss(out.float(), y)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--group", type=int, required=True, help="this replica group's index")
    p.add_argument("--lighthouse", required=True, help="the torchft lighthouse, e.g. http://localhost:29510")
    p.add_argument("--steps", type=int, default=16, help="steps to train (default 16)")
    p.add_argument("--verify-every", type=int, default=2, help="the guard's verification period (default 2)")
    p.add_argument("--incident-dir", default=None, help="where the incident record is written")
    p.add_argument(
        "--fault",
        default=None,
        metavar="GROUP:RANK:STEP",
        help="inject a persistent forward fault on that rank of that group from that step (a demo)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from torchft import Manager, ProcessGroupGloo

    from replicheck.elastic import exit_on_corruption
    from replicheck.faults import Fault
    from replicheck.guard import CorruptionDetected, GuardConfig
    from replicheck.integrations.torchft import TorchftGuard

    # The group's own process group: torchrun's environment, this group's ranks only.
    dist.init_process_group("gloo")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ttl = timedelta(seconds=30)
    pg = ProcessGroupGloo(timeout=ttl)  # rank `rank` of every group: torchft's cross-group group
    manager = Manager(
        pg=pg,
        load_state_dict=None,  # TorchftGuard registers the model, optimizer and guard state
        state_dict=None,
        min_replica_size=2,
        use_async_quorum=False,
        replica_id=f"group{args.group}",
        lighthouse_addr=args.lighthouse,
        rank=rank,
        world_size=ranks,
        timeout=ttl,
        quorum_timeout=ttl,
        connect_timeout=ttl,
    )
    config = GuardConfig(
        verify_every=args.verify_every,
        weights_every=args.verify_every,
        max_grad_norm=1.0,
        incident_dir=args.incident_dir,
    )
    guard = TorchftGuard(
        manager, pg, model, optimizer, loss_fn, config, node=f"group{args.group}", group=dist.group.WORLD
    )
    if args.fault:
        group, fault_rank, onset = (int(v) for v in args.fault.split(":"))
        if group == args.group and fault_rank == rank:
            Fault.at_forward("out").scale(4.0, index=3).on_rank(0).persistent(from_step=onset).install(
                model, optimizer=optimizer, rank=0, world_size=1
            )
    while manager.current_step() < args.steps:
        step = guard.begin()
        try:
            got = guard.step(batch(ranks * args.group + rank, step))
        except CorruptionDetected as exc:  # no group can be named alone: today's stop
            exit_on_corruption(exc.incident)
        if rank != 0:
            continue
        if got.committed and got.result is not None:
            print(
                f"group {args.group}: step {step} committed by {got.participants} groups, "
                f"loss {got.result.loss:.4f}, grad norm {got.result.grad_norm:.3f}"
                + (", verified" if got.result.verified else ""),
                flush=True,
            )
        elif got.incident is not None:
            print(
                f"group {args.group}: step {step} voted down: {got.incident.suspect_nodes[0]} named "
                f"({got.incident.classification}); taking step {step} again without it",
                flush=True,
            )
        else:
            print(f"group {args.group}: step {step} voted down; taking it again", flush=True)
    if rank == 0:
        print(f"group {args.group}: done at step {manager.current_step()}", flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
