"""What the detection design costs before any implementation choice (CPU, 2 gloo ranks).

The targets of ``make bench`` (ratio of totals at most 1.03, the ordinary DDP step at most 1 %)
are stated against the plain loop. This benchmark measures, in the same run and by the same
interleaving (benchkit/interleave.py), hand-written loops without the guard and the guard itself
against the plain DDP loop, on the model and batch of ``benchmarks/overhead.py`` (8 x
``--seq-len`` tokens per rank):

1. ``replay``: the work a one-sample ring replay cannot skip: every 10 steps the batch runs as
   two passes (the probe's sample under ``no_sync``, then the rest: DDP's split) and one sample
   is recomputed with ``torch.autograd.grad`` on the bare module (the replay of a peer's probe).
   No fingerprint, no exchange, no check.
2. ``hook + row``: no check at all, only the shape of one: a DDP communication hook that does
   what DDP does without a hook (the scaling by 1/world, then the all-reduce) and, after
   the backward, the all-gather of a 72-byte row and its host transfer (the one synchronisation
   that lets every rank stop a step before its update).
3. ``replay + reads``: 1, plus on every step the reads a check of each rank's gradient before the
   reduction and of the reduced gradient after it cannot skip (the local squared norm, the
   scaling as the hook's own pass, one streaming read of the reduced gradient), plus the row.
4. ``guard``: the guard at the published schedule (the ``make bench`` loop).

Loops 1-3 are lower bounds on this machine (one read of each buffer per check, nothing fused, no
Python besides the passes); what the guard's own code adds is the difference between 4 and 3.

    python benchmarks/overhead_floor.py [--rounds 16] [--json out.json]

Prints JSON and a markdown table. Not a test.
"""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations at runtime.
import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch's stubs do not re-export it
from torch.nn.parallel import DistributedDataParallel

from benchkit.interleave import Rounds, run_rounds, summary
from replicheck import fingerprint as fp
from replicheck.guard import Guard, GuardConfig
from replicheck.guard.checks.health import sq_norm
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

BLOCK = 10
"""Steps per round and loop: one verification period of the published schedule."""
ROW_BYTES = 72
"""The guard's step row under DDP (bytes a rank)."""
# torch 2.13 deprecates all_gather_into_tensor for all_gather_single; older ones lack the latter.
_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
LOOPS = ("replay", "hook + row", "replay + reads", "guard")


Seen = dict[str, list[torch.Tensor]]
"""What a hook saw in one step: ``{"norms": [...], "digests": [...]}``, one entry per bucket."""


def _scale_hook(state: Seen, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """What DDP does without a hook, as a hook: multiply by 1/world, all-reduce a sum."""
    buf = bucket.buffer()
    buf.mul_(1.0 / dist.get_world_size())
    return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])


def _reads_hook(state: Seen, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The per-step reads of a gradient check, nothing else: norm, scale, all-reduce, one read."""
    buf = bucket.buffer()
    state["norms"].append(sq_norm(buf))
    buf.mul_(1.0 / dist.get_world_size())
    fut: torch.futures.Future[list[torch.Tensor]] = dist.all_reduce(buf, async_op=True).get_future()

    def after(f: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
        out = f.value()[0]
        state["digests"].append(fp.row_digest(out))
        return out

    return fut.then(after)


def _bench(ctx: RankContext, opts: dict[str, Any]) -> dict[str, Any]:
    model_cfg = DecoderConfig(vocab=1024, d_model=256, n_layers=4, n_heads=8, seq_len=opts["seq_len"])
    batches = [synthetic_batch(model_cfg, step=s, rank=ctx.rank, batch=opts["batch"]) for s in range(BLOCK)]

    def make() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        ddp = DistributedDataParallel(make_model(model_cfg, seed=0))
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    def hand_written(*, replay: bool, hook: Any, row_sync: bool) -> Callable[[int], None]:
        ddp, opt = make()
        params = list(ddp.module.parameters())
        seen: Seen = {"norms": [], "digests": []}
        if hook is not None:
            ddp.register_comm_hook(seen, hook)
        row = torch.zeros(ROW_BYTES // 8, dtype=torch.int64)
        rows = torch.empty(ctx.world_size * row.numel(), dtype=torch.int64)
        n = opts["batch"]

        def step(i: int) -> None:
            b = batches[i]
            opt.zero_grad(set_to_none=True)
            if replay and i % BLOCK == 0:
                probe = {k: v[:1] for k, v in b.items()}
                rest = {k: v[1:] for k, v in b.items()}
                with ddp.no_sync():
                    (lm_loss(ddp, probe) * (1 / n)).backward()
                (lm_loss(ddp, rest) * ((n - 1) / n)).backward()
                torch.autograd.grad(lm_loss(ddp.module, probe) * (1 / n), params)
            else:
                lm_loss(ddp, b).backward()
            if row_sync:
                # What the guard's row carries (the local norm, the reduced digests combined), as
                # one cheap stand-in each: the cost is the gather and its host transfer.
                if seen["norms"]:
                    row[0] = torch.stack(seen["norms"]).sum().sqrt().view(torch.int64)
                    row[1] = torch.stack(seen["digests"]).sum()
                _all_gather(rows, row)
                rows.tolist()
                seen["norms"].clear()
                seen["digests"].clear()
            opt.step()

        return step

    def guarded() -> Callable[[int], None]:
        ddp, opt = make()
        config = GuardConfig(verify_every=BLOCK, weights_every=BLOCK, loss_reduction="sample_mean")
        guard = Guard(ddp, opt, lm_loss, node=ctx.node, config=config)
        return lambda i: guard.step(batches[i])

    plain_ddp, plain_opt = make()

    def plain(i: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        lm_loss(plain_ddp, batches[i]).backward()
        plain_opt.step()

    loops = {
        "replay": hand_written(replay=True, hook=None, row_sync=False),
        "hook + row": hand_written(replay=False, hook=_scale_hook, row_sync=True),
        "replay + reads": hand_written(replay=True, hook=_reads_hook, row_sync=True),
        "guard": guarded(),
    }

    def timer(loop: Callable[[int], None]) -> Callable[[bool, int], float]:
        def timed(other: bool, i: int) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            (loop if other else plain)(i)
            dist.barrier()
            return time.perf_counter() - t0

        return timed

    for loop in loops.values():  # settle buckets, allocator and caches; every loop ends a period
        for i in range(BLOCK):
            timer(loop)(False, i)
            timer(loop)(True, i)
    out: dict[str, Any] = {}
    for name, loop in loops.items():
        r: Rounds = run_rounds(timer(loop), rounds=opts["rounds"], block=BLOCK, verify_every=BLOCK)
        out[name] = summary(r)
    return out


def markdown(result: dict[str, Any]) -> str:
    """The table of the four loops against the plain loop."""
    lines = [
        "| loop | total / plain | plain step | extra per ordinary step | extra per verification step |",
        "|---|---|---|---|---|",
    ]
    for name in LOOPS:
        s = result[name]
        plain_ms = s["plain_step_ms_median"]
        ordinary = s["ordinary_step_extra_ms_median"]
        lines.append(
            f"| {name} | **{s['ratio_of_totals']:.3f}** | {plain_ms:.0f} ms | {ordinary:.2f} ms "
            f"({100 * ordinary / plain_ms:.1f} %) | {s['verification_step_extra_ms_median']:.1f} ms |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16, help="interleaved rounds per loop (default 16)")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step (default 8)")
    parser.add_argument("--json", help="write the figures here as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.batch < 2 or args.seq_len < 2:
        parser.error("--rounds must be at least 1, --batch and --seq-len at least 2")
    opts = {"rounds": args.rounds, "seq_len": args.seq_len, "batch": args.batch}
    started = time.monotonic()
    ranks = run_local(_bench, node_names(2, 1), args=(opts,), timeout=3600)
    result: dict[str, Any] = {
        **ranks[0],
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "tokens_per_rank_step": args.batch * args.seq_len,
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(result, indent=2))
    print(markdown(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
