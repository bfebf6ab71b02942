"""Bytes a guarded step allocates against the plain step, counted by a dispatch mode (CPU, 2 gloo ranks).

The CPU has no peak-memory counter, so every tensor an aten operation returns is counted as
allocated (``numel * element_size`` of each output that does not share storage with an input:
views and in-place results are not new memory). Two gloo ranks train the decoder of
``benchmarks/overhead.py`` (8 sequences x ``--seq-len`` tokens per rank) as a plain DDP loop and
as a guarded one at the published schedule (replay, weights and optimizer state every 10 steps),
one whole verification period each after a warm-up. Figures: total guarded bytes / total plain
bytes over the period (ordinary steps apart), and the peak of the step's live new tensors,
guarded / plain (the largest over the period, and over ordinary steps). Collectives
that torch runs outside the dispatcher (gloo's own buffers) are not seen, on either side.

    python benchmarks/step_memory.py [--seq-len 128] [--json out.json]

Prints the figures as JSON. Not a test (tests/benchmarks/test_step_memory.py runs a tiny one).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import weakref
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from replicheck.guard import Guard, GuardConfig
from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

PERIOD = 10
"""The published schedule: replay, weights and optimizer state every 10 steps."""


class AllocationCounter(TorchDispatchMode):
    """Bytes of every new tensor an aten operation returns while active: their sum, and the peak
    of those still alive (each is released when its tensor object is collected; a storage kept
    alive only by a view made later is released early, so the peak is a slight undercount)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.live = 0
        self.peak = 0
        self.ops = 0

    def _release(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        self.ops += 1
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.device.type != "meta"
        }
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage.data_ptr() not in inputs and storage.nbytes():
                    n = storage.nbytes()
                    self.bytes += n
                    self.live += n
                    weakref.finalize(t, self._release, n)
        self.peak = max(self.peak, self.live)
        return out


MODEL = DecoderConfig(vocab=1024, d_model=256, n_layers=4, n_heads=8, seq_len=128)
"""The decoder of ``benchmarks/overhead.py``."""


def _bench(ctx: RankContext, cfg_model: DecoderConfig, batch: int) -> dict[str, Any]:

    def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = DistributedDataParallel(make_model(cfg_model, seed=0))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    plain, plain_opt = make()
    guarded, guarded_opt = make()
    cfg = GuardConfig(verify_every=PERIOD, weights_every=PERIOD, loss_reduction="sample_mean")
    guard = Guard(guarded, guarded_opt, lm_loss, cfg, node=ctx.node)
    batches = [synthetic_batch(cfg_model, step=s, rank=ctx.rank, batch=batch) for s in range(PERIOD)]

    def plain_step(b: dict[str, torch.Tensor]) -> None:
        plain_opt.zero_grad(set_to_none=True)
        lm_loss(plain, b).backward()
        plain_opt.step()

    for b in batches:  # warm-up: DDP's bucket rebuild, optimizer state, the guard's first period
        plain_step(b)
        guard.step(b)
    rows: list[dict[str, Any]] = []
    for i, b in enumerate(batches):
        with AllocationCounter() as p:
            plain_step(b)
        verify = guard.next_step % PERIOD == 0
        with AllocationCounter() as g:
            guard.step(b)
        rows.append(
            {
                "step": i,
                "verification": verify,
                "plain": p.bytes,
                "guarded": g.bytes,
                "plain_peak": p.peak,
                "guarded_peak": g.peak,
            }
        )
    plain_total = sum(r["plain"] for r in rows)
    guarded_total = sum(r["guarded"] for r in rows)
    ordinary = [r for r in rows if not r["verification"]]
    return {
        "rank": ctx.rank,
        "rows": rows,
        "ratio_of_totals": round(guarded_total / plain_total, 4),
        "ordinary_ratio": round(sum(r["guarded"] for r in ordinary) / sum(r["plain"] for r in ordinary), 4),
        "verification_extra_bytes": [r["guarded"] - r["plain"] for r in rows if r["verification"]],
        "peak_ratio": round(max(r["guarded_peak"] for r in rows) / max(r["plain_peak"] for r in rows), 4),
        "ordinary_peak_ratio": round(
            max(r["guarded_peak"] for r in ordinary) / max(r["plain_peak"] for r in ordinary), 4
        ),
        "plain_step_bytes": plain_total // len(rows),
    }


def measure(model: DecoderConfig = MODEL, batch: int = 8) -> list[dict[str, Any]]:
    """Both ranks' figures (see the module docstring)."""
    return run_local(_bench, node_names(2, 1), args=(model, batch), timeout=600)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    ranks = measure(dataclasses.replace(MODEL, seq_len=args.seq_len), args.batch)
    summary = {
        "seq_len": args.seq_len,
        "batch": args.batch,
        "ranks": [{k: v for k, v in r.items() if k != "rows"} for r in ranks],
        "rows_rank0": ranks[0]["rows"],
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
