"""DistributedDataParallel: every rank holds the whole model; gradients meet in DDP's all-reduce."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard.checks.health import GradStats
from replicheck.guard.config import GuardConfig
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.parallel.alone import AloneReplays
from replicheck.guard.parallel.base import ForwardCounter, Parallelism, Replays, module_device
from replicheck.guard.parallel.ddp_hook import BucketCount, GradHealth, finish_reductions
from replicheck.guard.transport.comm import Comm


class DataParallel(Parallelism):
    """A ``DistributedDataParallel`` model: the guard's check sits in DDP's communication hook."""

    kind = "ddp"
    rebuilds_on_resume = True

    def __init__(self, ddp: DistributedDataParallel) -> None:
        _refuse_options(ddp)
        super().__init__(ddp, ddp.module, Comm(ddp.process_group, compute=module_device(ddp.module)))
        self.ddp = ddp
        self._buckets = BucketCount()
        self._hooked = False
        self._forwards = ForwardCounter(ddp)

    @classmethod
    def claim(cls, model: torch.nn.Module) -> DataParallel | None:
        if isinstance(getattr(model, "_orig_mod", None), DistributedDataParallel):
            raise GuardConfigError(
                "torch.compile(ddp_model) is not supported: the guard needs DDP's own module for its "
                "replays and DDP's gradient hooks for its checks. Compile the module inside DDP instead: "
                "DistributedDataParallel(torch.compile(model))"
            )
        return cls(model) if isinstance(model, DistributedDataParallel) else None

    def install(self, config: GuardConfig) -> GradStats:
        health = GradHealth(self.comm.group, digest_reduced=config.check_reduced and self.comm.world_size > 1)
        try:
            self.ddp.register_comm_hook(None, self._buckets.wrap(health.comm_hook))
        except RuntimeError as exc:
            # Falling back would lose which rank produced a bad local gradient: refuse instead.
            raise GuardConfigError(
                "the DDP model already has a communication hook (register_comm_hook, or DDP's "
                "mixed_precision option); the guard needs that slot to check each rank's gradient "
                "before the all-reduce. Remove the hook (for gradient compression, none is supported "
                f"with the guard yet). DDP said: {exc}"
            ) from None
        self._hooked = True
        return health

    def replays(self, params: Sequence[torch.nn.Parameter]) -> Replays:
        return AloneReplays(params)

    def accumulate(self, sync: bool) -> AbstractContextManager[Any]:
        return contextlib.nullcontext() if sync else self.ddp.no_sync()

    def sync_off(self) -> str | None:
        if not self.ddp.require_backward_grad_sync:
            return "DDP's gradient sync is off (inside ddp.no_sync())"
        return None

    @contextlib.contextmanager
    def failing_backward(self, synced: bool) -> Iterator[None]:
        """On the synchronising pass, the all-reduces DDP never launched are completed with zeros."""
        self._buckets.launched = 0
        try:
            yield
        except Exception:
            if synced and self._hooked:
                finish_reductions(self.ddp, self._buckets.launched)
            raise

    def join_failed_backward(self) -> None:
        """What the peers' synchronising backward runs, with zeros, in DDP's order (the step is
        discarded anyway): every bucket's all-reduce, then, with ``find_unused_parameters``, the
        all-reduce of which parameters were used — the order in which torch's reducer issues
        them (``tests/distributed/test_failure_flags.py`` pins it: a mismatch is a hang)."""
        if not self._hooked:
            return
        finish_reductions(self.ddp, 0)
        if getattr(self.ddp, "find_unused_parameters", False):
            used = [p for p in self.ddp.module.parameters() if p.requires_grad]
            unused = torch.zeros(len(used), dtype=torch.int32, device=module_device(self.ddp.module))
            dist.all_reduce(unused, group=self.ddp.process_group)

    def forwards(self) -> int:
        return self._forwards.count

    def join_failed_forward(self, skipped: bool) -> None:
        """The collectives DDP runs at the start of its forward (buffer broadcast, bucket rebuild),
        so the other ranks reach the failure flag instead of waiting in them."""
        ddp = self.ddp
        with contextlib.suppress(Exception):
            ddp._pre_forward()  # type: ignore[no-untyped-call]  # private, untyped in torch
            if ddp._check_sync_bufs_post_fwd():  # type: ignore[no-untyped-call]
                ddp._sync_buffers()  # type: ignore[no-untyped-call]
        # What DDP's post-forward records: whether the next forward broadcasts buffers. Without
        # it, a failed no_sync pass followed by a synced one broadcasts where peers do not.
        ddp.require_forward_param_sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync


def _refuse_options(ddp: DistributedDataParallel) -> None:
    """Refuse DDP options that bypass the guard's hooks or its extra passes."""
    if getattr(ddp, "static_graph", False):
        raise GuardConfigError(
            "DistributedDataParallel(static_graph=True) is not supported: the guard's probe adds "
            "backward passes under no_sync() that a static graph does not allow. Construct DDP "
            "without static_graph (use find_unused_parameters=True if parameters go unused)."
        )
    if getattr(ddp, "mixed_precision", None) is not None:
        raise GuardConfigError(
            "DistributedDataParallel(mixed_precision=...) installs DDP's own communication hook, "
            "which would replace the guard's per-rank gradient checks. Use torch.autocast in the "
            "loss function for mixed precision instead."
        )
