"""The step's failure flags: how every rank learns that one failed, at a point where all meet.

An error on one rank must end every rank in the same step, and no rank may be left waiting in a
collective its failed peer never joins.

- **DDP** (passes are not collectives): nothing is shared per forward. A rank that failed still
  takes part in every all-reduce of the step's synchronising backward, with zeros (as DDP's own
  ``join`` does for a rank out of data), so its peers' backward completes; its failure rides in
  the step's row all-gather, after which every rank stops. No extra collective, no host barrier.
- **FSDP2** (every forward and backward is a collective): a failed rank cannot run the backward's
  all-gathers and reduce-scatters without a graph, so after each forward every rank learns
  whether any failed — one 8-byte all-reduce on the communication device
  (:meth:`~replicheck.guard.transport.comm.Comm.flagged`), the same cost at any world size — and
  then every rank skips the rest of the step's passes. An error after the last forward (in a
  reduced-gradient hook) rides in the step's row on an ordinary step, whose reduce-scatter
  verdict and row every rank runs whatever failed; only a verification step, whose ring exchange
  and replays a failed rank would skip, shares one more flag after the passes.
"""

from __future__ import annotations

from replicheck.guard.transport.comm import Comm


class FailureFlags:
    """The ranks this step's shared flags showed failed (collective passes only)."""

    def __init__(self, comm: Comm) -> None:
        self._comm = comm
        self._failed: set[int] = set()

    def reset(self) -> None:
        """Start a step."""
        self._failed = set()

    def share(self, failed: bool) -> bool:
        """Collective: share this rank's flag now; whether any rank has failed in this step."""
        self._failed.update(self._comm.flagged(failed))
        return bool(self._failed)

    def ranks(self) -> list[bool]:
        """Per rank, whether a shared flag showed it failed in this step."""
        return [r in self._failed for r in range(self._comm.world_size)]
