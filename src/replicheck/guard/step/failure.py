"""An error on one rank ends every rank in the same step: this rank's error and the protocol.

A failed rank keeps the step's shape (the same forwards, so the collectives DDP runs in a
forward) but runs no backward of its own. Under DDP it joins the synchronising backward's
all-reduces with zeros and reports its failure in the step's row; under FSDP2 every rank shares a
flag after each forward and all skip the rest of the passes (:mod:`replicheck.guard.step.flags`).
At the step's row all-gather (DDP, and FSDP2 on an ordinary step) or after the passes (FSDP2 on a
step whose replays follow) the failed rank re-raises its error and the others raise
:class:`PeerFailed`; none waits in a collective until the process group's timeout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch

from replicheck.guard.errors import PeerFailed
from replicheck.guard.loss import Count, LossSum, unpack
from replicheck.guard.parallel.base import Parallelism
from replicheck.guard.step.determinism import determinism_error
from replicheck.guard.step.flags import FailureFlags
from replicheck.guard.step.support import checked_loss

T = TypeVar("T")


class StepFailure:
    """This rank's error in the current step, and how every rank learns of it."""

    def __init__(self, optimizer: torch.optim.Optimizer, parallelism: Parallelism) -> None:
        self._optimizer, self._par = optimizer, parallelism
        self.comm = parallelism.comm
        """The guarded job's collectives."""
        self.flags = FailureFlags(parallelism.comm)
        """The per-forward flags of collective passes (FSDP2)."""
        self.error: BaseException | None = None
        """This rank's error in the step, until the step stops on it."""
        self._peer_failed = False

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

    def forward(self, run: Callable[[], object], where: str) -> tuple[torch.Tensor, Count | None] | None:
        """One forward pass, then its flag; ``None`` when this rank has failed in the step."""
        loss: torch.Tensor | None = None
        count: Count | None = None
        entered = self._par.forwards()
        skipped = self.error is not None or self._peer_failed
        if not skipped:
            try:
                out = run()
                loss, count = unpack(out) if isinstance(out, LossSum) else (checked_loss(out, where), None)
            except Exception as exc:  # noqa: BLE001 - re-raised on this rank by stop()
                # A probe forward runs with deterministic kernels: note() names an op that has none.
                self.note(exc)
        if self.error is not None and self._par.forwards() == entered:
            self._par.join_failed_forward(skipped)
        if self._par.passes_are_collective:
            # The backward is a collective then: every rank must know now whether any failed,
            # and then every rank skips the rest of the step's passes.
            self._peer_failed = self.flags.share(self.error is not None)
        if self.error is not None or loss is None or self._peer_failed:
            return None
        return loss, count

    def backward(self, loss: torch.Tensor, synced: bool) -> None:
        """A training or split-probe backward. Its error (a tensor hook) is this rank's, reported at
        the step's next collective; the parallelism first finishes what the other ranks wait for
        (DDP: the all-reduces it never launched, with zeros), so no rank waits in them."""
        try:
            with self._par.failing_backward(synced):
                loss.backward()  # type: ignore[no-untyped-call]  # torch's stubs leave it untyped
        except Exception as exc:  # noqa: BLE001 - re-raised on this rank by stop()
            self.note(exc)

    def join_backward(self, synced: bool) -> None:
        """This rank failed before a backward: on a synchronising one, take part in what the other
        ranks' backward waits for (DDP: its all-reduces, with zeros)."""
        if synced and not self._par.passes_are_collective:
            self._par.join_failed_backward()

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

    def stop_after_passes(self, s: int, *, collectives_follow: bool) -> None:
        """Collective passes (FSDP2): every rank has shared a flag per forward; one more for what
        came after (a reduced-gradient hook's error), and a failure anywhere ends
        the step here, before the replays (collectives too). Under DDP, and under FSDP2 on a step
        whose next collectives every rank runs whatever failed (``collectives_follow`` false: an
        ordinary step, whose reduce-scatter verdict and row come next), failures travel in the
        step's row: one host barrier fewer a step."""
        if not self._par.passes_are_collective:
            return
        if collectives_follow or not self._par.row_reaches_every_rank:
            self.flags.share(self.failed)
        # A failed forward's flag was seen by every rank alike: all stop here, symmetrically.
        self.stop(s, self.flags.ranks())
