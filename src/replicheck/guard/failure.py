"""An error on one rank ends every rank in the same step: this rank's error and the protocol.

A failed rank keeps the step's shape (the same forwards, so the same flags and the collectives
DDP runs in a forward) but runs no backward; the flag it posts after each forward
(:mod:`replicheck.guard.flags`) tells the healthy ranks, in the comm hook before their first
all-reduce, to skip the step's all-reduces. After the passes, or at the step's row all-gather
for errors that come later, the failed rank re-raises its error and the others raise
:class:`PeerFailed`; none waits in a collective until the process group's timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard.comm import Comm
from replicheck.guard.determinism import determinism_error
from replicheck.guard.errors import PeerFailed
from replicheck.guard.flags import FailureFlags
from replicheck.guard.loss import LossSum, unpack
from replicheck.guard.sharded import collectives_of_forward
from replicheck.guard.support import checked_loss
from replicheck.guard.unwind import BucketCount, finish_reductions

T = TypeVar("T")


class StepFailure:
    """This rank's error in the current step, and how every rank learns of it."""

    def __init__(
        self,
        comm: Comm,
        optimizer: torch.optim.Optimizer,
        ddp: DistributedDataParallel | None,
        *,
        sharded: torch.nn.Module | None = None,
    ) -> None:
        self._optimizer, self._ddp, self._sharded = optimizer, ddp, sharded
        self.flags = FailureFlags(comm)
        """The per-forward flags (the comm hook asks them before the first all-reduce)."""
        self.buckets = BucketCount()
        """Counts the buckets DDP launched in the current backward."""
        self.hooked = False
        """Whether the guard's comm hook is installed (set by the guard once it is)."""
        self.error: BaseException | None = None
        """This rank's error in the step, until the step stops on it."""
        self._entries = 0
        self._peer_failed = False
        wrapper = ddp if ddp is not None else sharded
        if wrapper is not None:
            wrapper.register_forward_pre_hook(self._count_forward)

    def _count_forward(self, module: torch.nn.Module, args: object) -> None:
        self._entries += 1

    @property
    def failed(self) -> bool:
        return self.error is not None

    def reset(self) -> None:
        """Start a step."""
        self.flags.reset()
        self.error = None
        self._peer_failed = False

    def note(self, exc: BaseException) -> None:
        """Record ``exc`` as this rank's error unless one came earlier in the step."""
        if self.error is None:
            self.error = determinism_error(exc) or exc

    def forward(self, run: Callable[[], object], where: str) -> tuple[torch.Tensor, float | None] | None:
        """One forward pass, then its flag; ``None`` when this rank has failed in the step."""
        loss: torch.Tensor | None = None
        count: float | None = None
        entered = self._entries
        skipped = self.error is not None or self._peer_failed
        if not skipped:
            try:
                out = run()
                loss, count = unpack(out) if isinstance(out, LossSum) else (checked_loss(out, where), None)
            except Exception as exc:  # noqa: BLE001 - re-raised on this rank by stop()
                # A probe forward runs with deterministic kernels: note() names an op that has none.
                self.note(exc)
        if self.error is not None and self._entries == entered:
            if self._sharded is None:
                self._ddp_collectives_of_forward()
            elif not skipped:
                collectives_of_forward(self._sharded)
        self.flags.post(self.error is not None)
        if self._sharded is not None:
            # A sharded backward is a collective: every rank must know now whether any failed,
            # and then every rank skips the rest of the step's passes.
            self._peer_failed = any(self.flags.collect())
        if self.error is not None or loss is None or self._peer_failed:
            return None
        return loss, count

    def backward(self, loss: torch.Tensor, synced: bool) -> None:
        """A training or split-probe backward. Its error (a tensor hook) is this rank's, reported at
        the step's next collective; on the synchronising pass the all-reduces DDP never launched
        are completed with zeros first, so no rank waits in them."""
        self.buckets.launched = 0
        try:
            loss.backward()  # type: ignore[no-untyped-call]  # torch's stubs leave it untyped
        except Exception as exc:  # noqa: BLE001 - re-raised on this rank by stop()
            self.note(exc)
            if synced and self._ddp is not None and self.hooked:
                finish_reductions(self._ddp, self.buckets.launched)

    def attempt(self, run: Callable[[], T]) -> T | None:
        """Run a computation whose error is reported in the step's all-gather row, not raised here."""
        if self.error is not None:
            return None
        try:
            return run()
        except Exception as exc:  # noqa: BLE001 - re-raised on this rank by stop()
            self.note(exc)
            return None

    def stop(self, s: int, failed: Sequence[bool]) -> None:
        """End step ``s`` on every rank when any failed: re-raise this rank's error, else PeerFailed."""
        ranks = tuple(r for r, f in enumerate(failed) if f)
        if not ranks:
            return
        self._optimizer.zero_grad(set_to_none=True)
        mine, self.error = self.error, None
        if mine is not None:
            raise mine
        raise PeerFailed(s, ranks)

    def stop_after_passes(self, s: int) -> None:
        """Every rank has posted one flag per forward; a failure anywhere ends the step here."""
        self.stop(s, self.flags.collect())

    def _ddp_collectives_of_forward(self) -> None:
        """The loss function failed before it called the DDP model: take part in the collectives
        DDP runs at the start of its forward (buffer broadcast, bucket rebuild) as the other ranks
        do, so they reach the failure flag instead of waiting in those collectives."""
        ddp = self._ddp
        if ddp is not None:
            with contextlib.suppress(Exception):
                ddp._pre_forward()  # type: ignore[no-untyped-call]  # private, untyped in torch
                if ddp._check_sync_bufs_post_fwd():  # type: ignore[no-untyped-call]
                    ddp._sync_buffers()  # type: ignore[no-untyped-call]
            # What DDP's post-forward records: whether the next forward broadcasts buffers. Without
            # it, a failed no_sync pass followed by a synced one broadcasts where peers do not.
            ddp.require_forward_param_sync = torch.is_grad_enabled() and ddp.require_backward_grad_sync
