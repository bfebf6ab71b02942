"""FSDP2 inside a torchft replica group (issue 28): the model sharded over the group's ranks with
``fully_shard``, each shard replicated across the groups by torchft; see ``docs/no-restart.md``.

Rank ``l`` of every group holds shard ``l``: torchft's column ``l`` (the ``pg`` given to rank
``l``'s ``Manager``) joins the replicas of that shard, as the replicate dimension of HSDP does.
The guard of rank ``l`` runs over its column (:class:`~replicheck.guard.parallel.torchft.TorchftComm`):
its rows, its ring (rank ``l`` of group ``g`` replays the probe of rank ``l`` of another group),
the comparison of shard ``l``'s weights, optimizer state and reduced gradient across the groups.

A sharded pass is a collective of the group (parameter all-gathers, the reduce-scatter), so
discarded passes run in lockstep with the other ranks of the group: the pass counts of a phase
and the failure flag after each forward are reduced over the whole job, first over the group,
then over the column (:class:`GroupFlags`), so every rank of every group pads to the same count
and an error on one rank stops every rank in that pass. The reduction across the groups is
FSDP2's all-reduce hook (``set_all_reduce_hook``): ``Manager.allreduce`` of each reduced shard of
a training pass, before the guard's reduced-gradient digest.

Device discipline: gloo only, host tensors throughout, as :mod:`replicheck.guard.parallel.torchft`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from replicheck.guard.checks.health import GradStats
from replicheck.guard.config import GuardConfig
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.parallel.fsdp import Sharded
from replicheck.guard.parallel.fsdp_tap import GradTap
from replicheck.guard.parallel.torchft import TorchftComm, refuse_config, refuse_manager
from replicheck.guard.transport.transfer import to_host

if TYPE_CHECKING:
    from replicheck.guard.attribution.ring import Ring
    from replicheck.guard.checks.update import UpdateReplay


class GroupFlags(TorchftComm):
    """:class:`TorchftComm` whose failure flags and pass counts span the whole job: reduced over
    the replica group first, then over the column. Every other message stays in the column."""

    def __init__(self, manager: Any, pg: Any, group: dist.ProcessGroup) -> None:
        super().__init__(manager, pg)
        self.inner = group
        """The replica group's own process group."""

    def max_int(self, value: int) -> int:
        """The passes of a phase this rank starts: the most any rank of the job runs."""
        t = torch.tensor([value, 1], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.inner)
        return super().max_int(int(t[0]))

    def idle(self) -> int | None:
        """A rank whose phases are over, while another rank of its group may still start one
        (the columns judge different rows): the passes of the phase some rank of the group
        starts now (matched with its :meth:`max_int`), or ``None`` once every rank of the group
        is idle. Every group sees the same phases (each column's are the same in every group),
        so the column stage matches too."""
        t = torch.tensor([0, 0], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.inner)
        if not int(t[1]):
            return None
        return super().max_int(int(t[0]))

    def flagged(self, flag: bool, why: str = "failure flags") -> list[int]:
        """The column ranks (replica groups) in which some rank gave ``flag=True``."""
        t = torch.tensor([int(flag)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.inner)
        return super().flagged(bool(int(to_host(t, why)[0])), why)


class TorchftSharded(Sharded):
    """FSDP2 over a torchft replica group's ranks, torchft across the groups (module docstring).

    ``model`` is sharded with ``fully_shard`` on a 1-D mesh over the replica group's own process
    group, which must be torch.distributed's default group (a ``torchrun`` per replica group) and
    have at least 2 ranks (FSDP2 runs no reduce-scatter over one rank).
    """

    kind = "torchft-fsdp2"
    row_reaches_every_rank = False  # rows go over the column; flags over the whole job

    def __init__(self, manager: Any, pg: Any, model: torch.nn.Module) -> None:
        if not isinstance(model, FSDPModule):
            raise GuardConfigError("internal: TorchftSharded takes a fully_shard model")
        refuse_manager(manager, pg)
        group_size = int(getattr(manager, "_group_world_size", 1))
        world = dist.get_world_size() if dist.is_initialized() else 1
        if group_size < 2 or world != group_size:
            raise GuardConfigError(
                "FSDP2 inside a torchft replica group: shard over the group's own ranks, 2 or more, "
                "with torch.distributed's default group as the group (a torchrun per replica group): "
                f"the Manager's group has {group_size} rank(s), the default group {world}"
            )
        if dist.get_backend() != "gloo":
            raise GuardConfigError(
                "torchft replica groups: the group's own process group must be gloo in this version "
                f"(got {dist.get_backend()!r}); NCCL is not built yet"
            )
        super().__init__(model)
        if self.layout.replicas != 1:
            raise GuardConfigError(
                "FSDP2 inside a torchft replica group: a 1-D mesh over the group (torchft is the "
                "replicate dimension), not an HSDP mesh"
            )
        self.manager = manager
        group = dist.group.WORLD
        assert group is not None  # initialised: checked above
        self.group = group
        """The replica group's own process group (the default group)."""
        self.group_size = group_size
        self.group_rank = dist.get_rank()
        """This rank within its replica group (its column)."""
        self.quorum_comm = GroupFlags(manager, pg, group)
        """The guard's collectives: the column, with flags and pass counts over the job."""
        self.comm = self.quorum_comm

    @property
    def replica_groups(self) -> list[list[int]] | None:
        return None  # every rank of the column holds the same shard

    @property
    def replicated(self) -> bool:
        return self.comm.world_size > 1

    def install(self, config: GuardConfig) -> GradStats:
        refuse_config(config)
        # The replicas of each shard vote on the reduced shard (as under HSDP); no scatter check.
        self._tap = GradTap(self.model, digest_reduced=config.check_reduced, across=self._average)
        return self._tap

    def _average(self, reduced: torch.Tensor) -> None:
        """The reduced shard averaged over the quorum's groups, in place."""
        self.manager.allreduce(reduced).wait()

    def update_check(
        self, optimizer: torch.optim.Optimizer, ring: Ring, config: GuardConfig
    ) -> UpdateReplay | None:
        return None  # the replicas of each shard compare the state the update produced
