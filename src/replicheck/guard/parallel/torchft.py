"""torchft replica groups (issue 28): DDP inside a replica group of one or more ranks, torchft
across the groups; see ``docs/no-restart.md``.

torchft connects rank ``l`` of every group in the quorum through its reconfigurable process group
(the ``pg`` given to rank ``l``'s ``Manager``): a *column*. The guard of rank ``l`` runs over its
column: the step's rows, the ring exchange and the replica comparisons travel over that ``pg``,
whose rank and size are the quorum's (``Manager.participating_rank()``,
``Manager.num_participants()``: the group's index and the group count) and change when the quorum
does. Every rank's probe is thus replayed by the same rank of another group, and every rank's
weights and optimizer state are compared with the same rank's in the other groups (under DDP all
ranks of a group hold the same state, so each column compares the whole model).
:class:`replicheck.integrations.torchft.TorchftGuard` combines the columns' verdicts inside each
group, so every rank of a group acts alike.

The gradient hook sits where ``torchft.DistributedDataParallel`` puts its own: in the comm-hook
slot of a torch ``DistributedDataParallel``. With one rank per group that DDP runs on a dummy
process group that absorbs DDP's own collectives, as torchft builds it; with several, on the
group's own process group (``group``). ``find_unused_parameters=True`` keeps the buckets from
rebuilding. The hook sees each bucket of this rank's gradient first (the guard's local checks),
averages it inside the group (several ranks), then over the quorum through ``Manager.allreduce``.

Device discipline: gloo only (``TorchftComm``): every message of the guard is built and moved on
the host; the group's own all-reduce moves the gradient bucket where it is.

FSDP2 inside a group is :mod:`replicheck.guard.parallel.torchft_sharded`. Not built, refused at
construction (:class:`~replicheck.guard.errors.GuardConfigError`): torchft's async quorum,
tolerant mode, ``global_item_count``, NCCL.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import AllgatherOptions, AllreduceOptions
from torch.nn.parallel import DistributedDataParallel

from replicheck.guard.checks.health import GradStats
from replicheck.guard.config import GuardConfig
from replicheck.guard.errors import GuardConfigError
from replicheck.guard.parallel.alone import AloneReplays
from replicheck.guard.parallel.base import Parallelism, Replays, module_device
from replicheck.guard.parallel.ddp_hook import BucketCount, finish_reductions
from replicheck.guard.parallel.torchft_hook import TorchftGradHealth, comm_hook
from replicheck.guard.transport.comm import Comm


class TorchftComm(Comm):
    """The guard's collectives over torchft's reconfigurable process group.

    torchft's groups are not in torch.distributed's registry (its ``register()`` gives c10d a
    size-1 stand-in), so the collectives are called on the group object itself, and rank and size
    come from the manager after each quorum (:meth:`refresh`). gloo only in this slice: every
    message is built and moved on the host.
    """

    def __init__(self, manager: Any, pg: Any) -> None:
        # Not Comm.__init__: it asks torch.distributed about a group torch.distributed does not know.
        self.distributed = True
        self.group = pg
        self._pg: Any = pg  # torchft's ProcessGroup (a c10d ProcessGroup subclass, untyped here)
        self.manager = manager
        self.device = torch.device("cpu")
        """Where collectives move tensors: the host (gloo)."""
        self._p2p_ready = True  # gloo needs no first collective before point-to-point messages
        # Until the first quorum (refresh() after Manager.start_quorum): no peer yet.
        self.rank = 0
        self.world_size = 1

    def refresh(self) -> tuple[int, int]:
        """Take rank and size from the manager's current quorum; returns them."""
        rank = self.manager.participating_rank()
        if rank is None:
            raise GuardConfigError(
                "this replica group is not participating in torchft's quorum (a spare, or "
                "healing under the async quorum): the guard runs only in participating groups"
            )
        self.rank, self.world_size = int(rank), int(self.manager.num_participants())
        return self.rank, self.world_size

    def global_rank(self, group_rank: int) -> int:
        return group_rank

    def _all_reduce(self, t: torch.Tensor, op: dist.ReduceOp.RedOpType) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(op)
        self._pg.allreduce([t], opts).wait()

    def _all_gather_into(self, out: torch.Tensor, local: torch.Tensor) -> None:
        # Views of ``out``: gloo copies each rank's part into them.
        parts = list(out.chunk(self.world_size))
        self._pg.allgather([parts], [local], AllgatherOptions()).wait()

    def _grouped(
        self, sends: Sequence[tuple[int, torch.Tensor]], recvs: Sequence[tuple[int, torch.Tensor]]
    ) -> None:
        # gloo's send does not wait for its receiver, so posting every op before waiting on any
        # cannot deadlock whatever the pattern; one message per pair and direction, so tag 0.
        works = [self._pg.send([t], dst, 0) for dst, t in sends]
        works += [self._pg.recv([t], src, 0) for src, t in recvs]
        for work in works:
            work.wait()
        self._keep(*(t for _, t in sends), *(t for _, t in recvs))


class TorchftReplicas(Parallelism):
    """DDP inside a torchft replica group, torchft across the groups; the guard's comparisons and
    ring span the groups in the quorum, rank by rank (module docstring). Pass it as
    ``Guard(replicas.model, ..., parallelism=replicas)``, or let
    :class:`replicheck.integrations.torchft.TorchftGuard` build it.

    ``group`` is this replica group's own process group (its ranks only: in a group started by
    its own ``torchrun``, the default group), required when the manager's group has more than one
    rank (``Manager(world_size=...)``); its size must be that.

    Taken explicitly rather than claimed from a ``torchft.DistributedDataParallel``: that wrapper
    has already taken DDP's comm-hook slot for its own averaging (a slot DDP fills once), and the
    manager and its process group, which the guard needs, cannot be read back from it.
    """

    kind = "torchft"

    def __init__(
        self, manager: Any, pg: Any, module: torch.nn.Module, group: dist.ProcessGroup | None = None
    ) -> None:
        self.group_size = _refuse(manager, pg, module, group)
        """Ranks in this replica group."""
        from torchft.process_group import ProcessGroupDummy

        # One rank: as torchft builds its DDP, the dummy group absorbs DDP's start-up broadcast and
        # the used-parameters all-reduce. Several: DDP's own group is the replica group (its
        # start-up broadcast makes the group's ranks equal). find_unused_parameters keeps the
        # bucket layout fixed.
        inner = group if self.group_size > 1 else ProcessGroupDummy(0, 1)
        ddp = DistributedDataParallel(module, process_group=inner, find_unused_parameters=True)
        self.group = group if self.group_size > 1 else None
        """The replica group's own process group (``None`` for one rank)."""
        self.group_rank = dist.get_rank(self.group) if self.group is not None else 0
        """This rank within its replica group (its column)."""
        comm = TorchftComm(manager, pg)
        super().__init__(ddp, module, comm)
        self.quorum_comm = comm
        """The same object as :attr:`comm`, typed: the torchft collectives (refreshed per quorum)."""
        self.ddp = ddp
        self.manager = manager
        self.health: TorchftGradHealth | None = None
        """The newest guard's gradient view, which the comm hook feeds."""
        self._compute = module_device(module)
        self._buckets = BucketCount()
        ddp.register_comm_hook(self, self._buckets.wrap(comm_hook))

    @property
    def device(self) -> torch.device:
        return self._compute

    def install(self, config: GuardConfig) -> GradStats:
        """A fresh gradient view for a guard (one is built again on each quorum change); the comm
        hook, registered once, feeds the newest."""
        refuse_config(config)
        self.health = TorchftGradHealth(self.manager, self.group, digest_reduced=config.check_reduced)
        return self.health

    def replays(self, params: Sequence[torch.nn.Parameter]) -> Replays:
        return AloneReplays(params)

    def accumulate(self, sync: bool) -> AbstractContextManager[Any]:
        return nullcontext() if sync else self.ddp.no_sync()

    def sync_off(self) -> str | None:
        if not self.ddp.require_backward_grad_sync:
            return "DDP's gradient sync is off (inside no_sync())"
        return None

    @contextmanager
    def failing_backward(self, synced: bool) -> Iterator[None]:
        """On the synchronising pass, the reductions this rank never launched (inside the group
        and over the quorum) are completed with zeros, as under DDP; the step is voted down."""
        self._buckets.launched = 0
        try:
            yield
        except Exception:
            if synced and self.health is not None:
                finish_reductions(self.ddp, self._buckets.launched)
            raise

    def join_failed_backward(self) -> None:
        """This rank failed before the synchronising backward: its part in every reduction the
        others run, with zeros, then DDP's used-parameters all-reduce (inside the group)."""
        if self.health is None:
            return
        finish_reductions(self.ddp, 0)
        if self.group is not None:
            used = [p for p in self.ddp.module.parameters() if p.requires_grad]
            dist.all_reduce(torch.zeros(len(used), dtype=torch.int32, device=self._compute), group=self.group)


def _refuse(manager: Any, pg: Any, module: torch.nn.Module, group: dist.ProcessGroup | None) -> int:
    """What is not supported, refused before anything is built; returns the group's size."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, DistributedDataParallel):
        raise GuardConfigError(
            "TorchftReplicas takes the bare module (it builds the DDP wrapper torchft's averaging "
            "runs in); do not wrap it in DistributedDataParallel or torchft's DistributedDataParallel"
        )
    if isinstance(module, FSDPModule) or any(hasattr(p, "device_mesh") for p in module.parameters()):
        raise GuardConfigError(
            "TorchftReplicas takes a module that is not sharded; for FSDP2 inside a replica group "
            "use TorchftSharded (TorchftGuard picks it for a fully_shard model)"
        )
    refuse_manager(manager, pg)
    group_size = int(getattr(manager, "_group_world_size", 1))
    if group_size == 1:
        return 1
    if group is None:
        raise GuardConfigError(
            f"the torchft Manager's replica group has {group_size} ranks (Manager(world_size=...)): "
            "pass the group's own process group as group= (its ranks only; under a torchrun per "
            "replica group, torch.distributed's default group)"
        )
    size = dist.get_world_size(group)
    if size != group_size:
        raise GuardConfigError(
            f"group= has {size} ranks but the torchft Manager's replica group has {group_size}: "
            "pass the process group of this replica group's ranks"
        )
    if dist.get_backend(group) != "gloo":
        raise GuardConfigError(
            "torchft replica groups: the group's own process group must be gloo in this version "
            f"(got {dist.get_backend(group)!r}); NCCL is not built yet"
        )
    return group_size


def refuse_manager(manager: Any, pg: Any) -> None:
    """A manager the guard cannot follow, refused before anything is built."""
    # torchft has no public accessor for these; they are what the Manager was built with.
    if getattr(manager, "_pg", pg) is not pg:
        raise GuardConfigError("pg must be the process group given to the torchft Manager")
    if getattr(manager, "_use_async_quorum", False):
        raise GuardConfigError(
            "torchft replica groups: Manager(use_async_quorum=False) is required (the guard reads "
            "the quorum's membership before the forward, and a healed group's state must be in "
            "place before it computes)"
        )


def refuse_config(config: GuardConfig) -> None:
    """Guard settings the torchft parallelisms do not follow yet."""
    if config.mode != "exact":
        raise GuardConfigError(
            "torchft replica groups: only GuardConfig(mode='exact') in this version (tolerant "
            "mode's calibration does not yet follow quorum changes)"
        )
    if config.global_item_count:
        raise GuardConfigError(
            "torchft replica groups: GuardConfig(global_item_count=True) is not supported yet "
            "(its item count is summed over torch.distributed's group, not torchft's)"
        )
