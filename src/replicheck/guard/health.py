"""Per-step gradient checks: local health before the all-reduce, agreement after it."""

# No `from __future__ import annotations`: DDP inspects the comm hook's annotations at runtime.
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import GradBucket  # torch's stubs do not re-export it from torch.distributed

from replicheck import fingerprint as fp

ReducedHook = Callable[[int, torch.Tensor], None]
"""``hook(bucket_index, reduced_bucket)``: sees (and may modify) a bucket after its all-reduce."""


class GradStats:
    """One step's local gradient norm, reduced-gradient digests and reduced-gradient hooks: what
    the guard reads from DDP's comm hook (:class:`GradHealth`) or FSDP2's reduce-scatter
    (:class:`~replicheck.guard.sharded.GradTap`). Results are 0-dim device tensors."""

    def __init__(self, digest_reduced: bool) -> None:
        self.digest_reduced = digest_reduced
        self.reduced_hooks: list[ReducedHook] = []
        self.reset()

    def reset(self) -> None:
        """Start a step."""
        self._local_sq: list[torch.Tensor] = []
        self._reduced: dict[int, torch.Tensor] = {}
        self.errors: list[Exception] = []
        """Errors raised by reduced-gradient hooks this step (reported in the step's row, so
        every rank stops instead of the failing one leaving the others in a collective)."""

    def _run_hooks(self, index: int, t: torch.Tensor) -> None:
        for hook in self.reduced_hooks:
            try:
                hook(index, t)
            except Exception as exc:  # noqa: BLE001 - reported through the step's row
                self.errors.append(exc)

    def local_norm(self) -> torch.Tensor | float:
        """The local gradient norm (float64, on the device), or 0.0 when no gradient was seen."""
        if not self._local_sq:
            return 0.0
        return torch.stack(self._local_sq).sum().sqrt()

    def reduced_digest(self) -> torch.Tensor | int:
        """The reduced gradient's digest (on the device), or 0 when not checked."""
        if not self._reduced:
            return 0
        return fp.combine(torch.stack([self._reduced[i] for i in sorted(self._reduced)]))


class GradHealth(GradStats):
    """Collects, for one step, the local gradient norm and the digest of the reduced gradient.

    Everything stays on the gradients' device and nothing here waits for it: the results are
    0-dim device tensors that ride in the step's row (one host transfer per step, after the
    all-gather), so the comm hook never stalls the overlap of backward and all-reduce.

    As a DDP communication hook it sees every bucket before the all-reduce (so a non-finite or
    huge local gradient is attributed to the rank that produced it) and after it (so every
    rank's reduced gradient can be compared bit for bit). It reduces the way DDP's default hook
    does: divide by the world size, then all-reduce a sum.
    """

    def __init__(self, group: dist.ProcessGroup | None, digest_reduced: bool) -> None:
        self.group = group
        self.peer_failed: Callable[[], bool] | None = None
        """Asked before each bucket's all-reduce: when a rank failed in this step's forward (it
        never joins the all-reduce), the bucket is left local instead (the step is discarded)."""
        super().__init__(digest_reduced)

    # -- DDP communication hook -------------------------------------------------------------
    def comm_hook(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        buf = bucket.buffer()
        # Squared norm: one streaming read; NaN and Inf propagate into it.
        self._local_sq.append(sq_norm(buf))
        if self.peer_failed is not None and self.peer_failed():
            skipped: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            skipped.set_result(buf)
            return skipped
        world = dist.get_world_size(self.group)
        buf.div_(world)
        work = dist.all_reduce(buf, group=self.group, async_op=True)
        fut: torch.futures.Future[list[torch.Tensor]] = work.get_future()
        index = bucket.index()

        def after(f: "torch.futures.Future[list[torch.Tensor]]") -> torch.Tensor:
            out = f.value()[0]
            self._run_hooks(index, out)
            if self.digest_reduced:
                self._reduced[index] = fp.digest(out)
            return out

        return fut.then(after)

    # -- without DDP (world size 1, or a user-owned comm hook) -------------------------------
    def observe_local(self, grads: Sequence[torch.Tensor]) -> None:
        if grads:
            self._local_sq.extend(sq_norm(g) for g in grads)

    def observe_reduced(self, grads: Sequence[torch.Tensor]) -> None:
        if self.digest_reduced and grads:
            for i, g in enumerate(grads):
                self._run_hooks(i, g)
            self._reduced[0] = fp.combine(fp.digests(grads))


def sq_norm(t: torch.Tensor) -> torch.Tensor:
    """Squared L2 norm as float64: low-precision and float32 buckets are reduced in float32, float64
    in float64, complex as the norm of the magnitudes (NaN and Inf propagate)."""
    if t.is_complex():
        t = torch.view_as_real(t)
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    norm: torch.Tensor = torch.linalg.vector_norm(t, dtype=dtype)
    return norm.double().square()
