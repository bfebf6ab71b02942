"""Run a function as a local multi-process gloo job: the harness of tests, campaigns and demos.

The parent hosts the rendezvous store on a free port (port 0), each child joins the gloo group
and gets its node name explicitly, which is how several nodes are simulated on one machine.
Every child's return value (or its error, as text) comes back; a job that does not finish in
``timeout`` seconds is killed, since a collective bug shows as a hang.

Children are forked from a forkserver that has torch and the guarded job imported once: a
spawned child spends seconds importing them, more than most test jobs spend training, and
several ranks importing at once on a small machine multiply it. The server forks before any
torch thread pool or process group exists, so each child starts as clean as a spawned one;
the parent's environment at launch is handed to each child, since the server's is older.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import subprocess
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any


class LaunchError(RuntimeError):
    """A rank failed or the job did not finish in time."""


@dataclass(frozen=True)
class RankContext:
    """What a rank's function is given."""

    rank: int
    """Global rank."""
    world_size: int
    """Number of ranks."""
    node: str
    """This rank's simulated node name."""
    nodes: tuple[str, ...]
    """Node name of every rank."""


def node_names(nodes: int, per_node: int) -> list[str]:
    """``["node0", "node0", "node1", ...]``: consecutive ranks share a node, as torchrun places them."""
    return [f"node{r // per_node}" for r in range(nodes * per_node)]


# Imported once in the forkserver, inherited by every child it forks.
_PRELOAD = ["torch", "torch.distributed", "replicheck.harness.jobs"]


def _context() -> Any:
    """The forkserver context where the platform has one (Linux, macOS), else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _child(
    fn: Callable[..., Any],
    ctx: RankContext,
    port: int,
    args: tuple[Any, ...],
    out: Any,
    threads: int,
    environ: dict[str, str],
    group_timeout: float = 120.0,
) -> None:
    # The forkserver's environment is the one of its start; a rank sees the launcher's now.
    os.environ.clear()
    os.environ.update(environ)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, ctx.world_size, is_master=False, timeout=timedelta(seconds=60)
        )
        dist.init_process_group(
            "gloo",
            store=store,
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=timedelta(seconds=group_timeout),
        )
        try:
            result = fn(ctx, *args)
        finally:
            dist.destroy_process_group()
        # Tensors cross as bytes: torch's queue pickler would share them through file
        # descriptors that die with this process.
        buf = io.BytesIO()
        torch.save(result, buf)
        out.put((ctx.rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        out.put((ctx.rank, False, traceback.format_exc()))


def run_local(
    fn: Callable[..., Any],
    nodes: Sequence[str],
    *,
    args: tuple[Any, ...] = (),
    timeout: float = 300.0,
    threads_per_rank: int = 1,
    group_timeout: float = 120.0,
) -> list[Any]:
    """Run ``fn(ctx, *args)`` on ``len(nodes)`` ranks; return their results in rank order.

    ``fn`` must be importable by name (a module-level function): children are forked from a
    forkserver (spawned where there is none).
    ``group_timeout`` is the process group's timeout in seconds (how long a collective waits).
    """
    import torch.distributed as dist

    world = len(nodes)
    if world < 1:
        raise LaunchError("need at least one rank")
    store = dist.TCPStore("127.0.0.1", 0, world + 1, is_master=True, wait_for_workers=False)
    mpctx = _context()
    environ = dict(os.environ)
    out = mpctx.Queue()
    procs = []
    for rank in range(world):
        ctx = RankContext(rank=rank, world_size=world, node=nodes[rank], nodes=tuple(nodes))
        p = mpctx.Process(
            target=_child,
            args=(fn, ctx, store.port, args, out, threads_per_rank, environ, group_timeout),
            daemon=True,
        )
        p.start()
        procs.append(p)
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"job did not finish within {timeout:.0f}s (ranks done: {sorted(results)})")
            try:
                rank, ok, value = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [
                    i
                    for i, p in enumerate(procs)
                    if not p.is_alive() and i not in results and i not in errors
                ]
                for i in dead:
                    if procs[i].exitcode not in (0, None):
                        errors[i] = f"rank {i} exited with code {procs[i].exitcode}"
                continue
            if ok:
                import torch

                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        del store
    if errors:
        first = min(errors)
        raise LaunchError(f"rank {first} failed:\n{errors[first]}")
    return [results[r] for r in range(world)]


def run_processes(
    argvs: Sequence[Sequence[str]], *, timeout: float, env: Mapping[str, str] | None = None
) -> list[tuple[int, str, str]]:
    """Start one process per argv at once; each one's (exit status, stdout, stderr), in order.

    For jobs whose own exit status matters (an abort at interpreter exit shows only there). All
    are killed when one does not finish within ``timeout`` seconds (then ``TimeoutExpired``).
    """
    procs = [
        subprocess.Popen(
            list(argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(env) if env is not None else None,
        )
        for argv in argvs
    ]
    out: list[tuple[int, str, str]] = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=timeout)
            out.append((p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out
