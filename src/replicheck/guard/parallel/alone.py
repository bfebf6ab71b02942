"""Discarded passes that need no other rank: each runs on this rank alone (DDP, one process)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from replicheck.guard.loss import unpack
from replicheck.guard.parallel.base import (
    Capture,
    DiscardedPass,
    Fingerprints,
    LossRun,
    Replays,
    grads_put_back,
)


class AloneReplays(Replays):
    """Gradients by ``torch.autograd.grad``, leaving every ``.grad`` as it was.

    Reentrant activation checkpointing refuses ``autograd.grad`` (it runs its own inner
    ``backward`` into ``.grad``), so from the first such refusal on a pass runs ``backward`` into
    scratch ``.grad`` slots instead, again from the start under fresh contexts.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self._params = list(params)
        self._scratch_backward = False

    def _gradients(
        self, p: DiscardedPass, attempt: Callable[[], None] = lambda: None
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        for _attempt in range(2):
            attempt()
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
        """The pass's loss and gradient fingerprint, each parameter's gradient fingerprinted as
        it is produced and then dropped: no second full gradient set beside ``.grad``."""
        part = prints.part(seed)
        taken: dict[int, torch.Tensor] = {}

        def take(i: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def hook(g: torch.Tensor) -> torch.Tensor:
                taken[i] = part(g, i)
                # What the pass returns in its place costs no memory (one zero, expanded).
                return g.new_zeros(()).expand(g.shape)

            return hook

        # Registered last, so the user's own gradient hooks have run when the gradient is read.
        hooked = [(i, q) for i, q in enumerate(self._params) if q.requires_grad]
        handles = [q.register_hook(take(i)) for i, q in hooked]  # type: ignore[no-untyped-call]
        try:
            loss, _ = self._gradients(p, attempt=taken.clear)
        finally:
            for h in handles:
                h.remove()
        device = next((t.device for t in taken.values()), loss.device)
        parts = [taken[i] if i in taken else _part_of_none(part, i, device) for i in range(len(self._params))]
        return loss, prints.join(parts)

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


def _part_of_none(part: Capture, index: int, device: torch.device) -> torch.Tensor:
    """The fingerprint part of a parameter the pass gave no gradient, beside the others."""
    got: torch.Tensor = part(None, index)  # type: ignore[arg-type]  # no gradient has a fingerprint too
    return got.to(device)


class _RetryWithBackward(Exception):
    """Internal: the pass must run again with ``backward`` into scratch gradients."""
