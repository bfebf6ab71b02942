"""A short guarded 2-rank gloo job run as plain processes, to check that each one exits cleanly.

Rank 0 hosts the rendezvous store on a free port (port 0) and writes the port to ``--port-file``;
the other ranks wait for that file. Every verification pattern runs (replay every 2 steps,
weights every 3), then the process group is destroyed (unless ``--no-destroy``) and the process
returns from ``main`` normally.
"""

from __future__ import annotations

import argparse
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch


def _store(rank: int, world: int, port_file: Path) -> dist.TCPStore:
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        tmp = port_file.with_suffix(".tmp")
        tmp.write_text(str(store.port))
        tmp.rename(port_file)
        return store
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 did not publish the store port")
        time.sleep(0.05)
    return dist.TCPStore("127.0.0.1", int(port_file.read_text()), world, is_master=False)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--port-file", type=Path, required=True)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--no-destroy", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)
    store = _store(args.rank, args.world, args.port_file)
    dist.init_process_group(
        "gloo", store=store, rank=args.rank, world_size=args.world, timeout=timedelta(seconds=60)
    )
    cfg = DecoderConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, seq_len=8)
    model = DistributedDataParallel(make_model(cfg, seed=0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guard = Guard(
        model, opt, lm_loss, config=GuardConfig(verify_every=2, weights_every=3), node=f"n{args.rank}"
    )
    for step in range(args.steps):
        guard.step(synthetic_batch(cfg, step=step, rank=args.rank, batch=4))
    if not args.no_destroy:
        dist.destroy_process_group()
    print(f"rank {args.rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
