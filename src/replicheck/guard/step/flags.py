"""The step's failure flags: posted after each forward without waiting, collected before the
step's first gradient all-reduce.

An error on one rank must end every rank in the same step, and a rank whose forward failed never
joins the backward's all-reduce. Every rank therefore shares a failed/ok flag after each forward
(one value per rank, over a host group), but nothing waits for it there: the wait happens in the
DDP comm hook right before the first bucket's all-reduce, itself a point where the ranks meet,
so the flag adds no synchronisation point of its own. When a peer failed, every healthy rank skips
all the step's all-reduces (the buckets stay local; the step is discarded), and every rank raises
once its passes are done: the failing one its own error, the others :class:`PeerFailed`.
"""

from __future__ import annotations

from collections.abc import Callable

from replicheck.guard.transport.comm import Comm


class FailureFlags:
    """This step's posted flags and the ranks they showed failed."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self._pending: list[Callable[[], list[bool]]] = []
        self._failed = [False] * comm.world_size

    def reset(self) -> None:
        """Start a step: forget the last one's flags (all were collected unless a step was left
        by an exception outside the protocol, whose gathers every rank posted anyway)."""
        self._pending.clear()
        self._failed = [False] * self._comm.world_size

    def post(self, failed: bool) -> None:
        """Share this rank's flag after a forward pass, without waiting for the others."""
        self._pending.append(self._comm.post_host_flag(failed))

    def collect(self) -> list[bool]:
        """Wait for every flag posted so far; per rank, whether it failed in this step."""
        for wait in self._pending:
            self._failed = [a or b for a, b in zip(self._failed, wait())]
        self._pending.clear()
        return list(self._failed)

    def any_failed(self) -> bool:
        """:meth:`collect`, reduced to whether any rank failed (what the comm hook asks)."""
        return any(self.collect())
