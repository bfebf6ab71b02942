"""A guarded DDP job as a user writes it for torchrun (gloo, CPU): the tiny decoder, the guard's
replay every 5 steps, the incident written by the guard to ``--incident-dir``, and
``replicheck.elastic.guarded_main`` around ``main`` (start-up check, exit 87, torchrun error file).

``--fault-rank R`` makes rank R produce a NaN weight gradient from step 3 on. Each rank that
gets past the start-up check writes ``started-<restart>-<rank>`` into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from replicheck.elastic import guarded_main

p = argparse.ArgumentParser()
p.add_argument("--incident-dir", required=True)
p.add_argument("--out", required=True)
p.add_argument("--fault-rank", type=int, default=None)
p.add_argument("--steps", type=int, default=12)
ARGS = p.parse_args()
# One process per simulated node (torchrun on one host stands in for a 2-node job).
NODE = f"gpu-node-{os.environ['LOCAL_RANK']}"


@guarded_main(incident_dir=ARGS.incident_dir, node=NODE)
def main() -> int:
    import torch
    import torch.distributed as dist

    from replicheck.faults import Fault
    from replicheck.guard import Guard, GuardConfig
    from replicheck.harness.jobs import JobSpec, batch_for, build
    from replicheck.harness.launch import RankContext
    from replicheck.harness.workloads import DecoderConfig, lm_loss

    torch.set_num_threads(1)
    restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    (Path(ARGS.out) / f"started-{restart}-{rank}").write_text("")
    try:
        spec = JobSpec(model=DecoderConfig(vocab=64, d_model=16, n_layers=1, n_heads=2, seq_len=8), batch=4)
        model, opt = build(spec, RankContext(rank=rank, world_size=world, node="", nodes=()))
        guard = Guard(
            model,
            opt,
            lm_loss,
            config=GuardConfig(verify_every=5, weights_every=5, incident_dir=ARGS.incident_dir),
            node=NODE,
        )
        if ARGS.fault_rank is not None:
            Fault.at_weight_gradient("blocks.0.attn.qkv.weight").persistent(from_step=3).nan().on_rank(
                ARGS.fault_rank
            ).install(model, optimizer=opt, guard=guard, rank=rank)
        for step in range(ARGS.steps):
            guard.step(*batch_for(spec, step, rank))
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
