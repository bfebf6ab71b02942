"""One function in a fresh spawned process, optionally in a world-size-1 process group.

Each part of a benchmark runs in its own process so that a crash, a sticky CUDA error or leaked
device memory of one part cannot spoil the next, and so that a hang is ended by a timeout.

The processes are forked from a ``forkserver`` that has imported torch and the library once (it
never touches CUDA, so a fork of it may): a part starts in a fraction of a second instead of the
seconds a fresh interpreter takes to import torch, which keeps ``--tiny`` fast in ``make test``.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

PRELOAD = ["torch", "torch.distributed", "replicheck.guard", "replicheck.harness.workloads"]
"""Modules the fork server imports once for every part it starts."""


class PartFailed(RuntimeError):
    """The function raised in its process, died, or did not finish in time."""


def _child(
    fn: Callable[..., Any], args: tuple[Any, ...], backend: str | None, threads: int, out: Any
) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        if backend is not None:
            store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
            device_id = torch.device("cuda", 0) if backend == "nccl" else None
            if device_id is not None:
                torch.cuda.set_device(device_id)
            dist.init_process_group(
                backend,
                store=store,
                rank=0,
                world_size=1,
                timeout=timedelta(seconds=120),
                device_id=device_id,
            )
        try:
            result = fn(*args)
        finally:
            if backend is not None:
                dist.destroy_process_group()
        buf = io.BytesIO()
        torch.save(result, buf)  # bytes, not tensors shared through file descriptors
        out.put((True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        out.put((False, traceback.format_exc()))


def run_single(
    fn: Callable[..., Any],
    args: tuple[Any, ...] = (),
    *,
    backend: str | None = None,
    timeout: float = 300.0,
    threads: int = 1,
) -> Any:
    """``fn(*args)`` in a fresh process (``fn`` importable by name); its return value.

    ``backend``: ``"nccl"`` or ``"gloo"`` initialises a world-size-1 default process group first
    (NCCL bound to ``cuda:0``); ``None`` none. Raises :class:`PartFailed` with the child's traceback.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    out = ctx.Queue()
    proc = ctx.Process(target=_child, args=(fn, args, backend, threads, out), daemon=True)
    proc.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PartFailed(f"did not finish within {timeout:.0f}s")
            try:
                ok, value = out.get(timeout=min(left, 1.0))
                break
            except queue.Empty:
                if not proc.is_alive():
                    raise PartFailed(f"process exited with code {proc.exitcode} without a result") from None
    finally:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.kill()
            proc.join()
    if not ok:
        raise PartFailed(value)
    import torch

    return torch.load(io.BytesIO(value), weights_only=False)
