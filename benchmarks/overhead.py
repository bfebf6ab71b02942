"""Step-time overhead of the guard against the plain loop, measured in the same run (CPU, 2 gloo ranks).

Two gloo ranks train the Llama-style decoder (d_model 256, 4 layers, 8 sequences x ``--seq-len``
tokens per rank per step) as a plain DDP loop and as guarded loops, all in one pair of processes
(``--parallel fsdp``: both loops sharded with FSDP2 instead):

1. the published schedule (replay, weights and optimizer state every 10 steps, exact mode, every
   per-step check on): ``--rounds`` interleaved rounds (default 24);
2. latency-first (replay, weights and optimizer state every step): ``--latency-rounds`` rounds;
3. the latency-first step's cost per component (replay, split, digests, the step's all-gather,
   the per-forward failure flag...), timed over ``--breakdown-steps`` more steps in the same
   processes by wrapping the guard's phases with ``perf_counter`` (benchkit/phases.py).

Plain and guarded steps alternate one by one, the order swapped every step; a round is 10 steps of
each loop (whole verification periods). Headline: total guarded time / total plain time over all
rounds; the median of per-round ratios and the quartiles are secondary (benchkit/interleave.py).

    python benchmarks/overhead.py [--rounds 24] [--json out.json] [--markdown out.md]
    python benchmarks/overhead.py --parallel fsdp [--check-reduced off]

``--check-reduced off`` turns off the per-step check of the reduced gradient (DDP: its digest;
plain FSDP2: the reduce-scatter check), to show what the rest of the guard costs.

Prints the figures as JSON and as markdown tables. Not a test.
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

from benchkit.interleave import run_rounds, summary
from benchkit.phases import GUARD_PHASES, SHARDED_PHASES, PhaseTimer
from replicheck.guard import Guard, GuardConfig
from replicheck.guard.config import Mode
from replicheck.harness.jobs import shard
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

BLOCK = 10
"""Steps per round and loop: one verification period of the published schedule."""


def _model(seq_len: int) -> DecoderConfig:
    return DecoderConfig(vocab=1024, d_model=256, n_layers=4, n_heads=8, seq_len=seq_len)


def _bench(ctx: RankContext, opts: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    cfg_model = _model(opts["seq_len"])

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        bare = make_model(cfg_model, seed=0)
        model = shard(bare, ctx.world_size) if opts["parallel"] == "fsdp" else DistributedDataParallel(bare)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    def guarded(every: int) -> Guard:
        model, opt = make()
        config = GuardConfig(
            verify_every=every,
            weights_every=every,
            mode=opts["mode"],
            loss_reduction="sample_mean",
            check_reduced=opts["check_reduced"],
        )
        return Guard(model, opt, lm_loss, node=ctx.node, config=config)

    plain_model, plain_opt = make()
    guards = {"every_10": guarded(10), "latency_first": guarded(1)}
    batches = [synthetic_batch(cfg_model, step=s, rank=ctx.rank, batch=opts["batch"]) for s in range(BLOCK)]
    plain_parts: list[tuple[float, float]] = []  # (forward + backward, optimizer) of timed plain steps

    def plain_step(b: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        plain_opt.zero_grad(set_to_none=True)
        lm_loss(plain_model, b).backward()
        t1 = time.perf_counter()
        plain_opt.step()
        plain_parts.append((t1 - t0, time.perf_counter() - t1))

    def timer(guard: Guard) -> Any:
        def timed(use_guard: bool, i: int) -> float:
            dist.barrier()
            t0 = time.perf_counter()
            if use_guard:
                guard.step(batches[i])
            else:
                plain_step(batches[i])
            dist.barrier()
            return time.perf_counter() - t0

        return timed

    for guard in guards.values():
        timed = timer(guard)
        for i in range(opts["warmup"]):  # settle DDP buckets, allocator and caches on both loops
            timed(False, i % BLOCK)
            timed(True, i % BLOCK)
        while guard.next_step % guard.config.verify_every:  # rounds start on a verification step
            timed(True, 0)
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    for name, guard in guards.items():
        rounds = opts["rounds"] if name == "every_10" else opts["latency_rounds"]
        out[name] = run_rounds(
            timer(guard), rounds=rounds, block=BLOCK, verify_every=guard.config.verify_every
        )

    # The latency-first step by component: the same guard, plain steps interleaved as before.
    guard = guards["latency_first"]
    timed = timer(guard)
    phases = PhaseTimer(SHARDED_PHASES if opts["parallel"] == "fsdp" else GUARD_PHASES)
    guarded_t: list[float] = []
    plain_t: list[float] = []
    per_step: list[dict[str, float]] = []
    plain_parts.clear()
    with phases.installed():
        for i in range(opts["breakdown_steps"]):
            plain_t.append(timed(False, i % BLOCK))
            phases.reset()
            guarded_t.append(timed(True, i % BLOCK))
            per_step.append(dict(phases.totals))
    med = statistics.median
    names = sorted({k for d in per_step for k in d})
    out["breakdown"] = {
        "steps": len(guarded_t),
        "guarded_step_s": med(guarded_t),
        "plain_step_s": med(plain_t),
        "plain_forward_backward_s": med(fb for fb, _ in plain_parts),
        "plain_optimizer_s": med(o for _, o in plain_parts),
        "components_s": {k: med(d.get(k, 0.0) for d in per_step) for k in names},
        "missing": phases.missing,
    }
    return out


SPLIT_PARTS = ("own probe: split-off forward + backward", "training passes (rest of the batch)")


def _breakdown_rows(b: dict[str, Any]) -> tuple[list[dict[str, Any]], float]:
    """Per-component extra cost of a latency-first step over the plain step, in ms; and the rest."""
    comp = dict(b["components_s"])
    plain_ms = b["plain_step_s"] * 1e3
    rows: list[dict[str, Any]] = []
    if all(k in comp for k in SPLIT_PARTS):
        split = sum(comp.pop(k) for k in SPLIT_PARTS) - b["plain_forward_backward_s"]
        rows.append(
            {
                "component": "split: probe + rest instead of one pass, vs the plain forward + backward",
                "s": split,
            }
        )
    rows += [{"component": k, "s": v} for k, v in comp.items()]
    rows.sort(key=lambda r: -r["s"])
    for r in rows:
        r["ms_per_step"] = round(r.pop("s") * 1e3, 2)
        r["share_of_plain_step"] = round(r["ms_per_step"] / plain_ms, 4)
    extra_ms = (b["guarded_step_s"] - b["plain_step_s"]) * 1e3
    main_thread = sum(r["ms_per_step"] for r in rows if "[other thread]" not in r["component"])
    return rows, round(extra_ms - main_thread, 2)


def _row(name: str, schedule: str, s: dict[str, Any]) -> str:
    q = s["quartiles"]
    iqr = f"{q[0]:.3f} – {q[2]:.3f}" if q else "n/a"
    return (
        f"| {name} | {schedule} | **{s['ratio_of_totals']:.3f}** | {s['median_ratio']:.3f} | {iqr} | "
        f"{s['rounds']} | {s['plain_step_ms_median']:.0f} ms | {s['verification_step_extra_ms_median']} ms | "
        + (
            f"{s['ordinary_step_extra_ms_median']} ms |"
            if s["ordinary_step_extra_ms_median"] is not None
            else "– |"
        )
    )


def markdown(summary_: dict[str, Any]) -> str:
    """The tables docs/results/overhead.md includes."""
    lines = [
        "| row | schedule | total guarded / total plain | median of rounds | IQR | rounds | plain step | "
        "extra per verification step (median) | extra per ordinary step (median) |",
        "|---|---|---|---|---|---|---|---|---|",
        _row("published schedule", "replay + weights every 10", summary_["every_10"]),
        _row("latency-first", "replay + weights every step", summary_["latency_first"]),
        "",
        f"Latency-first step by component (median of {summary_['breakdown']['steps']} steps, "
        f"plain step {summary_['breakdown']['plain_step_ms']} ms, guarded step "
        f"{summary_['breakdown']['guarded_step_ms']} ms):",
        "",
        "| component | ms per step | share of the plain step |",
        "|---|---|---|",
    ]
    b = summary_["breakdown"]
    for r in b["components"]:
        lines.append(f"| {r['component']} | {r['ms_per_step']} | {r['share_of_plain_step']:.1%} |")
    lines.append(f"| rest (comm hook, optimizer gate, row building, timer) | {b['unattributed_ms']} | – |")
    if b["missing"]:
        lines += ["", f"Not found in this version of the guard (not timed): {', '.join(b['missing'])}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=int, default=24, help="rounds of the published schedule")
    parser.add_argument("--latency-rounds", type=int, default=4, help="rounds of the latency-first schedule")
    parser.add_argument(
        "--breakdown-steps", type=int, default=10, help="latency-first steps timed by component"
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--mode", choices=["exact", "tolerant"], default="exact")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--parallel",
        choices=["ddp", "fsdp"],
        default="ddp",
        help="DDP, or FSDP2 (fully_shard on each block and the root) for both loops",
    )
    parser.add_argument(
        "--check-reduced",
        choices=["on", "off"],
        default="on",
        help="GuardConfig.check_reduced (off: no reduced-gradient digest under DDP, no reduce-scatter "
        "check under FSDP2; to see what the rest of the guard costs)",
    )
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--markdown", help="also write the tables to this file")
    args = parser.parse_args(argv)
    if min(args.rounds, args.latency_rounds, args.breakdown_steps, args.batch) < 1 or args.seq_len < 2:
        parser.error("rounds, latency rounds, breakdown steps and batch must be >= 1, seq-len >= 2")
    mode: Mode = args.mode
    opts = {
        "rounds": args.rounds,
        "latency_rounds": args.latency_rounds,
        "breakdown_steps": args.breakdown_steps,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "mode": mode,
        "warmup": args.warmup,
        "parallel": args.parallel,
        "check_reduced": args.check_reduced == "on",
    }
    t0 = time.monotonic()
    out = run_local(_bench, node_names(2, 1), args=(opts,), timeout=7200)[0]
    b = out["breakdown"]
    rows, rest = _breakdown_rows(b)
    result = {
        "model": f"d_model 256, 4 layers, 8 heads, vocab 1024, seq_len {args.seq_len}",
        "tokens_per_rank_per_step": args.batch * args.seq_len,
        "ranks": 2,
        "parallel": args.parallel,
        "mode": args.mode,
        "check_reduced": args.check_reduced == "on",
        "every_10": {
            "schedule": "verify_every=10, weights_every=10, all per-step checks",
            **summary(out["every_10"]),
        },
        "latency_first": {
            "schedule": "verify_every=1, weights_every=1, all per-step checks",
            **summary(out["latency_first"]),
        },
        "breakdown": {
            "steps": b["steps"],
            "method": "latency-first steps after the rounds, same processes; the guard's phases wrapped "
            "with perf_counter (exclusive times, benchkit/phases.py); medians over the steps; split = probe + rest passes - the "
            "plain step's forward + backward; rank 0",
            "plain_step_ms": round(b["plain_step_s"] * 1e3, 1),
            "guarded_step_ms": round(b["guarded_step_s"] * 1e3, 1),
            "components": rows,
            "unattributed_ms": rest,
            "missing": b["missing"],
        },
        "torch": torch.__version__,
        "threads_per_rank": out["threads"],
        "seconds": round(time.monotonic() - t0, 1),
    }
    print(json.dumps(result, indent=2))
    table = markdown(result)
    print(table)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)
            fh.write("\n")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as fh:
            fh.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
