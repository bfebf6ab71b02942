"""Where a guarded step's time goes on one GPU: the breakdown behind part f of ``gpu_check.py``.

    python benchmarks/gpu_profile.py --out DIR          # one CUDA device, about 2 minutes
    python benchmarks/gpu_profile.py --tiny --out DIR   # the same code on the CPU (gloo)

One process at world size 1 (NCCL bound to ``cuda:0``), the ~1B-parameter decoder of part f,
DDP, bf16 autocast, AdamW, the published schedule (replay, weights and optimizer state every 10
steps). Each step is timed alone (a device synchronisation before and after it), plain and
guarded steps alternating, for each guard variant: exact (the default: math attention in the
probe), exact with ``probe_attention="default"``, and tolerant. Then, for the exact guard: the
verification step by component (benchkit/phases.py, with a synchronisation around each wrapped
call so device time lands in the phase that queued it) and the operators of one ordinary and one
verification step under ``torch.profiler`` (self device time, self host time, host syncs).

Writes ``gpu-profile.json`` and ``gpu-profile.md`` into ``--out``. Figures, not a test.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchkit import gpu_parts as gp
from benchkit.launch import run_single
from benchkit.phases import GUARD_PHASES, PhaseTimer, Target
from benchkit.settings import CheckSettings, gpu_settings, tiny_settings
from replicheck.guard import Guard, GuardConfig
from replicheck.harness.workloads import lm_loss_bf16

EVERY = 10
"""Replay, weights and optimizer-state period: the published schedule."""


class SyncedPhaseTimer(PhaseTimer):
    """Phases timed with a device synchronisation on entry and exit (device time included)."""

    def __init__(self, targets: list[Target], device: torch.device) -> None:
        super().__init__(targets)
        self.device = device

    def _wrap(self, fn: Callable[..., Any], target: Target) -> Callable[..., Any]:
        device = self.device

        def synced(*args: Any, **kwargs: Any) -> Any:
            gp.sync(device)
            try:
                return fn(*args, **kwargs)
            finally:
                gp.sync(device)

        synced.__name__ = getattr(fn, "__name__", "synced")
        return super()._wrap(synced, target)


TOLERANT_PARTS = [
    Target("replicheck.fingerprint:sketches", "sketches (device, then to the host)"),
    Target("replicheck.fingerprint:sketch_distance", "sketch distance (host)"),
    Target("replicheck.guard.transport.comm:pack", "pack a message"),
    Target("replicheck.guard.transport.comm:unpack", "unpack a message"),
]
"""Tolerant mode's own work, timed apart from the phases that call it."""


def _variants() -> dict[str, GuardConfig]:
    base = {"verify_every": EVERY, "weights_every": EVERY, "loss_reduction": "sample_mean"}
    return {
        "exact": GuardConfig(mode="exact", **base),  # type: ignore[arg-type]
        "exact, probe_attention=default": GuardConfig(
            mode="exact",
            probe_attention="default",
            **base,  # type: ignore[arg-type]
        ),
        "tolerant": GuardConfig(mode="tolerant", **base),  # type: ignore[arg-type]
    }


def _ms(xs: list[float]) -> float | None:
    return round(1000 * statistics.median(xs), 2) if xs else None


def _ops_table(prof: Any, key: str, n: int) -> list[dict[str, Any]]:
    rows = []
    for e in prof.key_averages():
        rows.append(
            {
                "op": e.key,
                "calls": e.count,
                "self_device_ms": round(getattr(e, "self_device_time_total", 0.0) / 1000, 3),
                "self_host_ms": round(e.self_cpu_time_total / 1000, 3),
            }
        )
    rows.sort(key=lambda r: -r[key])
    return rows[:n]


SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")


COPY_OPS = ("copy_", "_to_copy", "clone")


class _CopySources(TorchDispatchMode):
    """Counts copy operators dispatched on this thread by the innermost frame of replicheck or
    of torch's DDP/c10d Python code that led to them (what the profiler does not attribute)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.__name__.split(".")[0]
        if name in COPY_OPS:
            where = "(no replicheck or DDP frame)"
            for frame in reversed(traceback.extract_stack()[:-1]):
                f = frame.filename
                if "replicheck" in f or "nn/parallel" in f or "distributed/" in f:
                    where = f"{f.split('/src/')[-1].split('site-packages/')[-1]}:{frame.lineno} {frame.name}"
                    break
            self.counts[f"{name} @ {where}"] += 1
        return func(*args, **(kwargs or {}))


def _copy_sources(step: Callable[[], None], n: int = 12) -> list[dict[str, Any]]:
    """Where one step's copies come from (see :class:`_CopySources`)."""
    with _CopySources() as spy:
        step()
    return [{"op": k, "calls": v} for k, v in spy.counts.most_common(n)]


def _profile_step(step: Callable[[], None]) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(ProfilerActivity.CUDA)
    with profile(activities=acts) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    ev = prof.key_averages()
    syncs = {e.key: e.count for e in ev if any(e.key.startswith(s) for s in SYNC_OPS)}
    launches = sum(
        e.count for e in ev if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel")
    )
    aten = sum(e.count for e in ev if e.key.startswith("aten::"))
    return {
        "by_device_time": _ops_table(prof, "self_device_ms", 20),
        "by_host_time": _ops_table(prof, "self_host_ms", 20),
        "host_syncs": syncs,
        "kernel_launches": launches,
        "aten_calls": aten,
    }


def profile(st: CheckSettings, steps: int) -> dict[str, Any]:
    import torch.distributed as dist

    device = gp.device_of(st)
    batches = [gp.batch_on(st.big, s, st.big_batch, device) for s in range(EVERY)]

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        with torch.device(device):
            model = gp.make_model(st.big, seed=0)
        ddp = gp.ddp_of(model, device)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    plain, plain_opt = build()

    def plain_step(i: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        lm_loss_bf16(plain, batches[i % EVERY]).backward()
        plain_opt.step()

    def timed(fn: Callable[[], None]) -> float:
        gp.sync(device)
        t0 = time.perf_counter()
        fn()
        gp.sync(device)
        return time.perf_counter() - t0

    out: dict[str, Any] = {
        "setup": (
            f"world size {dist.get_world_size()}, {dist.get_backend()}, DDP, bf16 autocast, AdamW, "
            f"{st.big_batch} x {st.big.seq_len} tokens a step, replay/weights/optimizer state every {EVERY}"
        ),
        "parameters": sum(p.numel() for p in plain.parameters()),
        "variants": {},
    }
    for _ in range(2):
        plain_step(0)  # warm-up
    for name, cfg in _variants().items():
        guarded, opt = build()
        guard = Guard(guarded, opt, lm_loss_bf16, config=cfg, node="node0")
        for i in range(EVERY + 1):  # warm-up through one verification and its first ordinary step
            guard.step(batches[i % EVERY])
        while guard.next_step % EVERY:
            guard.step(batches[0])
        plain_t: list[float] = []
        ordinary: list[float] = []
        verify: list[float] = []
        for i in range(steps):
            s = guard.next_step
            g = timed(lambda i=i, gd=guard: gd.step(batches[i % EVERY]))
            (verify if s % EVERY == 0 else ordinary).append(g)
            plain_t.append(timed(lambda i=i: plain_step(i)))
        p = _ms(plain_t)
        row: dict[str, Any] = {
            "plain_step_ms": p,
            "ordinary_step_ms": _ms(ordinary),
            "verification_step_ms": _ms(verify),
            "verification_steps": len(verify),
            "ratio_of_totals": round((sum(ordinary) + sum(verify)) / sum(plain_t), 4),
        }
        if name == "tolerant":
            while guard.next_step % EVERY:
                guard.step(batches[0])
            phases = SyncedPhaseTimer(GUARD_PHASES + TOLERANT_PARTS, device)
            with phases.installed():
                t = timed(lambda gd=guard: gd.step(batches[0]))
            row["verification_breakdown_ms"] = {k: round(1000 * v, 2) for k, v in phases.totals.items()}
            row["verification_breakdown_total_ms"] = round(1000 * t, 2)
            row["calibrating"] = bool(guard._judge.calibrating)  # noqa: SLF001 - a figure's context
        if name == "exact":
            while guard.next_step % EVERY:
                guard.step(batches[0])
            phases = SyncedPhaseTimer(GUARD_PHASES, device)
            with phases.installed():
                t = timed(lambda gd=guard: gd.step(batches[0]))
            row["verification_breakdown_ms"] = {k: round(1000 * v, 2) for k, v in phases.totals.items()}
            row["verification_breakdown_total_ms"] = round(1000 * t, 2)
            row["breakdown_missing"] = phases.missing
            row["profile_ordinary"] = _profile_step(lambda gd=guard: gd.step(batches[1]))
            row["profile_ordinary_stacks"] = _copy_sources(lambda gd=guard: gd.step(batches[1]))
            while guard.next_step % EVERY:
                guard.step(batches[0])
            row["profile_verification"] = _profile_step(lambda gd=guard: gd.step(batches[2]))
            row["profile_plain"] = _profile_step(lambda: plain_step(3))
            row["profile_plain_stacks"] = _copy_sources(lambda: plain_step(4))
        out["variants"][name] = row
        del guard, guarded, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _markdown(data: dict[str, Any]) -> str:
    lines = [
        "# Where a guarded step's time goes on one GPU",
        "",
        f"Made with `python benchmarks/gpu_profile.py` on {data['device']}, {data['started']}, "
        f"{data['seconds']} s. {data['result']['setup']}; {data['result']['parameters']:,} parameters. "
        "Each step timed alone (synchronised before and after), plain and guarded alternating; medians.",
        "",
        "| guard | plain step ms | ordinary guarded step ms | verification step ms | ratio of totals |",
        "|---|---|---|---|---|",
    ]
    variants = data["result"]["variants"]
    for name, r in variants.items():
        lines.append(
            f"| {name} | {r['plain_step_ms']} | {r['ordinary_step_ms']} | {r['verification_step_ms']} "
            f"(n={r['verification_steps']}) | {r['ratio_of_totals']} |"
        )
    tol = variants.get("tolerant", {})
    if "verification_breakdown_ms" in tol:
        lines += [
            "",
            f"Tolerant verification step by component (synchronised around each phase; step "
            f"{tol['verification_breakdown_total_ms']} ms; calibrating: {tol.get('calibrating')}):",
            "",
            "| component | ms |",
            "|---|---|",
        ]
        for k, v in sorted(tol["verification_breakdown_ms"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {k} | {v} |")
    ex = variants.get("exact", {})
    if "verification_breakdown_ms" in ex:
        lines += [
            "",
            f"Exact verification step by component (synchronised around each phase; step "
            f"{ex['verification_breakdown_total_ms']} ms):",
            "",
            "| component | ms |",
            "|---|---|",
        ]
        for k, v in sorted(ex["verification_breakdown_ms"].items(), key=lambda kv: -kv[1]):
            lines.append(f"| {k} | {v} |")
    for key in ("profile_plain_stacks", "profile_ordinary_stacks"):
        if ex.get(key):
            lines += [
                "",
                f"Copies by Python stack ({key.removeprefix('profile_').removesuffix('_stacks')} step):",
                "",
            ]
            lines += ["| op @ innermost replicheck / DDP frame | calls |", "|---|---|"]
            for r in ex[key]:
                lines.append(f"| `{r['op']}` | {r['calls']} |")
    for key, title in (
        ("profile_plain", "plain step"),
        ("profile_ordinary", "ordinary guarded step"),
        ("profile_verification", "verification step"),
    ):
        pr = ex.get(key)
        if not pr:
            continue
        lines += [
            "",
            f"## {title}: {pr['aten_calls']} aten calls, {pr['kernel_launches']} kernel launches, "
            f"host syncs {pr['host_syncs']}",
            "",
            "| op (by self device time) | calls | self device ms | self host ms |",
            "|---|---|---|---|",
        ]
        for r in pr["by_device_time"][:12]:
            lines.append(f"| `{r['op'][:70]}` | {r['calls']} | {r['self_device_ms']} | {r['self_host_ms']} |")
        lines += [
            "",
            "| op (by self host time) | calls | self device ms | self host ms |",
            "|---|---|---|---|",
        ]
        for r in pr["by_host_time"][:12]:
            lines.append(f"| `{r['op'][:70]}` | {r['calls']} | {r['self_device_ms']} | {r['self_host_ms']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="the same code on the CPU, in seconds")
    parser.add_argument("--out", type=Path, required=True, help="directory for gpu-profile.json and .md")
    parser.add_argument("--steps", type=int, default=30, help="timed guarded steps per variant")
    parser.add_argument("--timeout-s", type=float, default=400.0)
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA device here: run on a GPU machine, or use --tiny")
    st = tiny_settings() if args.tiny else gpu_settings()
    if not args.tiny:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    t0 = time.monotonic()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res = run_single(profile, (st, args.steps), backend=st.backend, timeout=args.timeout_s)
    data = {
        "device": torch.cuda.get_device_name(0) if not args.tiny else "CPU (--tiny)",
        "torch": torch.__version__,
        "started": started,
        "seconds": round(time.monotonic() - t0, 1),
        "result": res,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu-profile.json").write_text(json.dumps(data, indent=1) + "\n")
    md = _markdown(data)
    (args.out / "gpu-profile.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
