"""Discarded passes of a sharded model, run by every rank at once.

A ``fully_shard`` model all-gathers its parameters in every forward and backward, so a pass is a
collective: a replay that runs on some ranks only (an arbiter's, a suspect's re-run) would leave
them waiting for the others. Every rank therefore runs the same number of passes in each phase,
padding with a discarded filler pass, and the ranks share a failed/ok flag after each forward so
that an error ends the pass on every rank before the backward's collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from replicheck.guard.checks.health import sq_norm
from replicheck.guard.context import current_step
from replicheck.guard.errors import PeerFailed
from replicheck.guard.loss import unpack
from replicheck.guard.parallel.base import (
    Capture,
    DiscardedPass,
    Fingerprints,
    ForwardCounter,
    LossRun,
    Replays,
    grads_put_back,
)
from replicheck.guard.parallel.fsdp_tap import ForwardOrder, GradTap, collectives_of_forward
from replicheck.guard.transport.batch import batch_size, split
from replicheck.guard.transport.comm import Comm

T = TypeVar("T")


class LockstepReplays(Replays):
    """Runs a sharded model's discarded passes in lockstep with the other ranks."""

    def __init__(
        self,
        comm: Comm,
        tap: GradTap,
        forwards: ForwardCounter,
        order: ForwardOrder,
        params: Sequence[torch.nn.Parameter],
    ) -> None:
        self._comm, self._tap, self._forwards = comm, tap, forwards
        self._order, self._params = order, list(params)
        self._filler: Any = None
        self._passes = 0
        """Passes this rank has taken part in (each shares a flag after its forward)."""
        self._shared: BaseException | None = None
        """The last error raised where every rank raised (at a pass's flag) or where no rank can
        go on (inside a backward's collectives): :meth:`together` lets it through as it is."""

    def begin_step(self, batch: Any, probe_size: int) -> None:
        """The samples a rank with nothing to replay runs instead (the front of its step's batch)."""
        self._filler = split(batch, min(probe_size, batch_size(batch)))[0]

    def fingerprint(
        self, p: DiscardedPass, prints: Fingerprints, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        with p.contexts():
            loss, parts = self._gradients(p.run, p.weight, prints.part(seed))
        return loss, prints.join(parts)

    def gradient_norm(self, passes: Sequence[DiscardedPass]) -> torch.Tensor | None:
        """The local norm summed over each pass's gradient buffers, as a sharded step's row has it."""
        squares: list[torch.Tensor] = []
        for p in passes:
            with p.contexts():
                squares += self._gradients(p.run, p.weight, _square)[1]
        if not squares:
            return None
        return torch.stack(squares).sum().sqrt()

    def _gradients(
        self, run: LossRun, weight: float, capture: Capture
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One pass: ``run()`` gives the loss; each gradient buffer goes to ``capture``.

        Every ``.grad`` is left as it was, and no gradient is reduced (every rank is in a pass).
        """
        entered = self._forwards.count
        loss: torch.Tensor | None = None
        error: Exception | None = None
        try:
            loss, _ = unpack(run())
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            error = exc
            if self._forwards.count == entered:
                collectives_of_forward(self._order)
        failed = self._comm.flagged(error is not None)
        self._passes += 1
        if failed:
            shared = error if error is not None else PeerFailed(current_step(), tuple(failed))
            self._shared = shared
            raise shared
        if loss is None:
            raise RuntimeError("internal: a pass without a loss")
        try:
            with grads_put_back(self._params), self._tap.capturing(capture) as parts:
                (loss * weight).backward()  # type: ignore[no-untyped-call]
        except Exception as exc:
            # Part-way through the backward's collectives: padding with filler passes would pair
            # this rank's collectives with the wrong ones of its peers.
            self._shared = exc
            raise
        return loss, list(parts)

    def together(self, passes: int, run: Callable[[], T], filler: Callable[[Any], object]) -> T:
        """``run()`` (``passes`` passes on this rank), then filler passes up to the most any rank
        runs, so every rank leaves the phase after the same collectives."""
        most = self._comm.max_int(passes)
        start = self._passes
        try:
            out = run()
        except Exception as exc:
            if exc is self._shared:
                raise
            # Raised between passes (a comparison, a copy to the host): the other ranks still
            # expect this rank's part in the phase's remaining passes; the error then travels in
            # the caller's next gather.
            for _ in range(most - (self._passes - start)):
                filler(self._filler)
            raise
        for _ in range(most - passes):
            filler(self._filler)
        return out

    def settle(self, filler: Callable[[Any], object]) -> None:
        """Filler passes for the phases the other ranks of this rank's lockstep group are still
        in, where the communicator tells them (``idle()``: the passes of the next phase, ``None``
        once every rank is done); elsewhere every rank judged the same rows and is done."""
        idle = getattr(self._comm, "idle", None)
        if idle is None:
            return
        while (most := idle()) is not None:
            for _ in range(most):
                filler(self._filler)


def _square(t: torch.Tensor, index: int) -> torch.Tensor:
    return sq_norm(t)
