"""One task of a guarded DDP training job under ``srun`` (gloo over 127.0.0.1): the tiny decoder,
a verified checkpoint every ``--checkpoint-every`` steps, the guard's replay every 10.

With ``--fault-rank R --fault-onset S`` rank R corrupts one forward activation from step S on
(a persistent fault). On detection the lowest healthy rank writes the incident, annotated with
its recommended checkpoint, to ``--incident-dir``, and every task exits with EXIT_CORRUPTION.
With ``--resume-checkpoint PATH`` the job restores that checkpoint and continues after it.
Each task records ``<node> <value>`` in ``--out``: ``rank-R`` (where it ran), ``resumed-R``
(the step resumed from) and ``done-R`` (the last step run, when it completes).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True, help="rendezvous port on 127.0.0.1 (rank 0 hosts it)")
    p.add_argument("--incident-dir", required=True)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--stop-step", type=int, default=40, help="run up to this step (exclusive)")
    p.add_argument("--checkpoint-every", type=int, default=5)
    p.add_argument("--fault-rank", type=int, default=None)
    p.add_argument("--fault-onset", type=int, default=0)
    p.add_argument("--resume-checkpoint", default=None, help="path of the checkpoint to resume from")
    args = p.parse_args()

    import torch
    import torch.distributed as dist

    from replicheck.checkpoint import CheckpointStore
    from replicheck.codes import EXIT_CORRUPTION
    from replicheck.faults import Fault
    from replicheck.guard import CorruptionDetected, Guard, GuardConfig
    from replicheck.guard.runtime import RuntimeInfo
    from replicheck.harness.jobs import JobSpec, batch_for, build
    from replicheck.harness.launch import RankContext
    from replicheck.harness.workloads import DecoderConfig, lm_loss
    from replicheck.incident import write_incident

    torch.set_num_threads(1)
    rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
    here = RuntimeInfo.from_env().node.name
    out = Path(args.out)
    (out / f"rank-{rank}").write_text(f"{here} {rank}\n")
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{args.port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=60),
    )
    try:
        spec = JobSpec(model=DecoderConfig(vocab=64, d_model=32, n_layers=2, n_heads=2, seq_len=16), batch=4)
        model, opt = build(spec, RankContext(rank=rank, world_size=world, node=here, nodes=()))
        store = CheckpointStore(args.checkpoint_dir)
        start = 0
        if args.resume_checkpoint is not None:
            wanted = Path(args.resume_checkpoint).resolve()
            (ckpt,) = [c for c in store.checkpoints() if c.path.resolve() == wanted]
            start = store.load(ckpt, model, opt) + 1
            (out / f"resumed-{rank}").write_text(f"{here} {start - 1}\n")
        # node=None: the guard names this task's node from the environment (SLURMD_NODENAME).
        verified = store.loaded.checkpoint.last_verified_step if store.loaded is not None else None
        guard = Guard(
            model,
            opt,
            lm_loss,
            config=GuardConfig(
                verify_every=10,
                weights_every=10,
                start_step=start,
                resume_verified_step=verified,
                loss_reduction="sample_mean",
            ),
        )
        if args.fault_rank is not None:
            # Bad hardware on one rank: the public injector, a no-op on every other rank.
            Fault.at_forward("blocks.0.ffn").persistent(from_step=args.fault_onset).scale(2.0).on_rank(
                args.fault_rank
            ).install(model, optimizer=opt, guard=guard, rank=rank)
        try:
            for step in range(start, args.stop_step):
                guard.step(*batch_for(spec, step, rank))
                if step % args.checkpoint_every == 0:
                    store.save(step, model, opt, guard=guard)
        except CorruptionDetected as exc:
            incident = exc.incident
            healthy = [r for r in range(world) if r not in incident.suspect_ranks]
            if rank == (healthy[0] if healthy else 0):
                write_incident(store.annotate(incident), args.incident_dir)
            dist.barrier()  # the incident is on disk before any task exits
            print(f"rank {rank}: {exc}", file=sys.stderr, flush=True)
            return EXIT_CORRUPTION
        (out / f"done-{rank}").write_text(f"{here} {args.stop_step - 1}\n")
        return 0
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # A normal interpreter exit: the task's exit status is what main() returned (no abort at exit,
    # see replicheck.guard.transport.inflight).
    sys.exit(main())
