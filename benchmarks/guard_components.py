"""Per-component CPU cost of the guard's ordinary step (issue 11: per-step overhead).

Two gloo ranks train the decoder of ``benchmarks/overhead.py`` (d_model 256, 4 layers, 8 x 256
tokens per rank) in two loops whose steps alternate (order rotated every round): plain DDP and
guarded with every ordinary-step check (``guard``; since issue 26 a DDP step shares no failure
flag: a failure rides in the step's row). No verification or weight check runs, so the
difference is the ordinary step's own cost. Then, on the same ranks, the 8-byte flag all-reduce
FSDP2 runs after each forward and the step-row all-gather alone, and in one process the
comm-hook work on the model's gradients.

    python benchmarks/guard_components.py [--rounds 30] [--json out.json]

Prints medians of wall time (perf_counter) and CPU time (process_time). Not a test.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck import fingerprint as fp
from replicheck.guard import Guard, GuardConfig
from replicheck.guard.checks.health import sq_norm as _sq_norm
from replicheck.guard.transport.records import StepRow
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

MODEL = DecoderConfig(vocab=1024, d_model=256, n_layers=4, n_heads=8, seq_len=256)


def _timed(fn: Callable[[], object], barrier: Callable[[], object]) -> tuple[float, float]:
    barrier()
    w, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w, time.process_time() - c


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


def _bench(ctx: RankContext, rounds: int, batch: int) -> dict[str, Any]:
    import torch.distributed as dist

    cfg = GuardConfig(verify_every=1_000_000, weights_every=0, loss_reduction="sample_mean")
    kinds = ("guard",)
    models = {k: DistributedDataParallel(make_model(MODEL, seed=0)) for k in ("plain", *kinds)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in models.items()}
    guards = {k: Guard(models[k], opts[k], lm_loss, cfg, node=ctx.node) for k in kinds}
    b = synthetic_batch(MODEL, step=0, rank=ctx.rank, batch=batch)

    def plain() -> None:
        opts["plain"].zero_grad(set_to_none=True)
        lm_loss(models["plain"], b).backward()
        opts["plain"].step()

    steps: dict[str, Callable[[], object]] = {"plain": plain}
    for k in kinds:
        steps[k] = functools.partial(guards[k].step, b)
    order = list(steps)
    for k in order * 2:  # warm-up: bucket rebuild, allocator, layouts
        steps[k]()
    wall: dict[str, list[float]] = {k: [] for k in order}
    cpu: dict[str, list[float]] = {k: [] for k in order}
    for r in range(rounds):
        for k in order[r % len(order) :] + order[: r % len(order)]:
            w, c = _timed(steps[k], dist.barrier)
            wall[k].append(w)
            cpu[k].append(c)
    comm = guards["guard"].comm
    row = StepRow(loss=torch.tensor(1.0), local_norm=torch.tensor(2.0), reduced=torch.tensor(3)).encode()
    micro: dict[str, tuple[list[float], list[float]]] = {"flag_gather": ([], []), "row_gather": ([], [])}
    for _ in range(200):
        for name, fn in (
            ("flag_gather", lambda: comm.flagged(False)),
            ("row_gather", lambda: comm.gather_rows(row)),
        ):
            w, c = _timed(fn, dist.barrier)
            micro[name][0].append(w)
            micro[name][1].append(c)
    out: dict[str, Any] = {
        "rank": ctx.rank,
        "step_wall_ms": {k: _ms(v) for k, v in wall.items()},
        "step_cpu_ms": {k: _ms(v) for k, v in cpu.items()},
        "extra_wall_ms": {k: _ms([g - p for g, p in zip(wall[k], wall["plain"])]) for k in kinds},
        "extra_cpu_ms": {k: _ms([g - p for g, p in zip(cpu[k], cpu["plain"])]) for k in kinds},
        "micro_wall_ms": {k: _ms(v[0]) for k, v in micro.items()},
        "micro_cpu_ms": {k: _ms(v[1]) for k, v in micro.items()},
    }
    return out


def _local_components(repeats: int = 30) -> dict[str, float]:
    """One process: the per-step guard work on the model's gradients, as the comm hook does it."""
    model = make_model(MODEL, seed=0)
    lm_loss(model, synthetic_batch(MODEL, step=0, rank=0, batch=2)).backward()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
    loss, norm, reduced = torch.tensor(1.0, dtype=torch.float64), _sq_norm(flat), fp.digest(flat)
    parts = {
        "sq_norm (local health)": lambda: _sq_norm(flat),
        "digest (reduced gradient)": lambda: fp.digest(flat),
        "row encode": lambda: StepRow(loss=loss, local_norm=norm, reduced=reduced).encode(),
        "weights + optimizer digests (every weights_every)": lambda: fp.model_digest_tensor(
            model, "replicated"
        ),
    }
    out: dict[str, float] = {"gradient_elements": float(flat.numel())}
    for name, fn in parts.items():
        fn()
        cpu = []
        for _ in range(repeats):
            c = time.process_time()
            fn()
            cpu.append(time.process_time() - c)
        out[name + " cpu_ms"] = _ms(cpu)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    local = _local_components()
    ranks = run_local(_bench, node_names(2, 1), args=(args.rounds, args.batch), timeout=3600)
    report = {"local": local, "ranks": ranks, "rounds": args.rounds}
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
