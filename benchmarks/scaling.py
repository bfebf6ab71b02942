"""Per-rank, per-step cost of the guard as the world grows: 2 to 32 gloo ranks (issue 26).

Re-run the whole sweep (the "after" table of docs/results/scaling.md) with one command:

    nice -n 10 python benchmarks/scaling.py --json docs/results/scaling.json \\
        --markdown docs/results/scaling.md --before docs/results/scaling-before.json

For each world size (``--worlds``, default 2 4 8 16 32; CPU processes, one intra-op thread each)
and each parallelism (DDP; FSDP2: plain ``fully_shard`` of each block and the root over all ranks)
the ranks train a tiny decoder as a plain loop and as a guarded loop
(``GuardConfig(verify_every=2, weights_every=2)``, so verification and ordinary steps alternate)
in the same processes. After ``--warmup`` guarded steps (at least one of each kind), ``--steps``
guarded steps of each kind and as many plain steps are measured one by one; every counter below is
taken on each rank for each step, averaged over the steps of a kind, and the table shows the
largest value over the ranks. "extra" is the guarded step minus the plain step on the same rank.

Counters (per rank, per step):

* ``collectives[:kind]``: calls of the ``torch.distributed`` collective and point-to-point
  functions (wrapped for the measured steps only, in ``torch.distributed`` and
  ``distributed_c10d``, restored afterwards); a call made inside another wrapped call
  (``batch_isend_irecv``'s ``isend``, a deprecated alias forwarding to its replacement) is part of
  the outer one. ``new_group`` is counted too (a group created inside a step is a collective of
  the store). The plain DDP loop registers torch's own ``allreduce_hook`` (what DDP does without a
  hook, in Python), so its bucket all-reduces are seen as the guard's are.
* ``bytes_sent[:kind]``: what this rank contributes. ``all_reduce``/``reduce``: the tensor(s);
  ``all_gather`` and its single-tensor forms, ``gather``: the input tensor; ``reduce_scatter``
  and its single-tensor forms, ``all_to_all``: the whole input (world x the output);
  ``broadcast``/``scatter``: the tensor(s) on the source rank, 0 elsewhere; ``send``/``isend``
  and the sends of a ``batch_isend_irecv``: the tensors sent; receives, barriers, object
  collectives (pickled sizes are not visible) and ``new_group``: 0.
* ``host_transfers[:reason]``: the guard's counted device->host transfers
  (``replicheck.guard.transport.transfer.COUNTER``, by the reason each gave).
* ``blocking_waits[:how]``: waits for the network: synchronous collective calls
  (``async_op`` false, ``send``/``recv``, object collectives, ``new_group``), ``Work.wait()`` and
  ``Future.wait()`` calls outside such a call.
* ``aten_ops`` / ``c10d_ops``: operators dispatched while the step runs, counted by a
  ``TorchDispatchMode`` (by namespace: ``aten``; ``c10d`` and ``_c10d_functional`` are the
  collectives as the dispatcher sees them; others under ``other_ops``). The mode is per thread:
  it covers the step's thread and the Python callbacks of futures (``Future.then``, as the
  guard's DDP hook digests the reduced gradient in one), not C++ callbacks on gloo's threads.
* ``wall_ms``: median wall time of the step, largest over the ranks. Reported, not judged: up
  to 32 processes share the machine's cores.

Besides: the step row the guard all-gathers (``row_bytes``: this rank's row, seen in
``Comm.gather_rows``; ``rows_gathered_bytes``: what the gather returns, world x row).

    python benchmarks/scaling.py [--worlds 2 4 8 16 32] [--steps 2] [--tiny] [--json out.json]
        [--markdown out.md] [--plot out.png] [--before before.json] [--render]

``--render``: run nothing, write ``--markdown`` and the plot from ``--before`` alone.

``--tiny``: 2 and 4 ranks, one measured step of each kind (tests/benchmarks/test_scaling.py
runs it in ``make test``). Not a test itself.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import math
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode

from replicheck.harness.launch import RankContext, node_names, run_local
from replicheck.harness.workloads import DecoderConfig, lm_loss, make_model, synthetic_batch

FORMAT = "replicheck.scaling/1"
VERIFY_EVERY = 2
"""Verification (and weights) period of the guarded loop: the two kinds of step alternate."""
MODEL = DecoderConfig(vocab=256, d_model=64, n_layers=2, n_heads=4, seq_len=16, ffn_mult=3.0)
"""Every parameter's first dimension (256, 192, 64) is a multiple of 32: FSDP2 pads no shard at
any world size here, so its bytes do not drift with the world size through padding."""
BATCH = 4
"""Sequences per rank per step."""
PARALLELS = ("ddp", "fsdp")
KINDS = ("ordinary", "verification")

# name -> (tensor arguments whose bytes count as sent; "src" = only on the source rank)
_COLLECTIVES: dict[str, tuple[tuple[str, ...], str]] = {
    "all_reduce": (("tensor",), ""),
    "all_reduce_coalesced": (("tensors",), ""),
    "reduce": (("tensor",), ""),
    "all_gather": (("tensor",), ""),
    "all_gather_single": (("input_tensor",), ""),
    "all_gather_into_tensor": (("input_tensor",), ""),
    "_all_gather_base": (("input_tensor",), ""),
    "all_gather_coalesced": (("input_tensor_list",), ""),
    "gather": (("tensor",), ""),
    "reduce_scatter": (("input_list",), ""),
    "reduce_scatter_single": (("input",), ""),
    "reduce_scatter_tensor": (("input",), ""),
    "_reduce_scatter_base": (("input",), ""),
    "all_to_all": (("input_tensor_list",), ""),
    "all_to_all_single": (("input",), ""),
    "broadcast": (("tensor",), "src"),
    "scatter": (("scatter_list",), "src"),
    "send": (("tensor",), ""),
    "isend": (("tensor",), ""),
    "recv": ((), ""),
    "irecv": ((), ""),
    "batch_isend_irecv": ((), ""),
    "barrier": ((), ""),
    "monitored_barrier": ((), ""),
    "all_gather_object": ((), ""),
    "gather_object": ((), ""),
    "broadcast_object_list": ((), ""),
    "scatter_object_list": ((), ""),
    "send_object_list": ((), ""),
    "recv_object_list": ((), ""),
    "new_group": ((), ""),
}
_ALWAYS_BLOCKING = {"send", "recv", "new_group", "monitored_barrier"} | {
    n for n in _COLLECTIVES if n.endswith("_object") or n.endswith("_object_list")
}
_NEVER_BLOCKING = {"isend", "irecv", "batch_isend_irecv"}


def _nbytes(value: object) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


class Tally:
    """Counters of one measured step (shared by every thread of the rank; a lock guards them)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.lock = threading.Lock()

    def add(self, name: str, n: int = 1) -> None:
        with self.lock:
            self.counts[name] += n


class _Ops(TorchDispatchMode):
    """Counts dispatched operators by namespace into a :class:`Tally`."""

    def __init__(self, tally: Tally) -> None:
        super().__init__()
        self.tally = tally

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        ns = func.namespace
        name = "aten_ops" if ns == "aten" else "c10d_ops" if "c10d" in ns else "other_ops"
        self.tally.add(name)
        return func(*args, **(kwargs or {}))


class Instruments:
    """Wraps the collectives, waits and future callbacks of this process while installed; each
    measured step gets a fresh :class:`Tally` through :meth:`step`."""

    def __init__(self) -> None:
        self.tally: Tally | None = None
        self._local = threading.local()
        self.rank = dist.get_rank()
        self.row_bytes: list[int] = []
        self.rows_gathered: list[int] = []

    def _depth(self) -> int:
        return getattr(self._local, "depth", 0)

    def _collective(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)
        args_of_bytes, src_only = _COLLECTIVES[name]

        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            tally = self.tally
            if tally is None or self._depth() > 0:
                return fn(*args, **kwargs)
            try:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                a = bound.arguments
            except TypeError:
                a = {}
            sent = sum(_nbytes(a.get(k)) for k in args_of_bytes)
            if src_only and a.get("src", a.get("group_src")) not in (None, self.rank):
                sent = 0
            if name == "batch_isend_irecv":
                sent = sum(_nbytes(op.tensor) for op in a.get("p2p_op_list", []) if op.op.__name__ == "isend")
            blocking = name in _ALWAYS_BLOCKING or (name not in _NEVER_BLOCKING and not a.get("async_op"))
            tally.add("collectives")
            tally.add(f"collectives:{name}")
            tally.add("bytes_sent", sent)
            tally.add(f"bytes_sent:{name}", sent)
            if blocking:
                tally.add("blocking_waits")
                tally.add("blocking_waits:synchronous call")
            self._local.depth = self._depth() + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth -= 1

        return wrapped

    def _wait(self, how: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.tally is not None and self._depth() == 0:
                self.tally.add("blocking_waits")
                self.tally.add(f"blocking_waits:{how}")
            return fn(*args, **kwargs)

        return wrapped

    def _then(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``Future.then`` whose callback counts its dispatched operators too (another thread)."""

        @functools.wraps(fn)
        def wrapped(fut: Any, callback: Callable[..., Any]) -> Any:
            tally = self.tally
            if tally is None:
                return fn(fut, callback)

            def counted(f: Any) -> Any:
                if threading.current_thread() is threading.main_thread():
                    return callback(f)  # the step's own mode already counts here
                with _Ops(tally):
                    return callback(f)

            return fn(fut, counted)

        return wrapped

    def _gather_rows(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(comm: Any, row: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = fn(comm, row, *args, **kwargs)
            if self.tally is not None:
                self.row_bytes.append(_nbytes(row))
                self.rows_gathered.append(_nbytes(out))
            return out

        return wrapped

    @contextmanager
    def installed(self) -> Iterator[Instruments]:
        from replicheck.guard.transport import comm as comm_mod

        undo: list[tuple[Any, str, Any]] = []

        def patch(owner: Any, attr: str, new: Any) -> None:
            undo.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, new)

        for name in _COLLECTIVES:
            original = getattr(c10d, name, None)
            if original is None:
                continue
            wrapped = self._collective(name, original)
            patch(c10d, name, wrapped)
            if getattr(dist, name, None) is original:
                patch(dist, name, wrapped)
        work = torch._C._distributed_c10d.Work
        patch(work, "wait", self._wait("Work.wait", work.wait))
        patch(torch._C.Future, "wait", self._wait("Future.wait", torch._C.Future.wait))
        # torch.futures.Future's wait/then call these: patched once, counted once.
        patch(torch._C.Future, "then", self._then(torch._C.Future.then))
        if hasattr(comm_mod.Comm, "gather_rows"):
            patch(comm_mod.Comm, "gather_rows", self._gather_rows(comm_mod.Comm.gather_rows))
        try:
            yield self
        finally:
            for owner, attr, original in reversed(undo):
                setattr(owner, attr, original)

    @contextmanager
    def step(self) -> Iterator[Tally]:
        """Count one step: collectives, waits, the guard's transfers and dispatched operators."""
        from replicheck.guard.transport.transfer import COUNTER

        tally = Tally()
        COUNTER.reset()
        self.tally = tally
        try:
            with _Ops(tally):
                yield tally
        finally:
            self.tally = None
        tally.add("host_transfers", COUNTER.total)
        for why, n in COUNTER.by_reason.items():
            tally.add(f"host_transfers:{why}", n)


def _measure(ctx: RankContext, parallel: str, opts: dict[str, Any]) -> dict[str, Any]:
    """One parallelism on this rank: warm-up, then the measured plain and guarded steps."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    from replicheck.guard import Guard, GuardConfig
    from replicheck.harness.jobs import shard

    def make(hook: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        bare = make_model(MODEL, seed=0)
        if parallel == "fsdp":
            model: torch.nn.Module = shard(bare, ctx.world_size)
        else:
            model = DistributedDataParallel(bare)
            if hook:  # the default reduction, in Python, so its all-reduces are counted
                model.register_comm_hook(None, allreduce_hook)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3)

    plain_model, plain_opt = make(hook=True)
    model, opt = make(hook=False)
    config = GuardConfig(verify_every=VERIFY_EVERY, weights_every=VERIFY_EVERY, loss_reduction="sample_mean")
    guard = Guard(model, opt, lm_loss, config, node=ctx.node)

    def batch(s: int) -> dict[str, torch.Tensor]:
        return synthetic_batch(MODEL, step=s, rank=ctx.rank, batch=BATCH)

    def plain(s: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        lm_loss(plain_model, batch(s)).backward()
        plain_opt.step()

    def guarded(s: int) -> None:
        guard.step(batch(s))

    for s in range(opts["warmup"]):
        plain(s)
        guarded(s)
    while guard.next_step % VERIFY_EVERY:  # measuring starts on a verification step
        plain(guard.next_step)
        guarded(guard.next_step)
    inst = Instruments()
    rows: dict[str, list[dict[str, float]]] = {"plain": [], "ordinary": [], "verification": []}
    with inst.installed():
        for _ in range(opts["steps"] * VERIFY_EVERY):
            s = guard.next_step
            kind = "verification" if s % VERIFY_EVERY == 0 else "ordinary"
            for name, fn in (("plain", plain), (kind, guarded)):
                dist.barrier()
                t0 = time.perf_counter()
                with inst.step() as tally:
                    fn(s)
                dist.barrier()  # the step ends when every rank's does
                counts: dict[str, float] = dict(tally.counts)
                counts["wall_ms"] = (time.perf_counter() - t0) * 1e3
                rows[name].append(counts)
    return {
        "steps": rows,
        "row_bytes": max(inst.row_bytes, default=0),
        "rows_gathered_bytes": max(inst.rows_gathered, default=0),
        "gather_rows_calls_per_guarded_step": len(inst.row_bytes) / max(1, opts["steps"] * VERIFY_EVERY),
    }


def _rank(ctx: RankContext, opts: dict[str, Any]) -> dict[str, Any]:
    return {parallel: _measure(ctx, parallel, opts) for parallel in opts["parallels"]}


def _per_rank(steps: list[dict[str, float]]) -> dict[str, float]:
    """One rank's counters for a kind of step: the mean over its steps (wall time: the median)."""
    names = sorted({k for s in steps for k in s})
    out = {k: sum(s.get(k, 0) for s in steps) / len(steps) for k in names if k != "wall_ms"}
    out["wall_ms"] = statistics.median(s["wall_ms"] for s in steps)
    return out


def _num(x: float) -> float | int:
    return int(x) if float(x).is_integer() else round(x, 2)


def summarise(world: int, ranks: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """The figures of one world size: per parallelism and kind, guarded / plain / extra counters
    (largest over the ranks; ``spread`` names the counters that differ between ranks)."""
    out: dict[str, Any] = {"world": world, "seconds": round(seconds, 1)}
    for parallel in ranks[0]:
        per = [r[parallel] for r in ranks]
        plain = [_per_rank(r["steps"]["plain"]) for r in per]
        entry: dict[str, Any] = {
            "row_bytes": max(r["row_bytes"] for r in per),
            "rows_gathered_bytes": max(r["rows_gathered_bytes"] for r in per),
            "gather_rows_calls_per_guarded_step": max(r["gather_rows_calls_per_guarded_step"] for r in per),
        }
        for kind in KINDS:
            guarded = [_per_rank(r["steps"][kind]) for r in per]
            names = sorted({k for d in guarded + plain for k in d})
            g = {k: _num(max(d.get(k, 0) for d in guarded)) for k in names}
            p = {k: _num(max(d.get(k, 0) for d in plain)) for k in names}
            extra = {
                k: _num(max(gd.get(k, 0) - pd.get(k, 0) for gd, pd in zip(guarded, plain))) for k in names
            }
            spread = sorted(k for k in names if k != "wall_ms" and len({d.get(k, 0) for d in guarded}) > 1)
            entry[kind] = {"guarded": g, "plain": p, "extra": extra, "spread_over_ranks": spread}
        out[parallel] = entry
    return out


def flat(summary: dict[str, Any], parallel: str, kind: str) -> dict[str, float]:
    """Every per-rank counter of one (parallelism, kind) as ``"guarded|plain|extra.name"``, plus
    the row sizes: what the tiny test compares between world sizes."""
    e = summary[parallel]
    out: dict[str, float] = {}
    for side in ("guarded", "plain", "extra"):
        for k, v in e[kind][side].items():
            out[f"{side}.{k}"] = v
    out["row_bytes"] = e["row_bytes"]
    out["rows_gathered_bytes"] = e["rows_gathered_bytes"]
    return out


def growth(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Counters that differ between the smallest and the largest world, with the change per
    doubling of the world (geometric mean ratio, and the mean absolute change)."""
    if len(results) < 2:
        return []
    lo, hi = results[0], results[-1]
    doublings = math.log2(hi["world"] / lo["world"])
    out = []
    for parallel in PARALLELS:
        if parallel not in lo:
            continue
        for kind in KINDS:
            a, b = flat(lo, parallel, kind), flat(hi, parallel, kind)
            for k in sorted(set(a) | set(b)):
                if k.endswith("wall_ms") or a.get(k, 0) == b.get(k, 0):
                    continue
                va, vb = a.get(k, 0), b.get(k, 0)
                ratio = (vb / va) ** (1 / doublings) if va > 0 and vb > 0 else None
                out.append(
                    {
                        "parallel": parallel,
                        "kind": kind,
                        "counter": k,
                        "world_lo": lo["world"],
                        "world_hi": hi["world"],
                        "lo": va,
                        "hi": vb,
                        "per_doubling_ratio": None if ratio is None else round(ratio, 3),
                        "per_doubling_change": round((vb - va) / doublings, 2),
                    }
                )
    return out


TABLE_COUNTERS = (
    ("collectives", "collectives"),
    ("bytes_sent", "bytes sent"),
    ("host_transfers", "host transfers"),
    ("blocking_waits", "blocking waits"),
    ("aten_ops", "aten ops"),
    ("c10d_ops", "c10d ops"),
    ("wall_ms", "wall ms"),
)


def table(results: list[dict[str, Any]]) -> str:
    """Rows: parallelism x step kind x world size; each counter as guarded / plain / extra."""
    head = "| parallelism | step | ranks | " + " | ".join(t for _, t in TABLE_COUNTERS) + " | row B |"
    lines = [
        head,
        "|" + "---|" * (len(TABLE_COUNTERS) + 4),
    ]
    for parallel in PARALLELS:
        for kind in KINDS:
            for r in results:
                if parallel not in r:
                    continue
                e = r[parallel][kind]
                cells = []
                for k, _ in TABLE_COUNTERS:
                    g, p, x = (e[s].get(k, 0) for s in ("guarded", "plain", "extra"))
                    cells.append(f"{g} / {p} / **{x}**")
                lines.append(
                    f"| {parallel} | {kind} | {r['world']} | "
                    + " | ".join(cells)
                    + f" | {r[parallel]['row_bytes']} |"
                )
    return "\n".join(lines) + "\n"


def kinds_table(results: list[dict[str, Any]]) -> str:
    """The extra collectives, bytes, transfers and waits of the guard by kind, per world size."""
    lines = [
        "| parallelism | step | ranks | extra counters by kind (guarded - plain, non-zero) |",
        "|---|---|---|---|",
    ]
    for parallel in PARALLELS:
        for kind in KINDS:
            for r in results:
                if parallel not in r:
                    continue
                x = r[parallel][kind]["extra"]
                parts = [f"{k} {v}" for k, v in x.items() if ":" in k and v]
                lines.append(f"| {parallel} | {kind} | {r['world']} | {'; '.join(parts) or '–'} |")
    return "\n".join(lines) + "\n"


def growth_text(results: list[dict[str, Any]]) -> str:
    """The "what grows with the world size" paragraph, computed from the figures: the guard's
    extra counters (guarded - plain) and the row that grow, those that shrink, and the rest."""
    if len(results) < 2:
        return ""
    lo, hi = results[0]["world"], results[-1]["world"]
    rows = [g for g in growth(results) if g["counter"].startswith("extra.") or "row" in g["counter"]]
    changed = {(g["parallel"], g["kind"], g["counter"]) for g in rows}
    cases = [(p, kind) for p in PARALLELS if p in results[0] for kind in KINDS]
    top = {
        k for p, kind in cases for k in flat(results[0], p, kind) if k.startswith("extra.") and ":" not in k
    }
    steady = sorted(
        k.removeprefix("extra.")
        for k in top - {"extra.wall_ms"}
        if not any((p, kind, k) in changed for p, kind in cases)
    )
    lines = [
        f"Computed from the figures above: the guard's extra per-rank counters (guarded - plain) and "
        f"its row, {lo} ranks against {hi} (wall time aside); per doubling of the world: the "
        "geometric-mean ratio and the mean change; per added rank: (value at "
        f"{hi} - value at {lo}) / {hi - lo}.",
        "",
    ]
    for title, sign in (("Grows", 1), ("Shrinks", -1)):
        part = [g for g in rows if (g["hi"] - g["lo"]) * sign > 0]
        if not part:
            continue
        lines.append(f"{title}:")
        lines.append("")
        for g in part:
            ratio = f"x{g['per_doubling_ratio']}" if g["per_doubling_ratio"] is not None else "from/to 0"
            per_rank = (g["hi"] - g["lo"]) / (hi - lo)
            lines.append(
                f"- {g['parallel']} {g['kind']}, `{g['counter']}`: {g['lo']} -> {g['hi']} "
                f"({ratio}, {g['per_doubling_change']:+} per doubling; {per_rank:+.2f} per added rank)"
            )
        lines.append("")
    lines.append(
        f"The same at {lo} and {hi} ranks for both parallelisms and both kinds of step: "
        + (", ".join(f"`{k}`" for k in steady) or "none")
        + ". Every counter that changed, guarded and plain included, is in the JSON (`growth`)."
    )
    return "\n".join(lines) + "\n"


def markdown(after: dict[str, Any] | None, before: dict[str, Any] | None) -> str:
    """docs/results/scaling.md: method, the "after" and "before" tables, growth, the plot."""
    doc = (__doc__ or "").split("Counters (per rank, per step):")[1].split("    python benchmarks")[0]
    lines = [
        "# Per-step cost of the guard against the world size (issue 26)",
        "",
        'Re-run (the "after" figures; keeps the "before" table):',
        "",
        "```",
        "nice -n 10 python benchmarks/scaling.py --json docs/results/scaling.json \\",
        "    --markdown docs/results/scaling.md --before docs/results/scaling-before.json",
        "```",
        "",
        f"{MODEL.n_layers}-layer decoder (d_model {MODEL.d_model}, vocab {MODEL.vocab}, {BATCH} x "
        f"{MODEL.seq_len} tokens per rank per step), gloo on CPU, one thread per rank; guarded with "
        f"`GuardConfig(verify_every={VERIFY_EVERY}, weights_every={VERIFY_EVERY}, "
        'loss_reduction="sample_mean")`, exact mode, every per-step check on. Each cell: '
        "**guarded / plain / extra** (extra = guarded - plain on the same rank), per rank and step, "
        "largest over the ranks; `row B`: the bytes of this rank's step row.",
        "",
        "Counters (per rank, per step):",
        doc.strip().replace("``", "`"),
        "",
        "`tests/benchmarks/test_scaling.py` runs `--tiny` (2 and 4 ranks) in `make test` and asserts "
        "every per-rank counter is equal at 2 and 4 ranks, except the gathered rows (world x the row), wall time, FSDP2's shard-sized bytes and the reduce-scatter check's sketches (which may only shrink) and the counters its `KNOWN_TO_GROW` lists (those that grew before issue 26's changes, removed as the changes landed: none is left).",
        "",
    ]
    for title, data in (("After", after), ("Before (the code before issue 26's changes)", before)):
        if data is None:
            continue
        res = data["results"]
        per_world = ", ".join(f"{r['world']} ranks {r['seconds']} s" for r in res)
        lines += [
            f"## {title}",
            "",
            f"torch {data['torch']}, {data['threads_per_rank']} thread per rank, {data['steps']} measured "
            f"step(s) of each kind after {data['warmup']} warm-up steps; sweep {data['seconds']} s "
            f"(per world: {per_world}).",
            "",
            table(res),
            "Extra by kind:",
            "",
            kinds_table(res),
            "### What grows with the world size",
            "",
            growth_text(res),
        ]
    shown = after if after is not None else before
    if shown is not None and shown.get("plot"):
        lines += [f"![extra per-rank counters against the world size]({Path(shown['plot']).name})", ""]
    elif shown is not None:
        lines += ["(No plot: matplotlib did not import.)", ""]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: str, before: dict[str, Any] | None = None) -> bool:
    """The extra counters against the world size, one panel per counter; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    counters = [c for c in TABLE_COUNTERS if c[0] != "wall_ms"] + [("wall_ms", "wall ms (not judged)")]
    fig, axes = plt.subplots(2, 4, figsize=(16, 7.5))
    for ax, (k, title) in zip(axes.flat, counters):
        for label, d, style in (("", data, "-"), ("before ", before, ":")):
            if d is None:
                continue
            res = d["results"]
            worlds = [r["world"] for r in res]
            for i, (parallel, kind) in enumerate((p, kd) for p in PARALLELS for kd in KINDS):
                if parallel not in res[0]:
                    continue
                ys = [r[parallel][kind]["extra"].get(k, 0) for r in res]
                ax.plot(worlds, ys, style, color=f"C{i}", marker="o", label=f"{label}{parallel} {kind}")
        ax.set_xscale("log", base=2)
        ax.set_title(f"extra {title} per rank per step", fontsize=9)
        ax.set_xlabel("ranks")
    axes.flat[-1].axis("off")
    h, lab = axes.flat[0].get_legend_handles_labels()
    axes.flat[-1].legend(h, lab, loc="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def run(worlds: list[int], steps: int, warmup: int, parallels: tuple[str, ...] = PARALLELS) -> dict[str, Any]:
    """The sweep: one local job per world size; its figures."""
    t0 = time.monotonic()
    results = []
    for w in worlds:
        t = time.monotonic()
        opts = {"steps": steps, "warmup": warmup, "parallels": parallels}
        ranks = run_local(_rank, node_names(w, 1), args=(opts,), timeout=1800, group_timeout=600)
        results.append(summarise(w, ranks, time.monotonic() - t))
        print(f"world {w}: {results[-1]['seconds']} s", file=sys.stderr, flush=True)
    return {
        "format": FORMAT,
        "model": f"d_model {MODEL.d_model}, {MODEL.n_layers} layers, vocab {MODEL.vocab}, seq_len {MODEL.seq_len}",
        "batch_per_rank": BATCH,
        "verify_every": VERIFY_EVERY,
        "weights_every": VERIFY_EVERY,
        "steps": steps,
        "warmup": warmup,
        "torch": torch.__version__,
        "threads_per_rank": 1,
        "seconds": round(time.monotonic() - t0, 1),
        "results": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8, 16, 32], help="world sizes")
    parser.add_argument("--steps", type=int, default=2, help="measured steps of each kind")
    parser.add_argument("--warmup", type=int, default=4, help="guarded (and plain) steps before measuring")
    parser.add_argument("--tiny", action="store_true", help="2 and 4 ranks, one measured step of each kind")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--markdown", help="write the tables here")
    parser.add_argument("--plot", help="write the plot here (default: next to --markdown, scaling.png)")
    parser.add_argument("--before", help="figures of an earlier run, shown as the 'before' table")
    parser.add_argument(
        "--render",
        action="store_true",
        help="run nothing: write --markdown and the plot from --before alone (the 'before' figures)",
    )
    args = parser.parse_args(argv)
    if args.tiny:
        args.worlds, args.steps, args.warmup = [2, 4], 1, 2
    if min(args.worlds) < 2 or args.steps < 1 or args.warmup < VERIFY_EVERY:
        parser.error(f"worlds must be >= 2, steps >= 1, warmup >= {VERIFY_EVERY}")
    if args.render and not (args.before and args.markdown):
        parser.error("--render needs --before and --markdown")
    before = json.loads(Path(args.before).read_text()) if args.before else None
    plot_path = args.plot or (str(Path(args.markdown).with_suffix(".png")) if args.markdown else None)
    if args.render:
        assert before is not None
        before["plot"] = plot_path if plot_path and plot(before, plot_path) else None
        Path(args.markdown).write_text(markdown(None, before), encoding="utf-8")
        return 0
    data = run(sorted(args.worlds), args.steps, args.warmup)
    data["growth"] = growth(data["results"])
    data["plot"] = plot_path if plot_path and plot(data, plot_path, before) else None
    print(json.dumps(data, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    if args.markdown:
        Path(args.markdown).write_text(markdown(data, before), encoding="utf-8")
    print(growth_text(data["results"]), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
