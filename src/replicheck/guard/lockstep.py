"""Probe passes of a sharded model, run by every rank at once.

A ``fully_shard`` model all-gathers its parameters in every forward and backward, so a pass is a
collective: a replay that runs on some ranks only (an arbiter's, a suspect's re-run) would leave
them waiting for the others. Every rank therefore runs the same number of passes in each phase,
padding with a discarded filler pass, and the ranks share a failed/ok flag after each forward so
that an error ends the pass on every rank before the backward's collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from replicheck.guard.batch import batch_size, split
from replicheck.guard.comm import Comm
from replicheck.guard.errors import PeerFailed
from replicheck.guard.loss import unpack
from replicheck.guard.probe import Capture
from replicheck.guard.sharded import GradTap, collectives_of_forward

T = TypeVar("T")


class Lockstep:
    """Runs a sharded model's discarded passes in lockstep with the other ranks."""

    def __init__(
        self, comm: Comm, tap: GradTap, model: torch.nn.Module, params: list[torch.nn.Parameter]
    ) -> None:
        self._comm, self._tap, self._model, self._params = comm, tap, model, params
        self._entries = 0
        self._filler: Any = None
        model.register_forward_pre_hook(self._count)

    def _count(self, module: torch.nn.Module, args: object) -> None:
        self._entries += 1

    def set_filler(self, batch: Any, size: int) -> None:
        """The samples a rank with nothing to replay runs instead (the front of its step's batch)."""
        self._filler = split(batch, min(size, batch_size(batch)))[0]

    def gradients(
        self, run: Callable[[], object], weight: float, capture: Capture, step: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One pass: ``run()`` gives the loss; each layer group's gradient goes to ``capture``.

        Every ``.grad`` is left as it was, and no gradient is reduced (every rank is in a pass).
        """
        entered = self._entries
        loss: torch.Tensor | None = None
        error: Exception | None = None
        try:
            loss, _ = unpack(run())
        except Exception as exc:  # noqa: BLE001 - raised below, once every rank knows
            error = exc
            if self._entries == entered:
                collectives_of_forward(self._model)
        failed = self._comm.host_flags(error is not None)
        if any(failed):
            if error is not None:
                raise error
            raise PeerFailed(step, tuple(r for r, f in enumerate(failed) if f))
        if loss is None:
            raise RuntimeError("internal: a pass without a loss")
        saved = [p.grad for p in self._params]
        for p in self._params:
            p.grad = None
        try:
            with self._tap.capturing(capture) as parts:
                (loss * weight).backward()  # type: ignore[no-untyped-call]
        finally:
            for p, g in zip(self._params, saved):
                p.grad = g
        return loss, list(parts)

    def together(self, passes: int, run: Callable[[], T], filler: Callable[[Any], object]) -> T:
        """``run()`` (``passes`` passes on this rank), then filler passes up to the most any rank
        runs, so every rank leaves the phase after the same collectives."""
        most = self._comm.max_int(passes)
        out = run()
        for _ in range(most - passes):
            filler(self._filler)
        return out
