"""The GPU check of issue 23: one prepared run on one CUDA device, within 5 minutes.

    python benchmarks/gpu_check.py [--out docs/results] [--budget-s 300]
    python benchmarks/gpu_check.py --tiny --out DIR      # the same code on the CPU (gloo)

Parts, most valuable first, each in its own process(es) at world size 1 (NCCL bound to cuda:0;
gloo with ``--tiny``), time-boxed and judged on its own (the list and what each would have caught:
docs/results/gpu.md):

a. ``exchange_exact`` / ``exchange_tolerant`` — a DDP guarded loop verifying every step; the
   exchange loops every message through the communication device (finding 1).
b. ``replicated_nan`` — ``replicate()``, an (N, 1) HSDP mesh and single-GPU FSDP2 with a NaN in
   one gradient: refused with what to do, or an incident at that step; ``fsdp_cpu_offload`` — a
   clean exact verification under ``CPUOffloadPolicy`` with the probe batch on the GPU (5, 8).
c. ``reproducibility`` — bitwise digests of SDPA math/flash/memory-efficient backward, embedding
   backward at 3,072 and 8,192 indices, bf16 ``linear`` on an aligned view vs a clone, 3 repeats
   in each of two processes (4, 10).
d. ``probe_pass_memory`` — peak memory and time of an exact verification step with
   ``probe_attention="math"`` vs ``"default"`` at 4K and 8K tokens (4).
e. ``gradient_fingerprints`` — digest and sketch of a 0.94B model's gradients (fp32, bf16): host
   time, device time, kernel launches; one FSDP2 update-replay step's bytes, devices, memory (3).
f. ``overhead`` — 20 back-to-back steps, one sync at the end, plain vs guarded interleaved, peak
   memory per loop; a tolerant bf16 run's largest pair distance against its threshold.
g. ``environment`` — driver, CUDA, NCCL, TF32 and reduced-precision flags, SDPA backends.

Writes ``gpu.json`` and ``gpu.md``. Exit status 1 if a judged check failed or a part did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchkit import gpu_parts as gp
from benchkit import judge, report
from benchkit.launch import run_single
from benchkit.settings import CheckSettings, gpu_settings, tiny_settings

DEFAULT_BUDGET_S = 300.0
"""The whole check on one H200 (the Makefile's comment says the same): 5 minutes."""
TINY_BUDGET_S = 120.0
MIN_PART_S = 10.0
"""A part is skipped (reported as such) with less than this left of the overall budget."""

LIMITS_S = {
    "exchange_exact": 60.0,
    "exchange_tolerant": 60.0,
    "replicated_nan": 90.0,
    "fsdp_cpu_offload": 45.0,
    "reproducibility": 60.0,
    "probe_pass_memory": 75.0,
    "gradient_fingerprints": 90.0,
    "overhead": 120.0,
    "environment": 30.0,
}
"""Each part's own time box (seconds), cut to what is left of the budget."""


@dataclasses.dataclass
class Part:
    status: str = "failed"
    """``passed``, ``failed`` or ``skipped`` (not started: the budget was short)."""
    seconds: float | None = None
    error: str | None = None
    checks: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    result: Any = None


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _run_part(name: str, budget: Budget, body: Callable[[float], Part]) -> Part:
    """``body(timeout)`` guarded: an exception or a spent time box fails this part only."""
    left = budget.left()
    if left < MIN_PART_S:
        return Part(status="skipped", error=f"skipped: {max(left, 0):.0f}s left of the overall time budget")
    t0 = time.monotonic()
    print(f"[gpu_check] {name} ...", flush=True)
    try:
        part = body(min(LIMITS_S[name], left))
    except Exception:  # noqa: BLE001 - one part's failure must not lose the others
        part = Part(error=traceback.format_exc())
    part.seconds = round(time.monotonic() - t0, 1)
    judged_ok = all(c["ok"] for c in part.checks.values() if c["judged"])
    part.status = "passed" if part.error is None and judged_ok else "failed"
    print(f"[gpu_check] {name}: {part.status} in {part.seconds}s", flush=True)
    return part


def _parts(st: CheckSettings) -> dict[str, Callable[[float], Part]]:
    def single(fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        return run_single(fn, (st, *args), backend=st.backend, timeout=timeout)

    def exchange(mode: str) -> Callable[[float], Part]:
        def body(timeout: float) -> Part:
            res = single(gp.exchange_loop, mode, timeout=timeout)
            return Part(checks=judge.exchange_checks(res, st), result=res)

        return body

    def replicated(timeout: float) -> Part:
        checks, results = {}, {}
        for i, kind in enumerate(gp.REPLICATED_KINDS):
            share = timeout / (len(gp.REPLICATED_KINDS) - i)  # each kind its own process and time box
            t0 = time.monotonic()
            try:
                results[kind] = single(gp.replicated_nan, kind, timeout=share)
                checks[kind] = judge.replicated_check(results[kind], st)
            except Exception:  # noqa: BLE001 - one kind's crash leaves the others
                results[kind] = {"outcome": "error", "error": traceback.format_exc()}
                checks[kind] = judge.check(False, traceback.format_exc().strip().splitlines()[-1])
            timeout -= time.monotonic() - t0
        return Part(checks=checks, result=results)

    def offload(timeout: float) -> Part:
        res = single(gp.offload_verify, timeout=timeout)
        return Part(checks=judge.offload_checks(res), result=res)

    def repro(timeout: float) -> Part:
        first = single(gp.reproducibility, timeout=timeout / 2)
        second = single(gp.reproducibility, timeout=timeout / 2)
        checks, table = judge.reproducibility_checks(first, second)
        return Part(checks=checks, result={"operations": table, "first": first, "second": second})

    def probe(timeout: float) -> Part:
        res = single(gp.probe_pass_memory, timeout=timeout)
        return Part(checks=judge.probe_checks(res), result=res)

    def fingerprints(timeout: float) -> Part:
        res = single(gp.gradient_fingerprints, timeout=timeout)
        return Part(checks=judge.fingerprint_checks(res), result=res)

    def overhead(timeout: float) -> Part:
        res = single(gp.overhead, timeout=timeout)
        return Part(checks=judge.overhead_checks(res), result=res)

    def environment(timeout: float) -> Part:
        return Part(result=run_single(gp.environment, (st,), timeout=timeout))

    return {
        "exchange_exact": exchange("exact"),
        "exchange_tolerant": exchange("tolerant"),
        "replicated_nan": replicated,
        "fsdp_cpu_offload": offload,
        "reproducibility": repro,
        "probe_pass_memory": probe,
        "gradient_fingerprints": fingerprints,
        "overhead": overhead,
        "environment": environment,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the same code on the CPU, in seconds")
    parser.add_argument("--out", type=Path, help="directory for gpu.json and gpu.md (default docs/results)")
    parser.add_argument(
        "--budget-s",
        type=float,
        help=f"overall time budget; parts that do not fit are skipped (default {DEFAULT_BUDGET_S:.0f}; "
        f"{TINY_BUDGET_S:.0f} with --tiny)",
    )
    args = parser.parse_args(argv)
    if args.tiny and args.out is None:
        parser.error("--tiny needs --out: a CPU run must not overwrite the GPU results")
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or use --tiny for the CPU twin")
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error("--budget-s must be > 0")
    out: Path = args.out if args.out is not None else Path("docs/results")
    st = tiny_settings() if args.tiny else gpu_settings()
    budget_s = (
        args.budget_s if args.budget_s is not None else (TINY_BUDGET_S if args.tiny else DEFAULT_BUDGET_S)
    )
    budget = Budget(budget_s)
    if not args.tiny:
        # Deterministic cuBLAS, as PyTorch documents for use_deterministic_algorithms; set before
        # any process initialises CUDA (the parts' processes inherit it).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    t0 = time.monotonic()
    parts = {name: _run_part(name, budget, body) for name, body in _parts(st).items()}
    data = {
        "format": report.FORMAT,
        "mode": "tiny" if args.tiny else "gpu",
        "ok": all(p.status == "passed" for p in parts.values()),
        "started": started,
        "seconds": round(time.monotonic() - t0, 1),
        "budget_s": budget_s,
        "environment": parts["environment"].result or {},
        "parts": {k: dataclasses.asdict(v) for k, v in parts.items()},
    }
    report.write(data, out)
    print(report.markdown(data).split("## Output format")[0])
    print(f"[gpu_check] wrote {out / 'gpu.json'} and {out / 'gpu.md'}", flush=True)
    return 0 if data["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
