"""Device measurements: fingerprint throughput against copy bandwidth, and the guarded/plain
step-time ratio of a large model. Each runs inside ``run_single`` (its own process)."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from benchkit.interleave import run_rounds, summary
from benchkit.settings import CheckSettings
from benchkit.syncs import SyncCounter
from replicheck import fingerprint as fp
from replicheck.guard import CorruptionDetected, Guard, GuardConfig
from replicheck.guard.config import Mode
from replicheck.harness.workloads import lm_loss_bf16, make_model, synthetic_batch


def _device(st: CheckSettings) -> torch.device:
    return torch.device(st.device, 0) if st.device == "cuda" else torch.device("cpu")


def time_call(fn: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    """Seconds per call of ``fn`` after one warm-up call: CUDA events on a GPU (the device's own
    clock, from the first queued kernel to the last), ``perf_counter`` on the CPU."""
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)  # elapsed_time is in milliseconds
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def throughput(st: CheckSettings) -> dict[str, Any]:
    """Digest, zero-folded digest and sketch of one float32 tensor, in GB/s of the tensor read,
    as a fraction of the copy bandwidth (bytes read + written by ``copy_``) of the same tensor."""
    device = _device(st)
    n = st.tensor_bytes // 4
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    size = x.numel() * x.element_size()
    ops: dict[str, Callable[[], object]] = {
        "copy_": lambda: y.copy_(x),
        "clone": lambda: x.clone(),
        "digest": lambda: fp.digest(x),
        "digest_fold_zero": lambda: fp.digest(x, fold_zero=True),
        "sketch_k4": lambda: fp.sketch(x, seed=1, k=4),
    }
    seconds = {name: statistics.median(time_call(fn, device, st.repeats)) for name, fn in ops.items()}
    copy_bw = 2 * size / seconds["copy_"]  # a copy reads and writes every byte
    rows = {}
    for name, s in seconds.items():
        moved = 2 * size if name in ("copy_", "clone") else size
        rows[name] = {
            "ms": round(s * 1e3, 3),
            "tensor_GBps": round(size / s / 1e9, 2),
            "memory_GBps": round(moved / s / 1e9, 2),
            # The reference itself: a copy moves each byte twice, so this would read 0.5 by definition.
            "fraction_of_copy_bandwidth": None
            if name in ("copy_", "clone")
            else round(size / s / copy_bw, 3),
        }
    return {
        "tensor": {"dtype": "float32", "bytes": size, "device": _device_name(device)},
        "copy_bandwidth_GBps": round(copy_bw / 1e9, 2),
        "ops": rows,
        "goal": "digest tensor GB/s >= 0.5 x copy bandwidth",
        "digest_meets_goal": rows["digest"]["fraction_of_copy_bandwidth"] >= 0.5,
        "sketch_meets_goal": rows["sketch_k4"]["fraction_of_copy_bandwidth"] >= 0.5,
    }


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def step_ratio(st: CheckSettings) -> dict[str, Any]:
    """Plain and guarded DDP loops of the large model interleaved in one world-size-1 process.

    Exact mode first. A clean run has no fault, so an alarm there is a false alarm (a kernel the
    probe passes could not make deterministic): it is recorded under ``exact_mode_incident`` and
    the ratio is measured again in tolerant mode with a fresh guarded model, so the run still
    yields a figure.
    """
    import torch.distributed as dist

    device = _device(st)
    cuda = device.type == "cuda"
    every = 10
    world = dist.get_world_size()

    def build() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        with torch.device(device):  # initialise on the device: 1B parameters on one CPU thread is slow
            model = make_model(st.big, seed=0)
        ddp = DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-4)

    plain, plain_opt = build()
    params = sum(p.numel() for p in plain.parameters())
    batches = []
    for s in range(every):
        b = synthetic_batch(st.big, step=s, rank=0, batch=st.big_batch)
        batches.append({k: v.to(device) for k, v in b.items()})

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def plain_step(i: int) -> None:
        plain_opt.zero_grad(set_to_none=True)
        lm_loss_bf16(plain, batches[i]).backward()
        plain_opt.step()

    def measure(mode: Mode, seconds: float) -> dict[str, Any]:
        guarded, guarded_opt = build()
        cfg = GuardConfig(verify_every=every, weights_every=every, mode=mode, loss_reduction="sample_mean")
        guard = Guard(guarded, guarded_opt, lm_loss_bf16, config=cfg, node="node0")

        def timed(use_guard: bool, i: int) -> float:
            sync()
            t0 = time.perf_counter()
            if use_guard:
                r = guard.step(batches[i])
                if world == 1 and r.step % every == 0:
                    # At world size 1 the guard has no replica to compare with and skips the
                    # weights and optimizer-state digests; compute them anyway so they are counted.
                    guard.check_replicas()
            else:
                plain_step(i)
            sync()
            return time.perf_counter() - t0

        for i in range(2):  # DDP's bucket rebuild, allocator, kernel autotuning, on both loops
            timed(False, i)
            timed(True, i)
        while guard.next_step % every:
            timed(True, 0)
        t0 = time.monotonic()
        rounds = run_rounds(timed, rounds=st.rounds, block=every, verify_every=every, deadline=t0 + seconds)
        out = summary(rounds)
        out["seconds"] = round(time.monotonic() - t0, 1)
        out["guard"] = f"{mode} mode, verify_every=10, weights_every=10, probe_size 1 (split)"
        # One more verification period with device->host synchronisations counted (after the
        # timed rounds: counting slows the step down).
        counter, ordinary, verification = SyncCounter(device), [], []
        for i in range(every):
            counts: list[int | None] = []
            with counter.count(counts):
                r = guard.step(batches[i])
            (verification if r.verified else ordinary).append(counts[0])
        out["syncs_ordinary"], out["syncs_verify"] = ordinary, verification
        if cuda:
            out["peak_memory_GiB"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
        return out

    start = time.monotonic()
    incident = None
    try:
        out = measure("exact", st.ratio_budget_s)
    except CorruptionDetected as exc:
        incident = exc.incident.to_dict()
        gc.collect()  # the exact-mode guarded model and its optimizer state: free them first
        if cuda:
            torch.cuda.empty_cache()
        out = measure("tolerant", max(st.ratio_budget_s - (time.monotonic() - start), 1.0))
    out.update(
        {
            "exact_mode_incident": incident,
            "setup": f"world size {world}, {dist.get_backend()}, DDP, one process"
            + (", weights/optimizer digests via Guard.check_replicas() every 10 steps" if world == 1 else ""),
            "device": _device_name(device),
            "parameters": params,
            "model": {
                "vocab": st.big.vocab,
                "d_model": st.big.d_model,
                "n_layers": st.big.n_layers,
                "n_heads": st.big.n_heads,
            },
            "tokens_per_step": st.big_batch * st.big.seq_len,
            "precision": "bf16 autocast (lm_loss_bf16), fp32 weights, AdamW",
        }
    )
    return out
