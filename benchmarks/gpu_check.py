"""The GPU check of issue 11: one prepared run on one CUDA device, under 8 minutes.

    python benchmarks/gpu_check.py [--out docs/results] [--budget-s 420] [--rounds 24]
    python benchmarks/gpu_check.py --tiny --out DIR      # the same code paths on the CPU

Parts, each in its own process and judged on its own (one failure leaves the others' results):

1. ``guard_multiprocess`` — 3 processes share the device (gloo over CUDA tensors: NCCL cannot put
   two ranks on one device) and run the guard in exact mode on a small Llama-style decoder with
   SDPA attention: clean verifications pass; a forward fault and a backward-only fault on rank 1
   are caught at the first verification after onset, naming rank 1 and its node; a run resumed
   from the checkpoint store is bit-identical to the uninterrupted one.
2. ``nccl_smoke`` — the same guarded loop at world size 1 over NCCL.
3. ``fingerprint_throughput`` — digest and sketch of a 4 GiB tensor against the copy bandwidth.
4. ``step_ratio`` — guarded/plain step time of a 0.94B-parameter decoder (bf16 autocast, verify
   and weights every 10), the two loops interleaved in one world-size-1 NCCL process.

Device→host synchronisations per step are counted with ``torch.cuda.set_sync_debug_mode``.
Writes ``gpu.json`` and ``gpu.md`` (format: docs/results/gpu.md). Exit status 1 if any part failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchkit import report
from benchkit.guarded_runs import guard_runs, smoke
from benchkit.judge import guard_checks, smoke_checks
from benchkit.launch import run_single
from benchkit.measure import step_ratio, throughput
from benchkit.settings import CheckSettings, gpu_settings, tiny_settings
from replicheck.harness.launch import run_local

MIN_PART_S = 20.0
"""A part is not started with less than this left of the overall budget."""


@dataclasses.dataclass
class Part:
    ok: bool = False
    seconds: float | None = None
    error: str | None = None
    checks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    result: Any = None


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _run_part(name: str, budget: Budget, limit: float, body: Callable[[float], Part]) -> Part:
    """``body(timeout)`` guarded: an exception or a spent budget fails this part only."""
    left = budget.left()
    if left < MIN_PART_S:
        return Part(error=f"not run: {left:.0f}s left of the overall time budget")
    t0 = time.monotonic()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        part = body(min(limit, left))
    except Exception:  # noqa: BLE001 - one part's failure must not lose the others
        part = Part(error=traceback.format_exc())
    part.seconds = round(time.monotonic() - t0, 1)
    part.ok = part.error is None and all(c["ok"] for c in part.checks.values())
    print(f"[gpu_check] {name}: {'passed' if part.ok else 'FAILED'} in {part.seconds}s", flush=True)
    return part


def _median(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _syncs(values: list[int | None]) -> dict[str, Any]:
    return {"per_step": values, "median": _median(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the same code paths on the CPU, in seconds")
    parser.add_argument("--out", type=Path, help="directory for gpu.json and gpu.md (default docs/results)")
    parser.add_argument("--budget-s", type=float, help="overall time budget (default 420; 150 with --tiny)")
    parser.add_argument("--rounds", type=int, default=24, help="interleaved rounds of the step-time ratio")
    args = parser.parse_args(argv)
    if args.tiny and args.out is None:
        parser.error("--tiny needs --out: a CPU run must not overwrite the GPU results")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or use --tiny for the CPU twin")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    out: Path = args.out if args.out is not None else Path("docs/results")
    st = tiny_settings(min(args.rounds, 2)) if args.tiny else gpu_settings(args.rounds)
    budget = Budget(args.budget_s if args.budget_s is not None else (150.0 if args.tiny else 420.0))
    if not args.tiny:
        # Deterministic cuBLAS, as PyTorch documents for use_deterministic_algorithms; set before
        # any process initialises CUDA (the parts' processes inherit it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    parts: dict[str, Part] = {}
    syncs: dict[str, dict[str, Any]] = {}

    def multiprocess(timeout: float) -> Part:
        with tempfile.TemporaryDirectory(prefix="gpu-check-store-") as store:
            nodes = [f"node{r}" for r in range(st.ranks)]
            by_rank = run_local(guard_runs, nodes, args=(st, store), timeout=timeout)
        clean0 = by_rank[0]["clean"]
        syncs["guard_3_ranks_gloo_rank0"] = {
            "ordinary": _median(clean0["syncs_ordinary"]),
            "verification": _median(clean0["syncs_verify"]),
            "ordinary_per_step": clean0["syncs_ordinary"],
            "verification_per_step": clean0["syncs_verify"],
        }
        result = {
            run: [
                {k: r[run].get(k) for k in ("rank", "node", "verified", "incident", "error")} for r in by_rank
            ]
            for run in by_rank[0]
        }
        return Part(checks=guard_checks(by_rank, st), result=result)

    def nccl(timeout: float) -> Part:
        res = run_single(smoke, (st,), backend=st.single_backend, timeout=timeout)
        syncs["smoke_world_size_1"] = {
            "ordinary": _median(res["syncs_ordinary"]),
            "verification": _median(res["syncs_verify"]),
            "plain": _median(res["syncs_plain"]),
            "ordinary_per_step": res["syncs_ordinary"],
            "verification_per_step": res["syncs_verify"],
            "plain_per_step": res["syncs_plain"],
        }
        keep = {k: res.get(k) for k in ("backend", "verified", "incident", "error", "losses")}
        return Part(checks=smoke_checks(res, st.single_backend), result=keep)

    def fingerprints(timeout: float) -> Part:
        return Part(result=run_single(throughput, (st,), timeout=timeout))

    def ratio(timeout: float) -> Part:
        # Rounds stop early so that building, warm-up and the last round fit the budget.
        rounds_s = max(min(st.ratio_budget_s, timeout - 120.0), 5.0)
        cfg = dataclasses.replace(st, ratio_budget_s=rounds_s)
        res = run_single(step_ratio, (cfg,), backend=st.single_backend, timeout=timeout, threads=4)
        syncs["step_ratio_large_model_world_size_1"] = {
            "ordinary": _median(res["syncs_ordinary"]),
            "verification": _median(res["syncs_verify"]),
            "ordinary_per_step": res["syncs_ordinary"],
            "verification_per_step": res["syncs_verify"],
        }
        inc = res["exact_mode_incident"]
        detail = (
            "no alarm in exact mode"
            if inc is None
            else f"FALSE ALARM in exact mode at step {inc['step']} (check {inc['check']}); figures are tolerant mode"
        )
        return Part(checks={"exact_mode_no_false_alarm": {"ok": inc is None, "detail": detail}}, result=res)

    parts["guard_multiprocess"] = _run_part("guard_multiprocess", budget, 240.0, multiprocess)
    parts["nccl_smoke"] = _run_part("nccl_smoke", budget, 120.0, nccl)
    parts["fingerprint_throughput"] = _run_part("fingerprint_throughput", budget, 120.0, fingerprints)
    parts["step_ratio"] = _run_part("step_ratio", budget, 330.0, ratio)
    data = {
        "format": report.FORMAT,
        "mode": "tiny" if args.tiny else "gpu",
        "ok": all(p.ok for p in parts.values()),
        "started": started,
        "seconds": round(time.monotonic() - t0, 1),
        "environment": _environment(st),
        "parts": {k: dataclasses.asdict(v) for k, v in parts.items()},
        "syncs_per_step": syncs,
    }
    report.write(data, out)
    print(report.markdown(data).split("## Output format")[0])
    print(f"[gpu_check] wrote {out / 'gpu.json'} and {out / 'gpu.md'}", flush=True)
    return 0 if data["ok"] else 1


def _environment(st: CheckSettings) -> dict[str, Any]:
    cuda = st.device == "cuda"
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(0)
        if cuda
        else f"cpu ({platform.processor() or platform.machine()})",
        "python": platform.python_version(),
        "CUBLAS_WORKSPACE_CONFIG": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


if __name__ == "__main__":
    sys.exit(main())
