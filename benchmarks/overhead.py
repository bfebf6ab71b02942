"""Step-time overhead of the guard against the plain DDP loop, measured in the same run.

Two gloo ranks train the Llama-style decoder (d_model 256, 4 layers, 8 sequences x 256 tokens
per rank per step) twice, in one pair of processes: a plain DDP loop and a guarded one. Their
steps alternate one by one (so drift of the machine hits both alike); each round is one whole
verification period (``--block`` steps) of each loop, and its ratio is guarded / plain time. The guarded configuration is the published schedule: replay every 10
steps, weights and optimizer state every 10 steps, exact mode, every per-step check on.

    python benchmarks/overhead.py [--rounds 16] [--block 10] [--json out.json]

Prints per-round ratios (guarded / plain), the median and the spread. Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard import Guard, GuardConfig
from replicheck.guard.config import Mode
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

MODEL = DecoderConfig(vocab=1024, d_model=256, n_layers=4, n_heads=8, seq_len=256)


def _bench(ctx: RankContext, rounds: int, block: int, batch: int, mode: Mode, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = DistributedDataParallel(make_model(MODEL, seed=0))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    plain_model, plain_opt = make()
    guarded_model, guarded_opt = make()
    guard = Guard(
        guarded_model,
        guarded_opt,
        lm_loss,
        node=ctx.node,
        config=GuardConfig(verify_every=10, weights_every=10, mode=mode, loss_reduction="sample_mean"),
    )
    batches = [synthetic_batch(MODEL, step=s, rank=ctx.rank, batch=batch) for s in range(block)]

    def plain_step(b: dict[str, torch.Tensor]) -> None:
        plain_opt.zero_grad(set_to_none=True)
        lm_loss(plain_model, b).backward()
        plain_opt.step()

    def timed(guarded: bool, b: dict[str, torch.Tensor]) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        if guarded:
            guard.step(b)
        else:
            plain_step(b)
        dist.barrier()
        return time.perf_counter() - t0

    for i in range(warmup):  # settle DDP buckets, allocator and caches on both loops
        timed(False, batches[i % block])
        timed(True, batches[i % block])
    while guard.next_step % 10:  # start the timed rounds on a verification step
        timed(True, batches[0])
    plain_t: list[float] = []
    guarded_t: list[float] = []
    verify_extra: list[float] = []  # paired differences, guarded - plain, per step
    ordinary_extra: list[float] = []
    for r in range(rounds):
        # Plain and guarded steps alternate one by one (order swapped every step), so anything
        # that slows the machine for a while slows both loops alike.
        p = g = 0.0
        for i, b in enumerate(batches):
            if (i + r) % 2:
                tg = timed(True, b)
                tp = timed(False, b)
            else:
                tp = timed(False, b)
                tg = timed(True, b)
            g, p = g + tg, p + tp
            (verify_extra if i % 10 == 0 else ordinary_extra).append(tg - tp)
        plain_t.append(p)
        guarded_t.append(g)
    return {
        "plain": plain_t,
        "guarded": guarded_t,
        "threads": torch.get_num_threads(),
        "verify_extra": verify_extra,
        "ordinary_extra": ordinary_extra,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--block", type=int, default=10, help="steps per timed block (a multiple of 10)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--mode", choices=["exact", "tolerant"], default="exact")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    out = run_local(
        _bench,
        node_names(2, 1),
        args=(args.rounds, args.block, args.batch, args.mode, args.warmup),
        timeout=3600,
    )[0]
    ratios = [g / p for g, p in zip(out["guarded"], out["plain"])]
    step_ms = statistics.median(out["plain"]) / args.block * 1e3
    summary = {
        "model": "d_model 256, 4 layers, 8 heads, vocab 1024",
        "tokens_per_rank_per_step": args.batch * MODEL.seq_len,
        "ranks": 2,
        "mode": args.mode,
        "schedule": "verify_every=10, weights_every=10, all per-step checks",
        "plain_step_ms_median": round(step_ms, 1),
        "ratios": [round(r, 4) for r in ratios],
        "median_ratio": round(statistics.median(ratios), 4),
        "quartiles": [round(q, 4) for q in statistics.quantiles(ratios, n=4)] if len(ratios) > 1 else [],
        "min_ratio": round(min(ratios), 4),
        "max_ratio": round(max(ratios), 4),
        "ratio_of_totals": round(sum(out["guarded"]) / sum(out["plain"]), 4),
        "verification_step_extra_ms_median": round(statistics.median(out["verify_extra"]) * 1e3, 1),
        "ordinary_step_extra_ms_median": round(statistics.median(out["ordinary_extra"]) * 1e3, 1),
        "torch": torch.__version__,
        "threads_per_rank": out["threads"],
    }
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(summary, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
