"""One rank of a small guarded job that then exits the way a training script does (run by
test_clean_exit.py as a plain subprocess, so its exit status and stderr are its own)."""

from __future__ import annotations

import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from replicheck.faults import Fault
from replicheck.guard import CorruptionDetected, Guard, GuardConfig
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch


def main() -> int:
    rank, world, port, scenario = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world + 1, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    cfg = DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=4, seq_len=16)
    model = DistributedDataParallel(make_model(cfg))
    opt = torch.optim.AdamW(model.parameters())
    config = GuardConfig(verify_every=2, weights_every=2, loss_reduction="sample_mean")
    guard = Guard(model, opt, lm_loss, config=config, node=f"node{rank}")
    if scenario == "fault":
        Fault.at_forward("blocks.0.ffn").persistent(from_step=3).bitflip(bit=22).on_rank(1).install(
            model, optimizer=opt, guard=guard
        )
    caught = None
    try:
        for s in range(6):
            guard.step(synthetic_batch(cfg, step=s, rank=rank, batch=4))
    except CorruptionDetected as exc:
        caught = exc.incident.step
    if scenario != "no_destroy":
        dist.destroy_process_group()
    print(f"rank {rank} finished, incident at {caught}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
