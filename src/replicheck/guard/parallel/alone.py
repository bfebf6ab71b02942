"""Discarded passes that need no other rank: each runs on this rank alone (DDP, one process)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replicheck.guard.loss import unpack
from replicheck.guard.parallel.base import DiscardedPass, Fingerprints, LossRun, Replays, grads_put_back


class AloneReplays(Replays):
    """Gradients by ``torch.autograd.grad``, leaving every ``.grad`` as it was.

    Reentrant activation checkpointing refuses ``autograd.grad`` (it runs its own inner
    ``backward`` into ``.grad``), so from the first such refusal on a pass runs ``backward`` into
    scratch ``.grad`` slots instead, again from the start under fresh contexts.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._params = list(params)
        self._scratch_backward = False

    def _gradients(self, p: DiscardedPass) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        for _attempt in range(2):
            try:
                with p.contexts():
                    return self._once(p.run, p.weight)
            except _RetryWithBackward:
                continue
        raise RuntimeError("internal: a replay retried twice")

    def _once(self, run: LossRun, weight: float) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        loss, _ = unpack(run())
        scaled = loss * weight
        if self._scratch_backward:
            with grads_put_back(self._params):
                scaled.backward()  # type: ignore[no-untyped-call]  # torch's stubs leave it untyped
                return loss, [p.grad for p in self._params]
        try:
            return loss, list(torch.autograd.grad(scaled, self._params, allow_unused=True))
        except RuntimeError as exc:
            if "use_reentrant" not in str(exc):
                raise
            self._scratch_backward = True
            raise _RetryWithBackward from exc

    def fingerprint(
        self, p: DiscardedPass, prints: Fingerprints, seed: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        loss, grads = self._gradients(p)
        return loss, prints(grads, seed)

    def gradient_norm(self, passes: Sequence[DiscardedPass]) -> torch.Tensor | None:
        acc: list[torch.Tensor | None] = [None] * len(self._params)
        for p in passes:
            grads = self._gradients(p)[1]
            acc = [a if g is None else (g if a is None else a + g) for a, g in zip(acc, grads)]
        present = [g.float() for g in acc if g is not None]
        if not present:
            return None
        norm: torch.Tensor = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g) for g in present])
        )
        return norm


class _RetryWithBackward(Exception):
    """Internal: the pass must run again with ``backward`` into scratch gradients."""
